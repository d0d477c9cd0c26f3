//! P1 and P2 under concurrency, each with its negative control.
//!
//! The direct path runs every op as a transaction of its own, so concurrent
//! sends race for the conversation's row lock. On the actor path, sends
//! through one hub all reach one actor and meet inside its batches, which
//! tests the batch, not the lock; so the actor variants race two engines (as
//! two nodes: separate pools, separate hubs) whose actors commit at most
//! `SMALL_BATCH` ops a transaction: sends then meet across batches and across
//! writers, where only the row lock keeps them apart. Each control takes the
//! guard under test away from the test's own database and runs the same race
//! through the same writers; the check must then fail. Last, a demonstration
//! of why seqs do not come from a database sequence.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use imcore::config::StoreSettings;
use imcore::store::{SendAck, Store};
use imcore::writer::Writer;
use imcore_actors::ConvId;
use serde_json::json;
use tokio::sync::Barrier;
use uuid::Uuid;

use super::{direct_chat, SUITE};
use crate::env::{send_with, text, Env, Path, PathName, WriteErr};
use crate::evidence::record;

/// Concurrent identical sends in the replay race.
const RACERS: usize = 32;
/// Distinct sends in the gapless burst.
const BURST: usize = 200;
/// Most ops an actor commits in one transaction in the races.
const SMALL_BATCH: usize = 4;
/// Attempts of one send in the burst: a client retries `INTERNAL` and
/// `OVERLOADED` with the same key (pool or lock waits time out on a loaded
/// machine), which P2 makes safe.
const ATTEMPTS: usize = 10;

/// The writers a race sends through, in turn, and what that exercises. Each
/// has a pool of `pool` connections and waits for one as long as it takes: on
/// a loaded machine opening connections is slow, and the race is about the
/// conversation row, not the pool.
async fn racing_writers(env: &Env, pool: u32) -> (Vec<Writer>, &'static str) {
    let settings = StoreSettings { pool_size: pool, pool_timeout_ms: 120_000, ..StoreSettings::default() };
    let store = || async { Store::connect_with(&env.db.url, &settings).await.expect("a node's store") };
    match env.writer.path() {
        Path::Direct => {
            let store = store().await;
            // Open the pool's connections up front, so each send runs on one of its own.
            let held = join_all((0..pool).map(|_| store.pool().get())).await;
            assert!(held.iter().all(Result::is_ok), "pool of {pool}");
            drop(held);
            (vec![env.another_node(store, 1)], "one direct writer, every send its own transaction")
        }
        Path::Actor => (
            vec![env.another_node(store().await, SMALL_BATCH), env.another_node(store().await, SMALL_BATCH)],
            "two engines in turn (separate pools and hubs, as two nodes), actor batches of at most 4",
        ),
    }
}

/// What `RACERS` identical sends, started together, left behind.
struct ReplayRace {
    failures: Vec<String>,
    rows: i64,
    distinct_message_ids: usize,
    distinct_seqs: usize,
    fresh: usize,
}

impl ReplayRace {
    /// Every caller answered, with the one row's ack, exactly one of them fresh.
    fn exactly_once(&self) -> bool {
        self.failures.is_empty()
            && self.rows == 1
            && self.distinct_message_ids == 1
            && self.distinct_seqs == 1
            && self.fresh == 1
    }

    fn observed(&self) -> serde_json::Value {
        json!({"senders": RACERS, "failed": self.failures.len(),
               "first_failures": &self.failures[..self.failures.len().min(2)], "rows": self.rows,
               "distinct_message_id": self.distinct_message_ids, "distinct_seq": self.distinct_seqs,
               "fresh": self.fresh})
    }
}

/// `RACERS` identical sends, started together through `writers` in turn.
///
/// So that the race is certain, not left to the scheduler, the transactions
/// are held at their INSERT (the test holds a `SHARE` lock on `events`, which
/// the write path's reads do not conflict with) until two of them are waiting
/// on a lock: both have then read the conversation row, or one waits for the
/// other's row lock.
async fn race_identical_sends(env: &Env, writers: &[Writer], conv: &ConvId, key: &str) -> ReplayRace {
    let gate = env.db.client().await;
    gate.batch_execute("BEGIN; LOCK TABLE events IN SHARE MODE").await.expect("hold inserts");
    let barrier = Barrier::new(RACERS);
    let sends = join_all((0..RACERS).map(|i| {
        let (writer, barrier) = (&writers[i % writers.len()], &barrier);
        async move {
            barrier.wait().await;
            send_with(writer, conv, "u-ana", key, text("once")).await
        }
    }));
    let c = env.db.client().await;
    let release = async {
        let formed = waiting_on_locks(&c, 2).await;
        gate.batch_execute("COMMIT").await.expect("release inserts");
        formed
    };
    let (results, formed) = tokio::join!(sends, release);
    assert!(formed, "two writers never met at the gate");
    let rows: i64 = c
        .query_one("SELECT count(*) FROM events WHERE conv_id = $1 AND client_msg_id = $2", &[&conv.as_str(), &key])
        .await
        .expect("count")
        .get(0);
    let acks: Vec<&SendAck> = results.iter().flatten().collect();
    ReplayRace {
        // Shortened: enough to name the failure (class, SQLSTATE, constraint).
        failures: results
            .iter()
            .filter_map(|r| r.as_ref().err())
            .map(|e| format!("{e:?}").chars().take(240).collect())
            .collect(),
        rows,
        distinct_message_ids: acks.iter().map(|a| a.message_id).collect::<BTreeSet<_>>().len(),
        distinct_seqs: acks.iter().map(|a| a.seq).collect::<BTreeSet<_>>().len(),
        fresh: acks.iter().filter(|a| !a.dup).count(),
    }
}

/// Waits (polling, at most ten seconds) until `n` backends of this database
/// other than `c`'s wait on a lock; false if they never do.
pub async fn waiting_on_locks(c: &tokio_postgres::Client, n: i64) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let waiting: i64 = c
            .query_one(
                "SELECT count(*) FROM pg_stat_activity
                  WHERE datname = current_database() AND pid <> pg_backend_pid() AND wait_event_type = 'Lock'",
                &[],
            )
            .await
            .expect("pg_stat_activity")
            .get(0);
        if waiting >= n {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    false
}

pub async fn concurrent_replay_one_row(path: Path) {
    let env = Env::new(path).await;
    let conv = direct_chat(&env).await;
    let (writers, how) = racing_writers(&env, RACERS as u32 + 2).await;
    let race = race_identical_sends(&env, &writers, &conv, "same-key").await;
    let pass = race.exactly_once();
    record(
        SUITE,
        "04-concurrent-replay-one-row",
        path.name(),
        &format!(
            "{RACERS} identical sends at once through {how}: every one answered, 1 row, 1 message_id, 1 seq, \
             exactly one dup=false"
        ),
        race.observed(),
        pass,
    );
    assert!(pass);
}

/// Negative control for P2: the same race through the same writers, with the
/// request key's guards taken away — the row lock (the replay lookup no
/// longer waits for the writer ahead to commit) and the unique index
/// `events_request_key`. The check above must fail: identical sends read the
/// same `next_seq` and collide on the primary key `(conv_id, seq)`, and their
/// callers get `INTERNAL` instead of `dup:true`. With that primary key
/// dropped too (P1's backstop), one key gets more than one row.
/// Rounds a negative control may take to show its race.
const CONTROL_ROUNDS: usize = 5;

pub async fn control_replay_without_row_lock(path: Path) {
    let env = Env::new(path).await;
    let conv = direct_chat(&env).await;
    let (writers, how) = racing_writers(&env, RACERS as u32 + 2).await;
    env.db.take_away_conversation_row_lock().await;
    let c = env.db.client().await;
    c.batch_execute("DROP INDEX events_request_key").await.expect("drop the request key index");
    // A race needs two writers' transactions to overlap; up to CONTROL_ROUNDS
    // rounds (a fresh key each) give it the chance, the first that breaks counts.
    let mut rounds = 0;
    let unguarded = loop {
        rounds += 1;
        let race = race_identical_sends(&env, &writers, &conv, &format!("key-a{rounds}")).await;
        if !race.exactly_once() || rounds == CONTROL_ROUNDS {
            break race;
        }
    };
    c.batch_execute("ALTER TABLE events DROP CONSTRAINT events_pkey").await.expect("drop the primary key");
    let mut rounds_without_pk = 0;
    let without_pk = loop {
        rounds_without_pk += 1;
        let race = race_identical_sends(&env, &writers, &conv, &format!("key-b{rounds_without_pk}")).await;
        if race.rows > 1 || rounds_without_pk == CONTROL_ROUNDS {
            break race;
        }
    };
    let pass = !unguarded.exactly_once() && without_pk.rows > 1;
    record(
        SUITE,
        "04-control-replay-without-row-lock",
        path.name(),
        &format!(
            "negative control: the same {RACERS} identical sends through {how}, with the row lock and \
             events_request_key taken away, fail the check (sends collide on the seq primary key) within \
             {CONTROL_ROUNDS} rounds; with the primary key dropped as well, the key gets more than 1 row"
        ),
        json!({"without_row_lock_and_key_index": unguarded.observed(), "rounds": rounds,
               "and_without_primary_key": without_pk.observed(), "rounds_without_primary_key": rounds_without_pk}),
        pass,
    );
    assert!(pass, "the race without the guards should have broken the check");
}

/// What a burst of `BURST` distinct sends, started together, left behind.
struct Burst {
    /// Keys that never got an ack (rejected, or failed `ATTEMPTS` times).
    unanswered: Vec<String>,
    retries: usize,
    /// Acked keys sent again once acked, through the next writer: each must
    /// answer `dup:true` with the original ack.
    late_retries: usize,
    late_retries_wrong: Vec<String>,
    /// Keys whose stored rows are not exactly the one their ack names.
    rows_unlike_acks: Vec<String>,
    distinct_acked_seqs: usize,
    log: (i64, i64, i64, i64),
}

impl Burst {
    /// Every send acked once and stored once; the log gapless (P1) with
    /// `next_seq` = max + 1 (P5).
    fn gapless_exactly_once(&self) -> bool {
        let (count, min, max, next_seq) = self.log;
        self.unanswered.is_empty()
            && self.late_retries_wrong.is_empty()
            && self.rows_unlike_acks.is_empty()
            && self.distinct_acked_seqs == BURST
            && count == max
            && min == 1
            && next_seq == max + 1
            && max == 2 + BURST as i64
    }

    fn observed(&self) -> serde_json::Value {
        let (count, min, max, next_seq) = self.log;
        json!({"senders": BURST, "unanswered": self.unanswered.len(), "retries": self.retries,
               "late_retries": self.late_retries, "late_retries_wrong": self.late_retries_wrong.len(),
               "keys_with_rows_unlike_ack": self.rows_unlike_acks.len(),
               "first_keys_unlike_ack": &self.rows_unlike_acks[..self.rows_unlike_acks.len().min(3)],
               "distinct_acked_seqs": self.distinct_acked_seqs, "count": count, "min_seq": min, "max_seq": max,
               "next_seq": next_seq})
    }
}

/// Sends `key` until it is acked, retrying failures as a client would;
/// returns the ack, if any, and the retries it took.
async fn send_until_acked(writer: &Writer, conv: &ConvId, user: &str, key: &str) -> (Option<SendAck>, usize) {
    for attempt in 0..ATTEMPTS {
        match send_with(writer, conv, user, key, text(&format!("burst {key}"))).await {
            Ok(ack) => return (Some(ack), attempt),
            Err(WriteErr::Rejected(_)) => return (None, attempt),
            Err(WriteErr::Failed(_)) => {}
        }
    }
    (None, ATTEMPTS)
}

/// One key of the burst, as its client saw it.
struct Sent {
    key: String,
    ack: Option<SendAck>,
    retries: usize,
    /// For a key sent again once acked: whether that answered `dup:true`
    /// with the original ack.
    late_retry_right: Option<bool>,
}

async fn burst(env: &Env, writers: &[Writer], conv: &ConvId) -> Burst {
    let barrier = Barrier::new(BURST);
    let sent: Vec<Sent> = join_all((0..BURST).map(|i| {
        let barrier = &barrier;
        async move {
            let (user, key) = (if i % 2 == 0 { "u-ana" } else { "u-ben" }, format!("k{i}"));
            barrier.wait().await;
            let (ack, retries) = send_until_acked(&writers[i % writers.len()], conv, user, &key).await;
            // Every fourth key is sent again once acked, landing in a later
            // transaction (on the actor path, a batch of the other node).
            let late_retry_right = match &ack {
                Some(ack) if i % 4 == 0 => {
                    let again = send_until_acked(&writers[(i + 1) % writers.len()], conv, user, &key).await.0;
                    Some(again.is_some_and(|a| a.dup && a.seq == ack.seq && a.message_id == ack.message_id))
                }
                _ => None,
            };
            Sent { key, ack, retries, late_retry_right }
        }
    }))
    .await;
    let c = env.db.client().await;
    let mut stored: HashMap<String, Vec<(i64, Uuid)>> = HashMap::new();
    for r in c
        .query(
            "SELECT client_msg_id, seq, message_id FROM events WHERE conv_id = $1 AND kind = 'msg'",
            &[&conv.as_str()],
        )
        .await
        .expect("stored messages")
    {
        stored.entry(r.get(0)).or_default().push((r.get(1), r.get(2)));
    }
    let acked_row = |s: &Sent| s.ack.iter().map(|a| (a.seq, a.message_id)).collect::<Vec<_>>();
    Burst {
        unanswered: sent.iter().filter(|s| s.ack.is_none()).map(|s| s.key.clone()).collect(),
        retries: sent.iter().map(|s| s.retries).sum(),
        late_retries: sent.iter().filter(|s| s.late_retry_right.is_some()).count(),
        late_retries_wrong: sent.iter().filter(|s| s.late_retry_right == Some(false)).map(|s| s.key.clone()).collect(),
        rows_unlike_acks: sent
            .iter()
            .filter(|s| stored.get(&s.key).cloned().unwrap_or_default() != acked_row(s))
            .map(|s| s.key.clone())
            .collect(),
        distinct_acked_seqs: sent.iter().filter_map(|s| s.ack.as_ref()).map(|a| a.seq).collect::<BTreeSet<_>>().len(),
        log: env.log_stats(conv).await,
    }
}

pub async fn seq_gapless(path: Path) {
    let env = Env::new(path).await;
    let conv = direct_chat(&env).await;
    let (writers, how) = racing_writers(&env, 64).await;
    let burst = burst(&env, &writers, &conv).await;
    let pass = burst.gapless_exactly_once();
    record(
        SUITE,
        "04-seq-gapless",
        path.name(),
        &format!(
            "{BURST} distinct sends at once through {how}, each retried with its key on INTERNAL, every 4th sent \
             again once acked: all acked, each key stored once as acked, late retries dup with the original ack, \
             count = max(seq), min = 1, next_seq = max + 1, {BURST} distinct acked seqs"
        ),
        burst.observed(),
        pass,
    );
    assert!(pass);
}

/// Negative control for P1 and P5: the same burst through the same writers
/// with both of P1's guards taken away — the row lock (writers read the same
/// `next_seq`) and the primary key `(conv_id, seq)`. The check above must
/// fail with repeated seqs. (The primary key alone turns those repeats into
/// collisions, which the burst's retries then absorb.)
pub async fn control_gapless_without_row_lock(path: Path) {
    let env = Env::new(path).await;
    let conv = direct_chat(&env).await;
    let (writers, how) = racing_writers(&env, 64).await;
    env.db.take_away_conversation_row_lock().await;
    let c = env.db.client().await;
    c.batch_execute("ALTER TABLE events DROP CONSTRAINT events_pkey").await.expect("drop the primary key");
    // Every append lingers 5 ms after its statement's snapshot, as on a busy
    // machine: the writers' transactions overlap whatever this machine's speed
    // (the two actor engines once ran each other's batches in turn).
    c.batch_execute(
        "CREATE FUNCTION linger() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(0.005); RETURN NULL; END $$;
         CREATE TRIGGER linger BEFORE INSERT ON events FOR EACH STATEMENT EXECUTE FUNCTION linger();",
    )
    .await
    .expect("slow appends");
    let burst = burst(&env, &writers, &conv).await;
    let pass = !burst.gapless_exactly_once();
    record(
        SUITE,
        "04-control-gapless-without-row-lock",
        path.name(),
        &format!(
            "negative control: the same {BURST} sends through {how}, with the row lock and the seq primary key \
             taken away and every append lingering 5 ms, fail the check (repeated seqs)"
        ),
        burst.observed(),
        pass,
    );
    assert!(pass, "the burst without the row lock should have repeated seqs");
}

/// A demonstration, not a control (it runs none of the product): a database
/// sequence leaves gaps when transactions roll back, which is why seqs come
/// from a locked row counter instead (ARCHITECTURE §3).
pub async fn demo_sequence_gaps(path: Path) {
    let env = Env::new(path).await;
    let mut c = env.db.client().await;
    c.batch_execute("CREATE SEQUENCE seq_ctl; CREATE TABLE seq_events (seq bigint PRIMARY KEY)").await.expect("setup");
    for i in 0..10 {
        let tx = c.transaction().await.expect("begin");
        tx.execute("INSERT INTO seq_events VALUES (nextval('seq_ctl'))", &[]).await.expect("insert");
        if i % 3 == 1 {
            tx.rollback().await.expect("rollback");
        } else {
            tx.commit().await.expect("commit");
        }
    }
    let r = c.query_one("SELECT count(*), max(seq) FROM seq_events", &[]).await.expect("count");
    let (rows, max): (i64, i64) = (r.get(0), r.get(1));
    let pass = rows == 7 && max == 10;
    record(
        SUITE,
        "04-demo-sequence-gaps",
        path.name(),
        "demonstration (no product code): 10 transactions take nextval from a sequence, 3 roll back: 7 rows, \
         max seq 10 (gaps)",
        json!({"transactions": 10, "rolled_back": 3, "rows": rows, "max_seq": max}),
        pass,
    );
    assert!(pass);
}
