//! PROTOCOL §1 at the edge: every input outside its form is `BAD_REQUEST`
//! before it reaches the database (never `INTERNAL`), and changes nothing;
//! unknown routes and wrong methods answer in the §2 error shape; a taken
//! group id says no more than "not available".

use serde_json::{json, Value};

use crate::harness::TestDb;
use crate::server::TestServer;

fn code(v: &Value) -> &str {
    v["error"]["code"].as_str().unwrap_or("")
}

/// Rows of `users`, `conversations` and `events`: what a refused input must leave as it was.
pub async fn row_counts(db: &TestDb) -> [i64; 3] {
    rows_of(&db.client().await).await
}

/// [`row_counts`] on a connection of the caller's.
pub async fn rows_of(c: &tokio_postgres::Client) -> [i64; 3] {
    let mut counts = [0; 3];
    for (n, table) in counts.iter_mut().zip(["users", "conversations", "events"]) {
        *n = c.query_one(&format!("SELECT count(*) FROM {table}"), &[]).await.expect("count").get(0);
    }
    counts
}

#[actix_web::test]
async fn display_names_outside_the_schema_or_with_controls_are_bad_requests() {
    let s = TestServer::start().await;
    let before = row_counts(&s.db).await;
    let mut refused = vec![];
    for (i, name) in
        ["x".repeat(129), "x".repeat(256), "nul\u{0}".into(), "new\nline".into(), "c1\u{85}".into(), "del\u{7f}".into()]
            .into_iter()
            .enumerate()
    {
        let (status, v) = s.admin("/v1/admin/users", json!({"user_id": format!("u-{i}"), "display_name": name})).await;
        refused.push((status, code(&v).to_owned()));
    }
    let after = row_counts(&s.db).await;
    let (longest, _) = s
        .admin("/v1/admin/users", json!({"user_id": "u-ok", "display_name": format!("Zoë {}", "é".repeat(124))}))
        .await;
    assert!(refused.iter().all(|(st, c)| *st == 400 && c == "BAD_REQUEST"), "{refused:?}");
    assert_eq!(before, after, "nothing stored");
    assert_eq!(longest, 201, "128 characters (more bytes) is the schema's limit and fits");
}

#[actix_web::test]
async fn group_names_settings_bodies_and_cursors_outside_their_forms_are_bad_requests() {
    let s = TestServer::start().await;
    let ana = s.user("u-ana").await;
    s.user("u-ben").await;
    let conv = s.direct(&ana, "u-ben").await;
    let mut a = s.ws(&ana).await;
    let before = row_counts(&s.db).await;
    let group = |extra: Value| {
        let mut f = json!({"kind": "group", "name": "g", "members": ["u-ben"]});
        f.as_object_mut().expect("object").extend(extra.as_object().expect("object").clone());
        f
    };
    let century_ms = 100 * 36_524 * 24 * 3_600 * 1_000_i64;
    // A time PostgreSQL cannot hold (before 4713 BC), in a well-formed cursor.
    let ancient = hex::encode(format!("{}:{conv}", -300_000_000_000_000_000_i64));
    let mut replies = vec![];
    for (op, fields) in [
        ("create_conversation", group(json!({"name": "nul\u{0}"}))),
        ("create_conversation", group(json!({"name": "bell\u{7}"}))),
        ("create_conversation", group(json!({"name": "x".repeat(129)}))),
        ("create_conversation", group(json!({"retention_ms": century_ms + 1}))),
        ("create_conversation", group(json!({"recall_window_ms": i64::MAX}))),
        ("send", json!({"conv_id": conv, "client_msg_id": "k1", "body": null})),
        ("conversations", json!({"cursor": "zz"})),
        ("conversations", json!({"cursor": "ab".repeat(200)})),
        ("conversations", json!({"cursor": ancient})),
    ] {
        let reply = a.request(op, fields.clone()).await;
        replies.push(json!({"op": op, "fields": fields, "reply": reply}));
    }
    let (null_status, null_http) = s
        .http(
            "POST",
            &format!("/v1/conversations/{conv}/messages"),
            Some(&ana),
            Some(&json!({"client_msg_id": "k2", "body": null})),
        )
        .await;
    let after = row_counts(&s.db).await;
    let century = a.request("create_conversation", group(json!({"retention_ms": century_ms}))).await;
    for r in &replies {
        assert_eq!(r["reply"]["error"]["code"], "BAD_REQUEST", "{r}");
    }
    assert_eq!((null_status, code(&null_http)), (400, "BAD_REQUEST"));
    assert_eq!(before, after, "nothing stored");
    assert_eq!(century["ok"], true, "100 years is the longest duration: {century}");
}

#[actix_web::test]
async fn unknown_routes_and_wrong_methods_answer_in_the_error_shape() {
    let s = TestServer::start().await;
    let ana = s.user("u-ana").await;
    let mut answers = vec![];
    for (method, path, token, want) in [
        ("GET", "/nope", None, (404, "NOT_FOUND")),
        ("GET", "/v1/conversations/c1/nope", Some(ana.as_str()), (404, "NOT_FOUND")),
        ("DELETE", "/v1/conversations", Some(ana.as_str()), (405, "BAD_REQUEST")),
        ("PUT", "/v1/conversations/c1/messages", Some(ana.as_str()), (405, "BAD_REQUEST")),
        ("POST", "/healthz", None, (405, "BAD_REQUEST")),
        ("POST", "/v1/ws", None, (405, "BAD_REQUEST")),
        ("GET", "/v1/admin/users", None, (405, "BAD_REQUEST")),
    ] {
        let (status, v) = s.http(method, path, token, None).await;
        let message = v["error"]["message"].as_str().is_some();
        answers.push((method, path, status, code(&v).to_owned(), message, want));
    }
    for (method, path, status, code, message, want) in &answers {
        assert_eq!((*status, code.as_str()), *want, "{method} {path}");
        assert!(message, "{method} {path} has a message");
    }
}

#[actix_web::test]
async fn a_ping_without_an_id_is_answered_without_one() {
    let s = TestServer::start().await;
    let ana = s.user("u-ana").await;
    let mut a = s.ws(&ana).await;
    a.send_text(r#"{"op":"ping"}"#.into()).await;
    let pong = a.reply_without_id().await;
    let with_id = a.request("ping", json!({})).await;
    assert!(pong["pong"].is_string(), "{pong}");
    assert_eq!(pong.as_object().map(|m| m.len()), Some(1), "only `pong`: {pong}");
    assert_eq!(with_id["ok"], true);
    a.send_text(r#"{"op":"send"}"#.into()).await;
    let other = a.reply_without_id().await;
    assert_eq!(other["error"]["code"], "BAD_REQUEST", "only a ping goes without an id: {other}");
}

/// Creating a group with a taken id answers the same to everyone, member or
/// not: `FORBIDDEN` "not available", never `ALREADY_EXISTS` (which told a
/// non-member that a group it cannot see exists).
#[actix_web::test]
async fn a_taken_group_id_is_refused_alike_for_members_and_strangers() {
    let s = TestServer::start().await;
    let ana = s.user("u-ana").await;
    let eve = s.user("u-eve").await;
    s.user("u-ben").await;
    let s = &s;
    let create = |token: &str, id: &str| {
        let body = json!({"kind": "group", "conv_id": id, "name": "g", "members": ["u-ben"]});
        let token = token.to_owned();
        async move { s.http("POST", "/v1/conversations", Some(&token), Some(&body)).await }
    };
    assert_eq!(create(&ana, "g-secret").await.0, 201);
    let before = row_counts(&s.db).await;
    let stranger = create(&eve, "g-secret").await;
    let member = create(&ana, "g-secret").await;
    let after = row_counts(&s.db).await;
    assert_eq!((stranger.0, code(&stranger.1)), (403, "FORBIDDEN"), "{stranger:?}");
    assert_eq!(stranger, member, "the same answer whoever asks");
    assert_eq!(before, after, "nothing stored");
}
