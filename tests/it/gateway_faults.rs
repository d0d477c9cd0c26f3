//! The gateway under faults (PROTOCOL §4): a client that
//! stops reading, a frame header announcing too much, and the server binary
//! killed with SIGKILL under load and restarted. Records go to evidence/im-05.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;

use crate::commit_stall;
use crate::evidence::Check;
use crate::harness::TestDb;
use crate::server::{free_port, http_raw, spawn_binary, TestServer, Ws, ADMIN};
use crate::sync_points::{pushed_seqs, sample};

const SUITE: &str = "im-05";

fn send_fields(conv: &str, key: &str, text: &str) -> Value {
    json!({"conv_id": conv, "client_msg_id": key, "body": {"type": "text", "text": text}})
}

#[actix_web::test]
async fn a_slow_consumer_is_closed_while_the_conversation_and_other_devices_carry_on() {
    const SENDS: usize = 1200;
    let check = Check::start(
        SUITE,
        "05-slow-consumer",
        "ws, 1200 sends of 4 KiB, one receiver never reads",
        "a device that stops reading overflows its bounded queue: its route is removed at once (routed 3 → 2) and, \
         once it reads again, it gets the pushes queued before the overflow (seq 3.. contiguous) then close 1013; \
         meanwhile every send is acked in order and the other device of the same user receives every event in \
         order; after reconnecting, sync recovers the rest",
    );
    let s = TestServer::start().await;
    let (ana, ben) = (s.user("u-ana").await, s.user("u-ben").await);
    let ben2 = s.device("u-ben", "d2").await;
    let conv = s.direct(&ana, "u-ben").await;

    // u-ben/d1 on a tiny receive buffer; after one ping it never reads again.
    let socket = TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("SO_RCVBUF");
    let tcp = socket.connect(([127, 0, 0, 1], s.port).into()).await.expect("connect");
    let mut req = format!("ws://127.0.0.1:{}/v1/ws", s.port).into_client_request().expect("request");
    req.headers_mut().insert("Authorization", format!("Bearer {ben}").parse().expect("header"));
    let (mut slow, _) = tokio_tungstenite::client_async(req, tcp).await.expect("upgrade");
    slow.send(Message::Text(json!({"id": 1, "op": "ping"}).to_string())).await.expect("ping");
    while let Some(Ok(m)) = slow.next().await {
        if matches!(&m, Message::Text(t) if t.contains("pong")) {
            break;
        }
    }

    let mut a = s.ws(&ana).await;
    let mut healthy = s.ws(&ben2).await;
    let (_, m) = s.http("GET", "/metrics", None, None).await;
    let routed_before = sample(&m, "imcore_connections{kind=\"routed\"}");
    let text = "x".repeat(4096);
    let last_seq = 2 + SENDS as i64;
    let sending = async {
        let mut acks = vec![];
        for i in 0..SENDS {
            let r = a.request("send", send_fields(&conv, &format!("m{i}"), &text)).await;
            acks.push(if r["ok"] == true { r["seq"].as_i64().unwrap_or(0) } else { -1 });
        }
        acks
    };
    let receiving = async {
        let mut seen = vec![];
        while seen.last() != Some(&last_seq) {
            match healthy.push_within(Duration::from_secs(20)).await {
                Some(p) => seen.extend(pushed_seqs(&p, &conv)),
                None => break,
            }
        }
        seen
    };
    let started = Instant::now();
    let (acks, seen) = tokio::join!(sending, receiving);
    let elapsed_ms = started.elapsed().as_millis() as u64;
    let (_, m) = s.http("GET", "/metrics", None, None).await;
    let overflowed = sample(&m, "imcore_ws_closed_total{reason=\"overflowed\"}");
    let routed_after = sample(&m, "imcore_connections{kind=\"routed\"}");

    // Now the slow client reads: what was queued for it, then the 1013 close.
    let mut slow_seqs = vec![];
    let mut slow_close = None;
    loop {
        match tokio::time::timeout(Duration::from_secs(20), slow.next()).await {
            Ok(Some(Ok(Message::Text(t)))) => {
                slow_seqs.extend(pushed_seqs(&serde_json::from_str(&t).unwrap_or(Value::Null), &conv));
            }
            Ok(Some(Ok(Message::Close(f)))) => {
                slow_close = f.map(|f| u16::from(f.code));
                break;
            }
            Ok(Some(Ok(_))) => {}
            Ok(Some(Err(_)) | None) | Err(_) => break,
        }
    }
    // It reconnects and syncs from the last seq it saw: nothing is lost.
    let mut again = s.ws(&ben).await;
    let mut recovered = slow_seqs.clone();
    let mut after = slow_seqs.last().copied().unwrap_or(2);
    loop {
        let page = again.request("sync", json!({"conv_id": conv, "after_seq": after, "limit": 1000})).await;
        recovered.extend(page["events"].as_array().into_iter().flatten().filter_map(|e| e["seq"].as_i64()));
        after = page["next_after"].as_i64().unwrap_or(after);
        if page["has_more"] != true {
            break;
        }
    }

    let want: Vec<i64> = (3..=last_seq).collect();
    let slow_prefix = slow_seqs.iter().copied().eq(3..3 + slow_seqs.len() as i64);
    let pass = acks == want
        && seen == want
        && overflowed >= 1.0
        && routed_before == 3.0
        && routed_after == 2.0
        && slow_close == Some(1013)
        && slow_prefix
        && slow_seqs.len() < SENDS
        && recovered == want;
    let pass = check.resolve(
        json!({"sends": SENDS, "elapsed_ms": elapsed_ms, "acks_in_order": acks == want, "healthy_in_order": seen == want,
               "healthy_received": seen.len(), "overflowed_metric": overflowed, "routed_before": routed_before,
               "routed_after": routed_after, "slow_received": slow_seqs.len(), "slow_received_contiguous": slow_prefix,
               "slow_close_code": slow_close, "recovered_after_sync": recovered == want}),
        pass,
    );
    assert!(pass);
}

/// Upgrades a raw TCP connection by hand; the stream after the 101.
pub async fn raw_upgrade(port: u16, token: &str) -> TcpStream {
    let mut tcp = TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
    tcp.write_all(upgrade_request(port, "GET", "/v1/ws", token).as_bytes()).await.expect("handshake");
    let head = response_head(&mut tcp).await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    tcp
}

/// A WebSocket upgrade request for `path` with `method`, the token as bearer.
pub fn upgrade_request(port: u16, method: &str, path: &str, token: &str) -> String {
    format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\
         Authorization: Bearer {token}\r\n\r\n"
    )
}

/// A response's head, up to its blank line, read byte by byte (nothing after it).
pub async fn response_head(tcp: &mut TcpStream) -> String {
    let mut head = vec![];
    while !head.ends_with(b"\r\n\r\n") {
        let mut b = [0u8; 1];
        tcp.read_exact(&mut b).await.expect("response head");
        head.push(b[0]);
    }
    String::from_utf8_lossy(&head).into_owned()
}

/// The close code of the first close frame the server sends (unmasked frames).
pub async fn close_code(tcp: &mut TcpStream) -> Option<u16> {
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
        if h[0] & 0x0f == 0x8 {
            return payload.get(..2).map(|c| u16::from_be_bytes([c[0], c[1]]));
        }
    }
}

#[actix_web::test]
async fn a_frame_announcing_more_than_64_kib_is_refused_with_1009_before_its_payload_arrives() {
    let check = Check::start(
        SUITE,
        "05-frame-limit-early",
        "header announces 8 MiB, 16 KiB sent",
        "a frame whose header announces more than 64 KiB is refused with close 1009 as soon as the header is read, \
         without waiting for (or buffering) its payload; the device reconnects normally",
    );
    let s = TestServer::start().await;
    let ana = s.user("u-ana").await;
    let mut tcp = raw_upgrade(s.port, &ana).await;
    // A masked text frame announcing 8 MiB, of which only 16 KiB ever come.
    let mut frame = vec![0x81, 0x80 | 127];
    frame.extend_from_slice(&(8u64 << 20).to_be_bytes());
    frame.extend_from_slice(&[7, 7, 7, 7]);
    frame.extend(std::iter::repeat(b'x').take(16 * 1024));
    let started = Instant::now();
    tcp.write_all(&frame).await.expect("write frame");
    let code = tokio::time::timeout(Duration::from_secs(5), close_code(&mut tcp)).await.ok().flatten();
    let waited_ms = started.elapsed().as_millis() as u64;
    // The server is fine and the device can connect again.
    let mut again = s.ws(&ana).await;
    let ping = again.request("ping", json!({})).await;
    let pass = code == Some(1009) && ping["ok"] == true;
    let pass = check.resolve(json!({"close_code": code, "waited_ms": waited_ms, "reconnect_ping": ping["ok"]}), pass);
    assert!(pass);
}

/// One send as the client saw it.
#[derive(Debug, Clone)]
struct Attempt {
    user: String,
    token: String,
    key: String,
    text: String,
    /// `(seq, message_id)` when acked.
    ack: Option<(i64, String)>,
}

/// Sends continuously (up to `WINDOW` in flight) until the connection dies;
/// send number `stall_at` carries the commit-stall mark.
async fn keep_sending(port: u16, user: String, token: String, conv: &str, stall_at: Option<u64>) -> Vec<Attempt> {
    const WINDOW: usize = 4;
    let mut ws = imcore_client::Ws::connect(port, Some(&token)).await.expect("upgrade");
    let mut attempts: Vec<Attempt> = vec![];
    // Request id → its attempt.
    let mut in_flight: HashMap<u64, usize> = HashMap::new();
    let mut next = 0u64;
    'run: loop {
        while in_flight.len() < WINDOW {
            let mark = if stall_at == Some(next) { commit_stall::MARK } else { "" };
            let (key, text) = (format!("{user}-{next}"), format!("message {next} of {user} {mark}"));
            let fields = send_fields(conv, &key, &text);
            attempts.push(Attempt { user: user.clone(), token: token.clone(), key, text, ack: None });
            next += 1;
            match ws.start("send", fields).await {
                Ok(id) => in_flight.insert(id, attempts.len() - 1),
                Err(_) => break 'run,
            };
        }
        // Pushes of the other senders' messages arrive too; only replies count.
        match tokio::time::timeout(Duration::from_secs(10), ws.read()).await {
            Ok(Ok(v)) => {
                let Some(i) = v["id"].as_u64().and_then(|id| in_flight.remove(&id)) else { continue };
                if v["ok"] == true {
                    let mid = v["message_id"].as_str().unwrap_or("").to_owned();
                    attempts[i].ack = v["seq"].as_i64().map(|seq| (seq, mid));
                }
            }
            Ok(Err(_)) | Err(_) => break,
        }
    }
    attempts
}

/// Every `msg` row of `conv`: (sender, client_msg_id) → [(seq, message_id)].
async fn msg_rows(db: &TestDb, conv: &str) -> HashMap<(String, String), Vec<(i64, String)>> {
    let rows = db
        .client()
        .await
        .query(
            "SELECT sender_user, client_msg_id, seq, message_id::text FROM events WHERE conv_id = $1 AND kind = 'msg'",
            &[&conv],
        )
        .await
        .expect("rows");
    let mut out: HashMap<(String, String), Vec<(i64, String)>> = HashMap::new();
    for r in rows {
        out.entry((r.get(0), r.get(1))).or_default().push((r.get(2), r.get(3)));
    }
    out
}

/// `(count, max(seq), next_seq)`.
async fn log_stats(db: &TestDb, conv: &str) -> (i64, i64, i64) {
    let r = db
        .client()
        .await
        .query_one(
            "SELECT count(*), coalesce(max(seq), 0), (SELECT next_seq FROM conversations WHERE conv_id = $1)
               FROM events WHERE conv_id = $1",
            &[&conv],
        )
        .await
        .expect("log stats");
    (r.get(0), r.get(1), r.get(2))
}

#[actix_web::test]
async fn acked_sends_survive_sigkill_and_unacked_ones_retry_to_exactly_one_row() {
    const SENDERS: usize = 16;
    /// The send of sender 0 whose batch the kill lands in, mid-COMMIT.
    const STALLED_SEND: u64 = 40;
    let check = Check::start(
        SUITE,
        "gateway-sigkill-restart",
        "real binary, 16 ws senders (window 4), kill -9 while a batch is in COMMIT, restart",
        "after SIGKILL under load, landing while a batch is in COMMIT (PostgreSQL finishes that commit without its \
         client), and a restart: every acked send is stored exactly as acked (seq, message_id); the log is gapless \
         (count = max = next_seq - 1); at least the stalled send is committed but unacked; retrying every unacked \
         send with its key gives exactly one row each (dup:true with the stored seq and message_id if it had \
         committed, a new seq otherwise); the log stays gapless",
    );
    let conv = "g-kill";
    let db = TestDb::with_pool(2).await;
    let watch = db.client().await;
    commit_stall::install(&watch, 3.0).await;
    let port = free_port();
    let mut server = spawn_binary(&db.url, port, &[], None).await;
    let users = kill_group(port, conv, SENDERS).await;

    let senders = join_all(
        users
            .iter()
            .enumerate()
            .map(|(i, (u, t))| keep_sending(port, u.clone(), t.clone(), conv, (i == 0).then_some(STALLED_SEND))),
    );
    let killer = async {
        let stalled = commit_stall::wait_until_stalled(&watch, Duration::from_secs(30)).await;
        server.start_kill().expect("SIGKILL");
        (stalled, server.wait().await.expect("reap"))
    };
    let (attempts, (stalled, status)) = tokio::join!(senders, killer);
    let attempts: Vec<Attempt> = attempts.into_iter().flatten().collect();
    let killed_by_signal = std::os::unix::process::ExitStatusExt::signal(&status) == Some(9);
    let (acked, unacked): (Vec<&Attempt>, Vec<&Attempt>) = attempts.iter().partition(|a| a.ack.is_some());
    // The stalled commit completes after its client died; then its backend exits.
    let commit_finished =
        !stalled.is_empty() && commit_stall::wait_until_gone(&watch, &stalled, Duration::from_secs(30)).await;

    let port = free_port();
    let mut server = spawn_binary(&db.url, port, &[], None).await;
    let rows = msg_rows(&db, conv).await;
    let stats_after_restart = log_stats(&db, conv).await;
    let acked_exact = acked.iter().all(|a| {
        rows.get(&(a.user.clone(), a.key.clone())).map(Vec::as_slice)
            == Some(std::slice::from_ref(a.ack.as_ref().expect("acked")))
    });
    let stalled_key = format!("{}-{STALLED_SEND}", users[0].0);
    let mut committed_unacked = 0;
    let mut stalled_retry = Value::Null;
    let mut retries_right = true;
    let mut retry_samples = vec![];
    for a in &unacked {
        let before = rows.get(&(a.user.clone(), a.key.clone())).cloned().unwrap_or_default();
        let mut ws = Ws::connect(port, Some(&a.token)).await.expect("reconnect");
        let r = ws.request("send", send_fields(conv, &a.key, &a.text)).await;
        let right = match before.as_slice() {
            [] => r["ok"] == true && r["dup"] == false,
            [(seq, mid)] => {
                committed_unacked += 1;
                r["ok"] == true && r["dup"] == true && r["seq"] == *seq && r["message_id"] == mid.as_str()
            }
            _ => false,
        };
        retries_right &= right;
        if a.key == stalled_key {
            stalled_retry = json!({"stored": before, "retry": r, "right": right});
        }
        if retry_samples.len() < 8 {
            retry_samples.push(json!({"key": a.key, "was_committed": !before.is_empty(), "retry": r}));
        }
        ws.close().await;
    }
    let rows_final = msg_rows(&db, conv).await;
    let stats_final = log_stats(&db, conv).await;
    let one_row_each =
        attempts.iter().all(|a| rows_final.get(&(a.user.clone(), a.key.clone())).map_or(0, Vec::len) == 1);
    let gapless = |(count, max, next): (i64, i64, i64)| count == max && max == next - 1;
    let stalled_was_committed_unacked = stalled_retry["right"] == true && stalled_retry["retry"]["dup"] == true;
    let pass = killed_by_signal
        && commit_finished
        && !acked.is_empty()
        && acked_exact
        && gapless(stats_after_restart)
        && committed_unacked >= 1
        && stalled_was_committed_unacked
        && retries_right
        && one_row_each
        && rows_final.len() == attempts.len()
        && gapless(stats_final);
    let _ = server.start_kill();
    let _ = server.wait().await;
    let pass = check.resolve(
        json!({"attempts": attempts.len(), "acked": acked.len(), "unacked": unacked.len(),
               "unacked_but_committed": committed_unacked, "stalled_send": stalled_retry,
               "killed_during_commit": !stalled.is_empty(), "stalled_commit_finished": commit_finished,
               "killed_by_sigkill": killed_by_signal, "acked_stored_exactly": acked_exact,
               "log_after_restart": stats_after_restart, "retries_right": retries_right,
               "one_row_per_key": one_row_each, "msg_rows": rows_final.len(), "log_final": stats_final,
               "retry_samples": retry_samples}),
        pass,
    );
    assert!(pass);
}

/// Creates `n` users with a device each and a pull-mode group `conv` of them
/// all (created by the first); their `(user, token)`s.
async fn kill_group(port: u16, conv: &str, n: usize) -> Vec<(String, String)> {
    let mut users = vec![];
    for i in 0..n {
        let user = format!("u-k{i:02}");
        let (st, _) =
            http_raw(port, "POST", "/v1/admin/users", Some(ADMIN), Some(&json!({"user_id": user}).to_string())).await;
        assert_eq!(st, 201, "create {user}");
        let (st, v) = http_raw(
            port,
            "POST",
            &format!("/v1/admin/users/{user}/devices"),
            Some(ADMIN),
            Some(&json!({"device_id": "d1"}).to_string()),
        )
        .await;
        assert_eq!(st, 201, "device of {user}");
        users.push((user, v["token"].as_str().expect("token").to_owned()));
    }
    let members: Vec<&str> = users[1..].iter().map(|(u, _)| u.as_str()).collect();
    let create =
        json!({"kind": "group", "conv_id": conv, "name": "kill -9", "members": members, "delivery_mode": "pull"});
    let (st, v) = http_raw(port, "POST", "/v1/conversations", Some(&users[0].1), Some(&create.to_string())).await;
    assert_eq!(st, 201, "create group: {v}");
    users
}
