//! The permission matrix of PROTOCOL §5: every group op (and `send`) × every
//! caller standing → the code (or ok), each row on a group arranged for it
//! alone, over WebSocket and over HTTP (each on its own, identical group),
//! against the rules written down here from the §5 table. A negative control
//! runs the same rows against a rule set that ignores a temporary admin's
//! `until`: it must disagree with the server exactly on the rows that involve
//! the expired temporary admin.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{SecondsFormat, Utc};
use futures_util::stream::{self, StreamExt};
use serde_json::{json, Value};

use super::{http_op, outcome, server, with_self, ws_op, Via, SUITE};
use crate::evidence::Check;
use crate::server::TestServer;

/// Where a caller stands in the row's conversation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Who {
    Owner,
    Admin,
    /// An admin `until` an hour ahead.
    TempAdmin,
    /// An admin whose `until` has passed.
    ExpiredAdmin,
    Member,
    /// A member with `extra_perms` KICK|MUTE.
    Extra,
    /// A member with `mute_until` an hour ahead.
    Muted,
    /// An admin with `mute_until` an hour ahead.
    MutedAdmin,
    NonMember,
    /// A member who left.
    Former,
}

const WHOS: [Who; 10] = [
    Who::Owner,
    Who::Admin,
    Who::TempAdmin,
    Who::ExpiredAdmin,
    Who::Member,
    Who::Extra,
    Who::Muted,
    Who::MutedAdmin,
    Who::NonMember,
    Who::Former,
];

/// A plain member and an admin that rows act on, a user invited by rows,
/// and one with a pending application in approval groups.
const TARGET_MEMBER: &str = "u-tm";
const TARGET_ADMIN: &str = "u-tadm";
const NEW_USER: &str = "u-new";
const APPLICANT: &str = "u-app";
const EXTRA_BITS: u32 = 4 | 16;

impl Who {
    fn user(self) -> &'static str {
        match self {
            Who::Owner => "u-own",
            Who::Admin => "u-adm",
            Who::TempAdmin => "u-tmp",
            Who::ExpiredAdmin => "u-exp",
            Who::Member => "u-mem",
            Who::Extra => "u-ext",
            Who::Muted => "u-mut",
            Who::MutedAdmin => "u-madm",
            Who::NonMember => "u-non",
            Who::Former => "u-left",
        }
    }

    fn of(user: &str) -> Who {
        match user {
            TARGET_MEMBER => Who::Member,
            TARGET_ADMIN => Who::Admin,
            _ => WHOS.into_iter().find(|w| w.user() == user).unwrap_or(Who::NonMember),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Invite,
    Approval,
    Free,
    /// An `invite` group with `mute_all` on.
    MuteAll,
    /// A `free` group dismissed after the arrangement.
    Dismissed,
    /// A direct conversation of the caller (rows of `Who::Member` only).
    Direct,
}

impl Place {
    fn join_mode(self) -> &'static str {
        match self {
            Place::Approval => "approval",
            Place::Free | Place::Dismissed => "free",
            _ => "invite",
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Target {
    No,
    User(&'static str),
    Caller,
}

struct Case {
    name: &'static str,
    op: &'static str,
    place: Place,
    target: Target,
    fields: fn() -> Value,
}

fn in_an_hour() -> String {
    (Utc::now() + chrono::Duration::hours(1)).to_rfc3339_opts(SecondsFormat::Millis, true)
}

fn none() -> Value {
    json!({})
}

macro_rules! case {
    ($name:literal, $op:literal, $place:ident, $target:expr) => {
        case!($name, $op, $place, $target, none)
    };
    ($name:literal, $op:literal, $place:ident, $target:expr, $fields:expr) => {
        Case { name: $name, op: $op, place: Place::$place, target: $target, fields: $fields }
    };
}

fn cases() -> Vec<Case> {
    use Target::{Caller, No, User};
    vec![
        case!("invite", "invite", Invite, No, || json!({"user_ids": [NEW_USER]})),
        case!("invite@approval", "invite", Approval, No, || json!({"user_ids": [NEW_USER]})),
        case!("join@invite", "join", Invite, No),
        case!("join@free", "join", Free, No),
        case!("join@approval", "join", Approval, No),
        case!("approve", "approve", Approval, User(APPLICANT)),
        case!("reject", "reject", Approval, User(APPLICANT)),
        case!("applications", "applications", Approval, No),
        case!("leave", "leave", Invite, No),
        case!("kick member", "kick", Invite, User(TARGET_MEMBER)),
        case!("kick admin", "kick", Invite, User(TARGET_ADMIN)),
        case!("kick owner", "kick", Invite, User("u-own")),
        case!("kick self", "kick", Invite, Caller),
        case!("kick expired temp admin", "kick", Invite, User("u-exp")),
        case!("kick non-member", "kick", Invite, User("u-non")),
        case!("set_role admin", "set_role", Invite, User(TARGET_MEMBER), || json!({"role": "admin"})),
        case!("set_role temp admin", "set_role", Invite, User(TARGET_MEMBER), || {
            json!({"role": "admin", "until": in_an_hour()})
        }),
        case!("set_role owner", "set_role", Invite, User("u-own"), || json!({"role": "member"})),
        case!("set_perms", "set_perms", Invite, User(TARGET_MEMBER), || json!({"extra_perms": 4})),
        case!("mute member", "mute_member", Invite, User(TARGET_MEMBER), || json!({"mute_until": in_an_hour()})),
        case!("mute admin", "mute_member", Invite, User(TARGET_ADMIN), || json!({"mute_until": in_an_hour()})),
        case!("mute owner", "mute_member", Invite, User("u-own"), || json!({"mute_until": in_an_hour()})),
        case!("mute expired temp admin", "mute_member", Invite, User("u-exp"), || {
            json!({"mute_until": in_an_hour()})
        }),
        case!("set_alias", "set_alias", Invite, No, || json!({"alias": "nick"})),
        case!("transfer_owner", "transfer_owner", Invite, User(TARGET_MEMBER)),
        case!("update_group name", "update_group", Invite, No, || json!({"name": "renamed"})),
        case!("update_group mute_all", "update_group", Invite, No, || json!({"mute_all": true})),
        case!("update_group max_member<count", "update_group", Invite, No, || json!({"max_member": 2})),
        case!("dismiss", "dismiss", Invite, No),
        case!("members", "members", Invite, No),
        case!("send", "send", Invite, No, || json!({"client_msg_id": "k1", "body": {"type": "text", "text": "hi"}})),
        case!(
            "send@mute_all",
            "send",
            MuteAll,
            No,
            || json!({"client_msg_id": "k1", "body": {"type": "text", "text": "hi"}})
        ),
        case!("dismissed: send", "send", Dismissed, No, || {
            json!({"client_msg_id": "k1", "body": {"type": "text", "text": "hi"}})
        }),
        case!("dismissed: invite", "invite", Dismissed, No, || json!({"user_ids": [NEW_USER]})),
        case!("dismissed: join", "join", Dismissed, No),
        case!("dismissed: leave", "leave", Dismissed, No),
        case!("dismissed: kick", "kick", Dismissed, User(TARGET_MEMBER)),
        case!("dismissed: set_alias", "set_alias", Dismissed, No, || json!({"alias": "nick"})),
        case!("dismissed: update_group", "update_group", Dismissed, No, || json!({"name": "x"})),
        case!("dismissed: dismiss", "dismiss", Dismissed, No),
        case!("dismissed: members", "members", Dismissed, No),
        case!("direct: invite", "invite", Direct, No, || json!({"user_ids": [NEW_USER]})),
        case!("direct: join", "join", Direct, No),
        case!("direct: approve", "approve", Direct, User(APPLICANT)),
        case!("direct: leave", "leave", Direct, No),
        case!("direct: kick", "kick", Direct, User(TARGET_MEMBER)),
        case!("direct: set_role", "set_role", Direct, User(TARGET_MEMBER), || json!({"role": "admin"})),
        case!("direct: set_perms", "set_perms", Direct, User(TARGET_MEMBER), || json!({"extra_perms": 4})),
        case!("direct: mute_member", "mute_member", Direct, User(TARGET_MEMBER), || json!({"mute_until": null})),
        case!("direct: set_alias", "set_alias", Direct, No, || json!({"alias": "nick"})),
        case!("direct: transfer_owner", "transfer_owner", Direct, User(TARGET_MEMBER)),
        case!("direct: update_group", "update_group", Direct, No, || json!({"name": "x"})),
        case!("direct: dismiss", "dismiss", Direct, No),
    ]
}

/// A rule set the expectations are computed from.
#[derive(Debug, Clone, Copy)]
struct Rules {
    /// A temporary admin is a member from its `until` on (PROTOCOL §5).
    role_until_honoured: bool,
}

const CORRECT: Rules = Rules { role_until_honoured: true };
/// The deliberately wrong rules of the negative control.
const BROKEN: Rules = Rules { role_until_honoured: false };

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Owner,
    Admin,
    Member,
}

const SEND_MSG: u32 = 1;
const KICK: u32 = 4;
const INVITE: u32 = 8;
const MUTE: u32 = 16;
const SET_ADMIN: u32 = 32;
const EDIT_INFO: u32 = 64;
const DISMISS: u32 = 1024;

impl Rules {
    /// The role of a current member at decision time; `None`: not a member.
    fn role(self, who: Who) -> Option<Role> {
        match who {
            Who::Owner => Some(Role::Owner),
            Who::Admin | Who::TempAdmin | Who::MutedAdmin => Some(Role::Admin),
            Who::ExpiredAdmin if !self.role_until_honoured => Some(Role::Admin),
            Who::ExpiredAdmin | Who::Member | Who::Extra | Who::Muted => Some(Role::Member),
            Who::NonMember | Who::Former => None,
        }
    }

    fn bits(self, who: Who, place: Place) -> u32 {
        let role = match self.role(who) {
            Some(Role::Owner) => 1 | 2 | 4 | 8 | 16 | 32 | 64 | 128 | 1024,
            Some(Role::Admin) => 1 | 2 | 4 | 8 | 16 | 64 | 128,
            Some(Role::Member) if place == Place::Approval => SEND_MSG,
            Some(Role::Member) => SEND_MSG | INVITE,
            None => 0,
        };
        role | if who == Who::Extra { EXTRA_BITS } else { 0 }
    }

    fn manager(self, who: Who) -> bool {
        matches!(self.role(who), Some(Role::Owner | Role::Admin))
    }

    /// The outcome PROTOCOL §5 gives `case` called by `who`.
    fn expect(self, case: &Case, who: Who) -> &'static str {
        let (place, member) = (case.place, self.role(who).is_some());
        let bits = self.bits(who, place);
        let target = match case.target {
            Target::User(u) => Some(Who::of(u)),
            Target::Caller => Some(who),
            Target::No => None,
        };
        let target_is_member = target.is_some_and(|t| self.role(t).is_some());
        let forbidden_unless = |ok: bool| if ok { "ok" } else { "FORBIDDEN" };
        match (case.op, place) {
            ("join", Place::Invite | Place::Direct) => return "NOT_MEMBER",
            // A stranger learns nothing of a dismissed group; anyone who was
            // ever a member learns it before the roster is looked at (PROTOCOL
            // §2 "Check order").
            ("join", Place::Dismissed) if who == Who::NonMember => return "NOT_MEMBER",
            (op, Place::Dismissed) if who != Who::NonMember && op != "members" => return "CONV_DISMISSED",
            ("join", _) if member => return "ALREADY_MEMBER",
            ("join", Place::Approval) => return "ok:pending",
            ("join", _) => return "ok",
            (_, Place::Direct) => return "FORBIDDEN",
            _ => {}
        }
        if !member {
            return "NOT_MEMBER";
        }
        if place == Place::Dismissed {
            return "ok";
        }
        match case.op {
            "send" if matches!(who, Who::Muted | Who::MutedAdmin) => "MUTED",
            "send" if place == Place::MuteAll && self.role(who) == Some(Role::Member) => "MUTED",
            "send" | "members" | "set_alias" => "ok",
            "applications" | "approve" | "reject" => forbidden_unless(self.manager(who)),
            "invite" if bits & INVITE != 0 => "ok:joined",
            "invite" if place == Place::Approval => "ok:pending",
            "invite" => "FORBIDDEN",
            "leave" => forbidden_unless(who != Who::Owner),
            "kick" if bits & KICK == 0 => "FORBIDDEN",
            "set_role" | "set_perms" if bits & SET_ADMIN == 0 => "FORBIDDEN",
            "mute_member" if bits & MUTE == 0 => "FORBIDDEN",
            "transfer_owner" if who != Who::Owner => "FORBIDDEN",
            "kick" | "set_role" | "set_perms" | "mute_member" | "transfer_owner" if !target_is_member => "NOT_FOUND",
            "kick" | "transfer_owner" if target == Some(who) => "FORBIDDEN",
            "kick" | "set_role" | "set_perms" if target == Some(Who::Owner) => "FORBIDDEN",
            "kick" | "mute_member" => {
                let target_manager = target.is_some_and(|t| self.manager(t));
                forbidden_unless(!target_manager || who == Who::Owner)
            }
            "set_role" | "set_perms" | "transfer_owner" => "ok",
            "update_group" if bits & EDIT_INFO == 0 => "FORBIDDEN",
            "update_group" => {
                let fields = (case.fields)();
                if fields.get("mute_all").is_some() && bits & MUTE == 0 {
                    "FORBIDDEN"
                } else if fields.get("max_member").is_some() {
                    "BAD_REQUEST"
                } else {
                    "ok"
                }
            }
            "dismiss" => forbidden_unless(bits & DISMISS != 0),
            other => panic!("no rule for {other}"),
        }
    }
}

fn group_id(row: usize, via: Via) -> String {
    format!("mx{row}-{}", if via == Via::Ws { "w" } else { "h" })
}

/// Creates the row's group with every standing (the expired admin's `until`
/// 2 s from now).
async fn arrange(s: &TestServer, tokens: &BTreeMap<&str, String>, conv: &str, place: Place) {
    let mut http = imcore_client::Http::new(s.port);
    let members: Vec<&str> = WHOS
        .iter()
        .filter(|w| !matches!(w, Who::Owner | Who::NonMember))
        .map(|w| w.user())
        .chain([TARGET_MEMBER, TARGET_ADMIN])
        .collect();
    let create = json!({"kind": "group", "conv_id": conv, "name": conv, "members": members,
                        "join_mode": place.join_mode(), "delivery_mode": "pull"});
    let (status, v) =
        http.call("POST", "/v1/conversations", Some(&tokens["u-own"]), Some(&create)).await.expect("create");
    assert_eq!(status, 201, "create {conv}: {v}");
    let soon = (Utc::now() + chrono::Duration::seconds(2)).to_rfc3339_opts(SecondsFormat::Millis, true);
    let mut steps: Vec<(&str, &'static str, Value)> = vec![
        ("u-own", "set_role", json!({"user_id": "u-adm", "role": "admin"})),
        ("u-own", "set_role", json!({"user_id": "u-tmp", "role": "admin", "until": in_an_hour()})),
        ("u-own", "set_role", json!({"user_id": "u-exp", "role": "admin", "until": soon})),
        ("u-own", "set_role", json!({"user_id": "u-madm", "role": "admin"})),
        ("u-own", "set_role", json!({"user_id": TARGET_ADMIN, "role": "admin"})),
        ("u-own", "set_perms", json!({"user_id": "u-ext", "extra_perms": EXTRA_BITS})),
        ("u-own", "mute_member", json!({"user_id": "u-mut", "mute_until": in_an_hour()})),
        ("u-own", "mute_member", json!({"user_id": "u-madm", "mute_until": in_an_hour()})),
        ("u-left", "leave", json!({})),
    ];
    match place {
        Place::Approval => steps.push((APPLICANT, "join", json!({}))),
        Place::MuteAll => steps.push(("u-own", "update_group", json!({"mute_all": true}))),
        Place::Dismissed => steps.push(("u-own", "dismiss", json!({}))),
        _ => {}
    }
    for (who, op, mut fields) in steps {
        fields["conv_id"] = json!(conv);
        let (method, path, body) = super::route(op, &fields);
        let body = (!body.is_null()).then_some(body);
        let (status, v) = http.call(method, &path, Some(&tokens[who]), body.as_ref()).await.expect("arrange");
        assert!((200..300).contains(&status), "arrange {conv} {op} {fields}: {status} {v}");
    }
}

/// The row's fields for its conversation.
fn row_fields(case: &Case, who: Who, conv: &str) -> Value {
    let mut fields = (case.fields)();
    fields["conv_id"] = json!(conv);
    match case.target {
        Target::User(u) => fields["user_id"] = json!(u),
        Target::Caller => fields["user_id"] = json!(who.user()),
        Target::No => {}
    }
    fields
}

struct Row {
    case: usize,
    who: Who,
    ws: String,
    http: String,
}

/// Arranges the groups of every row (`(case, who)`), two per row, 12 at a time.
async fn arrange_all(s: &TestServer, tokens: &BTreeMap<&str, String>, cases: &[Case], rows: &[(usize, Who)]) {
    let arrangements = rows
        .iter()
        .enumerate()
        .flat_map(|(row, (c, _))| [Via::Ws, Via::Http].map(|via| (group_id(row, via), cases[*c].place)));
    stream::iter(arrangements)
        .filter(|(_, place)| std::future::ready(*place != Place::Direct))
        .for_each_concurrent(12, |(conv, place)| async move { arrange(s, tokens, &conv, place).await })
        .await;
}

/// Runs every row over WebSocket and over HTTP; the callers at once, each its rows in turn.
async fn run_rows(
    s: &TestServer,
    tokens: &BTreeMap<&str, String>,
    cases: &[Case],
    rows: &[(usize, Who)],
    direct: &str,
) -> Vec<Row> {
    let by_who = WHOS.map(|who| {
        let mine: Vec<(usize, usize)> =
            rows.iter().enumerate().filter(|(_, (_, w))| *w == who).map(|(row, (c, _))| (row, *c)).collect();
        async move {
            let token = &tokens[who.user()];
            let mut ws = s.ws(token).await;
            let mut done = vec![];
            for (row, c) in mine {
                let case = &cases[c];
                let conv = |via| if case.place == Place::Direct { direct.to_owned() } else { group_id(row, via) };
                let w = ws_op(&mut ws, case.op, row_fields(case, who, &conv(Via::Ws))).await;
                let fields = with_self(case.op, row_fields(case, who, &conv(Via::Http)), who.user());
                let h = http_op(s.port, token, case.op, &fields).await;
                done.push(Row { case: c, who, ws: outcome(case.op, &w), http: outcome(case.op, &h) });
            }
            ws.close().await;
            done
        }
    });
    futures_util::future::join_all(by_who).await.into_iter().flatten().collect()
}

#[actix_web::test]
async fn every_group_op_by_every_standing_answers_the_code_of_the_rules() {
    let cases = cases();
    let check = Check::start(
        SUITE,
        "02-matrix",
        format!(
            "ws+http, {} op cases x 10 standings (direct: its member), a group of its own per row and transport",
            cases.len()
        ),
        "every op of PROTOCOL §5 (and send) by owner, admin, temporary admin before and after its until, plain \
         member, member with extra_perms KICK|MUTE, muted member, muted admin, non-member and former member \
         answers exactly the outcome of the §5 rules (role bits | extra_perms, role rules on owner/admins/self, \
         owner can't leave, mute_all, mute_until blocks an admin, approval-group invitees of a member pending, \
         dismissed → CONV_DISMISSED, direct → FORBIDDEN), identically over WebSocket and HTTP (HTTP status = \
         the code's §2 status)",
    );
    let s = server().await;
    let mut users: Vec<&str> = WHOS.iter().map(|w| w.user()).collect();
    users.extend([TARGET_MEMBER, TARGET_ADMIN, NEW_USER, APPLICANT]);
    let mut tokens = BTreeMap::new();
    for u in &users {
        tokens.insert(*u, s.user(u).await);
    }
    // One group per (row, transport); direct rows share the caller's one direct chat (nothing there changes).
    let direct = s.direct(&tokens["u-mem"], TARGET_MEMBER).await;
    let mut rows_to_run = vec![];
    for (c, case) in cases.iter().enumerate() {
        for who in WHOS {
            if case.place == Place::Direct && who != Who::Member {
                continue;
            }
            rows_to_run.push((c, who));
        }
    }
    let started = std::time::Instant::now();
    arrange_all(&s, &tokens, &cases, &rows_to_run).await;
    let arranged_in = started.elapsed();
    // The one wait on real time: past every expired admin's `until` (set
    // 2 s after the start of its group's arrangement).
    tokio::time::sleep(Duration::from_millis(2_200)).await;
    let rows = run_rows(&s, &tokens, &cases, &rows_to_run, &direct).await;

    let mut table = vec![];
    let mut wrong = vec![];
    let mut negative_disagrees = vec![];
    for r in &rows {
        let case = &cases[r.case];
        let want = CORRECT.expect(case, r.who);
        let line = format!("{} | {:?} → ws {} / http {}", case.name, r.who, r.ws, r.http);
        if r.ws != want || r.http != want {
            wrong.push(format!("{line} (want {want})"));
        }
        if BROKEN.expect(case, r.who) != r.ws {
            negative_disagrees.push(line.clone());
        }
        table.push(line);
    }
    let pass = wrong.is_empty() && rows.len() == rows_to_run.len();
    println!("matrix: {} rows, arranged in {arranged_in:?}, wrong: {wrong:#?}", rows.len());
    let observed = json!({"rows": rows.len(), "groups_arranged": 2 * rows_to_run.len(),
                          "arranged_ms": arranged_in.as_millis() as u64, "wrong": wrong, "table": table});
    let pass = check.resolve(observed, pass);

    let negative = Check::start(
        SUITE,
        "02-matrix-negative-control",
        "the same rows and server answers, expectations from rules that ignore role_until",
        "a rule set that keeps a temporary admin an admin past its until disagrees with the server, and only on \
         rows involving the expired temporary admin (as caller, or as the kicked/muted target) — the matrix can \
         detect a broken rule",
    );
    let only_expired = negative_disagrees.iter().all(|l| l.contains("ExpiredAdmin") || l.contains("expired"));
    let negative_pass = negative.resolve(
        json!({"disagreements": negative_disagrees.len(), "rows": negative_disagrees}),
        !negative_disagrees.is_empty() && only_expired,
    );
    assert!(pass, "rows answering other than the rules: {wrong:#?}");
    assert!(negative_pass, "the negative control did not separate: {negative_disagrees:#?}");
}
