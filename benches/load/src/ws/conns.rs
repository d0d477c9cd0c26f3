//! Issue 5 §3: connection scale. `N` idle authenticated connections (devices
//! share users: device i belongs to user i mod U), opened in stages; per
//! stage the connect rate, the server's RSS per connection, and one message
//! to a group of every user. A stage verifies when every connection opened,
//! the message was acked, and every online device got it exactly once on a
//! connection the server kept open.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::{stream, StreamExt};
use imcore_client::Ws;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::task::JoinSet;

use super::provision::{self, now_us, BoxError};
use super::server::{CpuWindow, Pg, Server};

const CONV: &str = "conns-all";
/// How long the stage's message may take to reach every device.
const REACH: Duration = Duration::from_secs(60);

pub struct Params {
    pub stages: Vec<usize>,
    pub devices_per_user: usize,
    pub source_addrs: usize,
    pub concurrency: usize,
}

/// What the idle devices record: per device, how often the current stage's
/// message arrived.
struct Arrivals {
    /// The message of the current stage (its body's `n`).
    message: AtomicU64,
    per_device: Vec<AtomicU32>,
    total: AtomicU64,
    last_us: AtomicU64,
    /// Idle connections the server ended.
    closed: AtomicU64,
}

struct Fleet {
    users: usize,
    tokens: Vec<String>,
    sender: Ws,
    arrivals: Arc<Arrivals>,
    tasks: JoinSet<()>,
    /// Indices of the devices online.
    online: Vec<usize>,
    /// Devices whose connection could not be opened, all stages.
    failed: usize,
    base_kib: u64,
    nofile: u64,
}

pub async fn run(server: &Server, pg: &Pg, p: &Params) -> Result<Vec<Value>, BoxError> {
    // The server and this process each hold one descriptor per connection:
    // stages past the open-file limit (which children inherit) are clamped.
    let nofile = super::server::raise_nofile(1 << 20);
    let cap = (nofile as usize).saturating_sub(400);
    let stages: Vec<usize> = p.stages.iter().map(|&n| n.min(cap)).collect();
    let mut fleet = setup(server, p, stages.iter().copied().max().unwrap_or(0), nofile).await?;
    let mut runs = vec![];
    for (stage, (&n, &requested)) in stages.iter().zip(&p.stages).enumerate() {
        if n <= fleet.tried() {
            continue;
        }
        let opened = fleet.open_up_to(server, pg, p, n).await;
        let reach = fleet.message_everyone(stage as u64 + 1).await?;
        runs.push(report(server, p, &fleet, requested, n, opened, reach));
    }
    fleet.sender.close().await;
    fleet.tasks.abort_all();
    while fleet.tasks.join_next().await.is_some() {}
    Ok(runs)
}

/// Users, `max_n` device tokens and a sender device; the group of every user.
async fn setup(server: &Server, p: &Params, max_n: usize, nofile: u64) -> Result<Fleet, BoxError> {
    let users_n = max_n.div_ceil(p.devices_per_user.max(1)).clamp(1, 1000);
    let users: Vec<String> = (0..users_n).map(|i| format!("cu{i}")).collect();
    let t = Instant::now();
    provision::create_users(server.port, &server.admin, users.clone()).await?;
    let mut devices: Vec<(String, String)> =
        (0..max_n).map(|i| (users[i % users_n].clone(), format!("d{}", i / users_n))).collect();
    devices.push((users[0].clone(), "sender".to_owned()));
    let mut tokens = provision::issue_tokens(server.port, &server.admin, devices).await?;
    eprintln!("connections: {users_n} users, {max_n} device tokens issued in {:.1} s", t.elapsed().as_secs_f64());
    let sender_token = tokens.pop().ok_or("no sender token")?;
    provision::create_group(
        server.port,
        &sender_token,
        json!({"kind": "group", "conv_id": CONV, "name": CONV, "members": users[1..], "max_member": users_n + 1}),
    )
    .await?;
    let sender = provision::connect_retry(server.port, provision::source_addr(0, 1), &sender_token).await?;
    // Let the creation settle before the baseline reading.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let arrivals = Arc::new(Arrivals {
        message: AtomicU64::new(0),
        per_device: (0..max_n).map(|_| AtomicU32::new(0)).collect(),
        total: AtomicU64::new(0),
        last_us: AtomicU64::new(0),
        closed: AtomicU64::new(0),
    });
    Ok(Fleet {
        users: users_n,
        tokens,
        sender,
        arrivals,
        tasks: JoinSet::new(),
        online: vec![],
        failed: 0,
        base_kib: server.rss_kib(),
        nofile,
    })
}

/// How opening a stage's connections went.
struct Opened {
    opened: usize,
    failed: usize,
    first_error: Option<String>,
    connect_s: f64,
    cpu: Value,
    rss_kib: u64,
}

/// How the stage's message went.
struct Reach {
    acked: bool,
    /// Online devices that got it exactly once, not at all, more than once.
    exactly_once: usize,
    missing: usize,
    repeated: usize,
    last_ms: f64,
}

impl Fleet {
    /// Opens connections until devices `0..n` were tried.
    async fn open_up_to(&mut self, server: &Server, pg: &Pg, p: &Params, n: usize) -> Opened {
        let cpu = CpuWindow::start(server, pg);
        let t = Instant::now();
        let (port, addrs, from) = (server.port, p.source_addrs, self.tried());
        let mut opening = stream::iter(self.tokens[from..n].iter().enumerate().map(|(i, t)| (from + i, t)))
            .map(|(i, t)| async move { (i, provision::connect_retry(port, provision::source_addr(i, addrs), t).await) })
            .buffer_unordered(p.concurrency);
        let (mut opened, mut failed, mut first_error) = (0, 0, None);
        while let Some((i, r)) = opening.next().await {
            match r {
                Ok(ws) => {
                    self.tasks.spawn(idle(ws, i, self.arrivals.clone()));
                    self.online.push(i);
                    opened += 1;
                }
                Err(e) => {
                    failed += 1;
                    first_error.get_or_insert_with(|| e.to_string());
                }
            }
        }
        drop(opening);
        self.failed += failed;
        let (connect_s, cpu) = (t.elapsed().as_secs_f64(), cpu.end(server, pg));
        // Let the server's allocations settle before reading its RSS.
        tokio::time::sleep(Duration::from_secs(2)).await;
        Opened { opened, failed, first_error, connect_s, cpu, rss_kib: server.rss_kib() }
    }

    /// Devices tried so far (online or failed).
    fn tried(&self) -> usize {
        self.online.len() + self.failed
    }

    /// Sends message `n` to the group and waits until every online device
    /// has it (at most `REACH`), then checks each device.
    async fn message_everyone(&mut self, n: u64) -> Result<Reach, BoxError> {
        let a = &self.arrivals;
        a.message.store(n, Ordering::Relaxed);
        a.total.store(0, Ordering::Relaxed);
        a.last_us.store(0, Ordering::Relaxed);
        for c in &a.per_device {
            c.store(0, Ordering::Relaxed);
        }
        let sent_us = now_us();
        let fields = json!({"conv_id": CONV, "client_msg_id": format!("m{n}"),
                            "body": {"type": "text", "text": "hello, everyone", "ts": sent_us, "n": n}});
        let id = self.sender.start("send", fields).await?;
        let acked = match tokio::time::timeout(REACH, self.sender.reply(id)).await {
            Ok(reply) => reply?["ok"] == true,
            Err(_) => false,
        };
        let until = Instant::now() + REACH;
        while Instant::now() < until && a.total.load(Ordering::Relaxed) < self.online.len() as u64 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let count = |i: &usize| a.per_device[*i].load(Ordering::Relaxed);
        Ok(Reach {
            acked,
            exactly_once: self.online.iter().filter(|i| count(i) == 1).count(),
            missing: self.online.iter().filter(|i| count(i) == 0).count(),
            repeated: self.online.iter().filter(|i| count(i) > 1).count(),
            last_ms: a.last_us.load(Ordering::Relaxed).saturating_sub(sent_us) as f64 / 1000.0,
        })
    }
}

fn report(server: &Server, p: &Params, fleet: &Fleet, requested: usize, n: usize, o: Opened, r: Reach) -> Value {
    let online = fleet.online.len();
    let closed = fleet.arrivals.closed.load(Ordering::Relaxed);
    let per_conn_kib = o.rss_kib.saturating_sub(fleet.base_kib) as f64 / online.max(1) as f64;
    let verified = r.acked && o.failed == 0 && r.exactly_once == online && closed == 0;
    let run = json!({
        "scenario": "connections",
        "write_path": "actor",
        "connections": online,
        "requested": requested,
        "limited_by": (n < requested).then(|| format!("RLIMIT_NOFILE {} (hard limit; raising it needs CAP_SYS_RESOURCE)", fleet.nofile)),
        "failed": o.failed,
        "first_error": o.first_error,
        "users": fleet.users,
        "source_addrs": p.source_addrs,
        "connect_concurrency": p.concurrency,
        "connect_s": (o.connect_s * 100.0).round() / 100.0,
        "connects_per_s": (o.opened as f64 / o.connect_s.max(1e-9)).round(),
        "connect_cpu": o.cpu,
        "server_rss_mb": (o.rss_kib as f64 / 1024.0).round(),
        "server_rss_base_mb": (fleet.base_kib as f64 / 1024.0).round(),
        "server_rss_per_connection_kib": (per_conn_kib * 10.0).round() / 10.0,
        "server_vmhwm_mb": (server.hwm_kib() as f64 / 1024.0).round(),
        "message_acked": r.acked,
        "devices_reached_once": r.exactly_once,
        "devices_missed": r.missing,
        "devices_reached_repeatedly": r.repeated,
        "connections_closed_by_server": closed,
        "message_last_device_ms": (r.last_ms * 10.0).round() / 10.0,
        "verified": verified,
    });
    eprintln!(
        "connections N={online:<7} ({} failed) {:.0} connects/s  server RSS {} MB, {per_conn_kib:.1} KiB/conn  \
         message reached {}/{online} once ({} missed, {} repeated, {closed} closed) in {:.0} ms  verified {verified}",
        o.failed,
        run["connects_per_s"].as_f64().unwrap_or(0.0),
        run["server_rss_mb"],
        r.exactly_once,
        r.missing,
        r.repeated,
        r.last_ms,
    );
    run
}

#[derive(Deserialize)]
struct PushIn {
    push: Option<String>,
    conv_id: Option<String>,
    event: Option<EventIn>,
}

#[derive(Deserialize)]
struct EventIn {
    body: Option<BodyIn>,
}

#[derive(Deserialize)]
struct BodyIn {
    n: Option<u64>,
}

/// Idle device `index`: reads (answering the server's pings) and records the
/// arrivals of the current stage's message.
async fn idle(mut ws: Ws, index: usize, a: Arc<Arrivals>) {
    loop {
        let Ok(text) = ws.next_text().await else {
            a.closed.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let Ok(push) = serde_json::from_str::<PushIn>(&text) else { continue };
        let n = push.event.and_then(|e| e.body).and_then(|b| b.n);
        if push.push.as_deref() == Some("event")
            && push.conv_id.as_deref() == Some(CONV)
            && n == Some(a.message.load(Ordering::Relaxed))
        {
            if let Some(c) = a.per_device.get(index) {
                c.fetch_add(1, Ordering::Relaxed);
            }
            a.total.fetch_add(1, Ordering::Relaxed);
            a.last_us.fetch_max(now_us(), Ordering::Relaxed);
        }
    }
}
