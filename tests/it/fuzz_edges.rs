//! Fuzz-style checks of both edges against a real server: valid requests
//! mutated (wrong types, huge numbers, control characters, missing and
//! unknown fields, unknown ops, nested junk), cut short, or junk from the
//! start. Whatever comes in: never a 5xx or `INTERNAL`, an error always in
//! the PROTOCOL §2 shape, the WebSocket still answers a ping, and a refused
//! request stores nothing (the rows of users, conversations and events move
//! only on a success). Cases come from a fixed seed; a failure names its input.
//! A last test replays the client-facing inputs of an attacker's audit by
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

/// One case of [`the_client_facing_edges_of_the_audit_are_answered_and_the_server_stays_healthy`]:
/// its record under `16-low-fuzz`, passing only if every input of it did.
struct Case {
    check: Check,
    variant: &'static str,
    inputs: Vec<Value>,
    pass: bool,
}

impl Case {
    fn start(variant: &'static str, expected: &'static str) -> Self {
        let check = Check::start("im-16", "16-low-fuzz", variant, expected);
        Self { check, variant, inputs: vec![], pass: true }
    }

    fn saw(&mut self, input: Value, pass: bool) {
        self.inputs.push(json!({"input": input, "pass": pass}));
        self.pass &= pass;
    }

    fn finish(self, failed: &mut Vec<String>) {
        let (variant, inputs) = (self.variant, Value::Array(self.inputs));
        if !self.check.resolve(inputs.clone(), self.pass) {
            failed.push(format!("{variant}: {inputs}"));
        }
    }
}

/// A masked client frame (mask key 0, so the payload goes as is).
fn raw_frame(first_byte: u8, payload: &[u8]) -> Vec<u8> {
    assert!(payload.len() < 126);
    let mut frame = vec![first_byte, 0x80 | payload.len() as u8, 0, 0, 0, 0];
    frame.extend_from_slice(payload);
    frame
}

/// The next data or close frame from the server: `(opcode, payload)`.
async fn next_frame(tcp: &mut TcpStream) -> Option<(u8, Vec<u8>)> {
    loop {
        let mut h = [0u8; 2];
        tcp.read_exact(&mut h).await.ok()?;
        let len = match h[1] & 0x7f {
            126 => u64::from(tcp.read_u16().await.ok()?),
            127 => tcp.read_u64().await.ok()?,
            n => u64::from(n),
        };
        let mut payload = vec![0u8; usize::try_from(len).ok()?];
        tcp.read_exact(&mut payload).await.ok()?;
        if matches!(h[0] & 0x0f, 0x1 | 0x8) {
            return Some((h[0] & 0x0f, payload));
        }
    }
}

/// The status of the answer to `request` sent raw, the write side then shut;
/// `None` when the server closed without answering. Bounded by `wait`.
async fn raw_http(port: u16, request: &[u8], wait: Duration) -> Result<Option<u16>, &'static str> {
    let mut tcp = TcpStream::connect(("127.0.0.1", port)).await.map_err(|_| "connect")?;
    tcp.write_all(request).await.map_err(|_| "write")?;
    let _ = tcp.shutdown().await;
    let mut answer = vec![];
    match tokio::time::timeout(wait, tcp.read_to_end(&mut answer)).await {
        Err(_) => Err("neither answered nor closed in time"),
        Ok(_) => Ok(std::str::from_utf8(answer.get(9..12).unwrap_or_default()).ok().and_then(|s| s.parse().ok())),
    }
}

fn not_internal(v: &Value) -> bool {
    (v["ok"] == true || well_shaped_error(v)) && v["error"]["code"] != "INTERNAL"
}

#[actix_web::test]
async fn the_client_facing_edges_of_the_audit_are_answered_and_the_server_stays_healthy() {
    let s = TestServer::start().await;
    let ana = s.user("u-ana").await;
    s.user("u-ben").await;
    let direct = s.direct(&ana, "u-ben").await;
    let mut a = s.ws(&ana).await;
    let group = a.request("create_conversation", json!({"kind": "group", "name": "g", "members": ["u-ben"]})).await;
    let group = group["conv_id"].as_str().expect("group").to_owned();
    for i in 0..3 {
        a.request("send", json!({"conv_id": group, "client_msg_id": format!("m{i}"), "body": {"t": i}})).await;
    }
    // Raw connections use a second device: `a` (device d1) stays routed.
    let raw = s.device("u-ana", "d2").await;
    let db = s.db.client().await;
    let mut failed = vec![];
    let healthy = |port| async move { http_raw(port, "GET", "/healthz", None, None).await.0 == 200 };

    let mut case = Case::start(
        "non-UTF-8 text frames",
        "a text message that is not UTF-8 (one frame, fragmented, a UTF-16 surrogate) closes with 1007; a valid \
         message split inside a character is answered; the device connects again; an unmasked frame still \
         closes with 1002",
    );
    let bad: [Vec<Vec<u8>>; 3] = [
        vec![raw_frame(0x81, b"{\"op\":\"ping\",\"x\":\"\xff\xfe\"}")],
        vec![raw_frame(0x01, b"{\"op\":\"ping\",\"x\":\"\xc3"), raw_frame(0x80, b"(\"}")],
        vec![raw_frame(0x81, b"{\"op\":\"ping\",\"x\":\"\xed\xa0\x80\"}")],
    ];
    for frames in bad {
        let mut tcp = raw_upgrade(s.port, &raw).await;
        for f in &frames {
            tcp.write_all(f).await.expect("write frame");
        }
        let code = tokio::time::timeout(WAIT, close_code(&mut tcp)).await.ok().flatten();
        let again = s.ws(&raw).await.request("ping", json!({})).await;
        case.saw(json!({"frames": frames.len(), "close": code, "ping_after": again["ok"]}), code == Some(1007));
    }
    let mut tcp = raw_upgrade(s.port, &raw).await;
    tcp.write_all(&raw_frame(0x01, "{\"op\":\"ping\",\"x\":\"\u{e9}".as_bytes().split_last().expect("bytes").1))
        .await
        .expect("write");
    tcp.write_all(&raw_frame(0x80, b"\xa9\"}")).await.expect("write");
    let pong = tokio::time::timeout(WAIT, next_frame(&mut tcp)).await.ok().flatten();
    let pong: Value = pong.map_or(Value::Null, |(_, p)| serde_json::from_slice(&p).unwrap_or_default());
    case.saw(json!({"split_inside_a_character": pong}), pong["pong"].is_string());
    // Contrast: another framing violation (a client frame without a mask) stays 1002.
    let mut tcp = raw_upgrade(s.port, &raw).await;
    tcp.write_all(b"\x81\x02{}").await.expect("write frame");
    let code = tokio::time::timeout(WAIT, close_code(&mut tcp)).await.ok().flatten();
    case.saw(json!({"unmasked_frame_close": code}), code == Some(1002));
    case.finish(&mut failed);

    let mut case = Case::start(
        "truncated and oversize HTTP bodies",
        "a Content-Length of 60000 with a cut body (then the write side shut) is answered 4xx or closed within 5 s; \
         a body over 64 KiB answers PAYLOAD_TOO_LARGE, a message body over 16 KiB too (HTTP and WebSocket); \
         nothing stored, /healthz answers",
    );
    let rows = rows_of(&db).await;
    let cut = format!(
        "POST /v1/conversations HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ana}\r\nContent-Type: application/json\r\n\
         Content-Length: 60000\r\n\r\n{{\"kind\":\"gro"
    );
    let started = std::time::Instant::now();
    let answered = raw_http(s.port, cut.as_bytes(), Duration::from_secs(5)).await;
    let pass = matches!(answered, Ok(None) | Ok(Some(400..=499)));
    case.saw(json!({"cut_body": format!("{answered:?}"), "ms": started.elapsed().as_millis() as u64}), pass);
    let envelope = json!({"kind": "group", "name": "x".repeat(70 * 1024)}).to_string();
    let (status, v) = http_raw(s.port, "POST", "/v1/conversations", Some(&ana), Some(&envelope)).await;
    case.saw(json!({"http_body_bytes": envelope.len(), "status": status, "code": v["error"]["code"]}), status == 413);
    for bytes in [16 * 1024 + 1, 200_039] {
        let big = json!({"client_msg_id": format!("big{bytes}"), "body": {"t": "x".repeat(bytes)}});
        let path = format!("/v1/conversations/{direct}/messages");
        let (status, v) = http_raw(s.port, "POST", &path, Some(&ana), Some(&big.to_string())).await;
        case.saw(json!({"message_body_bytes": bytes, "status": status, "code": v["error"]["code"]}), status == 413);
    }
    let ws_big = a
        .request("send", json!({"conv_id": direct, "client_msg_id": "bigws", "body": {"t": "x".repeat(16 * 1024)}}))
        .await;
    case.saw(json!({"ws_message_body": ws_big["error"]["code"]}), ws_big["error"]["code"] == "PAYLOAD_TOO_LARGE");
    let stalled = TcpStream::connect(("127.0.0.1", s.port)).await.map(|mut t| async move {
        let _ = t.write_all(cut.as_bytes()).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    });
    if let Ok(stalled) = stalled {
        stalled.await;
    }
    let now = rows_of(&db).await;
    case.saw(json!({"rows_before": rows, "rows_after": now, "healthz": healthy(s.port).await}), now == rows);
    case.finish(&mut failed);

    let mut case = Case::start(
        "ids with case variants",
        "ids differing only in case name nothing: `ANA` is not created, a conversation id or user id in another \
         case answers NOT_MEMBER / NOT_FOUND / BAD_REQUEST, never INTERNAL, and stores nothing",
    );
    let rows = rows_of(&db).await;
    let (status, v) = s.admin("/v1/admin/users", json!({"user_id": "U-ANA"})).await;
    case.saw(json!({"create U-ANA": [status, v["error"]["code"]]}), status == 400);
    let (status, v) = s.admin("/v1/admin/users/U-BEN/devices", json!({"device_id": "d1"})).await;
    case.saw(json!({"device of U-BEN": [status, v["error"]["code"]]}), status == 404);
    let upper = group.to_uppercase();
    for (op, fields) in [
        ("get_conversation", json!({"conv_id": upper})),
        ("send", json!({"conv_id": direct.to_uppercase(), "client_msg_id": "case", "body": {"t": 1}})),
        ("sync", json!({"conv_id": upper, "after_seq": 0})),
        ("create_conversation", json!({"kind": "direct", "members": ["U-BEN"]})),
        ("invite", json!({"conv_id": group, "user_ids": ["U-BEN", "u-Ben"]})),
    ] {
        let reply = a.request(op, fields.clone()).await;
        let pass = not_internal(&reply) && reply["ok"] != true || reply["joined"] == json!([]);
        case.saw(json!({"op": op, "fields": fields, "reply": reply}), pass);
    }
    let now = rows_of(&db).await;
    case.saw(json!({"rows_before": rows, "rows_after": now}), now == rows);
    case.finish(&mut failed);

    let mut case = Case::start(
        "bidirectional overrides in text",
        "U+202E in a display name, a group name, an alias and a message body is stored as given and echoed \
         exactly, inside a JSON string",
    );
    let rlo = "\u{202e}gnp.exe \u{202d}x\u{202c}";
    let (status, _) = s.admin("/v1/admin/users", json!({"user_id": "u-rlo", "display_name": rlo})).await;
    let stored: Option<String> =
        db.query_one("SELECT display_name FROM users WHERE user_id = 'u-rlo'", &[]).await.ok().and_then(|r| r.get(0));
    case.saw(json!({"display_name": [status, stored]}), status == 201 && stored.as_deref() == Some(rlo));
    let made = a.request("create_conversation", json!({"kind": "group", "name": rlo})).await;
    let rconv = made["conv_id"].as_str().unwrap_or_default().to_owned();
    let got = a.request("get_conversation", json!({"conv_id": rconv})).await;
    case.saw(json!({"get_conversation": got}), got.to_string().contains(rlo));
    let alias = a.request("set_alias", json!({"conv_id": rconv, "alias": rlo})).await;
    let members = a.request("members", json!({"conv_id": rconv})).await;
    let echoed = members["members"][0]["alias"] == rlo;
    case.saw(json!({"alias": alias["ok"], "members": members["members"]}), echoed);
    let body = json!({"type": "text", "text": format!("{rlo} user u-ana")});
    a.request("send", json!({"conv_id": rconv, "client_msg_id": "rlo", "body": body})).await;
    let synced = a.request("sync", json!({"conv_id": rconv, "after_seq": 0})).await;
    let round = synced["events"].as_array().into_iter().flatten().any(|e| e["body"] == body);
    case.saw(json!({"body_round_trip": round}), round);
    case.finish(&mut failed);

    let mut case = Case::start(
        "retention_ms edge values",
        "create_conversation and update_group with retention_ms 0, -1, 1, 100 years and one more, i64/u64 max, \
         2^53, 1.5, a numeric string, true, {} and null: each answered (stored exactly when accepted: a numeric \
         string as its number, null as unlimited), never INTERNAL, a refusal stores nothing",
    );
    let century_ms = 100 * 36_524 * 24 * 3_600 * 1_000_i64;
    let values = [
        json!(0),
        json!(-1),
        json!(1),
        json!(century_ms),
        json!(century_ms + 1),
        json!(i64::MAX),
        json!(u64::MAX),
        json!(1u64 << 53),
        json!(1.5),
        json!("1000"),
        json!(true),
        json!({}),
        json!(null),
    ];
    for value in &values {
        let rows = rows_of(&db).await;
        let made = a.request("create_conversation", json!({"kind": "group", "name": "r", "retention_ms": value})).await;
        let updated = a.request("update_group", json!({"conv_id": group, "retention_ms": value})).await;
        let now = rows_of(&db).await;
        // A numeric string is taken as its number (HTTP query parameters are strings).
        let want = value.as_i64().or_else(|| value.as_str().and_then(|v| v.parse().ok()));
        let stored = if made["ok"] == true {
            let conv = made["conv_id"].as_str().unwrap_or_default();
            let got = a.request("get_conversation", json!({"conv_id": conv})).await;
            got.to_string().contains(&format!("\"retention_ms\":{}", want.map_or("null".into(), |n| n.to_string())))
        } else {
            true
        };
        let pass = not_internal(&made)
            && not_internal(&updated)
            && stored
            && (made["ok"] == true || updated["ok"] == true || now == rows);
        case.saw(json!({"retention_ms": value, "create": made, "update": updated["error"]["code"]}), pass);
    }
    case.finish(&mut failed);

    let mut case = Case::start(
        "huge limits on sync",
        "sync with limit 0, -1, 1e9, 2^53, i64/u64 max, 1.5, \"100\", 1e300 is answered, never INTERNAL; an \
         accepted page holds at most 1000 events",
    );
    for limit in [
        "0",
        "-1",
        "1000000000",
        "9007199254740992",
        "9223372036854775807",
        "18446744073709551615",
        "1.5",
        "\"100\"",
        "1e300",
    ] {
        let id = 1_000 + case.inputs.len() as u64;
        a.send_text(format!(r#"{{"id":{id},"op":"sync","conv_id":"{group}","after_seq":0,"limit":{limit}}}"#)).await;
        let reply = tokio::time::timeout(WAIT, a.reply(id)).await.unwrap_or(Value::Null);
        let events = reply["events"].as_array().map_or(0, Vec::len);
        case.saw(
            json!({"limit": limit, "ok": reply["ok"], "code": reply["error"]["code"], "events": events}),
            not_internal(&reply) && events <= 1000,
        );
    }
    case.finish(&mut failed);

    let mut case = Case::start(
        "garbage ops",
        "an op that is empty, in another case, with a NUL or U+202E, padded, 10,000 characters, a prototype name, \
         or not a string answers BAD_REQUEST with its id, and the connection keeps answering",
    );
    let long = "x".repeat(10_000);
    for op in [
        json!(""),
        json!("SEND"),
        json!("Ping"),
        json!("send\u{0}"),
        json!("sync\u{202e}"),
        json!(" ping"),
        json!(long),
        json!("__proto__"),
        json!("constructor"),
        json!(42),
        json!(null),
        json!(["send"]),
        json!({"op": "send"}),
    ] {
        let id = 2_000 + case.inputs.len() as u64;
        a.send_text(json!({"id": id, "op": op, "conv_id": group}).to_string()).await;
        let reply = tokio::time::timeout(WAIT, a.reply(id)).await.unwrap_or(Value::Null);
        let ping = tokio::time::timeout(WAIT, a.request("ping", json!({}))).await.unwrap_or(Value::Null);
        let shown = if op == json!(long) { json!("x × 10000") } else { op.clone() };
        case.saw(
            json!({"op": shown, "code": reply["error"]["code"], "ping_after": ping["ok"]}),
            reply["error"]["code"] == "BAD_REQUEST" && ping["ok"] == true,
        );
    }
    case.finish(&mut failed);

    assert!(healthy(s.port).await, "the server answers /healthz after it all");
    assert!(failed.is_empty(), "{failed:#?}");
}
