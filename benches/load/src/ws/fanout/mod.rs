//! Issue 5 §2: fan-out. A group of `M` members, every member's device online,
//! one sender (a further device of member 0) at a steady rate. Per message:
//! the time until the last member device has it. `push` mode: the event
//! arrives in a push. `pull` mode: the device gets a coalesced `head` push and
//! calls `sync`; it has the event when the sync answer brings it. Both the
//! `head` arrival and the event arrival are reported for pull. A run verifies
//! when the log is intact and every device got every message once, in order,
//! on a connection the server kept open. With several nodes, member `i`'s
//! device is on node `i % N` and the sender on node 0.

mod device;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use imcore::store::{CreateConversation, GroupSettings, Store};
use imcore_actors::{ConvId, UserId};
use imcore_client::Ws;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::task::JoinSet;

use super::log_check::verify;
use super::nodes::Nodes;
use super::provision::{self, now_us, BoxError};
use super::server::{deliveries_per_server_core_s, CpuWindow, Pg, Server};
use crate::percentiles::Percentiles;
use device::{Current, Measure};

/// How long devices may take to get the last message after the last send.
const SETTLE: Duration = Duration::from_secs(20);

/// Online member devices, kept across the runs of one server.
pub struct Devices {
    tasks: JoinSet<()>,
    current: Current,
    /// Devices whose connection the server ended.
    closed: Arc<AtomicU64>,
    online: usize,
    tokens: Vec<String>,
    sender_token: String,
    users: Vec<String>,
    source_addrs: usize,
}

/// Users `f0..f{max_m}` with device `d0` each, and member 0's sending device.
pub async fn setup(server: &Server, max_m: usize, source_addrs: usize) -> Result<Devices, BoxError> {
    let users: Vec<String> = (0..max_m).map(|i| format!("f{i}")).collect();
    provision::create_users(server.port, &server.admin, users.clone()).await?;
    let mut devices: Vec<(String, String)> = users.iter().map(|u| (u.clone(), "d0".to_owned())).collect();
    devices.push((users.first().ok_or("fan-out needs members")?.clone(), "sender".to_owned()));
    let mut tokens = provision::issue_tokens(server.port, &server.admin, devices).await?;
    let sender_token = tokens.pop().ok_or("no sender token")?;
    Ok(Devices {
        tasks: JoinSet::new(),
        current: Arc::default(),
        closed: Arc::default(),
        online: 0,
        tokens,
        sender_token,
        users,
        source_addrs,
    })
}

impl Devices {
    /// Brings the devices of members `0..m` online, member `i` on node `i % N`.
    async fn online_up_to(&mut self, nodes: &Nodes, m: usize) -> Result<(), BoxError> {
        let (addrs, from) = (self.source_addrs, self.online);
        let conns = provision::connect_all(&self.tokens[from..m], from, addrs, |i| nodes.port(i), false).await?;
        for (i, ws) in conns.into_iter().enumerate() {
            self.tasks.spawn(device::device(ws, from + i, self.current.clone(), self.closed.clone()));
        }
        self.online = m;
        Ok(())
    }

    fn measure(&self, m: Option<Arc<Measure>>) -> Result<(), BoxError> {
        *self.current.write().map_err(|_| "poisoned")? = m;
        Ok(())
    }

    pub fn close(mut self) {
        self.tasks.abort_all();
    }
}

pub struct Params<'a> {
    pub members: usize,
    pub mode: &'a str,
    pub rate: f64,
    pub messages: usize,
    /// Report the sends' ack latency too (the cluster comparison: forwarding
    /// a send to its home node shows there); `fanout.json` keeps its fields.
    pub ack_ms: bool,
}

/// One run (its group made by [`create_group`]): its devices online, the
/// sends (through node 0), the report.
pub async fn run(nodes: &Nodes, pg: &Pg, db: &Store, devs: &mut Devices, p: &Params<'_>) -> Result<Value, BoxError> {
    let m = p.members.min(devs.users.len());
    let conv = group_id(p, m);
    let connect_started = Instant::now();
    devs.online_up_to(nodes, m).await?;
    let connect_s = connect_started.elapsed().as_secs_f64();
    let mut sender = provision::connect_retry(nodes.port(0), provision::source_addr(0, 1), &devs.sender_token).await?;
    let measure = Arc::new(Measure::new(conv.clone(), m as i64, p.messages, m, p.mode == "pull"));
    devs.measure(Some(measure.clone()))?;
    // The devices' connections ran statements whose counts a busy backend
    // reports up to a second late: they must not land in the window.
    tokio::time::sleep(STATS_FLUSH).await;
    let xacts_before = xacts(db).await?;
    let reads_before = nodes.sync_reads(None).await?;
    let cpu = CpuWindow::start(nodes, pg);
    // What a profiler waits for (benches/profile-push.sh).
    println!("sending: fanout {} M={m}", p.mode);
    let sent = drive(&mut sender, &measure, p).await;
    if let Ok(sent) = &sent {
        settle(&measure, m, sent.n).await;
    }
    let cpu = cpu.end(nodes, pg);
    // An idle backend reports its statistics within PostgreSQL's idle interval (10 s).
    tokio::time::sleep(STATS_FLUSH).await;
    let xacts = xacts(db).await? - xacts_before;
    let sync_reads = super::nodes::reads_since(&reads_before, nodes.sync_reads(None).await?);
    devs.measure(None)?;
    sender.close().await;
    let sent = sent?;
    let closed = devs.closed.load(Ordering::Relaxed);
    report(nodes, db, p, m, &measure, Outcome { sent, connect_s, cpu, closed, xacts, sync_reads }).await
}

/// How long PostgreSQL may take to count a backend's transactions once it is idle.
const STATS_FLUSH: Duration = Duration::from_secs(11);

/// Transactions of the benchmark database so far: each statement outside a
/// transaction block (every `sync` read) counts as one.
async fn xacts(db: &Store) -> Result<i64, BoxError> {
    let conn = db.pool().get().await?;
    let row = conn
        .query_one(
            "SELECT (xact_commit + xact_rollback)::bigint FROM pg_stat_database WHERE datname = current_database()",
            &[],
        )
        .await?;
    Ok(row.get(0))
}

fn group_id(p: &Params<'_>, m: usize) -> String {
    format!("fan-{}-{m}", p.mode)
}

/// The group of run `p`. Every group is made before any device comes
/// online: a live connection learns of a group from its join events, which
/// one made in the store directly never publishes. `create_conversation`
/// takes at most 1,000 listed members, and inviting the rest would push every
/// join to every member: larger groups are created in the store directly.
pub async fn create_group(server: &Server, db: &Store, devs: &Devices, p: &Params<'_>) -> Result<(), BoxError> {
    let m = p.members.min(devs.users.len());
    let conv = group_id(p, m);
    let conv = conv.as_str();
    if m <= 1000 {
        provision::create_group(
            server.port,
            &devs.tokens[0],
            json!({"kind": "group", "conv_id": conv, "name": conv, "members": devs.users[1..m],
                   "max_member": m + 1, "delivery_mode": p.mode}),
        )
        .await?;
        return Ok(());
    }
    let mut settings = GroupSettings { max_member: (m + 1) as i32, ..GroupSettings::default() };
    settings.delivery_mode = p.mode.parse().map_err(|()| "delivery mode")?;
    db.create_conversation(&CreateConversation::Group {
        creator: UserId::parse(&devs.users[0])?,
        conv_id: Some(ConvId::parse(conv)?),
        name: conv.to_owned(),
        members: devs.users[1..m].iter().map(|u| UserId::parse(u)).collect::<Result<_, _>>()?,
        settings,
    })
    .await?;
    Ok(())
}

#[derive(Deserialize)]
struct AckIn {
    id: Option<u64>,
    ok: Option<bool>,
    seq: Option<i64>,
    error: Option<ErrorIn>,
}

#[derive(Deserialize)]
struct ErrorIn {
    code: String,
}

/// What the sender did: `n` messages sent, the acks `(seq, client_msg_id)`
/// and their latency, the rejected or unanswered ones, and the refusals
/// (`OVERLOADED`) it sent again with the same key, by message.
struct Sent {
    n: usize,
    acks: Vec<(i64, String)>,
    ack_ms: Vec<f64>,
    errors: u64,
    /// Every error answer, `(message, code)`, retried or not.
    refusals: Vec<(usize, String)>,
}

/// How long the sender waits before sending a refused message again
/// (PROTOCOL: `Retry-After: 1`, and the same key makes the retry safe).
const SEND_RETRY: Duration = Duration::from_secs(1);

/// Sends `p.messages` at `p.rate`, collecting the acks (10 s grace for the
/// last); a message refused with `OVERLOADED` is sent again with the same
/// key after [`SEND_RETRY`], as a client does.
async fn drive(sender: &mut Ws, measure: &Measure, p: &Params<'_>) -> Result<Sent, BoxError> {
    let started = Instant::now();
    let interval = Duration::from_secs_f64(1.0 / p.rate.max(0.001));
    let mut sent = Sent { n: 0, acks: vec![], ack_ms: vec![], errors: 0, refusals: vec![] };
    let mut pending: HashMap<u64, String> = HashMap::new();
    // Refused messages to send again: `(when, n)`, in order of when.
    let mut retries: VecDeque<(Instant, usize)> = VecDeque::new();
    let mut next = started;
    let deadline = started + interval.mul_f64(p.messages as f64) + Duration::from_secs(10);
    let frame = |n: usize| {
        let ts = measure.sent_us[n].load(Ordering::Relaxed);
        json!({"id": n + 1, "op": "send", "conv_id": measure.conv, "client_msg_id": format!("f{n}"),
               "body": {"type": "text", "text": format!("fan-out message {n}"), "ts": ts, "n": n}})
    };
    while (sent.n < p.messages || !pending.is_empty()) && Instant::now() < deadline {
        let retry_at = retries.front().map(|r| r.0);
        tokio::select! {
            biased;
            frame = sender.next_text() => {
                let frame = frame.map_err(|e| format!("the sender's connection: {e}"))?;
                let Ok(r) = serde_json::from_str::<AckIn>(&frame) else { continue };
                let Some(id) = r.id.filter(|id| pending.contains_key(id)) else { continue };
                let n = id as usize - 1;
                match (r.seq, r.error) {
                    (Some(seq), _) if r.ok == Some(true) => {
                        let key = pending.remove(&id).unwrap_or_default();
                        let at = measure.sent_us.get(n).map_or(0, |t| t.load(Ordering::Relaxed));
                        sent.ack_ms.push(now_us().saturating_sub(at) as f64 / 1000.0);
                        sent.acks.push((seq, key));
                    }
                    (_, Some(e)) if e.code == "OVERLOADED" => {
                        sent.refusals.push((n, e.code));
                        retries.push_back((Instant::now() + SEND_RETRY, n));
                    }
                    (_, e) => {
                        pending.remove(&id);
                        sent.refusals.push((n, e.map_or_else(|| "no seq".into(), |e| e.code)));
                        sent.errors += 1;
                    }
                }
            },
            () = tokio::time::sleep_until(retry_at.unwrap_or(deadline).into()), if retry_at.is_some() => {
                if let Some((_, n)) = retries.pop_front() {
                    sender.send_text(frame(n).to_string()).await?;
                }
            },
            () = tokio::time::sleep_until(next.into()), if sent.n < p.messages => {
                let n = sent.n;
                measure.sent_us[n].store(now_us(), Ordering::Relaxed);
                sender.send_text(frame(n).to_string()).await?;
                pending.insert(n as u64 + 1, format!("f{n}"));
                sent.n += 1;
                next += interval;
            }
        }
    }
    sent.errors += pending.len() as u64;
    Ok(sent)
}

/// Waits until every device has every message sent, or `SETTLE`.
async fn settle(measure: &Measure, devices: usize, n: usize) {
    let until = Instant::now() + SETTLE;
    while Instant::now() < until && measure.complete_devices(n) < devices {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

struct Outcome {
    sent: Sent,
    connect_s: f64,
    cpu: Value,
    /// Device connections the server had closed by the end of the run.
    closed: u64,
    /// PostgreSQL transactions of the run's database from the first send
    /// until the devices settled (`pg_stat_database`; verification after).
    xacts: i64,
    /// `sync` pages read on PostgreSQL in that window, by where.
    sync_reads: Value,
}

/// Per message, the time until the `devices`-th device had it (messages
/// that never reached every device are left out and counted separately).
fn last_device(
    measure: &Measure,
    got: &[AtomicU32],
    last: &[AtomicU64],
    n: usize,
    devices: usize,
) -> (Percentiles, usize) {
    let ms: Vec<f64> = (0..n)
        .filter(|&i| got[i].load(Ordering::Relaxed) as usize >= devices)
        .map(|i| {
            last[i].load(Ordering::Relaxed).saturating_sub(measure.sent_us[i].load(Ordering::Relaxed)) as f64 / 1000.0
        })
        .collect();
    let complete = ms.len();
    (Percentiles::of(ms), complete)
}

async fn report(
    nodes: &Nodes,
    db: &Store,
    p: &Params<'_>,
    m: usize,
    measure: &Measure,
    o: Outcome,
) -> Result<Value, BoxError> {
    let n = o.sent.n;
    let (latency, complete) = last_device(measure, &measure.got, &measure.last_us, n, m);
    let devices_complete = measure.complete_devices(n);
    let anomalies = measure.anomalies.load(Ordering::Relaxed);
    let first_sent = measure.sent_us.first().map_or(0, |a| a.load(Ordering::Relaxed));
    let last_arrival = measure.last_us.iter().map(|a| a.load(Ordering::Relaxed)).max().unwrap_or(first_sent);
    let deliveries = measure.deliveries.load(Ordering::Relaxed);
    let span_s = (last_arrival.saturating_sub(first_sent) as f64 / 1e6).max(1e-9);
    let (log_ok, detail) = verify(db, &measure.conv, &o.sent.acks).await?;
    let verified =
        log_ok && n == p.messages && o.sent.errors == 0 && devices_complete == m && anomalies == 0 && o.closed == 0;
    let mut run = json!({
        "scenario": "fanout",
        "write_path": "actor",
        "delivery_mode": p.mode,
        "members": m,
        "online_devices": m,
        "rate_per_s": p.rate,
        "messages": n,
        "acked": o.sent.acks.len(),
        "send_errors": o.sent.errors,
        "send_refusals": o.sent.refusals.iter().map(|(n, code)| json!({"message": n, "code": code})).collect::<Vec<_>>(),
        "complete_messages": complete,
        // Devices that got every message once and in order; arrivals that
        // were not a device's next message; devices the server disconnected.
        "devices_complete": devices_complete,
        "device_anomalies": anomalies,
        "devices_closed_by_server": o.closed,
        "last_device_ms": latency.json(),
        "deliveries": deliveries,
        "deliveries_per_s": (deliveries as f64 / span_s).round(),
        "deliveries_per_server_core_s": deliveries_per_server_core_s(deliveries, &o.cpu),
        "connect_s": (o.connect_s * 100.0).round() / 100.0,
        "cpu": o.cpu,
        "server_rss_mb": (nodes.rss_kib() as f64 / 1024.0).round(),
        "pg_xacts": o.xacts,
        "pg_xacts_per_delivery": (o.xacts as f64 / deliveries.max(1) as f64 * 10_000.0).round() / 10_000.0,
        "sync_reads": o.sync_reads,
        "verified": verified,
        "verification": detail,
    });
    if p.ack_ms {
        run["ack_ms"] = Percentiles::of(o.sent.ack_ms).json();
    }
    if measure.pull {
        let (head, head_complete) = last_device(measure, &measure.head_got, &measure.head_last_us, n, m);
        run["head_push_ms"] = head.json();
        run["head_complete_messages"] = json!(head_complete);
        // One sync in flight per device, one more if heads came meanwhile:
        // a burst of heads costs one sync (plus its pages).
        run["pull_syncs"] = json!({"head_pushes": measure.heads.load(Ordering::Relaxed),
                                   "syncs": measure.syncs.load(Ordering::Relaxed),
                                   "syncs_refused_and_retried": measure.syncs_refused.load(Ordering::Relaxed)});
    }
    let pull_syncs = match &run["pull_syncs"] {
        Value::Null => String::new(),
        s => format!(
            "  head pushes {} -> syncs {} (refused and retried {})",
            s["head_pushes"], s["syncs"], s["syncs_refused_and_retried"]
        ),
    };
    eprintln!(
        "fanout {:<4} M={m:<6} {:.0} msg/s x {n}: last device {}  complete {complete}/{n}  devices {devices_complete}/{m}  \
         anomalies {anomalies}  closed {}{pull_syncs}  {:.0} deliveries/s  pg xacts {} ({} per delivery)  cpu {}  \
         verified {verified}",
        p.mode,
        p.rate,
        latency.text(),
        o.closed,
        run["deliveries_per_s"].as_f64().unwrap_or(0.0),
        o.xacts,
        run["pg_xacts_per_delivery"],
        run["cpu"],
    );
    Ok(run)
}
