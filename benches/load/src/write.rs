//! `imcore-load write` (the default): the in-process write-path load generator
//! (hot group, many conversations, the no-checks ceiling, latency at half
//! load), comparing the `actor` and `direct` write paths in one run against a
//! real PostgreSQL with durability on. Verifies P1/P2 on what each scenario
//! wrote and writes `evidence/bench/hot-group.json`. Every run is bounded in
//! messages and time; a run that did not verify makes the command fail.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use imcore::config::{EngineSettings, WritePath, WriteSettings};
use imcore::domain::Body;
use imcore::metrics::{write_phase_totals, WRITE_PHASES};
use imcore::pg::{EmbeddedPg, PgOptions, DATABASE};
use imcore::store::{CreateConversation, GroupSettings, SendOp, Store, WriteOp, Written};
use imcore::writer::{Engine, WriteFailure, Writer};
use imcore_actors::{ClientMsgId, ConvId, DeviceId, UserId};
use serde_json::{json, Value};

use crate::percentiles::Percentiles;

mod latency;

/// What `imcore-load write` measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    /// Hot group, many conversations, half load, the ceiling: `--out`.
    All,
    /// A lone sender's ack latency, C = `--latency-senders`: `--latency-out`.
    Latency,
}

#[derive(Debug, clap::Args)]
pub struct Args {
    /// PostgreSQL to load. Unset: an embedded PostgreSQL in --data-dir.
    #[arg(long, env = "DATABASE_URL")]
    database_url: Option<String>,
    #[arg(long, default_value = "./var/bench")]
    data_dir: PathBuf,
    /// Concurrent senders of the hot-group runs.
    #[arg(long, value_delimiter = ',', default_value = "1,8,64,256")]
    senders: Vec<usize>,
    /// Most messages per run.
    #[arg(long, default_value_t = 60_000)]
    messages: u64,
    /// Longest run, in seconds (the direct path is slow; runs stop at whichever comes first).
    #[arg(long, default_value_t = 8)]
    seconds: u64,
    /// Conversations of the many-conversations scenario.
    #[arg(long, default_value_t = 1000)]
    conversations: usize,
    /// Database connections.
    #[arg(long, default_value_t = 16)]
    pool_size: u32,
    /// Commit-stage workers of the actor path (0: one transaction per conversation batch).
    #[arg(long, default_value_t = 2)]
    commit_workers: usize,
    #[arg(long, default_value = "evidence/bench/hot-group.json")]
    out: PathBuf,
    #[arg(long, value_enum, default_value_t = Scenario::All)]
    scenario: Scenario,
    /// Concurrent senders of the latency runs (one op in flight each).
    #[arg(long, value_delimiter = ',', default_value = "1,2,8")]
    latency_senders: Vec<usize>,
    #[arg(long, default_value = "evidence/bench/latency.json")]
    latency_out: PathBuf,
}

const GROUP_MEMBERS: usize = 64;

pub fn main(args: Args) -> std::process::ExitCode {
    imcore::telemetry::init("warn");
    match actix::System::new().block_on(run(args)) {
        Ok(failed) => crate::verdict::exit_code("imcore-load write", &failed),
        Err(e) => {
            eprintln!("imcore-load: {e:?}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// The names of the runs that did not verify.
async fn run(args: Args) -> Result<Vec<String>, Box<dyn std::error::Error>> {
    let _pg;
    let url = match &args.database_url {
        Some(url) => url.clone(),
        None => {
            let pg = EmbeddedPg::start(PgOptions::new(&args.data_dir)).await?;
            let url = pg.url(DATABASE);
            _pg = pg;
            url
        }
    };
    let store = Store::connect(&url, args.pool_size).await?;
    store.migrate().await?;
    let run_id = format!("{:x}", chrono::Utc::now().timestamp_millis());
    let users: Vec<UserId> = (0..GROUP_MEMBERS).map(|i| uid(&format!("load-{run_id}-u{i}"))).collect();
    for u in &users {
        store.create_user(u, None).await?;
    }
    if args.scenario == Scenario::Latency {
        return latency::run(&store, &args, &users, &run_id).await;
    }
    let mut runs = vec![];
    let mut max_actor_rate: f64 = 0.0;
    for &senders in &args.senders {
        for path in [WritePath::Actor, WritePath::Direct] {
            let conv = group(&store, &users, &format!("hot-{run_id}-{}-{senders}", path_name(path))).await?;
            let r = hot_group(&store, path, &users, &conv, senders, &args, None).await?;
            eprintln!("{}", summary_line(&r));
            if path == WritePath::Actor && senders == *args.senders.iter().max().unwrap_or(&1) {
                max_actor_rate = r.acked_per_s;
            }
            runs.push(r);
        }
    }
    // Many quiet conversations: random senders over `conversations` groups of 4.
    // The actor path with and without the commit stage that merges conversations.
    for (path, workers) in [(WritePath::Actor, args.commit_workers), (WritePath::Actor, 0), (WritePath::Direct, 0)] {
        let r = many_conversations(&store, path, workers, &users, &args, &run_id).await?;
        eprintln!("{}", summary_line(&r));
        runs.push(r);
    }
    // Latency at half the measured maximum (actor path, most senders).
    let top = *args.senders.iter().max().unwrap_or(&1);
    let conv = group(&store, &users, &format!("half-{run_id}")).await?;
    let half = hot_group(&store, WritePath::Actor, &users, &conv, top, &args, Some(max_actor_rate / 2.0)).await?;
    eprintln!("{}", summary_line(&half));
    let ceiling = ceiling(&store, &args, &run_id).await?;
    eprintln!("ceiling (1,000-row INSERT transactions, one stream, no lock, no checks): {ceiling:.0} rows/s");
    write_evidence(&store, &args, &runs, &half, ceiling, max_actor_rate).await
}

/// Actor over direct throughput per hot-group sender count, and for many conversations.
fn ratios(runs: &[Run], senders: &[usize]) -> Vec<Value> {
    let ratio = |scenario: &str, senders: usize| {
        let rate = |p: &str| {
            runs.iter()
                .find(|r| r.scenario == scenario && r.write_path == p && r.senders == senders)
                .map(|r| r.acked_per_s)
        };
        match (rate("actor"), rate("direct")) {
            (Some(a), Some(d)) if d > 0.0 => json!(a / d),
            _ => Value::Null,
        }
    };
    senders
        .iter()
        .map(|&c| json!({"scenario": "hot-group", "senders": c, "actor_over_direct": ratio("hot-group", c)}))
        .chain(std::iter::once(json!({"scenario": "many-conversations", "senders": 256,
            "actor_over_direct": ratio("many-conversations", 256)})))
        .collect()
}

/// Writes `args.out`; returns the runs that did not verify.
async fn write_evidence(
    store: &Store,
    args: &Args,
    runs: &[Run],
    half: &Run,
    ceiling: f64,
    max_actor_rate: f64,
) -> Result<Vec<String>, Box<dyn std::error::Error>> {
    let ratios = ratios(runs, &args.senders);
    let runs: Vec<Value> = runs.iter().map(Run::json).collect();
    let half = half.json();
    let failed = crate::verdict::unverified(&[runs.as_slice(), std::slice::from_ref(&half)].concat());
    let doc = json!({
        "machine": machine(store).await?,
        "date": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        "git_rev": git_rev(),
        "durability": {"fsync": setting(store, "fsync").await?, "synchronous_commit": setting(store, "synchronous_commit").await?},
        "runs": runs,
        "half_load": half,
        "ceiling_rows_per_s": ceiling,
        "ratios": ratios,
        "actor_over_ceiling": max_actor_rate / ceiling,
        "command": std::env::args().collect::<Vec<_>>().join(" "),
    });
    if let Some(dir) = args.out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&args.out, serde_json::to_string_pretty(&doc)? + "\n")?;
    eprintln!("wrote {}", args.out.display());
    Ok(failed)
}

fn uid(s: &str) -> UserId {
    UserId::parse(s).unwrap_or_else(|_| unreachable!("generated ids are valid"))
}

fn path_name(p: WritePath) -> &'static str {
    match p {
        WritePath::Actor => "actor",
        WritePath::Direct => "direct",
    }
}

async fn group(store: &Store, users: &[UserId], id: &str) -> Result<ConvId, Box<dyn std::error::Error>> {
    let created = store
        .create_conversation(&CreateConversation::Group {
            creator: users[0].clone(),
            conv_id: Some(ConvId::parse(id)?),
            name: id.into(),
            members: users[1..].to_vec(),
            settings: GroupSettings { max_member: 10_000, ..GroupSettings::default() },
        })
        .await?;
    Ok(created.info.conv_id)
}

struct Run {
    scenario: &'static str,
    write_path: &'static str,
    senders: usize,
    conversations: usize,
    messages: u64,
    acked_per_s: f64,
    ack_ms: Percentiles,
    batch: (f64, i64),
    failed: u64,
    verified: bool,
    target_rate: Option<f64>,
    /// Mean ms per write transaction, by phase (`None`: no transaction of it).
    phase_ms: Vec<(&'static str, Option<f64>)>,
}

/// Mean ms per transaction and phase between two `write_phase_totals` readings.
fn phase_ms(before: &[(f64, u64)], after: &[(f64, u64)]) -> Vec<(&'static str, Option<f64>)> {
    WRITE_PHASES
        .iter()
        .zip(before.iter().zip(after))
        .map(|(phase, ((s0, n0), (s1, n1)))| {
            let n = n1.saturating_sub(*n0);
            (*phase, (n > 0).then(|| (s1 - s0) * 1000.0 / n as f64))
        })
        .collect()
}

impl Run {
    fn json(&self) -> Value {
        json!({
            "scenario": self.scenario,
            "write_path": self.write_path,
            "senders": self.senders,
            "conversations": self.conversations,
            "messages": self.messages,
            "acked_per_s": self.acked_per_s.round(),
            "ack_ms": self.ack_ms.json(),
            "batch": {"mean": self.batch.0, "max": self.batch.1},
            "failed": self.failed,
            "target_rate": self.target_rate,
            "transaction_phase_ms": self.phase_ms.iter().map(|(p, ms)| (p.to_string(), json!(ms))).collect::<serde_json::Map<_, _>>(),
            "verified": self.verified,
        })
    }
}

fn summary_line(r: &Run) -> String {
    let phases: Vec<String> =
        r.phase_ms.iter().map(|(p, ms)| ms.map_or_else(|| format!("{p} n/a"), |ms| format!("{p} {ms:.2}"))).collect();
    format!(
        "{:<18} {:<6} C={:<4} convs={:<5} msgs={:<6} {:>8.0} acked/s  ack {}  batch mean {:.1} max {}  failed {}  verified {}  txn ms: {}",
        r.scenario, r.write_path, r.senders, r.conversations, r.messages, r.acked_per_s, r.ack_ms.text(),
        r.batch.0, r.batch.1, r.failed, r.verified, phases.join(", ")
    )
}

fn body(n: u64) -> Body {
    let v = json!({"type": "text", "text": format!("load message {n:08} {}", "x".repeat(64))});
    Body::parse(&v, 16 * 1024).unwrap_or_else(|_| unreachable!("small body"))
}

fn writer(store: &Store, path: WritePath, commit_workers: usize) -> Writer {
    let write = WriteSettings { commit_workers, arbiters: 2, ..WriteSettings::on(path) };
    Engine::start(store.clone(), &EngineSettings { write, ..EngineSettings::default() }).writer
}

/// One group, `senders` closed-loop senders (each its own device and key
/// space), or an open loop at `rate` msgs/s when given.
async fn hot_group(
    store: &Store,
    path: WritePath,
    users: &[UserId],
    conv: &ConvId,
    senders: usize,
    args: &Args,
    rate: Option<f64>,
) -> Result<Run, Box<dyn std::error::Error>> {
    let writer = writer(store, path, args.commit_workers);
    let scenario = if rate.is_some() { "hot-group-half-load" } else { "hot-group" };
    measured(store, &writer, scenario, path, std::slice::from_ref(conv), users, senders, args, rate).await
}

/// Drives `convs` through `writer`, then verifies what was written and
/// reads the batch sizes PostgreSQL saw.
#[allow(clippy::too_many_arguments)]
async fn measured(
    store: &Store,
    writer: &Writer,
    scenario: &'static str,
    path: WritePath,
    convs: &[ConvId],
    users: &[UserId],
    senders: usize,
    args: &Args,
    rate: Option<f64>,
) -> Result<Run, Box<dyn std::error::Error>> {
    let phases_before = write_phase_totals();
    let (acks, failed, elapsed) = drive(writer, convs, users, senders, args, rate).await;
    let phase_ms = phase_ms(&phases_before, &write_phase_totals());
    writer.shutdown().await;
    Ok(Run {
        scenario,
        write_path: path_name(path),
        senders,
        conversations: convs.len(),
        messages: acks.len() as u64,
        acked_per_s: acks.len() as f64 / elapsed.as_secs_f64(),
        ack_ms: Percentiles::of(acks.iter().map(|a| a.ms).collect()),
        batch: batch_sizes(store, convs).await?,
        failed,
        verified: verify(store, convs, &acks).await?,
        target_rate: rate,
        phase_ms,
    })
}

async fn many_conversations(
    store: &Store,
    path: WritePath,
    commit_workers: usize,
    users: &[UserId],
    args: &Args,
    run_id: &str,
) -> Result<Run, Box<dyn std::error::Error>> {
    let mut convs = Vec::with_capacity(args.conversations);
    for i in 0..args.conversations {
        let members: Vec<UserId> = (1..4).map(|k| users[(i + k) % users.len()].clone()).collect();
        let created = store
            .create_conversation(&CreateConversation::Group {
                creator: users[i % users.len()].clone(),
                conv_id: Some(ConvId::parse(&format!("many-{run_id}-{}{commit_workers}-{i}", path_name(path)))?),
                name: "many".into(),
                members,
                settings: GroupSettings::default(),
            })
            .await?;
        convs.push(created.info.conv_id);
    }
    let writer = writer(store, path, commit_workers);
    let scenario = if path == WritePath::Actor && commit_workers == 0 {
        "many-conversations-no-commit-stage"
    } else {
        "many-conversations"
    };
    measured(store, &writer, scenario, path, &convs, users, 256, args, None).await
}

struct Ack {
    conv: usize,
    seq: i64,
    key: String,
    ms: f64,
}

/// Runs the senders until `args.messages` are issued or `args.seconds` pass:
/// closed loop (each sender waits for its ack), or open loop at `rate` msgs/s
/// in all (each write its own task, so acks are timed when they arrive).
/// With several conversations a sender picks one at random per message and
/// sends as one of its members (group i holds users i..i+3 mod 64).
async fn drive(
    writer: &Writer,
    convs: &[ConvId],
    users: &[UserId],
    senders: usize,
    args: &Args,
    rate: Option<f64>,
) -> (Vec<Ack>, u64, Duration) {
    type Done = (Result<Written, WriteFailure>, usize, String, Duration);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Done>();
    let issued = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs(args.seconds);
    let started = Instant::now();
    let budget = args.messages;
    for s in 0..senders {
        let (writer, issued, tx) = (writer.clone(), issued.clone(), tx.clone());
        let device = DeviceId::parse(&format!("dev-{s}")).unwrap_or_else(|_| unreachable!("valid"));
        let (convs, users) = (convs.to_vec(), users.to_vec());
        actix::spawn(async move {
            let mut rng = (s as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15).wrapping_add(1);
            let mut interval = rate.map(|r| {
                let mut i = tokio::time::interval(Duration::from_secs_f64(senders as f64 / r.max(1.0)));
                i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
                i
            });
            for n in 0u64.. {
                if let Some(i) = interval.as_mut() {
                    i.tick().await;
                }
                if Instant::now() >= deadline || issued.fetch_add(1, Ordering::Relaxed) >= budget {
                    break;
                }
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let (ci, user) = if convs.len() == 1 {
                    (0, users[s % users.len()].clone())
                } else {
                    let ci = (rng % convs.len() as u64) as usize;
                    (ci, users[(ci + 1 + ((rng >> 32) % 3) as usize) % users.len()].clone())
                };
                let key = format!("s{s}-{n}");
                let op = WriteOp::Send(SendOp {
                    sender: user,
                    device: device.clone(),
                    client_msg_id: ClientMsgId::parse(&key).unwrap_or_else(|_| unreachable!("valid")),
                    body: body(n),
                });
                let t = Instant::now();
                let write = writer.write(convs[ci].clone(), op);
                let tx = tx.clone();
                let done = async move {
                    let result = write.await;
                    let _ = tx.send((result, ci, key, t.elapsed()));
                };
                if interval.is_some() {
                    actix::spawn(done);
                } else {
                    done.await;
                }
            }
        });
    }
    drop(tx);
    let (mut acks, mut failed) = (vec![], 0);
    while let Some((result, conv, key, took)) = rx.recv().await {
        match result {
            Ok(Written::Sent(ack)) => acks.push(Ack { conv, seq: ack.seq, key, ms: took.as_secs_f64() * 1000.0 }),
            _ => failed += 1,
        }
    }
    (acks, failed, started.elapsed())
}

/// P1 (gapless from 1, next_seq = max + 1), P2 (one row per request key), and
/// every ack equals the stored row.
async fn verify(store: &Store, convs: &[ConvId], acks: &[Ack]) -> Result<bool, Box<dyn std::error::Error>> {
    let conn = store.pool().get().await?;
    let ids: Vec<&str> = convs.iter().map(|c| c.as_str()).collect();
    let r = conn
        .query_one(
            "SELECT count(*) FILTER (WHERE NOT ok) FROM (
               SELECT c.conv_id, count(e.seq) = max(e.seq) AND min(e.seq) = 1 AND c.next_seq = max(e.seq) + 1
                      AND count(e.client_msg_id) = count(DISTINCT (e.sender_user, e.client_msg_id))
                          FILTER (WHERE e.client_msg_id IS NOT NULL) AS ok
                 FROM conversations c JOIN events e USING (conv_id)
                WHERE c.conv_id = ANY($1) GROUP BY c.conv_id, c.next_seq) t",
            &[&ids],
        )
        .await?;
    let broken: i64 = r.get(0);
    let (conv_idx, seqs, keys): (Vec<&str>, Vec<i64>, Vec<&str>) =
        acks.iter().fold((vec![], vec![], vec![]), |(mut c, mut s, mut k), a| {
            c.push(ids[a.conv]);
            s.push(a.seq);
            k.push(&a.key);
            (c, s, k)
        });
    let mismatched: i64 = conn
        .query_one(
            "SELECT count(*) FROM unnest($1::text[], $2::int8[], $3::text[]) AS a(conv_id, seq, key)
              WHERE NOT EXISTS (SELECT 1 FROM events e WHERE e.conv_id = a.conv_id AND e.seq = a.seq
                                                        AND e.client_msg_id = a.key)",
            &[&conv_idx, &seqs, &keys],
        )
        .await?
        .get(0);
    let stored: i64 =
        conn.query_one("SELECT count(*) FROM events WHERE conv_id = ANY($1) AND kind = 'msg'", &[&ids]).await?.get(0);
    let ok = broken == 0 && mismatched == 0 && stored == acks.len() as i64;
    if !ok {
        eprintln!(
            "verification failed: {broken} broken logs, {mismatched} acks unlike their rows, {stored} rows for {} acks",
            acks.len()
        );
    }
    Ok(ok)
}

/// Batch sizes as PostgreSQL saw them: rows per inserting transaction (xmin).
async fn batch_sizes(store: &Store, convs: &[ConvId]) -> Result<(f64, i64), Box<dyn std::error::Error>> {
    let conn = store.pool().get().await?;
    let ids: Vec<&str> = convs.iter().map(|c| c.as_str()).collect();
    let r = conn
        .query_one(
            "SELECT coalesce(avg(n)::float8, 0), coalesce(max(n), 0) FROM (
               SELECT count(*) AS n FROM events WHERE conv_id = ANY($1) AND kind = 'msg' GROUP BY xmin::text) t",
            &[&ids],
        )
        .await?;
    Ok((r.get(0), r.get(1)))
}

/// The same rows with no lock and no checks: 1,000-row INSERT transactions,
/// one after another — one stream, as one hot conversation is.
async fn ceiling(store: &Store, args: &Args, run_id: &str) -> Result<f64, Box<dyn std::error::Error>> {
    let conv = format!("ceiling-{run_id}");
    let rows = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs(args.seconds.min(5));
    let started = Instant::now();
    let writers = (0..1).map(|w| {
        let (store, rows, conv) = (store.clone(), rows.clone(), conv.clone());
        async move {
            let mut batch = 0i64;
            while Instant::now() < deadline {
                let conn = store.pool().get().await?;
                let base = (w as i64 * 1_000_000_000) + batch * 1000;
                conn.execute(
                    "INSERT INTO events (conv_id, seq, kind, message_id, sender_user, sender_device, client_msg_id,
                                         request_hash, body, created_at)
                     SELECT $1, $2::int8 + i, 'msg', gen_random_uuid(), 'u', 'd', 'k' || ($2::int8 + i),
                            sha256(($2::int8 + i)::text::bytea), $3, now()
                       FROM generate_series(1, 1000) i",
                    &[&conv, &base, &body(0).text()],
                )
                .await?;
                rows.fetch_add(1000, Ordering::Relaxed);
                batch += 1;
            }
            Ok::<_, imcore::store::StoreError>(())
        }
    });
    for r in join_all(writers).await {
        r?;
    }
    Ok(rows.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64())
}

async fn machine(store: &Store) -> Result<Value, Box<dyn std::error::Error>> {
    let conn = store.pool().get().await?;
    let pg: String = conn.query_one("SHOW server_version", &[]).await?.get(0);
    let os = std::fs::read_to_string("/etc/os-release")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("PRETTY_NAME=").map(|v| v.trim_matches('"').to_owned())))
        .unwrap_or_else(|| std::env::consts::OS.to_owned());
    Ok(json!({
        "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "os": os,
        "postgres": pg,
    }))
}

async fn setting(store: &Store, name: &str) -> Result<String, Box<dyn std::error::Error>> {
    let conn = store.pool().get().await?;
    Ok(conn.query_one("SELECT current_setting($1)", &[&name]).await?.get(0))
}

fn git_rev() -> String {
    std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|| "unknown".into())
}
