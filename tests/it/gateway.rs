//! The gateway at the protocol level (PROTOCOL §3–5): the whole server on
//! port 0, real WebSocket and HTTP clients, a real PostgreSQL. Each check
//! writes its record to evidence/im-05.

use std::time::Duration;

use futures_util::future::join_all;
use serde_json::{json, Value};

use crate::evidence::Check;
use crate::server::{http_raw, TestServer, Ws};
use crate::sync_points::no_push_before_marker;

const SUITE: &str = "im-05";
/// A bound for what should take milliseconds, wide enough for a loaded 2-core machine.
pub const WAIT: Duration = Duration::from_secs(10);

pub fn hi(key: &str, conv: &str, text: &str) -> Value {
    json!({"conv_id": conv, "client_msg_id": key, "body": {"type": "text", "text": text}})
}

fn code(reply: &Value) -> &str {
    reply["error"]["code"].as_str().unwrap_or("")
}

#[actix_web::test]
async fn auth_is_checked_before_the_upgrade_and_a_rotated_token_is_kicked() {
    let check = Check::start(
        SUITE,
        "05-auth",
        "ws+http",
        "no/bad token: 401 before upgrade and UNAUTHORIZED over HTTP; ?token= works; rotation kicks the live \
         connection with kicked:token_revoked and the old token stops working",
    );
    let s = TestServer::start().await;
    let ana = s.user("u-ana").await;
    let no_token = Ws::connect(s.port, None).await.err();
    let bad_token = Ws::connect(s.port, Some("not-a-token")).await.err();
    let (http_status, http_body) = s.http("GET", "/v1/conversations", None, None).await;
    let by_query = Ws::connect_url(&format!("ws://127.0.0.1:{}/v1/ws?token={ana}", s.port)).await.is_ok();
    let mut live = s.ws(&ana).await;
    let before = live.request("ping", json!({})).await;
    let rotated = s.device("u-ana", "d1").await;
    let closed = live.closed().await;
    let old_again = Ws::connect(s.port, Some(&ana)).await.err();
    let new_ok = Ws::connect(s.port, Some(&rotated)).await.is_ok();
    let pass = no_token == Some(401)
        && bad_token == Some(401)
        && http_status == 401
        && code(&http_body) == "UNAUTHORIZED"
        && by_query
        && before["ok"] == true
        && before["pong"].is_string()
        && closed.pushes == [json!({"push": "kicked", "reason": "token_revoked"})]
        && old_again == Some(401)
        && new_ok;
    let pass = check.resolve(
        json!({"no_token": no_token, "bad_token": bad_token, "http": [http_status, http_body], "query_token": by_query,
               "kicked": closed.pushes, "close_code": closed.code, "old_token_again": old_again, "new_token": new_ok}),
        pass,
    );
    assert!(pass);
}

#[actix_web::test]
async fn a_send_is_acked_and_pushed_to_the_other_member_not_back_to_its_connection() {
    let check = Check::start(
        SUITE,
        "05-send-push",
        "ws",
        "ack {seq:3, dup:false, message_id}; u-ben's device gets push event seq 3; the sending connection gets no push",
    );
    let s = TestServer::start().await;
    let (ana, ben) = (s.user("u-ana").await, s.user("u-ben").await);
    let conv = s.direct(&ana, "u-ben").await;
    let mut a = s.ws(&ana).await;
    let mut b = s.ws(&ben).await;
    let ack = a.request("send", hi("m1", &conv, "hello")).await;
    let pushed = b.push().await;
    let echo_free = no_push_before_marker(&mut a, &mut b, &conv).await;
    let pass = ack["ok"] == true
        && ack["seq"] == 3
        && ack["dup"] == false
        && ack["message_id"].is_string()
        && pushed["push"] == "event"
        && pushed["conv_id"] == conv.as_str()
        && pushed["event"]["seq"] == 3
        && pushed["event"]["kind"] == "msg"
        && pushed["event"]["body"] == json!({"type": "text", "text": "hello"})
        && pushed["event"]["sender"] == json!({"user_id": "u-ana", "device_id": "d1"})
        && echo_free;
    let pass = check.resolve(json!({"ack": ack, "push": pushed, "sender_got_no_push": echo_free}), pass);
    assert!(pass);
}

#[actix_web::test]
async fn the_persistence_checks_hold_at_the_protocol_level() {
    let check_1 = Check::start(
        SUITE,
        "05-replay-mismatch-not-member-over-the-wire",
        "ws+http",
        "replay: dup:true, same seq and message_id (HTTP 200); other body: IDEMPOTENCY_MISMATCH; non-member and \
         unknown conversation: the same NOT_MEMBER error for send and sync",
    );
    let check_2 = Check::start(
        SUITE,
        "05-concurrent-identical-sends",
        "ws x32",
        "32 concurrent identical sends on 32 connections: all ok, one row, one seq, exactly one dup:false",
    );
    let s = TestServer::start().await;
    let (ana, _ben, cai) = (s.user("u-ana").await, s.user("u-ben").await, s.user("u-cai").await);
    let conv = s.direct(&ana, "u-ben").await;
    let mut a = s.ws(&ana).await;
    let first = a.request("send", hi("k1", &conv, "one")).await;
    let replay = a.request("send", hi("k1", &conv, "one")).await;
    let path = format!("/v1/conversations/{conv}/messages");
    let (http_replay_status, http_replay) = s.http("POST", &path, Some(&ana), Some(&hi("k1", &conv, "one"))).await;
    let mismatch = a.request("send", hi("k1", &conv, "two")).await;
    let mut c = s.ws(&cai).await;
    let non_member = c.request("send", hi("c1", &conv, "let me in")).await;
    let unknown = c.request("send", hi("c1", "g-does-not-exist", "hello?")).await;
    let unknown_sync = c.request("sync", json!({"conv_id": "g-does-not-exist"})).await;
    let non_member_sync = c.request("sync", json!({"conv_id": conv})).await;
    let pass = first["seq"] == 3
        && replay["dup"] == true
        && replay["seq"] == first["seq"]
        && replay["message_id"] == first["message_id"]
        && http_replay_status == 200
        && http_replay["dup"] == true
        && http_replay["seq"] == 3
        && code(&mismatch) == "IDEMPOTENCY_MISMATCH"
        && code(&non_member) == "NOT_MEMBER"
        && code(&unknown) == "NOT_MEMBER"
        && non_member["error"] == unknown["error"]
        && code(&unknown_sync) == "NOT_MEMBER"
        && unknown_sync["error"] == non_member_sync["error"];
    let pass = check_1.resolve(
        json!({"first": first, "replay": replay, "http_replay": [http_replay_status, http_replay], "mismatch": mismatch,
               "non_member": non_member, "unknown": unknown, "unknown_sync": unknown_sync}),
        pass,
    );
    assert!(pass);

    // 32 connections (32 devices of u-ana) send the same request key at once.
    let mut tokens = vec![];
    for i in 0..32 {
        tokens.push(s.device("u-ana", &format!("dev{i}")).await);
    }
    let mut conns = join_all(tokens.iter().map(|t| s.ws(t))).await;
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(conns.len()));
    let replies = join_all(conns.iter_mut().map(|ws| {
        let (barrier, conv) = (barrier.clone(), conv.clone());
        async move {
            barrier.wait().await;
            ws.request("send", hi("same-key", &conv, "once")).await
        }
    }))
    .await;
    let fresh = replies.iter().filter(|r| r["dup"] == false).count();
    let seqs: std::collections::BTreeSet<String> = replies.iter().map(|r| r["seq"].to_string()).collect();
    let all_ok = replies.iter().all(|r| r["ok"] == true);
    let rows: i64 = s
        .db
        .client()
        .await
        .query_one("SELECT count(*) FROM events WHERE conv_id = $1 AND client_msg_id = 'same-key'", &[&conv.as_str()])
        .await
        .expect("count")
        .get(0);
    let pass = all_ok && fresh == 1 && seqs.len() == 1 && rows == 1;
    let pass = check_2.resolve(json!({"ok": all_ok, "dup_false": fresh, "distinct_seqs": seqs, "rows": rows}), pass);
    assert!(pass);
}

#[actix_web::test]
async fn malformed_input_gets_bad_request_and_the_connection_stays_open() {
    let check = Check::start(
        SUITE,
        "05-malformed-input",
        "ws+http",
        "malformed JSON (no id), unknown op, invalid id, missing field: BAD_REQUEST, connection open; body over \
         16 KiB: PAYLOAD_TOO_LARGE (HTTP 413); nothing written; a 70 KiB frame closes with 1009",
    );
    let s = TestServer::start().await;
    let ana = s.user("u-ana").await;
    s.user("u-ben").await;
    let conv = s.direct(&ana, "u-ben").await;
    let mut a = s.ws(&ana).await;
    a.send_text("{not json".into()).await;
    let malformed = a.reply_without_id().await;
    let unknown_op = a.request("fly", json!({})).await;
    let bad_id = a.request("send", hi("bad key!", &conv, "x")).await;
    let missing = a.request("send", json!({"conv_id": conv, "client_msg_id": "k"})).await;
    let big = a.request("send", hi("k", &conv, &"x".repeat(17 * 1024))).await;
    let still_open = a.request("ping", json!({})).await;
    let (http_status, http_big) = s
        .http(
            "POST",
            &format!("/v1/conversations/{conv}/messages"),
            Some(&ana),
            Some(&hi("k", &conv, &"x".repeat(17 * 1024))),
        )
        .await;
    let (bad_json_status, bad_json) =
        http_raw(s.port, "POST", &format!("/v1/conversations/{conv}/messages"), Some(&ana), Some("{oops")).await;
    let unchanged = a.request("get_conversation", json!({"conv_id": conv})).await;
    a.send_text(format!("{{\"id\":99,\"op\":\"ping\",\"pad\":\"{}\"}}", "x".repeat(70 * 1024))).await;
    let oversized = a.closed().await;
    let pass = code(&malformed) == "BAD_REQUEST"
        && malformed.get("id").is_none()
        && code(&unknown_op) == "BAD_REQUEST"
        && unknown_op["id"].is_number()
        && code(&bad_id) == "BAD_REQUEST"
        && code(&missing) == "BAD_REQUEST"
        && code(&big) == "PAYLOAD_TOO_LARGE"
        && still_open["ok"] == true
        && http_status == 413
        && code(&http_big) == "PAYLOAD_TOO_LARGE"
        && bad_json_status == 400
        && unchanged["head"] == 2
        && oversized.code == Some(1009);
    let pass = check.resolve(
        json!({"malformed": malformed, "unknown_op": unknown_op, "bad_id": bad_id, "missing": missing, "big": big,
               "http_big": [http_status, http_big], "http_bad_json": [bad_json_status, bad_json],
               "head_after": unchanged["head"], "oversized_close": oversized.code}),
        pass,
    );
    assert!(pass);
}

#[actix_web::test]
async fn after_a_disconnect_sync_from_the_last_seq_recovers_the_gap() {
    let check = Check::start(
        SUITE,
        "05-gap-recovery",
        "ws",
        "pushes 3..5, disconnect, 5 sends, reconnect, sync after 5 gives 6..10, then push 11: nothing missing, nothing twice",
    );
    let s = TestServer::start().await;
    let (ana, ben) = (s.user("u-ana").await, s.user("u-ben").await);
    let conv = s.direct(&ana, "u-ben").await;
    let mut a = s.ws(&ana).await;
    let mut b = s.ws(&ben).await;
    let mut seen: Vec<i64> = vec![];
    for i in 0..3 {
        a.request("send", hi(&format!("before{i}"), &conv, "x")).await;
        let p = b.push().await;
        seen.push(p["event"]["seq"].as_i64().unwrap_or(0));
    }
    b.close().await;
    for i in 0..5 {
        a.request("send", hi(&format!("during{i}"), &conv, "y")).await;
    }
    let mut b = s.ws(&ben).await;
    let last = *seen.last().unwrap_or(&0);
    let page = b.request("sync", json!({"conv_id": conv, "after_seq": last})).await;
    let recovered: Vec<i64> =
        page["events"].as_array().into_iter().flatten().filter_map(|e| e["seq"].as_i64()).collect();
    a.request("send", hi("after", &conv, "z")).await;
    let next = b.push().await;
    seen.extend(&recovered);
    seen.push(next["event"]["seq"].as_i64().unwrap_or(0));
    let want: Vec<i64> = (3..=11).collect();
    let pass = seen == want && page["has_more"] == false && page["head"] == 10;
    let pass = check.resolve(
        json!({"seen": seen, "sync": {"head": page["head"], "next_after": page["next_after"], "has_more": page["has_more"]}}),
        pass,
    );
    assert!(pass);
}

#[actix_web::test]
async fn pull_mode_pushes_head_and_read_cursors_reach_the_other_device() {
    let check_1 = Check::start(
        SUITE,
        "05-pull-head",
        "ws",
        "in a pull-mode group a send pushes {push:head, conv_id, head} to the members' devices, not the event",
    );
    let check_2 = Check::start(
        SUITE,
        "05-read-cursor-inbox",
        "ws+http",
        "inbox shows unread 3 / read_seq 0; read 4 → {read_seq:4} and push read to the user's other device only \
         (the reading device's next push is a later marker message's head); read 1 never moves it back; unread \
         then 2 (msg 5 and the marker); HTTP inbox equals the WebSocket one",
    );
    let s = TestServer::start().await;
    let (ana, ben) = (s.user("u-ana").await, s.user("u-ben").await);
    let ben2 = s.device("u-ben", "d2").await;
    let (status, group) = s
        .http(
            "POST",
            "/v1/conversations",
            Some(&ana),
            Some(&json!({"kind": "group", "name": "big", "members": ["u-ben"], "delivery_mode": "pull"})),
        )
        .await;
    let conv = group["conv_id"].as_str().unwrap_or("").to_owned();
    let mut a = s.ws(&ana).await;
    let mut b1 = s.ws(&ben).await;
    let mut b2 = s.ws(&ben2).await;
    let ack = a.request("send", hi("p1", &conv, "pull me")).await;
    let head = b1.push().await;
    let head2 = b2.push().await;
    let pass = status == 201
        && group["delivery_mode"] == "pull"
        && head == json!({"push": "head", "conv_id": conv, "head": ack["seq"]})
        && head2 == head;
    let pass = check_1.resolve(json!({"create_status": status, "ack": ack, "pushes": [head, head2]}), pass);
    assert!(pass);

    // Inbox and read cursor across two devices.
    for i in 0..2 {
        a.request("send", hi(&format!("u{i}"), &conv, "unread")).await;
        b1.push().await;
        b2.push().await;
    }
    let inbox_before = b1.request("conversations", json!({})).await;
    let read = b1.request("read", json!({"conv_id": conv, "seq": 4})).await;
    let pushed = b2.push().await;
    let sender_quiet = no_push_before_marker(&mut b1, &mut a, &conv).await;
    let marker_head = b2.push().await;
    let back = b1.request("read", json!({"conv_id": conv, "seq": 1})).await;
    b2.push().await;
    let inbox_after = b2.request("conversations", json!({})).await;
    let (http_status, http_inbox) = s.http("GET", "/v1/conversations?limit=10", Some(&ben2), None).await;
    let item = |v: &Value| v["conversations"][0].clone();
    let pass = item(&inbox_before)["unread"] == 3
        && item(&inbox_before)["read_seq"] == 0
        && item(&inbox_before)["last_event"]["seq"] == 5
        && item(&inbox_before)["conv_id"] == conv.as_str()
        && read["read_seq"] == 4
        && pushed == json!({"push": "read", "conv_id": conv, "read_seq": 4})
        && sender_quiet
        && marker_head["head"] == 6
        && back["read_seq"] == 4
        && item(&inbox_after)["unread"] == 2
        && http_status == 200
        && http_inbox["conversations"] == inbox_after["conversations"]
        && http_inbox["next_cursor"].is_null();
    let pass = check_2.resolve(
        json!({"inbox_before": item(&inbox_before), "read": read, "other_device_push": pushed, "read_back": back,
               "inbox_after": item(&inbox_after), "http_status": http_status}),
        pass,
    );
    assert!(pass);
}

#[actix_web::test]
async fn http_and_websocket_give_identical_answers() {
    let check = Check::start(
        SUITE,
        "05-http-equals-ws",
        "ws+http",
        "the same op over HTTP and WebSocket gives the same result object (and the same error object); a direct \
         chat created again is 200; a new send 201 and its replay over WebSocket dup:true with the same seq",
    );
    let s = TestServer::start().await;
    let (ana, _) = (s.user("u-ana").await, s.user("u-ben").await);
    let conv = s.direct(&ana, "u-ben").await;
    let mut a = s.ws(&ana).await;
    let (created_status, _) =
        s.http("POST", "/v1/conversations", Some(&ana), Some(&json!({"kind": "direct", "members": ["u-ben"]}))).await;
    a.request("send", hi("m1", &conv, "one")).await;
    let (st, http_ack) =
        s.http("POST", &format!("/v1/conversations/{conv}/messages"), Some(&ana), Some(&hi("m2", &conv, "two"))).await;
    let ws_dup = a.request("send", hi("m2", &conv, "two")).await;
    let strip = |mut v: Value| {
        if let Value::Object(m) = &mut v {
            m.remove("id");
            m.remove("ok");
        }
        v
    };
    let mut same = vec![];
    for (op, fields, path) in [
        ("get_conversation", json!({"conv_id": conv}), format!("/v1/conversations/{conv}")),
        (
            "sync",
            json!({"conv_id": conv, "after_seq": 1, "limit": 2}),
            format!("/v1/conversations/{conv}/events?after_seq=1&limit=2"),
        ),
        ("sync", json!({"conv_id": conv, "before_seq": 4}), format!("/v1/conversations/{conv}/events?before_seq=4")),
        ("conversations", json!({}), "/v1/conversations".to_owned()),
        ("sync", json!({"conv_id": conv, "epoch": 9}), format!("/v1/conversations/{conv}/events?epoch=9")),
        ("get_conversation", json!({"conv_id": "nope"}), "/v1/conversations/nope".to_owned()),
    ] {
        let mut ws = strip(a.request(op, fields).await);
        let (status, mut http) = s.http("GET", &path, Some(&ana), None).await;
        // An inbox reply's `since` token is the time it was read: it may differ.
        let tokens = [&mut ws, &mut http].map(|v| v.as_object_mut().and_then(|m| m.remove("since")));
        let since_ok = (op != "conversations") == tokens.iter().all(Option::is_none)
            && tokens.iter().all(|t| t.as_ref().is_none_or(Value::is_string));
        same.push(json!({"op": op, "status": status, "equal": ws == http && since_ok, "ws": ws, "http": http}));
    }
    let ack_equal = http_ack["seq"] == ws_dup["seq"] && http_ack["message_id"] == ws_dup["message_id"];
    let pass = created_status == 200
        && st == 201
        && ack_equal
        && ws_dup["dup"] == true
        && same.iter().all(|c| c["equal"] == true)
        && same[4]["http"]["error"]["code"] == "EPOCH_CHANGED"
        && same[4]["status"] == 409;
    let pass = check.resolve(
        json!({"create_again_status": created_status, "http_send_status": st, "ack_equal": ack_equal, "pairs": same}),
        pass,
    );
    assert!(pass);
}
