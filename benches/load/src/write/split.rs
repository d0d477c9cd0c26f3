//! `imcore-load write --scenario split`: the many-conversations load (C=256
//! over `--conversations`) on one PostgreSQL, against the same load with the
//! storage split by `conv_id` over `--shards` embedded PostgreSQL instances
//! (a Store and Writer each; users on every shard, as Citus reference tables
//! are; 256 senders in all, then 256 per shard), and against the one
//! PostgreSQL pinned to one core; alternated `--rounds` times. Per run: acked
//! msgs/s, ack latency, PostgreSQL CPU per message from /proc, WAL fsyncs per
//! second; every run verified on each of its shards. Writes `--split-out`.
//! Why: STORAGE_PLAN "How it scales, measured".

use std::time::Duration;

use futures_util::future::join_all;
use imcore::config::{StoreSettings, WritePath};
use imcore::store::Store;
use imcore_actors::{ConvId, UserId};
use serde_json::{json, Value};

use super::{quiet_group, Args};
use crate::environment::{self, BoxError};
use crate::senders::{create_users, measured_on, summary_line, writer, Load, Run, Shard};
use crate::ws::server::self_cpu_s;

mod procs;

use procs::{cpu_ticks, pin, postgres_cpu_s};

/// How a run's storage is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Setup {
    /// Every conversation on the first PostgreSQL, its processes on any core.
    One,
    /// Conversations on `--shards` PostgreSQL instances by a hash of `conv_id`.
    Split,
    /// As `Split`, with 256 senders per shard: each shard offered the load `One` is.
    SplitScaled,
    /// As `One`, the PostgreSQL's processes pinned to one core (the app is not).
    OnePinned,
}

impl Setup {
    const ALL: [Setup; 4] = [Setup::One, Setup::Split, Setup::SplitScaled, Setup::OnePinned];

    fn name(self) -> &'static str {
        match self {
            Setup::One => "one",
            Setup::Split => "split",
            Setup::SplitScaled => "split-scaled",
            Setup::OnePinned => "one-pinned",
        }
    }
}

/// An embedded PostgreSQL of the run, migrated, holding the run's users.
struct Instance {
    _pg: Option<imcore::pg::EmbeddedPg>,
    postmaster: i32,
    store: Store,
}

/// The shard of `conv` among `shards`: FNV-1a of its id, stable across runs
/// and processes (what a hash-distributed table does with its own hash).
fn shard_of(conv: &ConvId, shards: usize) -> usize {
    let h =
        conv.as_str().bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    (h % shards.max(1) as u64) as usize
}

/// The runs that did not verify.
pub(super) async fn run(args: &Args, settings: &StoreSettings, run_id: &str) -> Result<Vec<String>, BoxError> {
    if args.database_url.is_some() {
        return Err(
            "--scenario split starts its own PostgreSQL instances (for /proc CPU and pinning): unset DATABASE_URL"
                .into(),
        );
    }
    let shards = args.shards.max(1);
    let mut instances = Vec::with_capacity(shards);
    for k in 0..shards {
        let dir = args.data_dir.join(format!("split-{k}"));
        let (pg, store) = environment::database(None, &dir, settings).await?;
        let postmaster = std::fs::read_to_string(dir.join("pg/postmaster.pid"))
            .ok()
            .and_then(|s| s.lines().next().and_then(|l| l.trim().parse().ok()))
            .ok_or("no postmaster.pid in the embedded cluster")?;
        instances.push(Instance { _pg: pg, postmaster, store });
    }
    // The same accounts on every shard (a reference table's copy per node).
    let mut users = vec![];
    for i in &instances {
        users = create_users(&i.store, &format!("split-{run_id}")).await?;
    }
    let mut runs = vec![];
    for round in 0..args.rounds.max(1) {
        for setup in Setup::ALL {
            let split = matches!(setup, Setup::Split | Setup::SplitScaled);
            let used = if split { &instances[..] } else { &instances[..1] };
            let r = one_run(used, setup, &users, args, &format!("{run_id}-{round}")).await?;
            runs.push(with_round(r, round));
        }
    }
    let failed = crate::verdict::unverified(&runs);
    let store = &instances[0].store;
    let doc = json!({
        "machine": environment::machine(store).await?,
        "date": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        "git_rev": environment::git_rev(),
        "durability": environment::durability(store).await?,
        "shards": shards,
        "rounds": args.rounds.max(1),
        "postgres_cpu": "utime+stime from /proc of each postmaster and its children over the senders' run \
                         (reaped children through the postmaster's cutime+cstime): statements, commits, WAL \
                         writes and flushes, walwriter, checkpointer, autovacuum",
        "wal_syncs": "pg_stat_wal.wal_sync over the run, summed over the run's PostgreSQL instances",
        "runs": runs,
        "summary": summary(&runs),
        "command": std::env::args().collect::<Vec<_>>().join(" "),
    });
    environment::write_json(&args.split_out, &doc)?;
    Ok(failed)
}

fn with_round(mut run: Value, round: usize) -> Value {
    run["round"] = json!(round);
    run
}

/// CPU readings at one moment: PostgreSQL's, this process's, the machine's.
#[derive(Clone, Copy, Default)]
struct Mark {
    postgres_s: f64,
    generator_s: f64,
    busy_ticks: u64,
    all_ticks: u64,
}

impl Mark {
    fn now(instances: &[Instance]) -> Self {
        let (busy_ticks, all_ticks) = cpu_ticks();
        Self {
            postgres_s: instances.iter().map(|i| postgres_cpu_s(i.postmaster)).sum(),
            generator_s: self_cpu_s(),
            busy_ticks,
            all_ticks,
        }
    }
}

/// One run of `setup` on `used` (the first instance alone unless split).
async fn one_run(used: &[Instance], setup: Setup, users: &[UserId], args: &Args, tag: &str) -> Result<Value, BoxError> {
    let mut convs = Vec::with_capacity(args.conversations);
    let mut placed = Vec::with_capacity(args.conversations);
    for i in 0..args.conversations {
        let id = ConvId::parse(&format!("split-{tag}-{}-{i}", setup.name()))?;
        let k = shard_of(&id, used.len());
        convs.push(used[k].store.create_conversation(&quiet_group(users, i, id)).await?.info.conv_id);
        placed.push(k);
    }
    if setup == Setup::OnePinned {
        pin(used[0].postmaster, true)?;
    }
    let writers: Vec<_> = used.iter().map(|i| writer(&i.store, WritePath::Actor, args.commit_workers)).collect();
    let shards: Vec<Shard> = used.iter().zip(&writers).map(|(i, w)| Shard { store: &i.store, writer: w }).collect();
    let wal_before = wal(used, args.pool_size).await?;
    let senders = if setup == Setup::SplitScaled { 256 * used.len() } else { 256 };
    let load = Load { convs: &convs, users, senders, keys: "", budget: args.budget(), rate: None };
    let mut marks = vec![];
    let measured =
        measured_on(&shards, &placed, "many-conversations", WritePath::Actor, &load, || marks.push(Mark::now(used)))
            .await;
    if setup == Setup::OnePinned {
        pin(used[0].postmaster, false)?;
    }
    let run = measured?;
    let wal_after = wal(used, args.pool_size).await?;
    let (a, b) = (marks.first().copied().unwrap_or_default(), marks.last().copied().unwrap_or_default());
    Ok(figures(&run, setup, used.len(), &placed, (a, b), (wal_before, wal_after)))
}

/// The run's evidence: [`Run::json`] and what it cost PostgreSQL and the machine.
fn figures(run: &Run, setup: Setup, shards: usize, placed: &[usize], (a, b): (Mark, Mark), wal: (Wal, Wal)) -> Value {
    let msgs = run.messages.max(1) as f64;
    let seconds = if run.acked_per_s > 0.0 { run.messages as f64 / run.acked_per_s } else { 0.0 };
    let per_s = |x: f64| if seconds > 0.0 { x / seconds } else { 0.0 };
    let postgres_s = b.postgres_s - a.postgres_s;
    let generator_s = b.generator_s - a.generator_s;
    let busy = (b.busy_ticks - a.busy_ticks) as f64 / (b.all_ticks - a.all_ticks).max(1) as f64;
    let syncs = (wal.1.syncs - wal.0.syncs) as f64;
    let per_shard: Vec<usize> = (0..shards).map(|k| placed.iter().filter(|&&p| p == k).count()).collect();
    let mut v = run.json();
    v["setup"] = json!(setup.name());
    v["shards"] = json!(shards);
    v["conversations_per_shard"] = json!(per_shard);
    v["seconds"] = json!(seconds);
    v["postgres_cpu_us_per_msg"] = json!(postgres_s * 1e6 / msgs);
    v["postgres_cores"] = json!(per_s(postgres_s));
    v["generator_cpu_us_per_msg"] = json!(generator_s * 1e6 / msgs);
    v["generator_cores"] = json!(per_s(generator_s));
    v["machine_busy_share"] = json!(busy);
    // Busy cores this run's processes do not account for: other work on the machine.
    v["other_cores"] = json!(busy * cores() - per_s(postgres_s) - per_s(generator_s));
    v["wal_syncs_per_s"] = json!(per_s(syncs));
    v["msgs_per_wal_sync"] = json!(if syncs > 0.0 { msgs / syncs } else { 0.0 });
    v["wal_records_per_msg"] = json!((wal.1.records - wal.0.records) as f64 / msgs);
    v["wal_bytes_per_msg"] = json!((wal.1.bytes - wal.0.bytes) / msgs);
    eprintln!("{:<10} {}", setup.name(), summary_line(run));
    eprintln!(
        "{:<10} postgres {:.1} µs/msg ({:.2} cores), generator {:.1} µs/msg ({:.2} cores), machine busy {:.0}%, \
         other work {:.2} cores, {:.0} WAL fsyncs/s ({:.1} msgs each), {:.2} WAL records/msg",
        "",
        postgres_s * 1e6 / msgs,
        per_s(postgres_s),
        generator_s * 1e6 / msgs,
        per_s(generator_s),
        busy * 100.0,
        busy * cores() - per_s(postgres_s) - per_s(generator_s),
        per_s(syncs),
        if syncs > 0.0 { msgs / syncs } else { 0.0 },
        (wal.1.records - wal.0.records) as f64 / msgs
    );
    v
}

fn cores() -> f64 {
    std::thread::available_parallelism().map_or(1.0, |n| n.get() as f64)
}

/// `pg_stat_wal` summed over instances.
#[derive(Clone, Copy, Default)]
struct Wal {
    syncs: i64,
    records: i64,
    bytes: f64,
}

/// `pg_stat_wal` of `used`, once each backend has reported: a backend
/// flushes its WAL counters at most once a second, when it goes idle, so
/// wait past that and run a statement on every pooled connection first.
async fn wal(used: &[Instance], pool_size: u32) -> Result<Wal, BoxError> {
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let mut sum = Wal::default();
    for i in used {
        let conns: Vec<_> = join_all((0..pool_size).map(|_| i.store.pool().get())).await;
        for c in conns.iter().flatten() {
            c.simple_query("SELECT 1").await?;
        }
        drop(conns);
        let conn = i.store.pool().get().await?;
        let r = conn.query_one("SELECT wal_sync, wal_records, wal_bytes::float8 FROM pg_stat_wal", &[]).await?;
        sum.syncs += r.get::<_, i64>(0);
        sum.records += r.get::<_, i64>(1);
        sum.bytes += r.get::<_, f64>(2);
    }
    Ok(sum)
}

/// Medians per setup, and split / one and pinned / one within each round.
fn summary(runs: &[Value]) -> Value {
    let field = |setup: &str, key: &str| -> Vec<f64> {
        runs.iter().filter(|r| r["setup"] == setup).filter_map(|r| r[key].as_f64()).collect()
    };
    let median = |mut v: Vec<f64>| -> Value {
        v.sort_by(f64::total_cmp);
        if v.is_empty() {
            Value::Null
        } else {
            json!(v[v.len() / 2])
        }
    };
    let ratio = |setup: &str| -> Vec<f64> {
        field(setup, "acked_per_s").iter().zip(field("one", "acked_per_s")).map(|(x, one)| x / one.max(1.0)).collect()
    };
    let keys = [
        "acked_per_s",
        "postgres_cpu_us_per_msg",
        "postgres_cores",
        "generator_cpu_us_per_msg",
        "wal_syncs_per_s",
        "other_cores",
    ];
    let setups = Setup::ALL.map(Setup::name);
    let medians: serde_json::Map<String, Value> = setups
        .iter()
        .map(|s| (s.to_string(), keys.iter().map(|k| (k.to_string(), median(field(s, k)))).collect()))
        .collect();
    json!({
        "medians": medians,
        "split_over_one": ratio("split"),
        "split_scaled_over_one": ratio("split-scaled"),
        "pinned_over_one": ratio("one-pinned"),
    })
}

#[cfg(test)]
mod tests {
    use super::{shard_of, ConvId};

    #[test]
    fn a_conversation_keeps_its_shard_and_shards_share_the_load() {
        let ids: Vec<ConvId> = (0..1000).map(|i| ConvId::parse(&format!("split-x-{i}")).expect("valid")).collect();
        assert!(ids.iter().all(|c| shard_of(c, 2) == shard_of(c, 2)));
        let first = ids.iter().filter(|c| shard_of(c, 2) == 0).count();
        assert!((400..=600).contains(&first), "{first} of 1000 on shard 0");
    }
}
