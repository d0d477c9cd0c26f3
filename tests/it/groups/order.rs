//! The one check order of PROTOCOL §2 as a matrix: every write op (and the
//! reads) × every standing (stranger, former member, member, muted member,
//! admin, owner) × every status (active, dismissed, banned, nonexistent),
//! over WebSocket and HTTP, against the order written down here. A stranger
//! must get the answer of a nonexistent conversation whatever the status; a
//! former member may learn the status. Rows that cannot change anything share
//! one group per status (whose head must not move); a member's write to an
//! active group gets a group of its own per transport. A negative control
//! computes the rows from the order before it was one (the roster before the
//! status for group ops, a stranger's join reaching any group open to joins):
//! it must disagree with the server, and only where a status leaked or hid.

use std::collections::BTreeMap;

use chrono::{SecondsFormat, Utc};
use futures_util::stream::{self, StreamExt};
use serde_json::{json, Value};

use super::{http_op, outcome, server, with_self, ws_op, Via, SUITE};
use crate::evidence::Check;
use crate::server::TestServer;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Who {
    Stranger,
    Former,
    Member,
    Muted,
    Admin,
    Owner,
}

const WHOS: [Who; 6] = [Who::Stranger, Who::Former, Who::Member, Who::Muted, Who::Admin, Who::Owner];

impl Who {
    fn user(self) -> &'static str {
        match self {
            Who::Stranger => "u-str",
            Who::Former => "u-left",
            Who::Member => "u-mem",
            Who::Muted => "u-mut",
            Who::Admin => "u-adm",
            Who::Owner => "u-own",
        }
    }

    fn current(self) -> bool {
        !matches!(self, Who::Stranger | Who::Former)
    }

    fn manager(self) -> bool {
        matches!(self, Who::Admin | Who::Owner)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Active,
    Dismissed,
    Banned,
    Nonexistent,
}

const STATUSES: [Status; 4] = [Status::Active, Status::Dismissed, Status::Banned, Status::Nonexistent];

/// The member rows act on, the applicant and the user invited.
const TARGET: &str = "u-tm";
const APPLICANT: &str = "u-app";
const NEW_USER: &str = "u-new";

const READS: [&str; 4] = ["sync", "get_conversation", "members", "applications"];

/// (row name, op, fields); `{msg}` in a field is the seq of the member's message.
fn ops(msg: i64) -> Vec<(&'static str, &'static str, Value)> {
    let hi = json!({"type": "text", "text": "hi"});
    let in_an_hour = (Utc::now() + chrono::Duration::hours(1)).to_rfc3339_opts(SecondsFormat::Millis, true);
    vec![
        ("send", "send", json!({"client_msg_id": "k1", "body": hi})),
        (
            "send mention_all",
            "send",
            json!({"client_msg_id": "k2", "body": {"type": "text", "text": "all", "mention_all": true}}),
        ),
        ("edit", "edit", json!({"client_msg_id": "e1", "target_seq": msg, "body": hi})),
        ("react", "react", json!({"target_seq": msg, "emoji": "👍", "on": true})),
        ("recall", "recall", json!({"target_seq": msg})),
        ("invite", "invite", json!({"user_ids": [NEW_USER]})),
        ("join", "join", json!({})),
        ("approve", "approve", json!({"user_id": APPLICANT})),
        ("reject", "reject", json!({"user_id": APPLICANT})),
        ("leave", "leave", json!({})),
        ("kick", "kick", json!({"user_id": TARGET})),
        ("set_role", "set_role", json!({"user_id": TARGET, "role": "admin"})),
        ("set_perms", "set_perms", json!({"user_id": TARGET, "extra_perms": 4})),
        ("mute_member", "mute_member", json!({"user_id": TARGET, "mute_until": in_an_hour})),
        ("set_alias", "set_alias", json!({"alias": "nick"})),
        ("transfer_owner", "transfer_owner", json!({"user_id": TARGET})),
        ("update_group", "update_group", json!({"name": "renamed"})),
        ("dismiss", "dismiss", json!({})),
        ("sync", "sync", json!({})),
        ("get_conversation", "get_conversation", json!({})),
        ("members", "members", json!({})),
        ("applications", "applications", json!({})),
    ]
}

/// `true`: the one order; `false`: the order before it (negative control).
fn expect(name: &str, who: Who, status: Status, one_order: bool) -> &'static str {
    let (ever, current, manager) = (who != Who::Stranger, who.current(), who.manager());
    let or_forbidden = |ok: bool| if ok { "ok" } else { "FORBIDDEN" };
    if status == Status::Nonexistent {
        return "NOT_MEMBER";
    }
    if READS.contains(&name) {
        return match name {
            "sync" | "get_conversation" if ever => "ok",
            "members" if current => "ok",
            "applications" if current => or_forbidden(manager),
            _ => "NOT_MEMBER",
        };
    }
    // 1. The stranger gate: only a join of an active group open to joins goes on.
    let joinable = status == Status::Active || !one_order;
    if !(ever || name == "join" && joinable) {
        return "NOT_MEMBER";
    }
    // Before, a group op asked for a current member before the status.
    let roster_first =
        !one_order && !matches!(name, "send" | "send mention_all" | "edit" | "react" | "recall" | "join");
    if roster_first && !current {
        return "NOT_MEMBER";
    }
    // 3. The status.
    match status {
        Status::Dismissed => return "CONV_DISMISSED",
        Status::Banned => return "CONV_BANNED",
        _ => {}
    }
    // 4. A current member (a join: not one already).
    if name == "join" {
        return if current { "ALREADY_MEMBER" } else { "ok:pending" };
    }
    if !current {
        return "NOT_MEMBER";
    }
    // 7–9. Mute, the bit, the op's own rules (an approval group: a member's invitee is pending).
    let muted = who == Who::Muted;
    match name {
        "send" | "react" if muted => "MUTED",
        "send mention_all" | "edit" if muted => "MUTED",
        "send" | "react" | "set_alias" => "ok",
        "send mention_all" => or_forbidden(manager),
        "edit" => or_forbidden(who == Who::Member),
        "recall" => or_forbidden(manager || who == Who::Member),
        "invite" if manager => "ok:joined",
        "invite" => "ok:pending",
        "leave" => or_forbidden(who != Who::Owner),
        "approve" | "reject" | "kick" | "mute_member" | "update_group" => or_forbidden(manager),
        "set_role" | "set_perms" | "transfer_owner" | "dismiss" => or_forbidden(who == Who::Owner),
        other => panic!("no rule for {other}"),
    }
}

/// Whether the row may change its group: a current member's write to an active one.
fn mutates(name: &str, who: Who, status: Status) -> bool {
    status == Status::Active && who.current() && !READS.contains(&name)
}

/// Creates `conv` (an approval group: owner, admin, member, muted member,
/// target; a former member; an application pending; the member's message,
/// whose seq it returns) and puts it in `status`.
async fn arrange(s: &TestServer, tokens: &BTreeMap<&str, String>, conv: &str, status: Status) -> i64 {
    let call = |who: &str, op: &'static str, mut fields: Value| {
        fields["conv_id"] = json!(conv);
        let token = tokens[who].clone();
        async move { http_op(s.port, &token, op, &fields).await.unwrap_or_else(|code| panic!("arrange {op}: {code}")) }
    };
    let members = ["u-adm", "u-mem", "u-mut", "u-left", TARGET];
    let create = json!({"kind": "group", "conv_id": conv, "name": conv, "members": members,
                        "join_mode": "approval", "delivery_mode": "pull", "recall_window_ms": 3_600_000});
    let (code, v) = s.http("POST", "/v1/conversations", Some(&tokens["u-own"]), Some(&create)).await;
    assert_eq!(code, 201, "create {conv}: {v}");
    let in_an_hour = (Utc::now() + chrono::Duration::hours(1)).to_rfc3339_opts(SecondsFormat::Millis, true);
    call("u-own", "set_role", json!({"user_id": "u-adm", "role": "admin"})).await;
    call("u-own", "mute_member", json!({"user_id": "u-mut", "mute_until": in_an_hour})).await;
    let sent = call("u-mem", "send", json!({"client_msg_id": "k0", "body": {"type": "text", "text": "m"}})).await;
    call("u-left", "leave", json!({})).await;
    call(APPLICANT, "join", json!({})).await;
    match status {
        Status::Dismissed => drop(call("u-own", "dismiss", json!({})).await),
        Status::Banned => {
            let (code, v) = s.admin(&format!("/v1/admin/conversations/{conv}/ban"), json!({})).await;
            assert_eq!(code, 200, "ban {conv}: {v}");
        }
        _ => {}
    }
    sent["seq"].as_i64().expect("the message's seq")
}

fn shared(status: Status) -> String {
    format!("ox-{status:?}").to_lowercase()
}

struct Row {
    name: &'static str,
    who: Who,
    status: Status,
    ws: String,
    http: String,
}

#[actix_web::test]
async fn every_op_by_every_standing_in_every_status_answers_in_the_one_check_order() {
    let check = Check::start(
        SUITE,
        "02-check-order-matrix",
        "ws+http; 22 ops (18 writes, 4 reads) x 6 standings x 4 statuses; approval groups; shared groups per status \
         for rows that change nothing, one group per transport for a member's write to an active group",
        "every row answers the outcome of PROTOCOL §2 \"Check order\" over both transports (HTTP status = the \
         code's): a stranger gets NOT_MEMBER in a dismissed, banned and nonexistent group alike (its join of an \
         active approval group is pending); a former member gets CONV_DISMISSED / CONV_BANNED for every write; a \
         muted member's mention_all answers MUTED; reads answer in every status; the dismissed and banned groups' \
         heads do not move",
    );
    let s = server().await;
    let mut tokens = BTreeMap::new();
    for u in WHOS.map(Who::user).into_iter().chain([TARGET, APPLICANT, NEW_USER]) {
        tokens.insert(u, s.user(u).await);
    }
    let mut msg = 0;
    let mut heads = BTreeMap::new();
    for status in [Status::Active, Status::Dismissed, Status::Banned] {
        msg = arrange(&s, &tokens, &shared(status), status).await;
        let info = s.http("GET", &format!("/v1/conversations/{}", shared(status)), Some(&tokens["u-own"]), None).await;
        heads.insert(shared(status), info.1["head"].clone());
    }
    let ops = ops(msg);
    let mut rows = vec![];
    for (i, (name, _, _)) in ops.iter().enumerate() {
        for who in WHOS {
            for status in STATUSES {
                rows.push((i, *name, who, status));
            }
        }
    }
    let own_group = |row: usize, via: Via| format!("ox{row}-{}", if via == Via::Ws { "w" } else { "h" });
    let conv_of = |row: usize, name: &str, who: Who, status: Status, via: Via| match status {
        Status::Nonexistent => "ox-nowhere".to_owned(),
        _ if mutates(name, who, status) => own_group(row, via),
        _ => shared(status),
    };
    let own: Vec<String> = rows
        .iter()
        .enumerate()
        .filter(|(_, (_, name, who, status))| mutates(name, *who, *status))
        .flat_map(|(row, _)| [Via::Ws, Via::Http].map(|via| own_group(row, via)))
        .collect();
    let seqs: Vec<i64> =
        stream::iter(&own).map(|conv| arrange(&s, &tokens, conv, Status::Active)).buffer_unordered(12).collect().await;
    assert!(seqs.iter().all(|&m| m == msg), "every group arranged alike");

    // The callers at once, each its rows in turn.
    let (s, ops, rows, conv_of, tokens) = (&s, &ops, &rows, &conv_of, &tokens);
    let by_who = WHOS.map(|who| async move {
        let token = &tokens[who.user()];
        let mut ws = s.ws(token).await;
        let mut done = vec![];
        for (row, (i, name, w, status)) in rows.iter().enumerate().filter(|(_, r)| r.2 == who) {
            let (_, op, fields) = &ops[*i];
            let fields_for = |via| {
                let mut f = fields.clone();
                f["conv_id"] = json!(conv_of(row, name, *w, *status, via));
                f
            };
            let by_ws = ws_op(&mut ws, op, fields_for(Via::Ws)).await;
            let by_http = http_op(s.port, token, op, &with_self(op, fields_for(Via::Http), who.user())).await;
            done.push(Row { name, who, status: *status, ws: outcome(op, &by_ws), http: outcome(op, &by_http) });
        }
        ws.close().await;
        done
    });
    let done: Vec<Row> = futures_util::future::join_all(by_who).await.into_iter().flatten().collect();

    let (mut wrong, mut table, mut control) = (vec![], vec![], vec![]);
    for r in &done {
        let want = expect(r.name, r.who, r.status, true);
        let line = format!("{} | {:?} | {:?} → ws {} / http {}", r.name, r.who, r.status, r.ws, r.http);
        if r.ws != want || r.http != want {
            wrong.push(format!("{line} (want {want})"));
        }
        if expect(r.name, r.who, r.status, false) != r.ws {
            control.push((r.who, r.status, line.clone()));
        }
        table.push(line);
    }
    let mut moved = vec![];
    for (conv, before) in &heads {
        let after = s.http("GET", &format!("/v1/conversations/{conv}"), Some(&tokens["u-own"]), None).await.1;
        if conv != &shared(Status::Active) && after["head"] != *before {
            moved.push(format!("{conv}: {before} → {}", after["head"]));
        }
    }
    let pass = wrong.is_empty() && moved.is_empty() && done.len() == rows.len();
    println!("check order: {} rows, {} groups of their own, wrong: {wrong:#?}", done.len(), own.len());
    let pass = check.resolve(
        json!({"rows": done.len(), "groups_of_their_own": own.len(), "wrong": wrong, "heads_moved": moved,
               "table": table}),
        pass,
    );
    let negative = Check::start(
        SUITE,
        "02-check-order-negative-control",
        "the same rows and answers, expectations from the order before: a group op asks for a current member \
         before the status; a stranger's join reaches any group open to joins",
        "the old order disagrees with the server, and only on rows of a former member or a stranger in a dismissed \
         or banned group: the matrix tells the two orders apart",
    );
    let only_status_rows = control.iter().all(|(who, status, _)| {
        matches!(who, Who::Former | Who::Stranger) && matches!(status, Status::Dismissed | Status::Banned)
    });
    let lines: Vec<&String> = control.iter().map(|(_, _, l)| l).collect();
    let negative_pass = negative
        .resolve(json!({"disagreements": control.len(), "rows": lines}), !control.is_empty() && only_status_rows);
    assert!(pass, "rows answering other than the order: {wrong:#?}, heads moved: {moved:?}");
    assert!(negative_pass, "the negative control did not separate: {lines:#?}");
}
