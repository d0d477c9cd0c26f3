//! Issue 5 §1 and §4: one hot group driven over WebSocket. `C` sender
//! connections (each its own device) keep up to `W` sends in flight (closed
//! loop) — or send at a fixed total rate (open loop, §4) — while `R` receiver
//! devices are online. Every online member device gets the pushes, senders
//! included (a device is only spared its own events). Afterwards the log is
//! verified in PostgreSQL, and every receiver: see [`DELIVERY_RULE`]. Sends
//! answered with anything but an ack or `OVERLOADED` fail the run too.
//! With several nodes, connection `i` (receivers first, then senders) is on
//! node `i % N`, and the live messages' latency is also given apart for
//! receivers on the sending connection's node and on another.

mod receiver;
mod sender;

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

use imcore::store::Store;
use imcore_client::Ws;
use serde_json::{json, Value};
use tokio::sync::watch;

use super::log_check::{batch_sizes, verify};
use super::nodes::Nodes;
use super::provision::{self, BoxError};
use super::server::{deliveries_per_server_core_s, CpuWindow, Pg, Server};
use crate::percentiles::Percentiles;
use receiver::{ReceiverOut, Target};
use sender::{SenderCfg, SenderOut};

/// Users the sender devices belong to (round robin): the group stays under
/// the 1,000-member creation limit at any `C`.
const SENDER_USERS: usize = 64;

/// How long receivers may take to catch up with the last ack.
const CATCH_UP: Duration = Duration::from_secs(20);

/// What a receiver must show for its run to verify (written into the evidence).
pub const DELIVERY_RULE: &str = "Every receiver ends with every message exactly once: the live ones (pushed, or \
    synced after a head push in pull mode, one sync in flight per receiver and one more if heads came meanwhile) \
    plus the gaps the live stream skipped, which it notes and fills by sync after the run (PROTOCOL §4: pushes may \
    be skipped, the log is the truth). Live messages must come in increasing seq order, and the server must close \
    no connection.";

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
    provision::create_users(server.port, &server.admin, senders.iter().chain(&recv).cloned().collect()).await?;
    let sender_tokens = provision::issue_tokens(
        server.port,
        &server.admin,
        (0..max_senders).map(|i| (senders[i % su].clone(), format!("d{i}"))).collect(),
    )
    .await?;
    let receiver_tokens = provision::issue_tokens(
        server.port,
        &server.admin,
        recv.iter().map(|u| (u.clone(), "d0".to_owned())).collect(),
    )
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

impl Params<'_> {
    fn pull(&self) -> bool {
        self.delivery_mode == "pull"
    }
}

/// One run: a fresh group, its connections (spread over the nodes), the
/// load, the report.
pub async fn run(nodes: &Nodes, pg: &Pg, db: &Store, setup: &Setup, p: &Params<'_>) -> Result<Value, BoxError> {
    let conv = format!("{}-{}-{}-c{}", p.scenario, p.write_path, p.delivery_mode, p.senders);
    let conns = connect(nodes, setup, p, &conv).await?;
    let driven = drive(nodes, pg, conns, p, &conv).await?;
    report(db, p, &conv, driven).await
}

struct Connections {
    /// The group head once created: the run's messages come after it.
    h0: i64,
    /// With several nodes: each connection's node.
    receivers: Vec<(Ws, Option<usize>)>,
    senders: Vec<(Ws, Option<usize>)>,
}

/// Creates the group, then connects the receivers (each routed: a ping
/// answered) before the senders; connection `i` (receivers first) goes to node `i % N`.
async fn connect(nodes: &Nodes, setup: &Setup, p: &Params<'_>, conv: &str) -> Result<Connections, BoxError> {
    let receivers = p.receivers.min(setup.receiver_tokens.len());
    let group = provision::create_group(
        nodes.first().port,
        &setup.receiver_tokens[0],
        json!({"kind": "group", "conv_id": conv, "name": conv, "members": setup.members,
               "max_member": 1000, "delivery_mode": p.delivery_mode}),
    )
    .await?;
    let h0 = group["head"].as_i64().ok_or("create_conversation answered no head")?;
    let addrs = p.source_addrs;
    let port = |i| nodes.port(i);
    let receivers = provision::connect_all(&setup.receiver_tokens[..receivers], 0, addrs, port, true).await?;
    let first = receivers.len();
    let senders = provision::connect_all(&setup.sender_tokens[..p.senders], first, addrs, port, false).await?;
    let on_nodes = |conns: Vec<Ws>, first: usize| -> Vec<(Ws, Option<usize>)> {
        conns.into_iter().enumerate().map(|(k, ws)| (ws, nodes.node_of(first + k))).collect()
    };
    let (receivers, senders) = (on_nodes(receivers, 0), on_nodes(senders, first));
    Ok(Connections { h0, receivers, senders })
}

struct Driven {
    start: Instant,
    senders: Vec<SenderOut>,
    receivers: Vec<ReceiverOut>,
    cpu: Value,
    rss_kib: u64,
    several_nodes: bool,
}

/// Runs the senders to the end of their budget or time, then lets the
/// receivers catch up with the last acked seq (at most `CATCH_UP`).
async fn drive(nodes: &Nodes, pg: &Pg, conns: Connections, p: &Params<'_>, conv: &str) -> Result<Driven, BoxError> {
    let (target_tx, target_rx) = watch::channel(None);
    let pull = p.pull();
    let recv_tasks: Vec<_> = conns
        .receivers
        .into_iter()
        .map(|(ws, node)| tokio::spawn(receiver::run(ws, node, target_rx.clone(), conv.to_owned(), conns.h0, pull)))
        .collect();
    let cpu = CpuWindow::start(nodes, pg);
    let start = Instant::now() + Duration::from_millis(50);
    let deadline = start + Duration::from_secs_f64(p.seconds);
    let cfg = Arc::new(SenderCfg {
        conv: conv.to_owned(),
        window: if p.rate.is_some() { 64 } else { p.window },
        start,
        deadline,
        hard: deadline + Duration::from_secs(15),
        issued: AtomicU64::new(0),
        budget: p.messages,
        interval: p.rate.map(|r| Duration::from_secs_f64(p.senders as f64 / r.max(1.0))),
        senders: p.senders,
    });
    let send_tasks: Vec<_> = conns
        .senders
        .into_iter()
        .enumerate()
        .map(|(i, (ws, node))| tokio::spawn(sender::run(i, node, ws, cfg.clone())))
        .collect();
    let mut senders = Vec::with_capacity(send_tasks.len());
    for t in send_tasks {
        senders.push(t.await?);
    }
    let head = senders.iter().flat_map(|o| o.acks.iter().map(|a| a.0)).max().unwrap_or(0);
    let _ = target_tx.send(Some(Target { head, give_up: Instant::now() + CATCH_UP }));
    let mut receivers = Vec::with_capacity(recv_tasks.len());
    for t in recv_tasks {
        receivers.push(t.await?);
    }
    Ok(Driven {
        start,
        senders,
        receivers,
        cpu: cpu.end(nodes, pg),
        rss_kib: nodes.rss_kib(),
        several_nodes: nodes.count() > 1,
    })
}

/// The receivers against [`DELIVERY_RULE`], and the sums over them.
struct Delivery {
    complete: usize,
    live: u64,
    gaps: u64,
    recovered: u64,
    out_of_order: u64,
    sync_faults: u64,
    heads: u64,
    syncs: u64,
    closed_receivers: usize,
    closed_senders: usize,
}

impl Delivery {
    fn of(d: &Driven, messages: usize) -> Self {
        let rs = &d.receivers;
        let sum = |f: fn(&ReceiverOut) -> u64| rs.iter().map(f).sum();
        Self {
            complete: rs
                .iter()
                .filter(|r| {
                    r.live + r.recovered == messages as u64 && r.out_of_order == 0 && r.sync_faults == 0 && !r.closed
                })
                .count(),
            live: sum(|r| r.live),
            gaps: sum(|r| r.gaps),
            recovered: sum(|r| r.recovered),
            out_of_order: sum(|r| r.out_of_order),
            sync_faults: sum(|r| r.sync_faults),
            heads: sum(|r| r.heads),
            syncs: sum(|r| r.syncs),
            closed_receivers: rs.iter().filter(|o| o.closed).count(),
            closed_senders: d.senders.iter().filter(|o| o.closed).count(),
        }
    }

    fn ok(&self, receivers: usize) -> bool {
        self.complete == receivers && self.closed_senders == 0
    }
}

/// Checks the log and every receiver, and describes the run.
async fn report(db: &Store, p: &Params<'_>, conv: &str, mut d: Driven) -> Result<Value, BoxError> {
    let last_ack = d.senders.iter().filter_map(|o| o.last_ack).max().unwrap_or(d.start);
    let elapsed = last_ack.saturating_duration_since(d.start).as_secs_f64().max(1e-9);
    let acks: Vec<(i64, String)> = d.senders.iter_mut().flat_map(|o| std::mem::take(&mut o.acks)).collect();
    let ack_ms = Percentiles::of(d.senders.iter_mut().flat_map(|o| std::mem::take(&mut o.ack_ms)).collect());
    let e2e_ms = Percentiles::of(d.receivers.iter().flat_map(|o| o.e2e_ms.iter().map(|e| e.0)).collect());
    // With several nodes: live messages to a receiver on the sending connection's node, and on another.
    let by_node = d.several_nodes.then(|| {
        let of = |other: bool| {
            Percentiles::of(
                d.receivers.iter().flat_map(|o| &o.e2e_ms).filter(|e| e.1 == Some(other)).map(|e| e.0).collect(),
            )
        };
        (of(false), of(true))
    });
    let mut errors: BTreeMap<String, u64> = BTreeMap::new();
    for (k, v) in d.senders.iter().flat_map(|o| &o.errors) {
        *errors.entry(k.clone()).or_default() += v;
    }
    let sender_events: u64 = d.senders.iter().map(|o| o.pushed_events).sum();
    let last_push = d.receivers.iter().filter_map(|o| o.last).max().unwrap_or(last_ack).max(last_ack);
    let push_window = last_push.saturating_duration_since(d.start).as_secs_f64().max(1e-9);
    let delivery = Delivery::of(&d, acks.len());
    let (log_ok, detail) = verify(db, conv, &acks).await?;
    // OVERLOADED is the server shedding load as designed (nothing stored, the
    // client may retry); any other error or missing answer is a failure.
    let failures: u64 = errors.iter().filter(|(code, _)| code.as_str() != "OVERLOADED").map(|(_, n)| n).sum();
    let verified = log_ok && failures == 0 && delivery.ok(d.receivers.len());
    let batch = batch_sizes(db, conv).await?;
    let r = |x: f64| x.round();
    let mut run = json!({
        "scenario": p.scenario,
        "write_path": p.write_path,
        "delivery_mode": p.delivery_mode,
        "senders": p.senders,
        "window": if p.rate.is_some() { Value::Null } else { json!(p.window) },
        "target_rate_per_s": p.rate.map(r),
        "receivers": d.receivers.len(),
        "seconds": p.seconds,
        "message_budget": p.messages,
        "messages": acks.len(),
        "acked_per_s": r(acks.len() as f64 / elapsed),
        "ack_ms": ack_ms.json(),
        // Live messages only: those synced after the run are not timed.
        "e2e_ms": e2e_ms.json(),
        "push_deliveries_per_s": r((sender_events + delivery.live) as f64 / push_window),
        // Beside `cpu.generator_cores`: where the generator is the bound, this is too.
        "push_deliveries_per_server_core_s": deliveries_per_server_core_s(sender_events + delivery.live, &d.cpu),
        "receiver_deliveries": delivery.live,
        "sender_deliveries": sender_events,
        // Receivers meeting DELIVERY_RULE.
        "receivers_complete": delivery.complete,
        "receiver_out_of_order": delivery.out_of_order,
        // Gaps in the receivers' live streams, summed, and what the sync
        // after the run fetched to fill them.
        "receiver_gaps": {"gaps": delivery.gaps, "messages_synced_after_the_run": delivery.recovered,
                          "sync_faults": delivery.sync_faults},
        "pull_syncs": if p.pull() { json!({"head_pushes": delivery.heads, "syncs": delivery.syncs}) } else { Value::Null },
        "errors": errors,
        "connections_closed_by_server": delivery.closed_receivers + delivery.closed_senders,
        "open_loop_skipped": d.senders.iter().map(|o| o.skipped).sum::<u64>(),
        "batch": {"mean": (batch.0 * 10.0).round() / 10.0, "max": batch.1},
        "cpu": d.cpu,
        "server_rss_mb": (d.rss_kib as f64 / 1024.0).round(),
        "verified": verified,
        "verification": detail,
    });
    if let Some((same, other)) = &by_node {
        run["e2e_ms_by_node"] = json!({"sender_node": same.json(), "other_node": other.json()});
    }
    print_run(p, &run, &delivery, &ack_ms, &e2e_ms, by_node.as_ref().map(|b| &b.1));
    Ok(run)
}

/// The run's line on stderr.
fn print_run(
    p: &Params<'_>,
    run: &Value,
    delivery: &Delivery,
    ack_ms: &Percentiles,
    e2e_ms: &Percentiles,
    cross_node: Option<&Percentiles>,
) {
    let pull_syncs =
        if p.pull() { format!("  head pushes {} -> syncs {}", delivery.heads, delivery.syncs) } else { String::new() };
    let cross_node = cross_node.map_or(String::new(), |c| format!(" (other node {})", c.text()));
    eprintln!(
        "{:<10} {:<6} {} C={:<5} {:>7.0} acked/s  ack {}  e2e {}{cross_node}  {:>8.0} deliveries/s  receivers complete {}/{}  \
         gaps {} (synced after the run: {} msgs, {} faults)  out-of-order {} closed {}{pull_syncs}  errors {}  cpu {}  \
         verified {}",
        p.scenario,
        p.write_path,
        p.delivery_mode,
        p.senders,
        run["acked_per_s"].as_f64().unwrap_or(0.0),
        ack_ms.text(),
        e2e_ms.text(),
        run["push_deliveries_per_s"].as_f64().unwrap_or(0.0),
        delivery.complete,
        run["receivers"],
        delivery.gaps,
        delivery.recovered,
        delivery.sync_faults,
        delivery.out_of_order,
        run["connections_closed_by_server"],
        run["errors"],
        run["cpu"],
        run["verified"],
    );
}
