//! `imcore-load retention`: what retention (P9) costs, in process against a
//! real PostgreSQL with durability on, in one run:
//! 1. purge rate: a conversation of a million old sends purged chunk by
//!    chunk (events/s, tombstones/s, per-chunk transaction time);
//! 2. a hot group while a purge runs — of another conversation, and of its
//!    own old events (each chunk moves its `min_seq` under the row lock) —
//!    against the same hot group with no purge;
//! 3. the send path where the tombstone probe runs (`min_seq > 1`) with a
//!    million tombstones against the same conversation shape without any.
//!
//! Writes `evidence/bench/retention.json`; every purge and run is checked
//! afterwards, and one that did not verify makes the command fail.

mod evidence;
mod fill;
mod purge;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use imcore::config::{RetentionSettings, StoreSettings, WritePath};
use imcore::store::{GroupSettings, Pace, Store};
use imcore_actors::{ConvId, UserId};
use serde_json::{json, Value};

use crate::environment::{self, BoxError};
use crate::senders::{create_users, group, measured, summary_line, writer, Budget, Load, Run};
use fill::Filled;
use purge::Purged;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// PostgreSQL to load. Unset: an embedded PostgreSQL in --data-dir.
    #[arg(long, env = "DATABASE_URL")]
    database_url: Option<String>,
    #[arg(long, default_value = "./var/bench-retention")]
    data_dir: PathBuf,
    /// Old sends in each conversation that is purged.
    #[arg(long, default_value_t = 1_000_000)]
    events: i64,
    /// Chunk sizes of the purge-rate runs, each on its own conversation of
    /// --events (the first also paces the purges under load).
    #[arg(long, value_delimiter = ',', default_values_t = [RetentionSettings::default().chunk, 10_000])]
    chunks: Vec<i64>,
    /// Percent of the time a purge works (`IMCORE_RETENTION_DUTY_PCT`).
    #[arg(long, default_value_t = RetentionSettings::default().duty_pct)]
    duty_pct: u32,
    /// Tombstones of the conversation whose sends probe them.
    #[arg(long, default_value_t = 1_000_000)]
    tombstones: i64,
    /// Concurrent senders of the hot-group runs.
    #[arg(long, default_value_t = 256)]
    senders: usize,
    /// Senders of the tombstone runs' latency comparison.
    #[arg(long, default_value_t = 1)]
    latency_senders: usize,
    /// Most messages per hot-group run.
    #[arg(long, default_value_t = 200_000)]
    messages: u64,
    /// Length of each hot-group run, in seconds.
    #[arg(long, default_value_t = 5)]
    seconds: u64,
    /// Database connections.
    #[arg(long, default_value_t = 16)]
    pool_size: u32,
    /// Commit-stage workers of the actor path.
    #[arg(long, default_value_t = 2)]
    commit_workers: usize,
    #[arg(long, default_value = "evidence/bench/retention.json")]
    out: PathBuf,
}

/// The least share of its no-purge throughput a hot group keeps during a purge.
const GOAL_RATIO: f64 = 0.8;

pub fn main(args: Args) -> std::process::ExitCode {
    crate::verdict::run_in_process("imcore-load retention", run(args))
}

/// Shared by every part of one run.
struct Bench<'a> {
    args: &'a Args,
    store: Store,
    users: Vec<UserId>,
    run_id: String,
}

/// The names of the runs that did not verify.
async fn run(args: Args) -> Result<Vec<String>, BoxError> {
    let started = Instant::now();
    let (_pg, store) =
        environment::database(args.database_url.as_deref(), &args.data_dir, &StoreSettings::pool(args.pool_size))
            .await?;
    let run_id = format!("{:x}", chrono::Utc::now().timestamp_millis());
    let users = create_users(&store, &format!("ret-{run_id}")).await?;
    let bench = Bench { args: &args, store, users, run_id };
    bench.warm_up().await?;
    // The tombstone runs first: `idem_tombstones` then holds only theirs
    // (on a fresh --data-dir), not also those of the purges below.
    let lookup = bench.tombstone_lookup().await?;
    let rates = bench.purge_rates().await?;
    let under_load = bench.hot_during_purge().await?;
    let seconds = started.elapsed().as_secs_f64();
    eprintln!("retention benchmark: {seconds:.0} s");
    bench.write_evidence(lookup, rates, under_load, seconds).await
}

impl Bench<'_> {
    /// The first chunk size at the run's duty: the pace of every purge but the rate runs'.
    fn pace(&self) -> Pace {
        self.pace_of(self.args.chunks.first().copied().unwrap_or(RetentionSettings::default().chunk))
    }

    fn pace_of(&self, chunk: i64) -> Pace {
        Pace { chunk, duty_pct: self.args.duty_pct }
    }

    fn id(&self, name: &str) -> String {
        format!("ret-{}-{name}", self.run_id)
    }

    /// One hot-group run on `conv` (the actor path), `keys` apart from the
    /// conversation's other runs.
    async fn hot(
        &self,
        scenario: &'static str,
        conv: &ConvId,
        senders: usize,
        keys: &'static str,
    ) -> Result<Run, BoxError> {
        self.hot_for(self.args.seconds, scenario, conv, senders, keys).await
    }

    async fn hot_for(
        &self,
        seconds: u64,
        scenario: &'static str,
        conv: &ConvId,
        senders: usize,
        keys: &'static str,
    ) -> Result<Run, BoxError> {
        let writer = writer(&self.store, WritePath::Actor, self.args.commit_workers);
        let budget = Budget { messages: self.args.messages, seconds };
        let load = Load { convs: std::slice::from_ref(conv), users: &self.users, senders, keys, budget, rate: None };
        let run = measured(&self.store, &writer, scenario, WritePath::Actor, &load).await?;
        eprintln!("{}", summary_line(&run));
        Ok(run)
    }

    /// A short hot-group run, not recorded: the first run after PostgreSQL
    /// starts is slower (cold caches, connections), and would flatter
    /// whatever is compared with it.
    async fn warm_up(&self) -> Result<(), BoxError> {
        let conv = group(&self.store, &self.users, &self.id("warm-up"), GroupSettings::default()).await?;
        self.hot_for(3, "warm-up", &conv, self.args.senders, "").await?;
        Ok(())
    }

    /// Part 1: each chunk size purges its own conversation of `events` old sends.
    async fn purge_rates(&self) -> Result<Vec<Value>, BoxError> {
        let mut out = vec![];
        for &chunk in &self.args.chunks {
            let filled = self.filled(&format!("rate-{chunk}")).await?;
            let purged = purge::purge(&self.store, &filled.conv, self.pace_of(chunk), None).await?;
            let verified = purge::check(&self.store, &filled, &purged).await?;
            eprintln!("purge-rate         {}  verified {verified}", purged.text());
            out.push(evidence::purge("purge-rate", &filled, &purged, verified));
        }
        Ok(out)
    }

    async fn filled(&self, name: &str) -> Result<Filled, BoxError> {
        let t = Instant::now();
        let filled = fill::filled_group(&self.store, &self.users, &self.id(name), self.args.events).await?;
        eprintln!("filled {} with {} old sends in {:.1} s", filled.conv, filled.events, t.elapsed().as_secs_f64());
        Ok(filled)
    }

    /// Part 2: the hot group while another conversation is purged, and
    /// while its own old events are, each between two runs without a purge
    /// (the machine's drift lands on both sides).
    async fn hot_during_purge(&self) -> Result<Value, BoxError> {
        let other = self.filled("other").await?;
        let itself = self.filled("itself").await?;
        let alone = group(&self.store, &self.users, &self.id("alone"), GroupSettings::default()).await?;
        let beside = group(&self.store, &self.users, &self.id("beside"), GroupSettings::default()).await?;
        settle(&self.store, &[]).await?;
        let c = self.args.senders;
        let before = self.hot("hot-group", &alone, c, "a").await?;
        let (run_other, purge_other) = self.hot_while_purging("hot-group-purging-other", &beside, &other, "").await?;
        let after = self.hot("hot-group", &alone, c, "b").await?;
        // The same conversation with its million old events (most of them
        // still there after the purge run), no purge running.
        let old_before = self.hot("hot-group-old-events", &itself.conv, c, "a").await?;
        let (run_itself, purge_itself) =
            self.hot_while_purging("hot-group-purging-itself", &itself.conv, &itself, "b").await?;
        let old_after = self.hot("hot-group-old-events", &itself.conv, c, "c").await?;
        Ok(json!({
            "goal_ratio": GOAL_RATIO,
            "purging_other": evidence::during(&run_other, &purge_other, &other, [&before, &after], GOAL_RATIO),
            "purging_itself":
                evidence::during(&run_itself, &purge_itself, &itself, [&old_before, &old_after], GOAL_RATIO),
        }))
    }

    /// A hot-group run on `conv` while `filled` is purged with the first
    /// chunk size until the run's time is up; the purge is checked afterwards.
    async fn hot_while_purging(
        &self,
        scenario: &'static str,
        conv: &ConvId,
        filled: &Filled,
        keys: &'static str,
    ) -> Result<(Run, (Purged, bool)), BoxError> {
        let until = Instant::now() + Duration::from_secs(self.args.seconds);
        let (run, purged) = futures_util::join!(
            self.hot(scenario, conv, self.args.senders, keys),
            purge::purge(&self.store, &filled.conv, self.pace(), Some(until))
        );
        let (run, purged) = (run?, purged?);
        let verified = purge::check(&self.store, filled, &purged).await?;
        eprintln!("  its purge        {}  verified {verified}", purged.text());
        Ok((run, (purged, verified)))
    }

    /// Part 3: the same runs on two conversations of one shape, `min_seq > 1`
    /// (so every send probes `idem_tombstones`), one holding the tombstones:
    /// per sender count without, with, with, without (the drift lands on both).
    async fn tombstone_lookup(&self) -> Result<Value, BoxError> {
        let without = self.probing_group("probe-without").await?;
        let with = self.probing_group("probe-with").await?;
        let t = Instant::now();
        fill::tombstones(&self.store, &with, &self.users, self.args.tombstones).await?;
        eprintln!("wrote {} tombstones of {with} in {:.1} s", self.args.tombstones, t.elapsed().as_secs_f64());
        settle(&self.store, &["idem_tombstones"]).await?;
        let table_rows = fill::tombstone_rows(&self.store).await?;
        let mut pairs = vec![];
        for (c, [k1, k2]) in [(self.args.senders, ["a", "b"]), (self.args.latency_senders, ["c", "d"])] {
            let w1 = self.hot("probe-no-tombstones", &without, c, k1).await?;
            let t1 = self.hot("probe-tombstones", &with, c, k1).await?;
            let t2 = self.hot("probe-tombstones", &with, c, k2).await?;
            let w2 = self.hot("probe-no-tombstones", &without, c, k2).await?;
            pairs.push(evidence::probe_pair([&w1, &w2], [&t1, &t2]));
        }
        Ok(json!({"conversation_tombstones": self.args.tombstones, "table_rows": table_rows, "pairs": pairs}))
    }

    /// A group of the benchmark's members whose creation events retention
    /// purged: `min_seq > 1`, and no tombstones (they were not sends).
    async fn probing_group(&self, name: &str) -> Result<ConvId, BoxError> {
        let conv = fill::old_group(&self.store, &self.users, &self.id(name)).await?;
        let (events, tombstones) = self.store.purge_conversation(&conv, self.pace()).await?;
        if events == 0 || tombstones != 0 {
            return Err(format!("{conv}: purging its creation events purged {events}, buried {tombstones}").into());
        }
        Ok(conv)
    }

    async fn write_evidence(
        &self,
        lookup: Value,
        rates: Vec<Value>,
        under_load: Value,
        seconds: f64,
    ) -> Result<Vec<String>, BoxError> {
        let failed = crate::verdict::unverified(&evidence::checked(&rates, &under_load, &lookup));
        let doc = json!({
            "run_id": self.run_id,
            "machine": environment::machine(&self.store).await?,
            "date": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            "git_rev": environment::git_rev(),
            "durability": environment::durability(&self.store).await?,
            "command": std::env::args().collect::<Vec<_>>().join(" "),
            "seconds": seconds.round(),
            "method": evidence::method(self.args.events, self.args.tombstones, fill::RETENTION_MS),
            "purge_rate": rates,
            "hot_during_purge": under_load,
            "tombstone_lookup": lookup,
            "verified": failed.is_empty(),
        });
        environment::write_json(&self.args.out, &doc)?;
        Ok(failed)
    }
}

/// Vacuums `tables` and writes out the dirty pages the fills left, so
/// neither autovacuum nor a checkpoint the fills caused lands in a measured
/// run. CHECKPOINT needs a superuser (or `pg_checkpoint`); without, the runs
/// go on and say so.
async fn settle(store: &Store, tables: &[&str]) -> Result<(), BoxError> {
    let conn = store.pool().get().await?;
    for table in tables {
        conn.batch_execute(&format!("VACUUM (ANALYZE) {table}")).await?;
    }
    if let Err(e) = conn.batch_execute("CHECKPOINT").await {
        eprintln!("no CHECKPOINT before the runs: {e}");
    }
    Ok(())
}
