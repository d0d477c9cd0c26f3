//! A connection's life at the protocol level: replaced by a newer one of its
//! device, closed for silence, told to go at graceful shutdown. The whole
//! server on port 0, real WebSocket clients, a real PostgreSQL. Each check
//! writes its record to evidence/im-05.

use std::time::{Duration, Instant};

use futures_util::future::join_all;
use futures_util::stream::{FuturesUnordered, StreamExt};
use serde_json::{json, Value};

use crate::commit_stall;
use crate::evidence::Check;
use crate::gateway::{hi, WAIT};
use crate::server::{TestServer, Ws};
use crate::sync_points::{sample, wait_for_connections};

const SUITE: &str = "im-05";

#[actix_web::test]
async fn a_replaced_connection_is_kicked_and_its_late_close_keeps_the_new_route() {
    let check_1 = Check::start(
        SUITE,
        "05-replaced",
        "ws",
        "the older connection of a device gets kicked:replaced (its last push) and closes; the newer one still receives pushes",
    );
    let check_2 = Check::start(
        SUITE,
        "05-reconnect-storm",
        "ws x8",
        "8 concurrent connections of one device: 7 get kicked:replaced, exactly one receives the next event",
    );
    let s = TestServer::start().await;
    let (ana, ben) = (s.user("u-ana").await, s.user("u-ben").await);
    let conv = s.direct(&ana, "u-ben").await;
    let mut old = s.ws(&ben).await;
    let mut new = s.ws(&ben).await;
    let kicked = old.closed().await;
    old.close().await;
    // The old session's cleanup ran once only the new one is left.
    let old_gone = wait_for_connections(&s, 1, 1).await;
    let mut a = s.ws(&ana).await;
    a.request("send", hi("m1", &conv, "still there?")).await;
    let pushed = new.push().await;
    // Delivery is asynchronous: the conversation's creation events may still
    // reach the old connection before its kick, which must come last.
    let (last, before) = kicked.pushes.split_last().map_or((None, &[][..]), |(l, b)| (Some(l), b));
    let pass = old_gone
        && last == Some(&json!({"push": "kicked", "reason": "replaced"}))
        && before.iter().all(|p| p["push"] == "event")
        && pushed["push"] == "event"
        && pushed["event"]["seq"] == 3;
    let pass = check_1.resolve(
        json!({"old": kicked.pushes, "old_close_code": kicked.code, "old_session_ended": old_gone, "new_got": pushed}),
        pass,
    );
    assert!(pass);

    // A reconnect storm of one device: only the newest stays routed.
    let mut storm: Vec<Ws> = join_all((0..8).map(|_| Ws::connect(s.port, Some(&ben))))
        .await
        .into_iter()
        .map(|w| w.expect("upgrade"))
        .collect();
    new.closed().await;
    // Each kick follows a newer connection's registration: once 7 are seen,
    // all 8 registered and the newest is routed.
    let mut firsts: Vec<Option<Value>> = vec![None; storm.len()];
    {
        let mut pending: FuturesUnordered<_> =
            storm.iter_mut().enumerate().map(|(i, ws)| async move { (i, ws.push_within(WAIT).await) }).collect();
        let mut kicks = 0;
        while kicks < firsts.len() - 1 {
            let Some((i, first)) = pending.next().await else { break };
            kicks += usize::from(first.as_ref().is_some_and(|p| p["push"] == "kicked"));
            firsts[i] = first;
        }
    }
    a.request("send", hi("m2", &conv, "storm")).await;
    let mut outcomes = vec![];
    for (ws, first) in storm.iter_mut().zip(firsts) {
        let got = match first {
            Some(p) => Some(p),
            None => ws.push_within(WAIT).await,
        };
        outcomes.push(match got {
            Some(p) if p["push"] == "event" => "event".to_owned(),
            Some(p) => p["reason"].as_str().unwrap_or("?").to_owned(),
            None => "nothing".to_owned(),
        });
    }
    let events = outcomes.iter().filter(|o| *o == "event").count();
    let replaced = outcomes.iter().filter(|o| *o == "replaced").count();
    let pass = events == 1 && replaced == 7;
    let pass = check_2.resolve(json!({"outcomes": outcomes}), pass);
    assert!(pass);
}

#[actix_web::test]
async fn a_silent_connection_is_closed_and_a_live_one_is_not() {
    const PING_MS: u64 = 300;
    const TIMEOUT_MS: u64 = 2000;
    let check = Check::start(
        SUITE,
        "05-heartbeat-timeout",
        "ping 300ms / timeout 2000ms",
        "a connection silent past the timeout is closed by the server (1001, counted as heartbeat_timeout); one \
         that answers pings stays open for twice the timeout",
    );
    let s = TestServer::with(|c| {
        c.ws.ping_ms = PING_MS;
        c.ws.timeout_ms = TIMEOUT_MS;
    })
    .await;
    let ana = s.user("u-ana").await;
    let mut silent = s.ws(&ana).await;
    let other = s.device("u-ana", "d2").await;
    let mut live = s.ws(&other).await;
    // `live` keeps reading (tungstenite answers pings as it reads) and pings
    // on its own; `silent` reads nothing (reading would answer the server's
    // pings), so its end is observed on the server: one session left.
    let started = Instant::now();
    let mut pace = tokio::time::interval(Duration::from_millis(100));
    let silent_gone = {
        let gone = wait_for_connections(&s, 1, 1);
        tokio::pin!(gone);
        loop {
            tokio::select! {
                gone = &mut gone => break gone,
                _ = pace.tick() => { live.request("ping", json!({})).await; }
            }
        }
    };
    let silent_closed_ms = started.elapsed().as_millis() as u64;
    while started.elapsed() < Duration::from_millis(2 * TIMEOUT_MS) {
        pace.tick().await;
        live.request("ping", json!({})).await;
    }
    let still = live.request("ping", json!({})).await;
    let closed = silent.closed().await;
    let (_, metrics) = s.http("GET", "/metrics", None, None).await;
    let timeouts = sample(&metrics, "imcore_ws_closed_total{reason=\"heartbeat_timeout\"}");
    // The close frame itself can be lost: the client answers the queued pings
    // as it reads, its pong hits the closed socket, and the RST discards the
    // unread close frame. The server-side count says who closed it.
    let pass = silent_gone && matches!(closed.code, Some(1001) | None) && timeouts >= 1.0 && still["ok"] == true;
    let pass = check.resolve(
        json!({"silent_close_code": closed.code, "silent_closed_after_ms": silent_closed_ms,
               "heartbeat_timeouts_metric": timeouts, "live_open_ms": started.elapsed().as_millis() as u64,
               "live_ping": still}),
        pass,
    );
    assert!(pass);
}

#[actix_web::test]
async fn graceful_shutdown_answers_in_flight_requests_then_kicks_everyone() {
    let check = Check::start(
        SUITE,
        "05-graceful-shutdown",
        "ws",
        "on shutdown signalled while a send is in COMMIT (and 19 more queued behind it), every in-flight send is \
         answered ok (and stored), then each connection gets kicked:shutdown, and the server stops",
    );
    let s = TestServer::start().await;
    let (ana, ben) = (s.user("u-ana").await, s.user("u-ben").await);
    let conv = s.direct(&ana, "u-ben").await;
    let watch = s.db.client().await;
    commit_stall::install(&watch, 1.5).await;
    let mut a = s.ws(&ana).await;
    let mut b = s.ws(&ben).await;
    let ids: Vec<u64> = {
        let mut ids = vec![];
        for i in 0..20 {
            let text = if i == 0 { commit_stall::MARK } else { "bye" };
            ids.push(a.start("send", hi(&format!("s{i}"), &conv, text)).await);
        }
        ids
    };
    let stalled = commit_stall::wait_until_stalled(&watch, WAIT).await;
    s.trigger.fire();
    let mut answered = 0;
    let mut stalled_send = Value::Null;
    for id in &ids {
        let reply = tokio::time::timeout(WAIT, a.reply(*id)).await.unwrap_or(Value::Null);
        answered += usize::from(reply["ok"] == true);
        if *id == ids[0] {
            stalled_send = reply;
        }
    }
    let a_closed = a.closed().await;
    let b_closed = b.closed().await;
    let stopped = tokio::time::timeout(Duration::from_secs(15), s.running).await;
    let stopped_ok = matches!(stopped, Ok(Ok(Ok(()))));
    let rows: i64 =
        s.db.client()
            .await
            .query_one("SELECT count(*) FROM events WHERE conv_id = $1 AND kind = 'msg'", &[&conv.as_str()])
            .await
            .expect("count")
            .get(0);
    let kicked = json!({"push": "kicked", "reason": "shutdown"});
    let pass = !stalled.is_empty()
        && stalled_send["seq"] == 3
        && answered == ids.len()
        && rows == ids.len() as i64
        && a_closed.pushes.last() == Some(&kicked)
        && b_closed.pushes.contains(&kicked)
        && stopped_ok;
    let pass = check.resolve(
        json!({"sends": ids.len(), "in_commit_when_signalled": !stalled.is_empty(), "stalled_send": stalled_send,
               "answered_ok": answered, "rows": rows, "a_close": a_closed.code,
               "b_pushes": b_closed.pushes, "stopped": stopped_ok}),
        pass,
    );
    assert!(pass);
}
