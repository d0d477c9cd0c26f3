//! `imcore-load peer-xmpp`: the latency scenario against an XMPP server, for
//! the side by side with `imcore-load ws --scenarios latency` (the server set
//! up by benches/peers/ejabberd/run.sh). Per sender count C, accounts u1..uC
//! join room `<prefix><C>`, send with one message in flight each, and a
//! message is acked when the room reflects it to its sender; afterwards the
//! room's rows in the peer's PostgreSQL `archive` table must be exactly the
//! acked messages. Evidence: ws-latency.json's fields where they apply, plus
//! how many transactions wrote the archive rows.

mod sender;
mod stream;

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::percentiles::Percentiles;
use crate::ws::provision::BoxError;
use crate::ws::server::{deliveries_per_server_core_s, proc_cpu_s, proc_status_kib, CpuWindow, Pg, ServerProcs};
use sender::{SenderCfg, SenderOut};
use stream::Xmpp;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The server's XMPP-over-WebSocket endpoint.
    #[arg(long)]
    ws_url: String,
    #[arg(long, default_value = "localhost")]
    domain: String,
    /// The MUC service (default: conference.<domain>).
    #[arg(long)]
    muc_service: Option<String>,
    /// The run with C senders uses room `<prefix><C>`, accounts u1..uC (password p<i>) its members.
    #[arg(long, default_value = "bench")]
    room_prefix: String,
    /// Sender connections of each run (one message in flight each).
    #[arg(long, value_delimiter = ',', default_value = "1,8,64")]
    senders: Vec<usize>,
    /// Longest sending time of a run, seconds.
    #[arg(long, default_value_t = 8.0)]
    seconds: f64,
    /// Most messages of a run.
    #[arg(long, default_value_t = 200_000)]
    messages: u64,
    /// The server's PostgreSQL database, holding its `archive` table.
    #[arg(long, env = "PEER_DATABASE_URL", hide_env_values = true)]
    database_url: String,
    /// The server process, for its CPU and memory.
    #[arg(long)]
    server_pid: Option<i32>,
    /// The postmaster, for PostgreSQL's CPU.
    #[arg(long)]
    postgres_pid: Option<i32>,
    /// What the server is, for the evidence (e.g. `ejabberd 23.01-1`).
    #[arg(long, default_value = "ejabberd")]
    peer: String,
    #[arg(long, default_value = "evidence/bench/peers/ejabberd.json")]
    out: PathBuf,
}

pub fn main(args: Args) -> std::process::ExitCode {
    crate::verdict::run_on_runtime("imcore-load peer-xmpp", run(args))
}

/// The peer's one process (a BEAM node is one OS process).
struct Peer(Option<i32>);

impl ServerProcs for Peer {
    fn node_cpu_s(&self) -> Vec<f64> {
        vec![self.0.map_or(0.0, proc_cpu_s)]
    }

    fn nats_cpu_s(&self) -> Option<f64> {
        None
    }
}

async fn run(a: Args) -> Result<Vec<String>, BoxError> {
    let mut pg = Pg::start(Some(&a.database_url), Path::new(".")).await?;
    pg.postmaster = a.postgres_pid;
    let conn = pg.admin.pool().get().await?;
    let mut durability = json!({});
    for name in ["fsync", "synchronous_commit"] {
        durability[name] = json!(conn.query_one("SELECT current_setting($1)", &[&name]).await?.get::<_, String>(0));
    }
    drop(conn);
    let mut runs = vec![];
    for &c in &a.senders {
        runs.push(run_one(&a, &pg, c).await?);
    }
    let commit_ms = pg.commit_probe(200).await?;
    let doc = json!({
        "machine": crate::ws::machine(&pg).await?,
        "date": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        "git_rev": crate::ws::git_rev(),
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "durability": durability,
        "peer": {"server": a.peer, "client": "XMPP over WebSocket (RFC 7395), SASL PLAIN on loopback",
                 "room": "MUC, persistent, members-only, MAM archive (db_type sql)"},
        "profile": {"commit_ms": (commit_ms * 1000.0).round() / 1000.0},
        "runs": runs,
    });
    crate::environment::write_json(&a.out, &doc).map_err(|e| e.to_string())?;
    Ok(crate::verdict::unverified(&runs))
}

/// One run: C sessions joined to the room, the load, the archive checked.
async fn run_one(a: &Args, pg: &Pg, c: usize) -> Result<Value, BoxError> {
    let service = a.muc_service.clone().unwrap_or_else(|| format!("conference.{}", a.domain));
    let room = format!("{}{c}@{service}", a.room_prefix);
    let mut sessions = Vec::with_capacity(c);
    for i in 1..=c {
        let mut x = Xmpp::login(&a.ws_url, &a.domain, &format!("u{i}"), &format!("p{i}")).await?;
        x.join(&room, &format!("u{i}")).await?;
        sessions.push(x);
    }
    let peer = Peer(a.server_pid);
    let cpu = CpuWindow::start(&peer, pg);
    let start = Instant::now() + Duration::from_millis(50);
    let deadline = start + Duration::from_secs_f64(a.seconds);
    let cfg = Arc::new(SenderCfg {
        room: room.clone(),
        start,
        deadline,
        hard: deadline + Duration::from_secs(15),
        issued: AtomicU64::new(0),
        budget: a.messages,
    });
    let tasks: Vec<_> = sessions
        .into_iter()
        .enumerate()
        .map(|(i, x)| tokio::spawn(sender::run(i, format!("u{}", i + 1), x, cfg.clone())))
        .collect();
    let mut outs = Vec::with_capacity(c);
    for t in tasks {
        let (x, out) = t.await?;
        x.close().await;
        outs.push(out);
    }
    let cpu = cpu.end(&peer, pg);
    let rss_kib = a.server_pid.map_or(0, |p| proc_status_kib(p, "VmRSS:"));
    report(a, pg, &room, Driven { start, outs, cpu, rss_kib }).await
}

struct Driven {
    start: Instant,
    outs: Vec<SenderOut>,
    cpu: Value,
    rss_kib: u64,
}

async fn report(a: &Args, pg: &Pg, room: &str, d: Driven) -> Result<Value, BoxError> {
    let Driven { start, mut outs, cpu, rss_kib } = d;
    let c = outs.len();
    let last_ack = outs.iter().filter_map(|o| o.last_ack).max().unwrap_or(start);
    let elapsed = last_ack.saturating_duration_since(start).as_secs_f64().max(1e-9);
    let acks: Vec<String> = outs.iter_mut().flat_map(|o| std::mem::take(&mut o.acks)).collect();
    let ack_ms = Percentiles::of(outs.iter_mut().flat_map(|o| std::mem::take(&mut o.ack_ms)).collect());
    let mut errors: BTreeMap<String, u64> = BTreeMap::new();
    for (k, v) in outs.iter().flat_map(|o| &o.errors) {
        *errors.entry(k.clone()).or_default() += v;
    }
    let deliveries: u64 = outs.iter().map(|o| o.deliveries).sum();
    let closed = outs.iter().filter(|o| o.closed).count();
    let (archive_ok, verification) = verify(pg, room, &acks).await?;
    let verified = archive_ok && errors.is_empty() && closed == 0;
    let r = |x: f64| x.round();
    let run = json!({
        "scenario": "latency",
        "peer": a.peer,
        "room": room,
        "delivery_mode": "push",
        "senders": c,
        "window": 1,
        "receivers": 0,
        "seconds": a.seconds,
        "message_budget": a.messages,
        "messages": acks.len(),
        "acked_per_s": r(acks.len() as f64 / elapsed),
        "ack_ms": ack_ms.json(),
        "push_deliveries_per_s": r(deliveries as f64 / elapsed),
        "push_deliveries_per_server_core_s": deliveries_per_server_core_s(deliveries, &cpu),
        "sender_deliveries": deliveries,
        "errors": errors,
        "connections_closed_by_server": closed,
        "cpu": cpu,
        "server_rss_mb": (rss_kib as f64 / 1024.0).round(),
        "verified": verified,
        "verification": verification,
    });
    eprintln!(
        "latency    {} C={c:<5} {:>7.0} acked/s  ack {}  {:>8.0} deliveries/s  errors {}  closed {closed}  cpu {}  \
         archive {}  verified {verified}",
        a.peer,
        run["acked_per_s"].as_f64().unwrap_or(0.0),
        ack_ms.text(),
        run["push_deliveries_per_s"].as_f64().unwrap_or(0.0),
        run["errors"],
        run["cpu"],
        run["verification"],
    );
    Ok(run)
}

/// The room's archive rows against the acks: every acked message stored
/// once, nothing else stored. Also how many transactions wrote them (`xmin`):
/// one per row is one commit per message.
async fn verify(pg: &Pg, room: &str, acks: &[String]) -> Result<(bool, Value), BoxError> {
    let conn = pg.admin.pool().get().await?;
    let rows = conn.query("SELECT txt, xmin::text FROM archive WHERE username = $1", &[&room]).await?;
    let keys: Vec<String> = rows
        .iter()
        .map(|r| r.get::<_, Option<String>>(0).and_then(|t| t.split_whitespace().nth(2).map(str::to_owned)))
        .map(Option::unwrap_or_default)
        .collect();
    let stored: HashSet<&str> = keys.iter().map(String::as_str).collect();
    let acked: HashSet<&str> = acks.iter().map(String::as_str).collect();
    let transactions: HashSet<String> = rows.iter().map(|r| r.get(1)).collect();
    let unlike = acked.symmetric_difference(&stored).count();
    let duplicates = keys.len() - stored.len();
    let ok = unlike == 0 && duplicates == 0 && acks.len() == acked.len();
    Ok((
        ok,
        json!({"acks": acks.len(), "stored_msgs": rows.len(), "acks_unlike_rows": unlike,
               "duplicate_keys": duplicates, "archive_transactions": transactions.len()}),
    ))
}
