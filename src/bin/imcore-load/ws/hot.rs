//! Issue 5 §1 and §4: one hot group driven over WebSocket. `C` sender
//! connections (each its own device) keep up to `W` sends in flight (closed
//! loop) — or send at a fixed total rate (open loop, §4) — while `R` receiver
//! devices are online. Every online member device gets the pushes, senders
//! included (a device is only spared its own events). Afterwards the log is
//! verified in PostgreSQL.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::{stream, SinkExt, StreamExt};
use imcore::store::Store;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::watch;
use tokio::time::sleep_until;
use tokio_tungstenite::tungstenite::Message;

use super::client::{self, now_us, BoxError, Percentiles, Ws};
use super::server::{CpuWindow, Pg, Server};

/// Users the sender devices belong to (round robin): the group stays under
/// the 1,000-member creation limit at any `C`.
const SENDER_USERS: usize = 64;

pub struct Setup {
    sender_tokens: Vec<String>,
    receiver_tokens: Vec<String>,
    members: Vec<String>,
}

/// Users and device tokens for up to `max_senders` senders and `receivers` receivers.
pub async fn setup(server: &Server, max_senders: usize, receivers: usize) -> Result<Setup, BoxError> {
    let su = SENDER_USERS.min(max_senders.max(1));
    let senders: Vec<String> = (0..su).map(|i| format!("hs{i}")).collect();
    let recv: Vec<String> = (0..receivers.max(1)).map(|i| format!("hr{i}")).collect();
    client::create_users(server.port, &server.admin, senders.iter().chain(&recv).cloned().collect()).await?;
    let sender_tokens = client::issue_tokens(
        server.port,
        &server.admin,
        (0..max_senders).map(|i| (senders[i % su].clone(), format!("d{i}"))).collect(),
    )
    .await?;
    let receiver_tokens =
        client::issue_tokens(server.port, &server.admin, recv.iter().map(|u| (u.clone(), "d0".to_owned())).collect())
            .await?;
    // hr0 creates the groups; everyone else is listed.
    let members = senders.iter().chain(recv.iter().skip(1)).cloned().collect();
    Ok(Setup { sender_tokens, receiver_tokens, members })
}

pub struct Params<'a> {
    pub scenario: &'static str,
    pub write_path: &'a str,
    pub senders: usize,
    pub window: usize,
    pub receivers: usize,
    pub seconds: f64,
    pub messages: u64,
    /// Open loop at this total rate (msgs/s); closed loop when `None`.
    pub rate: Option<f64>,
    pub source_addrs: usize,
    pub delivery_mode: &'a str,
}

pub async fn run(server: &Server, pg: &Pg, db: &Store, setup: &Setup, p: &Params<'_>) -> Result<Value, BoxError> {
    let conv = format!("{}-{}-{}-c{}", p.scenario, p.write_path, p.delivery_mode, p.senders);
    let receivers = p.receivers.min(setup.receiver_tokens.len());
    client::create_group(
        server.port,
        &setup.receiver_tokens[0],
        json!({"kind": "group", "conv_id": conv, "name": conv, "members": setup.members,
               "max_member": 1000, "delivery_mode": p.delivery_mode}),
    )
    .await?;
    let port = server.port;
    let addrs = p.source_addrs;
    // Receivers first, each routed (a ping answered) before the senders start.
    let recv_ws: Vec<Ws> = stream::iter(setup.receiver_tokens[..receivers].iter().enumerate())
        .map(|(i, t)| async move {
            let mut ws = client::connect_retry(port, client::source_addr(i, addrs), t).await?;
            ws.send(Message::Text(r#"{"id":0,"op":"ping"}"#.into())).await?;
            while let Some(m) = ws.next().await {
                if matches!(m?, Message::Text(t) if t.contains("pong")) {
                    break;
                }
            }
            Ok::<_, BoxError>(ws)
        })
        .buffered(256)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<_, _>>()?;
    let send_ws: Vec<Ws> = stream::iter(setup.sender_tokens[..p.senders].iter().enumerate())
        .map(|(i, t)| client::connect_retry(port, client::source_addr(receivers + i, addrs), t))
        .buffered(256)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<_, _>>()?;

    let (stop_tx, stop_rx) = watch::channel(false);
    let recv_tasks: Vec<_> =
        recv_ws.into_iter().map(|ws| tokio::spawn(receiver(ws, stop_rx.clone(), conv.clone()))).collect();
    let cpu = CpuWindow::start(server, pg);
    let start = Instant::now() + Duration::from_millis(50);
    let deadline = start + Duration::from_secs_f64(p.seconds);
    let cfg = Arc::new(SenderCfg {
        conv: conv.clone(),
        window: if p.rate.is_some() { 64 } else { p.window },
        start,
        deadline,
        hard: deadline + Duration::from_secs(15),
        issued: AtomicU64::new(0),
        budget: p.messages,
        interval: p.rate.map(|r| Duration::from_secs_f64(p.senders as f64 / r.max(1.0))),
        senders: p.senders,
    });
    let send_tasks: Vec<_> =
        send_ws.into_iter().enumerate().map(|(i, ws)| tokio::spawn(sender(i, ws, cfg.clone()))).collect();
    let mut outs = Vec::with_capacity(send_tasks.len());
    for t in send_tasks {
        outs.push(t.await?);
    }
    let last_ack = outs.iter().filter_map(|o| o.last_ack).max().unwrap_or(start);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let _ = stop_tx.send(true);
    let mut routs = Vec::with_capacity(recv_tasks.len());
    for t in recv_tasks {
        routs.push(t.await?);
    }
    let cpu = cpu.end(server, pg);
    let rss_kib = server.rss_kib();

    let elapsed = last_ack.saturating_duration_since(start).as_secs_f64().max(1e-9);
    let acks: Vec<(i64, String)> = outs.iter_mut().flat_map(|o| std::mem::take(&mut o.acks)).collect();
    let ack_ms = Percentiles::of(outs.iter_mut().flat_map(|o| std::mem::take(&mut o.ack_ms)).collect());
    let e2e_ms = Percentiles::of(routs.iter_mut().flat_map(|o| std::mem::take(&mut o.e2e_ms)).collect());
    let mut errors: BTreeMap<String, u64> = BTreeMap::new();
    for o in &outs {
        for (k, v) in &o.errors {
            *errors.entry(k.clone()).or_default() += v;
        }
    }
    let sender_events: u64 = outs.iter().map(|o| o.pushed_events).sum();
    let receiver_events: u64 = routs.iter().map(|o| o.events).sum();
    let last_push = routs.iter().filter_map(|o| o.last).max().unwrap_or(last_ack).max(last_ack);
    let push_window = last_push.saturating_duration_since(start).as_secs_f64().max(1e-9);
    let closed = outs.iter().filter(|o| o.closed).count() + routs.iter().filter(|o| o.closed).count();
    let gaps: u64 = routs.iter().map(|o| o.gaps).sum();
    let out_of_order: u64 = routs.iter().map(|o| o.out_of_order).sum();
    let skipped: u64 = outs.iter().map(|o| o.skipped).sum();
    let (verified, detail) = verify(db, &conv, &acks).await?;
    let batch = batch_sizes(db, &conv).await?;
    let r = |x: f64| x.round();
    let run = json!({
        "scenario": p.scenario,
        "write_path": p.write_path,
        "delivery_mode": p.delivery_mode,
        "senders": p.senders,
        "window": if p.rate.is_some() { Value::Null } else { json!(p.window) },
        "target_rate_per_s": p.rate.map(r),
        "receivers": receivers,
        "seconds": p.seconds,
        "message_budget": p.messages,
        "messages": acks.len(),
        "acked_per_s": r(acks.len() as f64 / elapsed),
        "ack_ms": ack_ms.json(),
        "e2e_ms": e2e_ms.json(),
        "push_deliveries_per_s": r((sender_events + receiver_events) as f64 / push_window),
        "receiver_deliveries": receiver_events,
        "sender_deliveries": sender_events,
        // Pushes a receiver saw jump ahead (seq > last + 1) or arrive at or
        // below a seq it had already seen (PROTOCOL §4: increasing seq).
        "receiver_gaps": gaps,
        "receiver_out_of_order": out_of_order,
        "errors": errors,
        "connections_closed_by_server": closed,
        "open_loop_skipped": skipped,
        "batch": {"mean": (batch.0 * 10.0).round() / 10.0, "max": batch.1},
        "cpu": cpu,
        "server_rss_mb": (rss_kib as f64 / 1024.0).round(),
        "verified": verified,
        "verification": detail,
    });
    eprintln!(
        "{:<10} {:<6} {} C={:<5} {:>7.0} acked/s  ack p50 {:.1} p99 {:.1} max {:.1} ms  e2e p50 {:.1} p99 {:.1} ms  \
         {:>8.0} deliveries/s  gaps {} out-of-order {}  errors {}  cpu {}  verified {}",
        p.scenario,
        p.write_path,
        p.delivery_mode,
        p.senders,
        run["acked_per_s"].as_f64().unwrap_or(0.0),
        ack_ms.p50,
        ack_ms.p99,
        ack_ms.max,
        e2e_ms.p50,
        e2e_ms.p99,
        run["push_deliveries_per_s"].as_f64().unwrap_or(0.0),
        gaps,
        out_of_order,
        run["errors"],
        run["cpu"],
        verified
    );
    Ok(run)
}

struct SenderCfg {
    conv: String,
    window: usize,
    start: Instant,
    deadline: Instant,
    hard: Instant,
    issued: AtomicU64,
    budget: u64,
    interval: Option<Duration>,
    senders: usize,
}

#[derive(Default)]
struct SenderOut {
    acks: Vec<(i64, String)>,
    ack_ms: Vec<f64>,
    errors: BTreeMap<String, u64>,
    pushed_events: u64,
    last_ack: Option<Instant>,
    closed: bool,
    skipped: u64,
}

#[derive(Deserialize)]
struct ReplyIn {
    id: Option<u64>,
    ok: Option<bool>,
    seq: Option<i64>,
    error: Option<ErrorIn>,
}

#[derive(Deserialize)]
struct ErrorIn {
    code: String,
}

fn send_frame(conv: &str, id: u64, key: &str, n: u64) -> String {
    json!({"id": id, "op": "send", "conv_id": conv, "client_msg_id": key,
           "body": {"type": "text", "text": format!("load message {n:08} {}", "x".repeat(64)), "ts": now_us(), "n": n}})
    .to_string()
}

async fn sender(idx: usize, mut ws: Ws, cfg: Arc<SenderCfg>) -> SenderOut {
    let mut out = SenderOut::default();
    // (id, sent at, key)
    let mut inflight: Vec<(u64, Instant, String)> = Vec::with_capacity(cfg.window);
    let mut next_id = 1u64;
    let mut exhausted = false;
    let mut tick = cfg.interval.map(|i| cfg.start + i.mul_f64(idx as f64 / cfg.senders.max(1) as f64));
    sleep_until(cfg.start.into()).await;
    loop {
        let can_issue = !exhausted && Instant::now() < cfg.deadline;
        if cfg.interval.is_none() && can_issue {
            let mut fed = false;
            while inflight.len() < cfg.window {
                if cfg.issued.fetch_add(1, Ordering::Relaxed) >= cfg.budget {
                    exhausted = true;
                    break;
                }
                let key = format!("c{idx}-{next_id}");
                let frame = send_frame(&cfg.conv, next_id, &key, next_id);
                if ws.feed(Message::Text(frame)).await.is_err() {
                    out.closed = true;
                    return out;
                }
                inflight.push((next_id, Instant::now(), key));
                next_id += 1;
                fed = true;
            }
            if fed && ws.flush().await.is_err() {
                out.closed = true;
                return out;
            }
        }
        if inflight.is_empty() && !can_issue {
            return out;
        }
        let tick_at = tick.unwrap_or(cfg.hard);
        tokio::select! {
            biased;
            frame = ws.next() => match frame {
                Some(Ok(Message::Text(t))) => {
                    if t.starts_with("{\"push\"") {
                        out.pushed_events += t.matches("\"seq\":").count() as u64;
                        continue;
                    }
                    let Ok(reply) = serde_json::from_str::<ReplyIn>(&t) else { continue };
                    let Some(pos) = reply.id.and_then(|id| inflight.iter().position(|f| f.0 == id)) else { continue };
                    let (_, at, key) = inflight.swap_remove(pos);
                    match (reply.ok, reply.seq, reply.error) {
                        (Some(true), Some(seq), _) => {
                            out.ack_ms.push(at.elapsed().as_secs_f64() * 1000.0);
                            out.acks.push((seq, key));
                            out.last_ack = Some(Instant::now());
                        }
                        (_, _, Some(e)) => *out.errors.entry(e.code).or_default() += 1,
                        _ => *out.errors.entry("UNPARSED".into()).or_default() += 1,
                    }
                }
                Some(Ok(Message::Close(_))) | Some(Err(_)) | None => {
                    out.closed = true;
                    *out.errors.entry("CONNECTION_CLOSED".into()).or_default() += inflight.len() as u64;
                    return out;
                }
                Some(Ok(_)) => {}
            },
            () = sleep_until(tick_at.into()), if tick.is_some() && can_issue => {
                tick = tick.map(|t| t + cfg.interval.unwrap_or_default());
                if inflight.len() >= cfg.window {
                    out.skipped += 1;
                    continue;
                }
                if cfg.issued.fetch_add(1, Ordering::Relaxed) >= cfg.budget {
                    exhausted = true;
                    continue;
                }
                let key = format!("c{idx}-{next_id}");
                if ws.send(Message::Text(send_frame(&cfg.conv, next_id, &key, next_id))).await.is_err() {
                    out.closed = true;
                    return out;
                }
                inflight.push((next_id, Instant::now(), key));
                next_id += 1;
            }
            () = sleep_until(cfg.hard.into()) => {
                *out.errors.entry("NO_ANSWER".into()).or_default() += inflight.len() as u64;
                return out;
            }
        }
    }
}

#[derive(Default)]
struct ReceiverOut {
    e2e_ms: Vec<f64>,
    events: u64,
    gaps: u64,
    out_of_order: u64,
    last: Option<Instant>,
    closed: bool,
}

#[derive(Deserialize)]
struct PushIn {
    conv_id: Option<String>,
    event: Option<EventIn>,
    events: Option<Vec<EventIn>>,
}

#[derive(Deserialize)]
struct EventIn {
    seq: i64,
    body: Option<BodyIn>,
}

#[derive(Deserialize)]
struct BodyIn {
    ts: Option<u64>,
}

async fn receiver(mut ws: Ws, mut stop: watch::Receiver<bool>, conv: String) -> ReceiverOut {
    let mut out = ReceiverOut::default();
    let mut last_seq: Option<i64> = None;
    loop {
        tokio::select! {
            frame = ws.next() => match frame {
                Some(Ok(Message::Text(t))) => {
                    let Ok(push) = serde_json::from_str::<PushIn>(&t) else { continue };
                    if push.conv_id.as_deref() != Some(conv.as_str()) {
                        continue;
                    }
                    let now = now_us();
                    for e in push.event.into_iter().chain(push.events.unwrap_or_default()) {
                        match last_seq {
                            Some(l) if e.seq > l + 1 => out.gaps += 1,
                            Some(l) if e.seq <= l => out.out_of_order += 1,
                            _ => {}
                        }
                        last_seq = Some(last_seq.map_or(e.seq, |l| l.max(e.seq)));
                        if let Some(ts) = e.body.and_then(|b| b.ts) {
                            out.events += 1;
                            out.e2e_ms.push(now.saturating_sub(ts) as f64 / 1000.0);
                        }
                    }
                    out.last = Some(Instant::now());
                }
                Some(Ok(Message::Close(_))) | Some(Err(_)) | None => {
                    out.closed = true;
                    return out;
                }
                Some(Ok(_)) => {}
            },
            _ = stop.changed() => return out,
        }
    }
}

/// P1 (gapless from 1, next_seq = max + 1), P2 (one row per request key),
/// every ack equals its stored row, and as many rows as acks.
pub async fn verify(db: &Store, conv: &str, acks: &[(i64, String)]) -> Result<(bool, Value), BoxError> {
    let conn = db.pool().get().await?;
    let row = conn
        .query_one(
            "SELECT count(e.seq), coalesce(min(e.seq), 0), coalesce(max(e.seq), 0), max(c.next_seq),
                    count(e.client_msg_id)
                      - count(DISTINCT (e.sender_user, e.client_msg_id)) FILTER (WHERE e.client_msg_id IS NOT NULL),
                    count(*) FILTER (WHERE e.kind = 'msg')
               FROM conversations c JOIN events e USING (conv_id) WHERE c.conv_id = $1",
            &[&conv],
        )
        .await?;
    let (count, min, max, next, dup_keys, msgs): (i64, i64, i64, i64, i64, i64) =
        (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4), row.get(5));
    let seqs: Vec<i64> = acks.iter().map(|a| a.0).collect();
    let keys: Vec<&str> = acks.iter().map(|a| a.1.as_str()).collect();
    let mismatched: i64 = conn
        .query_one(
            "SELECT count(*) FROM unnest($2::int8[], $3::text[]) AS a(seq, key)
              WHERE NOT EXISTS (SELECT 1 FROM events e WHERE e.conv_id = $1 AND e.seq = a.seq
                                                        AND e.client_msg_id = a.key AND e.kind = 'msg')",
            &[&conv, &seqs, &keys],
        )
        .await?
        .get(0);
    let gapless = min == 1 && count == max && next == max + 1;
    let ok = gapless && dup_keys == 0 && mismatched == 0 && msgs == acks.len() as i64;
    Ok((
        ok,
        json!({"gapless": gapless, "duplicate_keys": dup_keys, "acks_unlike_rows": mismatched,
               "stored_msgs": msgs, "acks": acks.len(), "head": max}),
    ))
}

/// Rows per inserting transaction (xmin), as PostgreSQL saw them.
async fn batch_sizes(db: &Store, conv: &str) -> Result<(f64, i64), BoxError> {
    let conn = db.pool().get().await?;
    let r = conn
        .query_one(
            "SELECT coalesce(avg(n)::float8, 0), coalesce(max(n), 0) FROM (
               SELECT count(*) AS n FROM events WHERE conv_id = $1 AND kind = 'msg' GROUP BY xmin::text) t",
            &[&conv],
        )
        .await?;
    Ok((r.get(0), r.get(1)))
}
