//! Banned groups (PROTOCOL "Banned groups"): the operator's ban and unban
//! over the admin endpoint and the `imcore admin conversation` command, every
//! write refused with `CONV_BANNED` while banned and nothing changed, the
//! reads going on, and a `group` event recording each change.

use std::time::Duration;

use serde_json::{json, Value};

use super::{http_op, ok, server, visible_events, ws_op, SUITE};
use crate::admin_commands::imcore;
use crate::evidence::Check;
use crate::server::{TestServer, Ws, ADMIN};

const CONV: &str = "g-ban";

fn text(t: &str) -> Value {
    json!({"type": "text", "text": t})
}

/// `POST /v1/admin/conversations/{conv}/{action}` with `token`.
async fn admin_status(s: &TestServer, conv: &str, action: &str, token: &str) -> (u16, Value) {
    s.http("POST", &format!("/v1/admin/conversations/{conv}/{action}"), Some(token), Some(&json!({}))).await
}

/// Every write of PROTOCOL §5 (and v1.2) by the member, the admin or the
/// owner, over WebSocket then HTTP: each answer's code.
async fn every_write(s: &TestServer, tokens: &[(&str, &str)], ws: &mut [Ws], msg: i64) -> Vec<(String, String)> {
    let writes: [(usize, &str, Value); 17] = [
        (0, "send", json!({"client_msg_id": "after", "body": text("no")})),
        (0, "edit", json!({"client_msg_id": "e1", "target_seq": msg, "body": text("edited")})),
        (0, "react", json!({"target_seq": msg, "emoji": "👍", "on": true})),
        (0, "recall", json!({"target_seq": msg})),
        (0, "leave", json!({})),
        (0, "set_alias", json!({"alias": "nick"})),
        (0, "join", json!({})),
        (1, "kick", json!({"user_id": "u-mem"})),
        (1, "mute_member", json!({"user_id": "u-mem", "mute_until": null})),
        (1, "approve", json!({"user_id": "u-app"})),
        (1, "reject", json!({"user_id": "u-app"})),
        (2, "invite", json!({"user_ids": ["u-new"]})),
        (2, "set_role", json!({"user_id": "u-mem", "role": "admin"})),
        (2, "set_perms", json!({"user_id": "u-mem", "extra_perms": 4})),
        (2, "transfer_owner", json!({"user_id": "u-adm"})),
        (2, "update_group", json!({"name": "renamed"})),
        (2, "dismiss", json!({})),
    ];
    let mut answers = vec![];
    for (who, op, mut fields) in writes {
        fields["conv_id"] = json!(CONV);
        let by_ws = ws_op(&mut ws[who], op, fields.clone()).await;
        if op == "set_alias" {
            fields["user_id"] = json!(tokens[who].0);
        }
        let by_http = http_op(s.port, tokens[who].1, op, &fields).await;
        for (via, r) in [("ws", by_ws), ("http", by_http)] {
            answers.push((format!("{op} by {} over {via}", tokens[who].0), r.err().unwrap_or_else(|| "ok".into())));
        }
    }
    answers
}

/// The event at `seq` of `CONV` as pushed to `ws`, passing over the pushes before it.
async fn pushed_at(ws: &mut Ws, seq: Option<i64>) -> Option<Value> {
    let seq = seq?;
    while let Some(push) = ws.push_within(Duration::from_secs(10)).await {
        let events = match push["push"].as_str() {
            Some("event") => vec![push["event"].clone()],
            _ => push["events"].as_array().cloned().unwrap_or_default(),
        };
        if let Some(e) = events.into_iter().find(|e| e["seq"].as_i64() == Some(seq)) {
            return Some(e);
        }
    }
    None
}

async fn head(s: &TestServer, token: &str) -> Value {
    s.http("GET", &format!("/v1/conversations/{CONV}"), Some(token), None).await.1
}

#[actix_web::test]
async fn a_banned_group_refuses_every_write_keeps_its_reads_and_logs_each_change() {
    let check = Check::start(
        SUITE,
        "02-banned-group",
        "ws+http; an approval group (owner, admin, member, one application pending); the member online; ban over \
         the admin endpoint, ban again and unban with `imcore admin conversation`",
        "a ban answers changed:true with the seq of a group event {actor: null, change: {status: banned}}, pushed \
         to the online member; banning again answers changed:false, seq null and appends nothing; while banned, \
         each of 17 writes (send, edit, react, recall, leave, set_alias, join, kick, mute_member, approve, reject, \
         invite, set_role, set_perms, transfer_owner, update_group, dismiss) answers CONV_BANNED over both \
         transports (HTTP 403) and the head does not move; a retry of a send made before the ban answers dup:true; \
         sync, get_conversation (status banned), members, applications and the inbox answer; the unban appends \
         {status: active} and a send appends again; an unknown conversation answers 404 NOT_FOUND, a direct one \
         403 FORBIDDEN, a dismissed group 410 CONV_DISMISSED, a wrong token 401",
    );
    let s = server().await;
    let names = ["u-mem", "u-adm", "u-own"];
    let mut tokens = vec![];
    for u in names.into_iter().chain(["u-new", "u-app"]) {
        tokens.push((u, s.user(u).await));
    }
    let tokens: Vec<(&str, &str)> = tokens.iter().map(|(u, t)| (*u, t.as_str())).collect();
    let mut ws = vec![];
    for (_, token) in &tokens[..3] {
        ws.push(s.ws(token).await);
    }
    let create = json!({"kind": "group", "conv_id": CONV, "name": "ban", "members": ["u-mem", "u-adm"],
                        "join_mode": "approval"});
    ok(ws_op(&mut ws[2], "create_conversation", create).await, "create");
    ok(ws_op(&mut ws[2], "set_role", json!({"conv_id": CONV, "user_id": "u-adm", "role": "admin"})).await, "admin");
    let mut applicant = s.ws(tokens[4].1).await;
    ok(ws_op(&mut applicant, "join", json!({"conv_id": CONV})).await, "application");
    let first = json!({"conv_id": CONV, "client_msg_id": "before", "body": text("hi")});
    let msg = ok(ws_op(&mut ws[0], "send", first.clone()).await, "send")["seq"].as_i64().unwrap_or(0);

    let (ban_status, banned) = admin_status(&s, CONV, "ban", ADMIN).await;
    let ban_seq = banned["seq"].as_i64();
    let pushed_event = pushed_at(&mut ws[0], ban_seq).await;
    let server = format!("http://127.0.0.1:{}", s.port);
    let by_env = [("IMCORE_ADMIN_TOKEN", ADMIN)];
    let again = imcore(&["admin", "--server", &server, "conversation", "ban", CONV], &by_env).await;
    let head_banned = head(&s, tokens[2].1).await;

    let refused = every_write(&s, &tokens, &mut ws, msg).await;
    let retry = ws_op(&mut ws[0], "send", first.clone()).await;
    let head_after = head(&s, tokens[2].1).await;
    let synced = visible_events(&mut ws[0], CONV).await;
    let members = ws_op(&mut ws[0], "members", json!({"conv_id": CONV})).await;
    let applications = ws_op(&mut ws[1], "applications", json!({"conv_id": CONV})).await;
    let inbox = s.http("GET", "/v1/conversations", Some(tokens[0].1), None).await.1;
    let listed = inbox["conversations"].as_array().into_iter().flatten().find(|c| c["conv_id"] == CONV).cloned();

    let unbanned = imcore(&["admin", "--server", &server, "conversation", "unban", CONV], &by_env).await;
    let sent =
        ws_op(&mut ws[0], "send", json!({"conv_id": CONV, "client_msg_id": "later", "body": text("back")})).await;
    let status_events: Vec<Value> = visible_events(&mut ws[0], CONV)
        .await
        .into_iter()
        .filter(|e| e["kind"] == "group" && e["change"].get("status").is_some())
        .collect();

    let direct = s.direct(tokens[0].1, "u-adm").await;
    let (direct_status, _) = admin_status(&s, &direct, "ban", ADMIN).await;
    let (unknown_status, unknown) = admin_status(&s, "g-nowhere", "ban", ADMIN).await;
    let (wrong_status, _) = admin_status(&s, CONV, "ban", "not-the-admin-token-0123456789abcdef").await;
    ok(ws_op(&mut ws[2], "dismiss", json!({"conv_id": CONV})).await, "dismiss");
    let (dismissed_status, dismissed) = admin_status(&s, CONV, "ban", ADMIN).await;

    let ban_event = json!({"actor": null, "change": {"status": "banned"}});
    let event_of = |e: &Value| json!({"actor": e["actor"], "change": e["change"]});
    let ban_ok = ban_status == 200
        && banned["changed"] == true
        && banned["status"] == "banned"
        && ban_seq == Some(msg + 1)
        && pushed_event.as_ref().is_some_and(|e| event_of(e) == ban_event);
    let again_ok = again.0 && again.1.trim() == format!("conversation {CONV} is already banned");
    let refusals_ok = refused.len() == 34
        && refused.iter().all(|(_, code)| code == "CONV_BANNED")
        && head_after["head"] == head_banned["head"]
        && head_banned["head"].as_i64() == ban_seq;
    let retry_ok = retry.as_ref().is_ok_and(|r| r["dup"] == true && r["seq"].as_i64() == Some(msg));
    let reads_ok = synced.last().is_some_and(|e| e["seq"].as_i64() == ban_seq && event_of(e) == ban_event)
        && head_banned["status"] == "banned"
        && members.as_ref().is_ok_and(|m| m["member_count"] == 3)
        && applications.as_ref().is_ok_and(|a| a["applications"][0]["user_id"] == "u-app")
        && listed.as_ref().is_some_and(|c| c["status"] == "banned");
    let unban_ok = unbanned.0
        && unbanned.1.trim() == format!("conversation {CONV} is now active")
        && sent.as_ref().is_ok_and(|r| r["seq"].as_i64() == ban_seq.map(|b| b + 2))
        && status_events.iter().map(event_of).collect::<Vec<_>>()
            == [ban_event.clone(), json!({"actor": null, "change": {"status": "active"}})];
    let edges_ok = direct_status == 403
        && (unknown_status, unknown["error"]["code"].as_str()) == (404, Some("NOT_FOUND"))
        && wrong_status == 401
        && (dismissed_status, dismissed["error"]["code"].as_str()) == (410, Some("CONV_DISMISSED"));
    let pass = check.resolve(
        json!({"ban": banned, "pushed": pushed_event, "ban_again": again.1.trim(), "refused": refused,
               "head_banned": head_banned["head"], "head_after_refusals": head_after["head"],
               "retry_of_earlier_send": format!("{retry:?}"), "synced_last": synced.last(),
               "members": members.as_ref().ok().map(|m| m["member_count"].clone()),
               "inbox_status": listed.map(|c| c["status"].clone()), "unban": unbanned.1.trim(),
               "send_after_unban": format!("{sent:?}"), "status_events": status_events,
               "admin_edges": {"direct": direct_status, "unknown": unknown_status, "wrong_token": wrong_status,
                               "dismissed": dismissed_status}}),
        ban_ok && again_ok && refusals_ok && retry_ok && reads_ok && unban_ok && edges_ok,
    );
    assert!(pass, "ban {ban_ok} again {again_ok} refusals {refusals_ok} retry {retry_ok} reads {reads_ok} unban {unban_ok} edges {edges_ok}: {again:?} {unbanned:?}");
}
