//! Part 2 of `groups`: sends to the large group while some of its members'
//! devices are online. The owner's second device sends `messages` one at a
//! time (each after the previous ack), then `burst` written at once. Every
//! online device must get every message once, in order.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::ws::frame::FrameIn;
use imcore::store::Store;
use imcore_client::Ws;
use serde_json::{json, Value};
use tokio::sync::watch;
use tokio::task::JoinSet;

use super::{call, Big};
use crate::percentiles::Percentiles;
use crate::ws::log_check::verify;
use crate::ws::provision::{self, now_us, BoxError};
use crate::ws::server::{CpuWindow, Pg, Server};

/// How long devices may take to get the last message after the last ack.
const SETTLE: Duration = Duration::from_secs(30);

pub struct Params {
    pub online: usize,
    pub messages: usize,
    pub burst: usize,
    pub source_addrs: usize,
}

/// What one device saw: per message, ms from send to arrival (NaN: never came).
struct DeviceLog {
    arrival_ms: Vec<f32>,
    in_order: usize,
    anomalies: u64,
    closed: bool,
}

/// Records the group's pushes until `stop`; counts itself in `complete` once it has all `total` in order.
async fn device(
    mut ws: Ws,
    conv: Arc<str>,
    total: usize,
    complete: Arc<AtomicUsize>,
    mut stop: watch::Receiver<bool>,
) -> DeviceLog {
    let mut log = DeviceLog { arrival_ms: vec![f32::NAN; total], in_order: 0, anomalies: 0, closed: false };
    loop {
        let text = tokio::select! {
            _ = stop.changed() => break,
            text = ws.next_text() => text,
        };
        let Ok(text) = text else {
            log.closed = true;
            return log;
        };
        let Ok(p) = serde_json::from_str::<FrameIn>(&text) else { continue };
        if !matches!(p.push.as_deref(), Some("event" | "events")) || p.conv_id.as_deref() != Some(&*conv) {
            continue;
        }
        let now = now_us();
        for b in p.event.into_iter().chain(p.events.unwrap_or_default()).filter_map(|e| e.body) {
            let (Some(n), Some(ts)) = (b.n, b.ts) else { continue };
            match log.arrival_ms.get_mut(n) {
                Some(slot) if slot.is_nan() && n == log.in_order => {
                    *slot = now.saturating_sub(ts) as f32 / 1000.0;
                    log.in_order += 1;
                    if log.in_order == total {
                        complete.fetch_add(1, Ordering::Relaxed);
                    }
                }
                _ => log.anomalies += 1,
            }
        }
    }
    ws.close().await;
    log
}

/// Acks `(seq, client_msg_id)`, ack latencies of the closed loop and of the burst, failed sends.
#[derive(Default)]
struct Sent {
    acks: Vec<(i64, String)>,
    loop_ms: Vec<f64>,
    burst_ms: Vec<f64>,
    errors: u64,
}

fn send_frame(conv: &str, n: usize) -> (Value, String) {
    let key = format!("g{n}");
    let body = json!({"type": "text", "text": format!("large group message {n}"), "ts": now_us(), "n": n});
    (json!({"conv_id": conv, "client_msg_id": key, "body": body}), key)
}

async fn drive(ws: &mut Ws, conv: &str, p: &Params) -> Result<Sent, BoxError> {
    let mut sent = Sent::default();
    let mut id = 0;
    for n in 0..p.messages {
        let (fields, key) = send_frame(conv, n);
        let (r, ms) = call(ws, &mut id, "send", fields).await?;
        match r["seq"].as_i64() {
            Some(seq) if r["ok"] == true => sent.acks.push((seq, key)),
            _ => sent.errors += 1,
        }
        sent.loop_ms.push(ms);
    }
    // The burst: every frame written, then the replies in any order.
    let mut pending = std::collections::HashMap::new();
    for n in p.messages..p.messages + p.burst {
        id += 1;
        let (mut frame, key) = send_frame(conv, n);
        frame["id"] = json!(id);
        frame["op"] = json!("send");
        ws.feed_text(frame.to_string()).await?;
        pending.insert(id, (Instant::now(), key));
    }
    ws.flush().await?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !pending.is_empty() {
        let text = tokio::time::timeout_at(deadline.into(), ws.next_text()).await.map_err(|_| "burst: no acks")??;
        let r: Value = serde_json::from_str(&text)?;
        let Some((at, key)) = r["id"].as_u64().and_then(|i| pending.remove(&i)) else { continue };
        match r["seq"].as_i64() {
            Some(seq) if r["ok"] == true => sent.acks.push((seq, key)),
            _ => sent.errors += 1,
        }
        sent.burst_ms.push(at.elapsed().as_secs_f64() * 1000.0);
    }
    Ok(sent)
}

pub async fn run(server: &Server, pg: &Pg, db: &Store, big: &Big, p: &Params) -> Result<Value, BoxError> {
    let total = p.messages + p.burst;
    let conv: Arc<str> = big.conv.as_str().into();
    let complete = Arc::new(AtomicUsize::new(0));
    let (stop, stopped) = watch::channel(false);
    let connect_started = Instant::now();
    let tokens = &big.online_tokens[..p.online.min(big.online_tokens.len())];
    let conns = provision::connect_all(tokens, 0, p.source_addrs, |_| server.port, false).await?;
    let connect_s = connect_started.elapsed().as_secs_f64();
    let online = conns.len();
    let mut devices = JoinSet::new();
    for ws in conns {
        devices.spawn(device(ws, conv.clone(), total, complete.clone(), stopped.clone()));
    }
    let mut sender = provision::connect_retry(server.port, provision::source_addr(0, 1), &big.sender_token).await?;
    let cpu = CpuWindow::start(server, pg);
    let sent = drive(&mut sender, &big.conv, p).await;
    let until = Instant::now() + SETTLE;
    while sent.is_ok() && complete.load(Ordering::Relaxed) < online && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let cpu = cpu.end(server, pg);
    sender.close().await;
    let _ = stop.send(true);
    let mut logs = vec![];
    while let Some(log) = devices.join_next().await {
        logs.push(log?);
    }
    let sent = sent?;
    let (log_ok, detail) = verify(db, &big.conv, &sent.acks).await?;
    let o = Outcome { online, logs, sent, log_ok, detail, connect_s, cpu, rss_kib: server.rss_kib() };
    Ok(report(p, big.members, o))
}

struct Outcome {
    online: usize,
    logs: Vec<DeviceLog>,
    sent: Sent,
    log_ok: bool,
    detail: Value,
    connect_s: f64,
    cpu: Value,
    rss_kib: u64,
}

fn report(p: &Params, members: usize, o: Outcome) -> Value {
    let Outcome { online, logs, sent, log_ok, detail, connect_s, cpu, rss_kib } = o;
    let total = p.messages + p.burst;
    let samples = |range: std::ops::Range<usize>| {
        Percentiles::of(
            logs.iter()
                .flat_map(|l| l.arrival_ms[range.clone()].iter().filter(|x| !x.is_nan()).map(|&x| f64::from(x)))
                .collect(),
        )
    };
    // Per message, the time until the last online device had it (complete messages only).
    let last_device = |range: std::ops::Range<usize>| {
        Percentiles::of(
            range
                .filter_map(|n| {
                    logs.iter().try_fold(0f64, |m, l| {
                        let x = l.arrival_ms[n];
                        (!x.is_nan()).then(|| m.max(f64::from(x)))
                    })
                })
                .collect(),
        )
    };
    let (loop_push, burst_push) = (samples(0..p.messages), samples(p.messages..total));
    let (loop_last, burst_last) = (last_device(0..p.messages), last_device(p.messages..total));
    let (loop_ack, burst_ack) = (Percentiles::of(sent.loop_ms), Percentiles::of(sent.burst_ms));
    let devices_complete = logs.iter().filter(|l| l.in_order == total).count();
    let anomalies: u64 = logs.iter().map(|l| l.anomalies).sum();
    let closed = logs.iter().filter(|l| l.closed).count();
    let deliveries: usize = logs.iter().map(|l| l.in_order).sum();
    let verified = log_ok
        && sent.errors == 0
        && sent.acks.len() == total
        && online == p.online
        && devices_complete == online
        && anomalies == 0
        && closed == 0;
    eprintln!(
        "groups send: {online} devices online; closed loop x{}: ack {}, push {}; burst x{}: ack {}, push {}; \
         devices complete {devices_complete}/{online}, anomalies {anomalies}, closed {closed}; cpu {cpu}  verified {verified}",
        p.messages,
        loop_ack.text(),
        loop_push.text(),
        p.burst,
        burst_ack.text(),
        burst_push.text(),
    );
    json!({
        "scenario": "groups-send",
        "members": members,
        "online_devices": online,
        "messages": p.messages,
        "burst": p.burst,
        "acked": sent.acks.len(),
        "send_errors": sent.errors,
        "closed_loop": {"ack_ms": loop_ack.json(), "push_ms": loop_push.json(), "last_device_ms": loop_last.json()},
        "burst_sends": {"ack_ms": burst_ack.json(), "push_ms": burst_push.json(), "last_device_ms": burst_last.json()},
        "deliveries": deliveries,
        "expected_deliveries": online * total,
        "devices_complete": devices_complete,
        "device_anomalies": anomalies,
        "devices_closed_by_server": closed,
        "connect_s": super::round2(connect_s),
        "cpu": cpu,
        "server_rss_mb": (rss_kib as f64 / 1024.0).round(),
        "verified": verified,
        "verification": detail,
    })
}
