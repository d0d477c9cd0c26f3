//! The WebSocket upgrade taken over from actix-http at the handshake
//! (ARCHITECTURE §5, "An idle connection"): bytes that arrive with the
//! handshake or a frame split across reads reach the session, and upgrades
//! that are refused get the PROTOCOL §2 answer they got from actix-web.
//! Records go to evidence/im-05.

use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::evidence::Check;
use crate::gateway_faults::{response_head, upgrade_request};
use crate::server::TestServer;

const SUITE: &str = "im-05";
const WAIT: Duration = Duration::from_secs(5);

/// `text` as a client's masked text frame (RFC 6455 §5.3).
fn masked_text(text: &str) -> Vec<u8> {
    let mask = [0x11, 0x22, 0x33, 0x44];
    let len = text.len();
    let mut frame = vec![0x81];
    if len < 126 {
        frame.push(0x80 | len as u8);
    } else {
        frame.push(0x80 | 126);
        frame.extend_from_slice(&(len as u16).to_be_bytes());
    }
    frame.extend_from_slice(&mask);
    frame.extend(text.bytes().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    frame
}

/// The next text frame the server sends (unmasked), as JSON.
async fn next_text(tcp: &mut TcpStream) -> Value {
    loop {
        let mut h = [0u8; 2];
        tcp.read_exact(&mut h).await.expect("frame header");
        let len = match h[1] & 0x7f {
            126 => usize::from(tcp.read_u16().await.expect("length")),
            127 => usize::try_from(tcp.read_u64().await.expect("length")).expect("length"),
            n => usize::from(n),
        };
        let mut payload = vec![0u8; len];
        tcp.read_exact(&mut payload).await.expect("payload");
        if h[0] & 0x0f == 0x1 {
            return serde_json::from_slice(&payload).expect("a JSON text frame");
        }
    }
}

#[actix_web::test]
async fn frames_behind_the_handshake_and_frames_split_across_reads_reach_the_session() {
    let check = Check::start(
        SUITE,
        "05-upgrade-leftover-and-split-frames",
        "a whoami frame in the handshake's own write; a second one written in three pieces 50 ms apart",
        "the bytes a client sends right behind its upgrade request, read together with it, are the session's first \
         frame and are answered; a frame whose header and payload arrive in separate reads is answered once whole",
    );
    let s = TestServer::start().await;
    let ana = s.user("u-ana").await;
    let mut tcp = TcpStream::connect(("127.0.0.1", s.port)).await.expect("connect");
    let mut first = upgrade_request(s.port, "GET", "/v1/ws", &ana).into_bytes();
    first.extend(masked_text(r#"{"id": 1, "op": "whoami"}"#));
    tcp.write_all(&first).await.expect("handshake and frame");
    let head = tokio::time::timeout(WAIT, response_head(&mut tcp)).await.expect("101 in time");
    let behind = tokio::time::timeout(WAIT, next_text(&mut tcp)).await.ok();
    let second = masked_text(r#"{"id": 2, "op": "whoami"}"#);
    for piece in [&second[..1], &second[1..9], &second[9..]] {
        tcp.write_all(piece).await.expect("piece");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let split = tokio::time::timeout(WAIT, next_text(&mut tcp)).await.ok();
    let answered = |reply: &Option<Value>, id: i64| {
        reply.as_ref().is_some_and(|r| r["id"] == id && r["ok"] == true && r["user_id"] == "u-ana")
    };
    let pass = head.starts_with("HTTP/1.1 101") && answered(&behind, 1) && answered(&split, 2);
    let pass = check.resolve(json!({"head": head.lines().next(), "behind": behind, "split": split}), pass);
    assert!(pass);
}

#[actix_web::test]
async fn refused_upgrades_get_the_protocol_error_shape_and_a_closed_connection() {
    let check = Check::start(
        SUITE,
        "05-upgrade-refusals",
        "WebSocket upgrades to another path, with another method, with a wrong token; GET /v1/ws without one",
        "an upgrade request the server does not take is answered like any request: 404 NOT_FOUND, 405 with \
         `Allow: GET`, 401 UNAUTHORIZED, each in the PROTOCOL §2 shape, and the connection closes after it; a \
         plain GET of /v1/ws is 400 BAD_REQUEST once the token is accepted",
    );
    let s = TestServer::start().await;
    let ana = s.user("u-ana").await;
    let mut seen = vec![];
    let mut pass = true;
    for (method, path, token, status, code) in [
        ("GET", "/healthz", ana.as_str(), 404, "NOT_FOUND"),
        ("POST", "/v1/ws", ana.as_str(), 405, "BAD_REQUEST"),
        ("GET", "/v1/ws", "not-a-token", 401, "UNAUTHORIZED"),
    ] {
        let mut tcp = TcpStream::connect(("127.0.0.1", s.port)).await.expect("connect");
        tcp.write_all(upgrade_request(s.port, method, path, token).as_bytes()).await.expect("request");
        let mut answer = vec![];
        let read = tokio::time::timeout(WAIT, tcp.read_to_end(&mut answer)).await;
        let answer = String::from_utf8_lossy(&answer).into_owned();
        let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
        let body: Value = serde_json::from_str(body).unwrap_or(Value::Null);
        let ok = read.is_ok_and(|r| r.is_ok())
            && head.starts_with(&format!("HTTP/1.1 {status} "))
            && body["error"]["code"] == code
            && (status != 405 || head.to_ascii_lowercase().contains("allow: get"));
        pass &= ok;
        seen.push(json!({"request": format!("{method} {path}"), "head": head.lines().next(), "body": body, "ok": ok}));
    }
    let (status, body) = crate::server::http_raw(s.port, "GET", "/v1/ws", Some(&ana), None).await;
    pass &= status == 400 && body["error"]["code"] == "BAD_REQUEST";
    seen.push(json!({"request": "GET /v1/ws without Upgrade", "status": status, "body": body}));
    let pass = check.resolve(json!({ "answers": seen }), pass);
    assert!(pass);
}
