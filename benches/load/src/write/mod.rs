//! `imcore-load write` (the default): the in-process write-path load generator
//! (hot group, many conversations, the no-checks ceiling, latency at half
//! load), comparing the `actor` and `direct` write paths in one run against a
//! real PostgreSQL with durability on. Verifies P1/P2 on what each scenario
//! wrote and writes `evidence/bench/hot-group.json`; `--scenario split` puts
//! the many-conversations load on several PostgreSQL instances (`split.rs`).
//! Every run is bounded in messages and time; a run that did not verify makes
//! the command fail.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use imcore::config::{LargeGroupSettings, StoreSettings, WritePath};
use imcore::store::{CreateConversation, GroupSettings, Store};
use imcore_actors::{ConvId, UserId};
use serde_json::{json, Value};

use crate::environment::{self, BoxError};
use crate::senders::{
    body, create_users, group, measured, path_name, summary_line, uid, writer, Budget, Load, Run, GROUP_MEMBERS,
};

mod latency;
mod split;

/// What `imcore-load write` measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    /// Hot group, many conversations, half load, the ceiling: `--out`.
    All,
    /// A lone sender's ack latency, C = `--latency-senders`: `--latency-out`.
    Latency,
    /// Many conversations through the commit stage, and the ceiling: printed
    /// only (for a before/after of the merged path).
    Many,
    /// The hot group on the actor path at `--senders`, and the ceiling:
    /// printed only (for a before/after of the hot stream).
    Hot,
    /// Many conversations on one PostgreSQL, split by `conv_id` over
    /// `--shards`, and on one PostgreSQL pinned to one core, alternated
    /// `--rounds` times: `--split-out`.
    Split,
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
    /// `IMCORE_ACTIVITY_RESOLUTION_MS` of the store (0: a roster row write per sender per batch).
    #[arg(long, default_value_t = LargeGroupSettings::default().activity_resolution_ms)]
    activity_resolution_ms: i64,
    #[arg(long, default_value = "evidence/bench/hot-group.json")]
    out: PathBuf,
    #[arg(long, value_enum, default_value_t = Scenario::All)]
    scenario: Scenario,
    /// Concurrent senders of the latency runs (one op in flight each).
    #[arg(long, value_delimiter = ',', default_value = "1,2,8")]
    latency_senders: Vec<usize>,
    #[arg(long, default_value = "evidence/bench/latency.json")]
    latency_out: PathBuf,
    /// PostgreSQL instances the split scenario spreads conversations over.
    #[arg(long, default_value_t = 2)]
    shards: usize,
    /// Rounds of the split scenario (each: one, split, split with 256 senders per shard, one pinned).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    #[arg(long, default_value = "evidence/bench/split.json")]
    split_out: PathBuf,
    /// Members of the `--scenario hot` group: the 64 senders' users, and
    /// silent ones up to this count (a large group).
    #[arg(long, default_value_t = GROUP_MEMBERS)]
    members: usize,
}

impl Args {
    fn budget(&self) -> Budget {
        Budget { messages: self.messages, seconds: self.seconds }
    }
}

pub fn main(args: Args) -> std::process::ExitCode {
    crate::verdict::run_in_process("imcore-load write", run(args))
}

/// `--scenario hot`: each C of `--senders` on the actor path, then the
/// ceiling, each rate printed as a share of it.
async fn hot_only(store: &Store, args: &Args, users: &[UserId], run_id: &str) -> Result<Vec<String>, BoxError> {
    let mut members = users.to_vec();
    for i in members.len()..args.members {
        let silent = uid(&format!("silent-{run_id}-{i}"));
        store.create_user(&silent, None).await?;
        members.push(silent);
    }
    let mut rates = vec![];
    let mut failed = vec![];
    for &senders in &args.senders {
        let conv = group(store, &members, &format!("hot-{run_id}-{senders}"), GroupSettings::default()).await?;
        let r = hot_group(store, WritePath::Actor, users, &conv, senders, args, None).await?;
        eprintln!("{}", summary_line(&r));
        if !r.verified {
            failed.push(format!("{}-{senders}", r.scenario));
        }
        rates.push((senders, r.acked_per_s));
    }
    let ceiling = ceiling(store, args, run_id).await?;
    for (senders, rate) in rates {
        eprintln!(
            "hot-group C={senders}, {} members: {rate:.0} msgs/s, {:.0}% of the ceiling ({ceiling:.0} rows/s)",
            members.len(),
            100.0 * rate / ceiling
        );
    }
    Ok(failed)
}

/// The names of the runs that did not verify.
async fn run(args: Args) -> Result<Vec<String>, BoxError> {
    let large_groups = LargeGroupSettings { activity_resolution_ms: args.activity_resolution_ms, ..Default::default() };
    let settings = StoreSettings { large_groups, ..StoreSettings::pool(args.pool_size) };
    let run_id = format!("{:x}", chrono::Utc::now().timestamp_millis());
    if args.scenario == Scenario::Split {
        return split::run(&args, &settings, &run_id).await;
    }
    let (_pg, store) = environment::database(args.database_url.as_deref(), &args.data_dir, &settings).await?;
    let users = create_users(&store, &format!("load-{run_id}")).await?;
    if args.scenario == Scenario::Latency {
        return latency::run(&store, &args, &users, &run_id).await;
    }
    if args.scenario == Scenario::Many {
        let r = many_conversations(&store, WritePath::Actor, args.commit_workers, &users, &args, &run_id).await?;
        eprintln!("{}", summary_line(&r));
        let ceiling = ceiling(&store, &args, &run_id).await?;
        eprintln!("ceiling: {ceiling:.0} rows/s; many-conversations at {:.0}% of it", 100.0 * r.acked_per_s / ceiling);
        return Ok(if r.verified { vec![] } else { vec![r.scenario.to_owned()] });
    }
    if args.scenario == Scenario::Hot {
        return hot_only(&store, &args, &users, &run_id).await;
    }
    let mut runs = vec![];
    let mut max_actor_rate: f64 = 0.0;
    for &senders in &args.senders {
        for path in [WritePath::Actor, WritePath::Direct] {
            let id = format!("hot-{run_id}-{}-{senders}", path_name(path));
            let conv = group(&store, &users, &id, GroupSettings::default()).await?;
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
    let conv = group(&store, &users, &format!("half-{run_id}"), GroupSettings::default()).await?;
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
) -> Result<Vec<String>, BoxError> {
    let ratios = ratios(runs, &args.senders);
    let runs: Vec<Value> = runs.iter().map(Run::json).collect();
    let half = half.json();
    let failed = crate::verdict::unverified(&[runs.as_slice(), std::slice::from_ref(&half)].concat());
    let doc = json!({
        "machine": environment::machine(store).await?,
        "date": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        "git_rev": environment::git_rev(),
        "durability": environment::durability(store).await?,
        "runs": runs,
        "half_load": half,
        "ceiling_rows_per_s": ceiling,
        "ratios": ratios,
        "actor_over_ceiling": max_actor_rate / ceiling,
        "command": std::env::args().collect::<Vec<_>>().join(" "),
    });
    environment::write_json(&args.out, &doc)?;
    Ok(failed)
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
) -> Result<Run, BoxError> {
    let writer = writer(store, path, args.commit_workers);
    let scenario = if rate.is_some() { "hot-group-half-load" } else { "hot-group" };
    let load = Load { convs: std::slice::from_ref(conv), users, senders, keys: "", budget: args.budget(), rate };
    measured(store, &writer, scenario, path, &load).await
}

async fn many_conversations(
    store: &Store,
    path: WritePath,
    commit_workers: usize,
    users: &[UserId],
    args: &Args,
    run_id: &str,
) -> Result<Run, BoxError> {
    let mut convs = Vec::with_capacity(args.conversations);
    for i in 0..args.conversations {
        let id = ConvId::parse(&format!("many-{run_id}-{}{commit_workers}-{i}", path_name(path)))?;
        convs.push(store.create_conversation(&quiet_group(users, i, id)).await?.info.conv_id);
    }
    let writer = writer(store, path, commit_workers);
    let scenario = if path == WritePath::Actor && commit_workers == 0 {
        "many-conversations-no-commit-stage"
    } else {
        "many-conversations"
    };
    let load = Load { convs: &convs, users, senders: 256, keys: "", budget: args.budget(), rate: None };
    measured(store, &writer, scenario, path, &load).await
}

/// Quiet group `i` of the many-conversations load: users i..i+3 (mod 64), the first its creator.
fn quiet_group(users: &[UserId], i: usize, conv_id: ConvId) -> CreateConversation {
    CreateConversation::Group {
        creator: users[i % users.len()].clone(),
        conv_id: Some(conv_id),
        name: "many".into(),
        members: (1..4).map(|k| users[(i + k) % users.len()].clone()).collect(),
        settings: GroupSettings::default(),
    }
}

/// The same rows with no lock and no checks: 1,000-row INSERT transactions,
/// one after another — one stream, as one hot conversation is.
async fn ceiling(store: &Store, args: &Args, run_id: &str) -> Result<f64, BoxError> {
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
