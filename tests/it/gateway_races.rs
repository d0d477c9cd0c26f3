//! Concurrency at the protocol level (PROTOCOL §3, §4): per-connection push
//! order under concurrent senders on both write paths, and a token rotated
//! while its device connects and sends. Records go to evidence/im-05.

use std::time::Duration;

use futures_util::future::join_all;
use serde_json::{json, Value};

use crate::env::{Path, PathName};
use crate::evidence::Check;
use crate::server::{TestServer, Ws};
use crate::sync_points::pushed_seqs;

const SUITE: &str = "im-05";
const WAIT: Duration = Duration::from_secs(10);

fn send_fields(conv: &str, key: &str) -> Value {
    json!({"conv_id": conv, "client_msg_id": key, "body": {"type": "text", "text": key}})
}

/// What one connection saw: pushed seqs in arrival order, and what its own
/// sends were acked with.
struct Seen {
    pushed: Vec<i64>,
    own: Vec<i64>,
}

/// Sends `n` messages pipelined on `ws` (all frames first, then the replies).
async fn send_burst(ws: &mut Ws, conv: &str, tag: &str, n: usize) -> Vec<i64> {
    let mut ids = vec![];
    for i in 0..n {
        ids.push(ws.start("send", send_fields(conv, &format!("{tag}-{i}"))).await);
    }
    let mut acked = vec![];
    for id in ids {
        let r = ws.reply(id).await;
        acked.push(r["seq"].as_i64().unwrap_or_else(|| panic!("send {tag}: {r}")));
    }
    acked
}

/// Reads pushes until one carries `last` (or nothing comes within [`WAIT`]).
async fn pushes_until(ws: &mut Ws, conv: &str, last: i64, into: &mut Vec<i64>) {
    while !into.contains(&last) {
        match ws.push_within(WAIT).await {
            Some(p) => into.extend(pushed_seqs(&p, conv)),
            None => return,
        }
    }
}

async fn order_under_concurrent_senders(path: Path) {
    const SENDERS: usize = 4;
    const LISTENERS: usize = 3;
    const PER_SENDER: usize = 40;
    let check = Check::start(
        SUITE,
        "05-push-order-concurrent-senders",
        format!("{}, 4 senders x 40 pipelined + 3 listeners, one group", path.name()),
        "every connection (senders included) receives the group's events in strictly increasing seq; after a \
         final marker has reached it, its pushes, its own acks and a sync of the gaps it detected cover every \
         seq exactly (own messages are never pushed back)",
    );
    let s = TestServer::with(|c| c.engine.write.path = path).await;
    let names: Vec<String> = (0..SENDERS + LISTENERS).map(|i| format!("u-o{i}")).collect();
    let mut tokens = vec![];
    for n in &names {
        tokens.push(s.user(n).await);
    }
    let conv = "g-order";
    let create = json!({"kind": "group", "conv_id": conv, "name": "order", "members": names[1..]});
    let (status, _) = s.http("POST", "/v1/conversations", Some(&tokens[0]), Some(&create)).await;
    assert_eq!(status, 201);
    let head_before = (SENDERS + LISTENERS) as i64;
    let mut conns = join_all(tokens.iter().map(|t| s.ws(t))).await;

    let bursts = join_all(
        conns
            .iter_mut()
            .take(SENDERS)
            .enumerate()
            .map(|(i, ws)| async move { send_burst(ws, conv, &format!("s{i}"), PER_SENDER).await }),
    )
    .await;
    // The marker comes from a device of its own, so every checked connection
    // is pushed it; being the newest event, not even the direct path's
    // reordering guard drops it.
    let marker_token = s.device(&names[SENDERS], "d-marker").await;
    let mut marker_ws = s.ws(&marker_token).await;
    let marker = send_burst(&mut marker_ws, conv, "marker", 1).await[0];
    let mut seen: Vec<Seen> = vec![];
    for (i, ws) in conns.iter_mut().enumerate() {
        let mut pushed = vec![];
        pushes_until(ws, conv, marker, &mut pushed).await;
        seen.push(Seen { pushed, own: bursts.get(i).cloned().unwrap_or_default() });
    }
    let all: Vec<i64> = (head_before + 1..=marker).collect();
    let mut report = vec![];
    let mut right = marker == head_before + (SENDERS * PER_SENDER) as i64 + 1;
    for (i, (seen, ws)) in seen.iter().zip(conns.iter_mut()).enumerate() {
        let in_order = seen.pushed.windows(2).all(|w| w[0] < w[1]);
        let mut have: Vec<i64> = seen.pushed.iter().chain(&seen.own).copied().collect();
        have.sort_unstable();
        let gaps: Vec<i64> = all.iter().copied().filter(|q| have.binary_search(q).is_err()).collect();
        for gap in &gaps {
            let page = ws.request("sync", json!({"conv_id": conv, "after_seq": gap - 1, "limit": 1})).await;
            have.extend(page["events"].as_array().into_iter().flatten().filter_map(|e| e["seq"].as_i64()));
        }
        have.sort_unstable();
        let complete = have == all;
        right &= in_order && complete;
        report.push(json!({"connection": names[i], "pushed": seen.pushed.len(), "own": seen.own.len(),
                           "in_order": in_order, "gaps_synced": gaps.len(), "complete": complete}));
    }
    let pass = check.resolve(json!({"marker_seq": marker, "connections": report}), right);
    assert!(pass);
}

on_path!(order_actor, crate::env::Path::Actor, [order_under_concurrent_senders]);
on_path!(order_direct, crate::env::Path::Direct, [order_under_concurrent_senders]);

/// How a connection opened with the token being rotated ended.
async fn old_token_connection(port: u16, token: &str, conv: &str, round: usize) -> Value {
    let mut ws = match Ws::connect(port, Some(token)).await {
        Ok(ws) => ws,
        Err(status) => return json!({"refused": status}),
    };
    for i in 0..3 {
        ws.start("send", send_fields(conv, &format!("r{round}-{i}"))).await;
    }
    let closed = ws.closed().await;
    json!({"kicked": closed.pushes.last().cloned(), "close_code": closed.code})
}

#[actix_web::test]
async fn a_token_rotated_while_its_device_connects_and_sends_locks_the_old_token_out() {
    const ROUNDS: usize = 12;
    let check = Check::start(
        SUITE,
        "05-token-rotation-race",
        "ws+http, 12 rounds of connect+send racing a rotation",
        "a connection opened with a token while that token is rotated is either refused (401) or ends with \
         kicked:token_revoked as its last push, never staying open; afterwards the old token is refused (WebSocket \
         401, HTTP UNAUTHORIZED) and the new one connects and sends",
    );
    let s = TestServer::start().await;
    let mut token = s.user("u-ana").await;
    s.user("u-ben").await;
    let conv = s.direct(&token, "u-ben").await;
    let mut rounds = vec![];
    let mut right = true;
    for round in 0..ROUNDS {
        let connecting = old_token_connection(s.port, &token, &conv, round);
        // A different head start each round moves the rotation across the connection's steps.
        let rotating = async {
            for _ in 0..round {
                tokio::task::yield_now().await;
            }
            s.device("u-ana", "d1").await
        };
        let (ended, rotated) = tokio::join!(connecting, rotating);
        let old_ws = Ws::connect(s.port, Some(&token)).await.err();
        let (old_http, _) = s.http("GET", "/v1/conversations", Some(&token), None).await;
        let mut fresh = s.ws(&rotated).await;
        let sent = fresh.request("send", send_fields(&conv, &format!("new-{round}"))).await;
        fresh.close().await;
        let ok = (ended["refused"] == 401 || ended["kicked"] == json!({"push": "kicked", "reason": "token_revoked"}))
            && old_ws == Some(401)
            && old_http == 401
            && sent["ok"] == true;
        right &= ok;
        rounds.push(json!({"old_connection": ended, "old_ws_after": old_ws, "old_http_after": old_http,
                           "new_send_ok": sent["ok"], "right": ok}));
        token = rotated;
    }
    let pass = check.resolve(json!({"rounds": rounds}), right);
    assert!(pass);
}
