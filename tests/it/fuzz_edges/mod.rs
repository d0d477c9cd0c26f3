//! Fuzz-style checks of both edges against a real server: valid requests
//! mutated (wrong types, huge numbers, control characters, missing and
//! unknown fields, unknown ops, nested junk), cut short, or junk from the
//! start. Whatever comes in: never a 5xx or `INTERNAL`, an error always in
//! the PROTOCOL §2 shape, the WebSocket still answers a ping, and a refused
//! request stores nothing (the rows of users, conversations and events move
//! only on a success). Cases come from a fixed seed; a failure names its input.
//! `audit` replays the client-facing inputs of an attacker's audit by
//! hand (non-UTF-8 frames, cut and oversize bodies, ids in another case,
//! bidirectional overrides, edge settings and limits, garbage ops).

use std::time::Duration;

use proptest::prelude::*;
use proptest::sample::{select, Index};
use proptest::strategy::ValueTree;
use proptest::test_runner::TestRunner;
use serde_json::{json, Map, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::evidence::Check;
use crate::gateway_faults::{close_code, raw_upgrade};
use crate::input_forms::rows_of;
use crate::server::{http_raw, TestServer, Ws, ADMIN};

const WS_CASES: usize = 500;
const HTTP_CASES: usize = 300;
const WAIT: Duration = Duration::from_secs(10);

/// The fields the ops read, so that mutations hit them.
const FIELDS: &[&str] = &[
    "id",
    "op",
    "conv_id",
    "client_msg_id",
    "body",
    "kind",
    "name",
    "members",
    "delivery_mode",
    "join_mode",
    "max_member",
    "recall_window_ms",
    "retention_ms",
    "limit",
    "cursor",
    "after_seq",
    "before_seq",
    "epoch",
    "seq",
    "user_id",
    "device_id",
    "display_name",
];
const METHODS: &[&str] = &["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"];

/// Short text with C0/C1 controls; NUL (which PostgreSQL refuses in text) often.
fn control_text() -> impl Strategy<Value = String> {
    prop_oneof!["[\\x00-\\x1f\\x7f-\\x9fa-z]{0,8}", "[a-z]{0,3}\\x00[a-z]{0,3}"]
}

fn junk_text() -> impl Strategy<Value = String> {
    prop_oneof![any::<String>(), control_text(), "[A-Za-z0-9._:@-]{0,70}", (0usize..300).prop_map(|n| "x".repeat(n))]
}

/// Any JSON value, weighted to what breaks parsers: extreme numbers, controls, nesting.
fn junk() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        select(vec![0, -1, 1, i64::MAX, i64::MIN, i64::from(i32::MAX) + 1]).prop_map(Value::from),
        any::<f64>().prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        junk_text().prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::vec((select(FIELDS), inner), 0..4)
                .prop_map(|kv| Value::Object(kv.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())),
        ]
    })
}

#[derive(Debug, Clone)]
enum Mutation {
    /// Sets (or adds) a named field to junk.
    Set(&'static str, Value),
    /// Replaces the value of an existing field.
    Replace(Index, Value),
    Remove(Index),
    /// A NUL and maybe other control characters spliced into an existing string field.
    Controls(Index, String),
    /// A body just over the 16 KiB limit.
    BigBody,
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        3 => (select(FIELDS), junk()).prop_map(|(k, v)| Mutation::Set(k, v)),
        3 => (any::<Index>(), junk()).prop_map(|(i, v)| Mutation::Replace(i, v)),
        2 => any::<Index>().prop_map(Mutation::Remove),
        3 => (any::<Index>(), "\\x00[\\x00-\\x1f\\x7f-\\x9f]{0,2}").prop_map(|(i, c)| Mutation::Controls(i, c)),
        1 => Just(Mutation::BigBody),
    ]
}

fn mutate(mut fields: Map<String, Value>, mutations: &[Mutation]) -> Map<String, Value> {
    for m in mutations {
        let key = |i: &Index, f: &Map<String, Value>| f.keys().nth(i.index(f.len().max(1))).cloned();
        match m {
            Mutation::Set(k, v) => {
                fields.insert((*k).to_owned(), v.clone());
            }
            Mutation::Replace(i, v) => {
                if let Some(k) = key(i, &fields) {
                    fields.insert(k, v.clone());
                }
            }
            Mutation::Remove(i) => {
                if let Some(k) = key(i, &fields) {
                    fields.remove(&k);
                }
            }
            Mutation::Controls(i, controls) => {
                let texts: Vec<String> = fields.iter().filter(|(_, v)| v.is_string()).map(|(k, _)| k.clone()).collect();
                if let Some(k) = texts.get(i.index(texts.len().max(1))) {
                    let text = fields[k].as_str().unwrap_or_default();
                    let spliced = format!("{text}{controls}{text}");
                    fields.insert(k.clone(), spliced.into());
                }
            }
            Mutation::BigBody => {
                fields.insert("body".into(), json!({"text": "x".repeat(16 * 1024)}));
            }
        }
    }
    fields
}

fn object(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => Map::new(),
    }
}

/// `text` cut at a character boundary chosen by `at`.
fn cut(text: &str, at: Index) -> String {
    let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
    text[..bounds[at.index(bounds.len())]].to_owned()
}

/// Valid requests of every op, to mutate.
fn ws_templates(direct: &str, group: &str) -> Vec<Value> {
    let id = 1u64 << 40;
    vec![
        json!({"id": id, "op": "ping"}),
        json!({"op": "ping"}),
        json!({"id": id, "op": "get_conversation", "conv_id": group}),
        json!({"id": id, "op": "conversations", "limit": 5}),
        json!({"id": id, "op": "sync", "conv_id": direct, "after_seq": 0, "limit": 10}),
        json!({"id": id, "op": "sync", "conv_id": group, "before_seq": 3, "epoch": 1}),
        json!({"id": id, "op": "read", "conv_id": direct, "seq": 1}),
        json!({"id": id, "op": "send", "conv_id": direct, "client_msg_id": "k", "body": {"type": "text", "text": "hi"}}),
        json!({"id": id, "op": "create_conversation", "kind": "group", "name": "g", "members": ["u-ben"],
               "max_member": 10, "retention_ms": 60_000, "delivery_mode": "pull"}),
        json!({"id": id, "op": "create_conversation", "kind": "group", "name": "Zoë's", "join_mode": "free"}),
        json!({"id": id, "op": "create_conversation", "kind": "direct", "members": ["u-ben"]}),
    ]
}

/// Texts no mutation of a JSON value produces.
fn ws_nasty(direct: &str) -> Vec<String> {
    vec![
        r#"{"id":1,"op":"sync","conv_id":"c1","limit":1e400}"#.into(),
        r#"{"id":1,"op":"sync","conv_id":"c1","after_seq":123456789012345678901234567890}"#.into(),
        format!(r#"{{"id":1,"op":"send","conv_id":"{direct}","client_msg_id":"s","body":"\ud800"}}"#),
        format!(r#"{{"id":1,"op":"send","conv_id":"{direct}","client_msg_id":"n","body":{{"t":"\u0000"}}}}"#),
        r#"{"id":1,"op":"ping","op":"fly"}"#.into(),
        r#"{"op":"ping","id":null}"#.into(),
        "[".repeat(10_000),
        String::new(),
        "null".into(),
        "\"ping\"".into(),
    ]
}

fn ws_frame(templates: Vec<Value>, nasty: Vec<String>) -> impl Strategy<Value = String> {
    prop_oneof![
        6 => (select(templates.clone()), prop::collection::vec(mutation(), 0..3))
            .prop_map(|(t, ms)| Value::Object(mutate(object(t), &ms)).to_string()),
        1 => (select(templates), any::<Index>()).prop_map(|(t, at)| cut(&t.to_string(), at)),
        1 => junk().prop_map(|v| v.to_string()),
        1 => any::<String>(),
        1 => select(nasty),
    ]
}

/// Draws `n` cases of `strategy` from a fixed seed.
fn draw<S: Strategy>(strategy: S, n: usize) -> Vec<S::Value> {
    let mut runner = TestRunner::deterministic();
    (0..n).map(|_| strategy.new_tree(&mut runner).expect("generate a case").current()).collect()
}

/// The reply the server owes `text`: by its id when it has an integer one.
/// A negative id (valid, but not what the test client pairs) becomes positive.
fn paired(text: String) -> (String, Option<u64>) {
    match serde_json::from_str::<Value>(&text) {
        Ok(Value::Object(mut m)) => match m.get("id") {
            Some(id) if id.is_u64() => {
                let id = id.as_u64();
                (text, id)
            }
            Some(id) if id.is_i64() => {
                let id = id.as_i64().unwrap_or_default().unsigned_abs();
                m.insert("id".into(), id.into());
                (Value::Object(m).to_string(), Some(id))
            }
            _ => (text, None),
        },
        _ => (text, None),
    }
}

fn well_shaped_error(v: &Value) -> bool {
    v["error"]["code"].is_string() && v["error"]["message"].is_string()
}

#[actix_web::test]
async fn mutated_websocket_frames_never_fail_internally_nor_store_what_they_refuse() {
    let s = TestServer::start().await;
    let ana = s.user("u-ana").await;
    s.user("u-ben").await;
    let direct = s.direct(&ana, "u-ben").await;
    let mut a = s.ws(&ana).await;
    let group = a.request("create_conversation", json!({"kind": "group", "name": "g", "members": ["u-ben"]})).await;
    let group = group["conv_id"].as_str().expect("group").to_owned();
    let db = s.db.client().await;
    let mut rows = rows_of(&db).await;
    let cases = draw(ws_frame(ws_templates(&direct, &group), ws_nasty(&direct)), WS_CASES);
    for (n, text) in cases.into_iter().enumerate() {
        let (text, id) = paired(text);
        a.send_text(text.clone()).await;
        let reply = tokio::time::timeout(WAIT, async {
            match id {
                Some(id) => a.reply(id).await,
                None => a.reply_without_id().await,
            }
        })
        .await
        .unwrap_or_else(|_| panic!("case {n}: no reply to {text:?}"));
        let ok = reply["ok"] == true || (id.is_none() && reply["pong"].is_string());
        assert!(ok || well_shaped_error(&reply), "case {n}: {text:?} → {reply}");
        assert_ne!(reply["error"]["code"], "INTERNAL", "case {n}: {text:?}");
        let ping = tokio::time::timeout(WAIT, a.request("ping", json!({}))).await;
        assert!(matches!(&ping, Ok(p) if p["ok"] == true), "case {n}: the connection still answers after {text:?}");
        let now = rows_of(&db).await;
        assert!(ok || now == rows, "case {n}: refused {text:?} ({reply}) but rows went {rows:?} → {now:?}");
        rows = now;
    }
}

#[derive(Debug, Clone, Copy)]
enum Token {
    Device,
    Admin,
    Junk,
    Absent,
}

#[derive(Debug, Clone)]
struct HttpTemplate {
    method: &'static str,
    path: Vec<String>,
    body: Option<Value>,
    token: Token,
}

fn http_templates(direct: &str) -> Vec<HttpTemplate> {
    let t = |method, path: &str, body: Option<Value>, token| HttpTemplate {
        method,
        path: path.split('/').filter(|p| !p.is_empty()).map(str::to_owned).collect(),
        body,
        token,
    };
    let conv = |rest: &str| format!("/v1/conversations/{direct}{rest}");
    vec![
        t(
            "POST",
            "/v1/conversations",
            Some(json!({"kind": "group", "name": "g", "members": ["u-ben"]})),
            Token::Device,
        ),
        t("GET", "/v1/conversations", None, Token::Device),
        t("GET", &conv(""), None, Token::Device),
        t("POST", &conv("/messages"), Some(json!({"client_msg_id": "h", "body": {"t": "x"}})), Token::Device),
        t("GET", &conv("/events"), None, Token::Device),
        t("POST", &conv("/read"), Some(json!({"seq": 1})), Token::Device),
        t("GET", "/v1/ping", None, Token::Device),
        t("POST", "/v1/admin/users", Some(json!({"user_id": "u-new", "display_name": "N"})), Token::Admin),
        t("POST", "/v1/admin/users/u-fuzz/devices", Some(json!({"device_id": "d9"})), Token::Admin),
        t("POST", &format!("/v1/admin/conversations/{direct}/epoch"), None, Token::Admin),
        t("GET", "/v1/ws", None, Token::Device),
        t("GET", "/healthz", None, Token::Absent),
    ]
}

#[derive(Debug, Clone)]
struct HttpCase {
    method: &'static str,
    target: String,
    body: Option<String>,
    token: Token,
}

fn percent(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn http_case(templates: Vec<HttpTemplate>) -> impl Strategy<Value = HttpCase> {
    let tweaks = (
        prop::option::weighted(0.2, select(METHODS)),
        prop::option::weighted(0.3, (any::<Index>(), junk_text())),
        prop::collection::vec((select(FIELDS), junk_text()), 0..3),
        prop::collection::vec(mutation(), 0..3),
        prop::option::weighted(0.15, any::<String>()),
        prop::option::weighted(0.15, select(vec![Token::Device, Token::Admin, Token::Junk, Token::Absent])),
    );
    (select(templates), tweaks).prop_map(|(t, (method, segment, query, mutations, raw_body, token))| {
        let mut path = t.path.clone();
        if let Some((i, junk)) = segment {
            let at = i.index(path.len());
            path[at] = junk;
        }
        let mut target = path.iter().map(|p| format!("/{}", percent(p))).collect::<String>();
        if !query.is_empty() {
            let pairs: Vec<String> = query.iter().map(|(k, v)| format!("{k}={}", percent(v))).collect();
            target = format!("{target}?{}", pairs.join("&"));
        }
        let body = raw_body.or_else(|| match (&t.body, mutations.is_empty()) {
            (None, true) => None,
            (body, _) => Some(Value::Object(mutate(object(body.clone().unwrap_or_default()), &mutations)).to_string()),
        });
        HttpCase { method: method.unwrap_or(t.method), target, body, token: token.unwrap_or(t.token) }
    })
}

#[actix_web::test]
async fn mutated_http_requests_never_fail_internally_nor_store_what_they_refuse() {
    let s = TestServer::start().await;
    let ana = s.user("u-ana").await;
    s.user("u-ben").await;
    s.user("u-fuzz").await;
    let direct = s.direct(&ana, "u-ben").await;
    let db = s.db.client().await;
    let mut rows = rows_of(&db).await;
    for (n, case) in draw(http_case(http_templates(&direct)), HTTP_CASES).into_iter().enumerate() {
        let token = match case.token {
            Token::Device => Some(ana.as_str()),
            Token::Admin => Some(ADMIN),
            Token::Junk => Some("not-a-token"),
            Token::Absent => None,
        };
        let (status, v) = http_raw(s.port, case.method, &case.target, token, case.body.as_deref()).await;
        assert!((200..500).contains(&status), "case {n}: {case:?} → {status} {v}");
        assert!(status < 400 || well_shaped_error(&v), "case {n}: {case:?} → {status} {v}");
        let now = rows_of(&db).await;
        assert!(
            status < 300 || now == rows,
            "case {n}: refused {case:?} ({status} {v}) but rows went {rows:?} → {now:?}"
        );
        rows = now;
    }
    let mut a = Ws::connect(s.port, Some(&ana)).await.expect("the device's token still works");
    assert_eq!(a.request("ping", json!({})).await["ok"], true);
}

mod audit;
