//! History beyond messages (PROTOCOL v1.2) on the wire: `edit`, `react`,
//! `send`'s `reply_to` and `mentions`, and the inbox's `unread_mentions`. The
//! rules run as one script over WebSocket and over HTTP on identical groups;
//! races run with real concurrent connections; the edit window is met by
//! moving a target's `created_at` in SQL, not by waiting. Each rule writes
//! its record to evidence/im-14.

use std::collections::{BTreeMap, HashMap};

use serde_json::{json, Value};

use crate::evidence::Check;
use crate::server::{TestServer, Ws};

const SUITE: &str = "im-14";
const USERS: [&str; 6] = ["u-ana", "u-ben", "u-cai", "u-dan", "u-eve", "u-hal"];

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Via {
    Ws,
    Http,
}

impl Via {
    fn name(self) -> &'static str {
        match self {
            Via::Ws => "ws",
            Via::Http => "http",
        }
    }
}

/// The callers of one transport: a token each and, over WebSocket, a connection each.
struct Callers {
    tokens: HashMap<&'static str, String>,
    conns: HashMap<&'static str, Ws>,
}

/// An answer, the same shape whatever carried it: the result object without
/// its per-call fields (`message_id`, `created_at`), or `{"error": code}`.
fn outcome(reply: &Value) -> Value {
    if let Some(code) = reply["error"]["code"].as_str() {
        return json!({"error": code});
    }
    let mut v = reply.clone();
    if let Some(m) = v.as_object_mut() {
        for field in ["id", "ok", "message_id", "created_at"] {
            m.remove(field);
        }
    }
    v
}

/// The HTTP route of a device op (PROTOCOL §5, v1.2).
fn route(op: &str, conv: &str) -> (&'static str, String) {
    match op {
        "send" => ("POST", format!("/v1/conversations/{conv}/messages")),
        "edit" => ("POST", format!("/v1/conversations/{conv}/edit")),
        "react" => ("POST", format!("/v1/conversations/{conv}/react")),
        "recall" => ("POST", format!("/v1/conversations/{conv}/recall")),
        "update_group" => ("PATCH", format!("/v1/conversations/{conv}")),
        "read" => ("POST", format!("/v1/conversations/{conv}/read")),
        other => panic!("no route for {other}"),
    }
}

impl Callers {
    async fn start(s: &TestServer, via: Via) -> Self {
        let (mut tokens, mut conns) = (HashMap::new(), HashMap::new());
        for user in USERS {
            let token = s.device(user, via.name()).await;
            if via == Via::Ws {
                conns.insert(user, s.ws(&token).await);
            }
            tokens.insert(user, token);
        }
        Self { tokens, conns }
    }

    /// `op` with `fields` (which name `conv_id`) as `caller`.
    async fn call(&mut self, s: &TestServer, caller: &'static str, op: &str, fields: Value) -> Value {
        match self.conns.get_mut(caller) {
            Some(ws) => outcome(&ws.request(op, fields).await),
            None => {
                let conv = fields["conv_id"].as_str().expect("conv_id").to_owned();
                let (method, path) = route(op, &conv);
                let mut body = fields;
                body.as_object_mut().expect("object").remove("conv_id");
                outcome(&s.http(method, &path, Some(&self.tokens[caller]), Some(&body)).await.1)
            }
        }
    }
}

fn text(t: &str) -> Value {
    json!({"type": "text", "text": t})
}

/// A group op over HTTP that must succeed.
async fn ok_http(s: &TestServer, token: &str, method: &str, path: String, body: Value) -> Value {
    let (status, v) = s.http(method, &path, Some(token), Some(&body)).await;
    assert!(status == 200 || status == 201, "{method} {path}: {status} {v}");
    v
}

/// Moves the `created_at` of `seqs` back by `ms`.
async fn age(s: &TestServer, conv: &str, seqs: &[i64], ms: i64) {
    let c = s.db.client().await;
    c.execute(
        "UPDATE events SET created_at = now() - $3 * interval '1 millisecond' WHERE conv_id = $1 AND seq = ANY($2)",
        &[&conv, &seqs, &(ms as f64)],
    )
    .await
    .expect("age events");
}

/// The conversation's head, straight from its row.
async fn head(s: &TestServer, conv: &str) -> i64 {
    let c = s.db.client().await;
    c.query_one("SELECT next_seq - 1 FROM conversations WHERE conv_id = $1", &[&conv]).await.expect("head").get(0)
}

/// Every event `user` can see, by seq (sync forward from 0).
async fn events(s: &TestServer, token: &str, conv: &str) -> BTreeMap<i64, Value> {
    let (status, page) =
        s.http("GET", &format!("/v1/conversations/{conv}/events?after_seq=0&limit=1000"), Some(token), None).await;
    assert_eq!(status, 200, "sync: {page}");
    page["events"].as_array().expect("events").iter().map(|e| (e["seq"].as_i64().expect("seq"), e.clone())).collect()
}

/// The backward page below `before`.
async fn events_before(s: &TestServer, token: &str, conv: &str, before: i64) -> BTreeMap<i64, Value> {
    let path = format!("/v1/conversations/{conv}/events?before_seq={before}&limit=1000");
    let (_, page) = s.http("GET", &path, Some(token), None).await;
    page["events"].as_array().expect("events").iter().map(|e| (e["seq"].as_i64().expect("seq"), e.clone())).collect()
}

/// `user`'s inbox item of `conv`.
async fn inbox_item(s: &TestServer, token: &str, conv: &str) -> Value {
    let (_, v) = s.http("GET", "/v1/conversations?limit=200", Some(token), None).await;
    v["conversations"].as_array().and_then(|cs| cs.iter().find(|c| c["conv_id"] == conv)).cloned().unwrap_or_default()
}

/// The history rules, each as `(id, observed, pass)`, run over `via` on a fresh group.
async fn run_rules(s: &TestServer, via: Via) -> Vec<(&'static str, Value, bool)> {
    let conv_owned = format!("g-hist-{}", via.name());
    let conv = conv_owned.as_str();
    let mut c = Callers::start(s, via).await;
    let t = c.tokens.clone();
    // ana owner; ben, cai, eve members; dan never a member; hal joins later.
    let create = json!({"kind": "group", "conv_id": conv, "name": conv, "members": ["u-ben", "u-cai", "u-eve"]});
    ok_http(s, &t["u-ana"], "POST", "/v1/conversations".into(), create).await;
    let mut results = vec![];
    macro_rules! call {
        ($who:literal, $op:literal, $fields:tt) => {{
            let mut f = json!($fields);
            f["conv_id"] = json!(conv);
            c.call(s, $who, $op, f).await
        }};
    }
    macro_rules! seq_of {
        ($who:literal, $key:literal) => {{
            let r = call!($who, "send", {"client_msg_id": $key, "body": text($key)});
            r["seq"].as_i64().unwrap_or_else(|| panic!("send {}: {r}", $key))
        }};
    }

    // --- edit own within the window, and what every read then shows.
    let m1 = seq_of!("u-ana", "m1");
    let edit = call!("u-ana", "edit", {"client_msg_id": "e1", "target_seq": m1, "body": text("m1, edited")});
    let other = call!("u-ben", "edit", {"client_msg_id": "e1", "target_seq": m1, "body": text("mine now")});
    let ev = events(s, &t["u-ben"], conv).await;
    let back = events_before(s, &t["u-ben"], conv, head(s, conv).await + 1).await;
    let item = inbox_item(s, &t["u-ben"], conv).await;
    let edit_seq = edit["seq"].as_i64().unwrap_or(0);
    let shows = |e: &Value| e["body"] == text("m1, edited") && e["edited_at"].is_string();
    let pass = edit == json!({"seq": m1 + 1, "dup": false})
        && other == json!({"error": "FORBIDDEN"})
        && shows(&ev[&m1])
        && shows(&back[&m1])
        && ev[&edit_seq]["kind"] == "edit"
        && ev[&edit_seq]["target_seq"] == m1
        && ev[&edit_seq]["body"] == text("m1, edited")
        && item["last_event"]["seq"] == edit_seq
        && item["unread"] == 1;
    results.push((
        "14-edit-own-within-window",
        json!({"edit": edit, "someone_else": other, "sync_forward": ev[&m1], "sync_backward": back[&m1],
               "edit_event": ev[&edit_seq], "inbox_last_event": item["last_event"], "unread": item["unread"]}),
        pass,
    ));

    // --- the edit's key replayed: the same request, another body, a send's key.
    let again = call!("u-ana", "edit", {"client_msg_id": "e1", "target_seq": m1, "body": text("m1, edited")});
    let other_body = call!("u-ana", "edit", {"client_msg_id": "e1", "target_seq": m1, "body": text("changed")});
    let other_target = call!("u-ana", "edit", {"client_msg_id": "e1", "target_seq": 1, "body": text("m1, edited")});
    let send_key = call!("u-ana", "edit", {"client_msg_id": "m1", "target_seq": m1, "body": text("m1")});
    let as_send = call!("u-ana", "send", {"client_msg_id": "e1", "body": text("m1, edited")});
    let db = s.db.client().await;
    let edit_rows: i64 = db
        .query_one("SELECT count(*) FROM events WHERE conv_id = $1 AND kind = 'edit'", &[&conv])
        .await
        .expect("count")
        .get(0);
    let mismatch = json!({"error": "IDEMPOTENCY_MISMATCH"});
    let pass = again == json!({"seq": edit_seq, "dup": true})
        && other_body == mismatch
        && other_target == mismatch
        && send_key == mismatch
        && as_send == mismatch
        && edit_rows == 1;
    results.push((
        "14-edit-key-replayed",
        json!({"again": again, "other_body": other_body, "other_target": other_target,
               "a_sends_key": send_key, "send_with_the_edits_key": as_send, "edit_events": edit_rows}),
        pass,
    ));

    // --- the window: past it refused; widened by update_group, allowed.
    let m2 = seq_of!("u-ana", "m2");
    age(s, conv, &[m2], 86_400_000 + 2_000).await;
    let before = head(s, conv).await;
    let expired = call!("u-ana", "edit", {"client_msg_id": "e2", "target_seq": m2, "body": text("late")});
    let unchanged = head(s, conv).await == before;
    let widened = call!("u-ana", "update_group", {"edit_window_ms": 2 * 86_400_000i64});
    let allowed = call!("u-ana", "edit", {"client_msg_id": "e2", "target_seq": m2, "body": text("late")});
    let (_, info) = s.http("GET", &format!("/v1/conversations/{conv}"), Some(&t["u-ben"]), None).await;
    let pass = expired == json!({"error": "EDIT_WINDOW_EXPIRED"})
        && unchanged
        && widened["seq"].is_i64()
        && allowed["dup"] == false
        && info["edit_window_ms"] == 2 * 86_400_000i64;
    results.push((
        "14-edit-window-expired",
        json!({"one_day_and_2s_old": expired, "head_unchanged": unchanged, "update_group": widened,
               "after_widening": allowed, "edit_window_ms": info["edit_window_ms"]}),
        pass,
    ));

    // --- edit after recall; the recall erases the earlier edits' bodies too.
    let m3 = seq_of!("u-ana", "m3");
    let e3 = call!("u-ana", "edit", {"client_msg_id": "e3", "target_seq": m3, "body": text("m3 secret")});
    let recall = call!("u-ana", "recall", {"target_seq": m3});
    let after = call!("u-ana", "edit", {"client_msg_id": "e3b", "target_seq": m3, "body": text("back")});
    let replayed = call!("u-ana", "edit", {"client_msg_id": "e3", "target_seq": m3, "body": text("m3 secret")});
    let guessed = call!("u-ana", "edit", {"client_msg_id": "e3", "target_seq": m3, "body": text("a guess")});
    let join_event = call!("u-ana", "edit", {"client_msg_id": "e3c", "target_seq": 1, "body": text("x")});
    let beyond = call!("u-ana", "edit", {"client_msg_id": "e3d", "target_seq": 10_000, "body": text("x")});
    let outsider = call!("u-dan", "edit", {"client_msg_id": "e3e", "target_seq": m3, "body": text("x")});
    let ev = events(s, &t["u-ben"], conv).await;
    let e3_seq = e3["seq"].as_i64().unwrap_or(0);
    // The fingerprint of the erased edit is gone too: no guess can be checked against it.
    let erased_hash: bool =
        s.db.client()
            .await
            .query_one(
                "SELECT request_hash = decode(repeat('00', 32), 'hex') FROM events WHERE conv_id = $1 AND seq = $2",
                &[&conv, &e3_seq],
            )
            .await
            .expect("the edit's row")
            .get(0);
    let pass = e3["dup"] == false
        && replayed == json!({"seq": e3_seq, "dup": true})
        && guessed == replayed
        && erased_hash
        && recall["dup"] == false
        && after == json!({"error": "NOT_FOUND"})
        && join_event == json!({"error": "NOT_FOUND"})
        && beyond == json!({"error": "NOT_FOUND"})
        && outsider == json!({"error": "NOT_MEMBER"})
        && ev[&m3]["recalled"] == true
        && ev[&m3]["body"].is_null()
        && ev[&e3_seq]["body"].is_null()
        && erased_everywhere(s, conv).await;
    results.push((
        "14-edit-after-recall",
        json!({"edit_before": e3, "recall": recall, "edit_after": after, "its_key_replayed": replayed,
               "its_key_with_a_guessed_body": guessed, "edit_fingerprint_erased": erased_hash, "edit_of_a_join_event": join_event,
               "past_the_head": beyond, "non_member": outsider, "synced_target": ev[&m3],
               "synced_earlier_edit": ev[&e3_seq]}),
        pass,
    ));

    // --- reactions: set semantics, mute, members only, the limit, bad emoji.
    let r_on = call!("u-ben", "react", {"target_seq": m1, "emoji": "👍", "on": true});
    let r_on2 = call!("u-ben", "react", {"target_seq": m1, "emoji": "👍", "on": true});
    let r_off = call!("u-ben", "react", {"target_seq": m1, "emoji": "👍", "on": false});
    let r_off2 = call!("u-ben", "react", {"target_seq": m1, "emoji": "👍", "on": false});
    let eve_sent = seq_of!("u-eve", "eve1");
    let mute = json!({"mute_until": "2099-01-01T00:00:00Z"});
    ok_http(s, &t["u-ana"], "PATCH", format!("/v1/conversations/{conv}/members/u-eve"), mute).await;
    let before = head(s, conv).await;
    let muted_react = call!("u-eve", "react", {"target_seq": m1, "emoji": "👍", "on": true});
    let muted_edit = call!("u-eve", "edit", {"client_msg_id": "e-eve", "target_seq": eve_sent, "body": text("x")});
    let outsider = call!("u-dan", "react", {"target_seq": m1, "emoji": "👍", "on": true});
    let recalled = call!("u-ben", "react", {"target_seq": m3, "emoji": "👍", "on": true});
    let unchanged = head(s, conv).await == before;
    let pass = r_on == json!({"changed": true, "seq": before - 3})
        && r_on2 == json!({"changed": false, "seq": null})
        && r_off["changed"] == true
        && r_off2 == json!({"changed": false, "seq": null})
        && muted_react == json!({"error": "MUTED"})
        && muted_edit == json!({"error": "MUTED"})
        && outsider == json!({"error": "NOT_MEMBER"})
        && recalled == json!({"error": "NOT_FOUND"})
        && unchanged;
    results.push((
        "14-react-muted",
        json!({"on": r_on, "on_again": r_on2, "off": r_off, "off_again": r_off2, "muted_react": muted_react,
               "muted_edit_own": muted_edit, "non_member": outsider, "recalled_target": recalled,
               "head_unchanged": unchanged}),
        pass,
    ));

    let emoji: Vec<String> = (0..21).map(|i| format!(":e{i}:")).collect();
    let mut first20 = vec![];
    for e in &emoji[..20] {
        first20.push(call!("u-ana", "react", {"target_seq": m1, "emoji": e, "on": true})["changed"].clone());
    }
    let before = head(s, conv).await;
    let twenty_first = call!("u-ana", "react", {"target_seq": m1, "emoji": emoji[20], "on": true});
    let long = call!("u-ana", "react", {"target_seq": m1, "emoji": "x".repeat(33), "on": true});
    let spaced = call!("u-ana", "react", {"target_seq": m1, "emoji": "a b", "on": true});
    let unchanged = head(s, conv).await == before;
    let existing = call!("u-ben", "react", {"target_seq": m1, "emoji": emoji[0], "on": true});
    let freed = call!("u-ana", "react", {"target_seq": m1, "emoji": emoji[19], "on": false});
    let now_fits = call!("u-ben", "react", {"target_seq": m1, "emoji": emoji[20], "on": true});
    let ev = events(s, &t["u-ben"], conv).await;
    let shown = ev[&m1]["reactions"].clone();
    let expected_shown: Vec<Value> = emoji[..19]
        .iter()
        .enumerate()
        .map(|(i, e)| json!({"emoji": e, "count": if i == 0 { 2 } else { 1 }, "me": i == 0}))
        .chain([json!({"emoji": emoji[20], "count": 1, "me": true})])
        .collect();
    let pass = first20.iter().all(|c| c == true)
        && twenty_first == json!({"error": "TOO_MANY_REACTIONS"})
        && long == json!({"error": "BAD_REQUEST"})
        && spaced == json!({"error": "BAD_REQUEST"})
        && unchanged
        && existing["changed"] == true
        && freed["changed"] == true
        && now_fits["changed"] == true
        && shown == json!(expected_shown);
    results.push((
        "14-react-limit-20",
        json!({"twenty_new": first20, "twenty_first": twenty_first, "emoji_of_33_bytes": long,
               "emoji_with_a_space": spaced, "head_unchanged": unchanged, "an_existing_emoji_by_another": existing,
               "one_removed": freed, "then_the_21st": now_fits, "synced_reactions_for_ben": shown}),
        pass,
    ));

    // --- replies.
    ok_http(s, &t["u-ana"], "POST", format!("/v1/conversations/{conv}/members"), json!({"user_ids": ["u-hal"]})).await;
    let before = head(s, conv).await;
    let before_joined = call!("u-hal", "send", {"client_msg_id": "h1", "body": text("re"), "reply_to": m1});
    let future = call!("u-ana", "send", {"client_msg_id": "r1", "body": text("re"), "reply_to": before + 5});
    let not_msg = call!("u-ana", "send", {"client_msg_id": "r2", "body": text("re"), "reply_to": 1});
    let unchanged = head(s, conv).await == before;
    let good = call!("u-ben", "send", {"client_msg_id": "r3", "body": text("re"), "reply_to": m1});
    let to_recalled = call!("u-ben", "send", {"client_msg_id": "r4", "body": text("re"), "reply_to": m3});
    let ev = events(s, &t["u-cai"], conv).await;
    let good_seq = good["seq"].as_i64().unwrap_or(0);
    let pass = before_joined == json!({"error": "NOT_FOUND"})
        && future == json!({"error": "NOT_FOUND"})
        && not_msg == json!({"error": "NOT_FOUND"})
        && unchanged
        && good["dup"] == false
        && to_recalled["dup"] == false
        && ev[&good_seq]["reply_to"] == m1;
    results.push((
        "14-reply-to-invisible",
        json!({"before_the_caller_joined": before_joined, "in_the_future": future, "a_join_event": not_msg,
               "head_unchanged": unchanged, "a_visible_msg": good, "a_recalled_msg": to_recalled,
               "synced_reply": ev[&good_seq]}),
        pass,
    ));

    // --- mentions.
    let before = head(s, conv).await;
    let outsider = call!("u-ana", "send", {"client_msg_id": "n1", "body": text("hi"), "mentions": ["u-ben", "u-dan"]});
    let unknown = call!("u-ana", "send", {"client_msg_id": "n2", "body": text("hi"), "mentions": ["u-nobody"]});
    let unchanged = head(s, conv).await == before;
    let good =
        call!("u-ana", "send", {"client_msg_id": "n3", "body": text("hi"), "mentions": ["u-ben", "u-cai", "u-ben"]});
    let ev = events(s, &t["u-cai"], conv).await;
    let good_seq = good["seq"].as_i64().unwrap_or(0);
    let pass = outsider == json!({"error": "NOT_FOUND"})
        && unknown == json!({"error": "NOT_FOUND"})
        && unchanged
        && good["dup"] == false
        && ev[&good_seq]["mentions"] == json!(["u-ben", "u-cai"]);
    results.push((
        "14-mentions-not-member",
        json!({"a_non_member": outsider, "an_unknown_user": unknown, "head_unchanged": unchanged,
               "members_one_twice": good, "synced_mentions": ev[&good_seq]["mentions"]}),
        pass,
    ));

    let before = head(s, conv).await;
    let many: Vec<String> = (0..51).map(|i| format!("u-m{i}")).collect();
    let fifty_one = call!("u-ana", "send", {"client_msg_id": "n4", "body": text("hi"), "mentions": many});
    let not_ids = call!("u-ana", "send", {"client_msg_id": "n5", "body": text("hi"), "mentions": "u-ben"});
    let unchanged = head(s, conv).await == before;
    let pass = fifty_one == json!({"error": "BAD_REQUEST"}) && not_ids == json!({"error": "BAD_REQUEST"}) && unchanged;
    results.push((
        "14-mentions-51",
        json!({"fifty_one": fifty_one, "not_an_array": not_ids, "head_unchanged": unchanged}),
        pass,
    ));
    results
}

/// No recalled message leaves content in the log: the target's body and the
/// body of every `edit` of it are NULL.
async fn erased_everywhere(s: &TestServer, conv: &str) -> bool {
    leaks(s, conv).await == 0
}

/// The `edit` rows whose target is recalled but whose body is still there.
async fn leaks(s: &TestServer, conv: &str) -> i64 {
    let db = s.db.client().await;
    db.query_one(
        "SELECT count(*) FROM events m JOIN events e ON e.conv_id = m.conv_id AND e.target_seq = m.seq
          WHERE m.conv_id = $1 AND m.kind = 'msg' AND (m.recalled AND (m.body IS NOT NULL
                OR (e.kind = 'edit' AND e.body IS NOT NULL)))",
        &[&conv],
    )
    .await
    .expect("leaks")
    .get(0)
}

#[actix_web::test]
async fn the_history_rules_hold_alike_over_websocket_and_http() {
    let s = TestServer::start().await;
    for user in USERS {
        s.user(user).await;
    }
    let mut by_via = vec![];
    for via in [Via::Ws, Via::Http] {
        by_via.push(run_rules(&s, via).await);
    }
    let mut passed = true;
    for (via, results) in [Via::Ws, Via::Http].into_iter().zip(&by_via) {
        for (id, observed, pass) in results {
            let check = Check::start(SUITE, id, via.name(), expected(id));
            passed &= check.resolve(observed.clone(), *pass);
        }
    }
    let check = Check::start(
        SUITE,
        "14-both-transports-identical",
        "ws+http",
        "every answer of the rules script (edit, react, send with reply_to and mentions, recall, update_group) \
         is the same JSON over WebSocket and over HTTP, on identical groups",
    );
    let (ws, http) = (&by_via[0], &by_via[1]);
    let differing: Vec<&str> = ws
        .iter()
        .zip(http)
        .filter(|(a, b)| a.0 != b.0 || a.2 != b.2 || per_call_fields_out(&a.1) != per_call_fields_out(&b.1))
        .map(|(a, _)| a.0)
        .collect();
    passed &= check.resolve(json!({"rules": ws.len(), "differing": differing}), differing.is_empty());
    assert!(passed, "{by_via:#?}");
}

/// `v` without what differs by run, call or device (the conversation, times,
/// ids, the device in `sender`), for comparing the two transports' runs.
fn per_call_fields_out(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.iter()
                .filter(|(k, _)| {
                    !["conv_id", "created_at", "edited_at", "message_id", "device_id"].contains(&k.as_str())
                })
                .map(|(k, v)| (k.clone(), per_call_fields_out(v)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(per_call_fields_out).collect()),
        other => other.clone(),
    }
}

fn expected(id: &str) -> &'static str {
    match id {
        "14-edit-own-within-window" => {
            "the sender's edit of its msg: {seq, dup:false}; another member's: FORBIDDEN; sync forward and backward \
             show the new body with edited_at; the edit event carries target_seq and body; the inbox's last_event \
             is the edit and unread counts the msg only"
        }
        "14-edit-key-replayed" => {
            "the same edit again: dup:true with the first seq; the key with another body or target, a send's key \
             for an edit, an edit's key for a send: IDEMPOTENCY_MISMATCH; one edit event"
        }
        "14-edit-window-expired" => {
            "a msg 1 day + 2 s old (default window 1 day): EDIT_WINDOW_EXPIRED, nothing appended; after \
             update_group edit_window_ms = 2 days: the same edit succeeds"
        }
        "14-edit-after-recall" => {
            "edit of a recalled msg: NOT_FOUND; of a join event, past the head: NOT_FOUND; by a non-member: \
             NOT_MEMBER; the recall erased the earlier edit's body and fingerprint as well as the msg's body, so \
             that edit's key answers dup:true with its seq for the same body and for a guessed one alike"
        }
        "14-react-muted" => {
            "on: changed with the event's seq; on again: changed:false, seq:null; off; off again: unchanged; a muted \
             member's react and edit: MUTED; a non-member: NOT_MEMBER; a recalled target: NOT_FOUND; nothing appended"
        }
        "14-react-limit-20" => {
            "20 distinct emoji: each changed; a 21st: TOO_MANY_REACTIONS; 33 bytes or a space: BAD_REQUEST; nothing \
             appended; an existing emoji by another: changed; after one is removed, the 21st fits; sync shows the \
             20 with counts and me in first-added order"
        }
        "14-reply-to-invisible" => {
            "reply_to a msg from before the caller joined, a future seq, a join event: NOT_FOUND, nothing appended; \
             a visible msg (a recalled one too): sent, and the event carries reply_to"
        }
        "14-mentions-not-member" => {
            "mentions naming a non-member or an unknown user: NOT_FOUND, nothing appended; members (one twice): \
             sent, the event carries them once each in order"
        }
        "14-mentions-51" => "51 mentions or mentions not an array: BAD_REQUEST, nothing appended",
        _ => "",
    }
}

mod derived;
/// What a run of toggles of one (user, message, emoji) left: the `reaction`
/// events in log order, and the stored set and count.
mod races;
