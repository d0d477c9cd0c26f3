//! The commit stage isolates conversations (ARCHITECTURE §3), through the
//! server's engine on a real PostgreSQL: a conversation whose row another
//! session holds, a batch that fails its merged transaction, and a worker
//! that panics each reach only their own conversation's callers.
//! Each check writes its record to evidence/im-10.

use std::cell::Cell;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use imcore::store::Written;
use imcore::writer::WriteFailure;
use imcore_actors::ConvId;
use serde_json::{json, Value};

use crate::env::{send_op, text, Env, Path};
use crate::evidence::Check;

const SUITE: &str = "im-10";
/// The `lock_timeout` of every pooled connection.
const LOCK_TIMEOUT: Duration = Duration::from_secs(5);
/// What an unrelated conversation's send may take while another's row is
/// held: a few merged rounds, nothing like a lock wait.
const UNRELATED_MAX: Duration = Duration::from_secs(1);
const FREE_CONVS: usize = 100;

/// `FREE_CONVS` groups `g-free-N` and one group per name in `more`, all of u-ana.
async fn groups(env: &Env, more: &[&str]) -> (Vec<ConvId>, Vec<ConvId>) {
    env.users(&["u-ana"]).await;
    let names: Vec<String> = (0..FREE_CONVS).map(|i| format!("g-free-{i:03}")).collect();
    let mut free = Vec::with_capacity(FREE_CONVS);
    for chunk in names.chunks(10) {
        free.extend(join_all(chunk.iter().map(|n| env.group(n, "u-ana", &[]))).await);
    }
    let mut others = Vec::with_capacity(more.len());
    for n in more {
        others.push(env.group(n, "u-ana", &[]).await);
    }
    (free, others)
}

async fn send(env: &Env, conv: &ConvId, key: &str, body: &str) -> Result<Written, WriteFailure> {
    env.writer.write(conv.clone(), send_op("u-ana", key, text(body))).await
}

fn summary(latencies: &mut [Duration]) -> Value {
    latencies.sort();
    let at = |q: f64| {
        let i = ((latencies.len() as f64 * q).ceil() as usize).clamp(1, latencies.len().max(1)) - 1;
        latencies.get(i).map_or(0, |d| d.as_millis())
    };
    json!({"sends": latencies.len(), "p50_ms": at(0.5), "p99_ms": at(0.99), "max_ms": at(1.0)})
}

/// Backends of this database waiting for a row lock now (for the holder's
/// transaction, or for the tuple behind another waiter).
async fn row_lock_waiters(observer: &tokio_postgres::Client) -> i64 {
    observer
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'
                AND wait_event IN ('transactionid', 'tuple')",
            &[],
        )
        .await
        .expect("pg_stat_activity")
        .get(0)
}

/// Each free conversation sends in a loop until `stop`: the latency of every
/// send, and the failures.
async fn send_until(env: &Env, free: &[ConvId], stop: &Cell<bool>) -> (Vec<Duration>, Vec<String>) {
    let loops = free.iter().map(|conv| async move {
        let (mut latencies, mut failures) = (vec![], vec![]);
        let mut n = 0;
        while !stop.get() {
            let key = format!("k-{n}");
            let started = Instant::now();
            match send(env, conv, &key, &key).await {
                Ok(_) => latencies.push(started.elapsed()),
                Err(e) => failures.push(format!("{conv} {key}: {e:?} after {:?}", started.elapsed())),
            }
            n += 1;
        }
        (latencies, failures)
    });
    let (mut latencies, mut failures) = (vec![], vec![]);
    for (l, f) in join_all(loops).await {
        latencies.extend(l);
        failures.extend(f);
    }
    (latencies, failures)
}

#[actix_web::test]
async fn a_locked_conversation_delays_no_other() {
    let check = Check::start(
        SUITE,
        "09-locked-conversation-isolated",
        "actor path, commit stage, 100 conversations sending in loops",
        "while another session holds one conversation's row (SELECT … FOR UPDATE in an open transaction), every \
         send of 100 other conversations succeeds in under 1 s; the locked conversation's send that waits past \
         lock_timeout (5 s) fails with INTERNAL, not earlier; its next send, waiting when the lock is released, \
         is acked right after, at the seq after the head before (the failed one left no gap)",
    );
    let env = Env::new(Path::Actor).await;
    let (free, locked) = groups(&env, &["g-locked"]).await;
    let locked = &locked[0];
    let head_before = env.head(locked).await;
    let observer = env.db.client().await;
    let mut holder = env.db.client().await;
    let hold = holder.transaction().await.expect("begin");
    hold.query("SELECT 1 FROM conversations WHERE conv_id = $1 FOR UPDATE", &[&locked.as_str()]).await.expect("lock");
    let held_at = Instant::now();

    let stop = Cell::new(false);
    let drive = async {
        // Queued at once, beside the first sends of every free conversation.
        let first = env.writer.write(locked.clone(), send_op("u-ana", "l-1", text("l-1"))).await;
        let first_after = held_at.elapsed();
        let second = env.writer.write(locked.clone(), send_op("u-ana", "l-2", text("l-2")));
        while row_lock_waiters(&observer).await == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        hold.rollback().await.expect("release");
        let released = Instant::now();
        let held_for = held_at.elapsed();
        let second = second.await;
        let second_after_release = released.elapsed();
        stop.set(true);
        (first, first_after, second, second_after_release, held_for)
    };
    let ((first, first_after, second, second_after_release, held_for), (mut latencies, failures)) =
        tokio::join!(drive, send_until(&env, &free, &stop));

    let first_internal = matches!(first, Err(WriteFailure::Internal(_)));
    let second_seq = match &second {
        Ok(Written::Sent(ack)) => Some(ack.seq),
        _ => None,
    };
    let unrelated = summary(&mut latencies);
    let max = latencies.last().copied().unwrap_or_default();
    let pass = failures.is_empty()
        && !latencies.is_empty()
        && max < UNRELATED_MAX
        && first_internal
        && first_after >= LOCK_TIMEOUT - Duration::from_millis(500)
        && second_seq == Some(head_before + 1)
        && second_after_release < UNRELATED_MAX;
    let shown_failures: Vec<&String> = failures.iter().take(5).collect();
    let observed = json!({
        "row_held_ms": held_for.as_millis(),
        "unrelated": unrelated,
        "unrelated_failures": failures.len(),
        "first_failures": shown_failures,
        "locked_first": {"result": format!("{first:?}"), "after_ms": first_after.as_millis()},
        "head_before": head_before,
        "locked_second": {"seq": second_seq, "result": format!("{second:?}"),
                          "after_release_ms": second_after_release.as_millis()},
    });
    assert!(check.resolve(observed.clone(), pass), "{observed:#}");
}

/// Fails, before COMMIT, any transaction that inserts an event whose body
/// carries "POISON".
const POISON: &str = "
CREATE FUNCTION poison() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.body LIKE '%POISON%' THEN RAISE EXCEPTION 'poisoned batch'; END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER poison BEFORE INSERT ON events FOR EACH ROW EXECUTE FUNCTION poison();";

#[actix_web::test]
async fn a_failing_batch_fails_only_its_own_callers() {
    const WAVES: usize = 3;
    let check = Check::start(
        SUITE,
        "09-failing-batch-isolated",
        "actor path, commit stage, 3 waves of 100 conversations + 1 poisoned",
        "a batch that fails the merged transaction before COMMIT (a trigger raises on its row) fails only its own \
         callers with INTERNAL; every send of the 100 conversations queued at the same moment, and so merged with \
         it, is acked",
    );
    let env = Env::new(Path::Actor).await;
    let (free, poisoned) = groups(&env, &["g-poisoned"]).await;
    env.db.client().await.batch_execute(POISON).await.expect("install the trigger");
    let (mut acked, mut failed, mut poisoned_internal) = (0, vec![], 0);
    for wave in 0..WAVES {
        // Every send is queued before any is awaited, so they share rounds.
        let key = format!("w-{wave}");
        let poison = env.writer.write(poisoned[0].clone(), send_op("u-ana", &key, text("POISON")));
        let sends: Vec<_> =
            free.iter().map(|c| env.writer.write(c.clone(), send_op("u-ana", &key, text(&key)))).collect();
        let (poison, results) = futures_util::join!(poison, join_all(sends));
        poisoned_internal += usize::from(matches!(poison, Err(WriteFailure::Internal(_))));
        for (conv, r) in free.iter().zip(results) {
            match r {
                Ok(_) => acked += 1,
                Err(e) => failed.push(format!("{conv} {key}: {e:?}")),
            }
        }
    }
    let pass = failed.is_empty() && acked == WAVES * FREE_CONVS && poisoned_internal == WAVES;
    let observed = json!({
        "acked": acked,
        "failed": failed.len(),
        "first_failures": failed.iter().take(5).collect::<Vec<_>>(),
        "poisoned_internal": poisoned_internal,
    });
    assert!(check.resolve(observed.clone(), pass), "{observed:#}");
}

/// Holds, for `HOLD_SECS`, the transaction of any send to a `g-hold-*` group.
const HOLD: &str = "
CREATE FUNCTION hold() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.conv_id LIKE 'g-hold-%' THEN PERFORM pg_sleep(1); END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER hold BEFORE INSERT ON events FOR EACH ROW EXECUTE FUNCTION hold();";

/// Backends of this database in `pg_sleep` now.
async fn sleeping(observer: &tokio_postgres::Client) -> i64 {
    let sql = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event = 'PgSleep'";
    observer.query_one(sql, &[]).await.expect("pg_stat_activity").get(0)
}

#[actix_web::test]
async fn a_panicking_worker_is_replaced() {
    /// More than the commit stage's workers (2).
    const PANICS: usize = 3;
    let check = Check::start(
        SUITE,
        "09-commit-worker-panic-replaced",
        "actor path, commit stage of 2 workers, 3 panics",
        "a conversation row that makes the worker committing it panic (a NULL where the code relies on NOT NULL) \
         fails that round's callers with INTERNAL, 3 times over with 2 workers (each time both rounds' slots are \
         held by sends that sleep in a trigger, so the broken send waits for a worker instead of committing on its \
         caller's task); afterwards the 100 other conversations' sends are all acked",
    );
    let env = Env::new(Path::Actor).await;
    let (free, broken) = groups(&env, &["g-broken", "g-hold-1", "g-hold-2"]).await;
    let observer = env.db.client().await;
    observer
        .batch_execute(&format!(
            "ALTER TABLE conversations ALTER member_count DROP NOT NULL;
             UPDATE conversations SET member_count = NULL WHERE conv_id = '{}'; {HOLD}",
            broken[0]
        ))
        .await
        .expect("break the row");
    let (mut panicked, mut held_slots) = (vec![], vec![]);
    for n in 0..PANICS {
        let key = format!("b-{n}");
        let hold = join_all(broken[1..].iter().map(|c| send(&env, c, &key, &key)));
        let after_hold = async {
            let deadline = Instant::now() + Duration::from_secs(10);
            while sleeping(&observer).await < 2 && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            held_slots.push(sleeping(&observer).await);
            send(&env, &broken[0], &key, &key).await
        };
        let (_, result) = futures_util::join!(hold, after_hold);
        panicked.push(result);
    }
    let internal = panicked.iter().filter(|r| matches!(r, Err(WriteFailure::Internal(_)))).count();
    let results = join_all(free.iter().map(|c| send(&env, c, "after", "after"))).await;
    let failed: Vec<String> = results.iter().filter_map(|r| r.as_ref().err().map(|e| format!("{e:?}"))).collect();
    let pass = internal == PANICS && failed.is_empty() && held_slots.iter().all(|&n| n >= 2);
    let observed = json!({
        "broken_sends": panicked.iter().map(|r| format!("{r:?}")).collect::<Vec<_>>(),
        "sleeping_holders_when_sent": held_slots,
        "after": {"acked": results.len() - failed.len(), "failed": failed.len(),
                  "first_failures": failed.iter().take(3).collect::<Vec<_>>()},
    });
    assert!(check.resolve(observed.clone(), pass), "{observed:#}");
}

/// Records each inserted event's transaction, and holds every INSERT
/// statement on `events` for 0.2 s.
const ROUND_PROBE: &str = "
CREATE TABLE round_probe (tx xid8 NOT NULL, conv_id text NOT NULL);
CREATE FUNCTION probe_round() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO round_probe VALUES (pg_current_xact_id(), NEW.conv_id);
  RETURN NEW;
END $$;
CREATE FUNCTION slow_round() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_sleep(0.2); RETURN NULL; END $$;
CREATE TRIGGER probe_round AFTER INSERT ON events FOR EACH ROW EXECUTE FUNCTION probe_round();
CREATE TRIGGER slow_round AFTER INSERT ON events FOR EACH STATEMENT EXECUTE FUNCTION slow_round();";

#[actix_web::test]
async fn lone_and_merged_rounds_never_outnumber_the_workers() {
    const WAVES: usize = 3;
    let check = Check::start(
        SUITE,
        "09-rounds-within-workers",
        "actor path, commit stage of 2 workers, 3 waves of 100 conversations queued at once, every transaction held \
         0.2 s by a trigger",
        "lone batches commit on their callers' tasks and the rest wait for the workers, yet at most 2 write \
         transactions run at once (backends in the trigger's pg_sleep, polled every 10 ms), and the batches that \
         waited still merge: fewer transactions than conversations; every send acked",
    );
    let env = Env::new(Path::Actor).await;
    let (free, _) = groups(&env, &[]).await;
    let observer = env.db.client().await;
    observer.batch_execute(ROUND_PROBE).await.expect("install the probe");
    let done = Cell::new(false);
    let (mut acked, mut failed) = (0, vec![]);
    let waves = async {
        for wave in 0..WAVES {
            let key = format!("r-{wave}");
            let results = join_all(free.iter().map(|c| send(&env, c, &key, &key))).await;
            for (conv, r) in free.iter().zip(results) {
                match r {
                    Ok(_) => acked += 1,
                    Err(e) => failed.push(format!("{conv} {key}: {e:?}")),
                }
            }
        }
        done.set(true);
    };
    let most_at_once = async {
        let mut most = 0;
        while !done.get() {
            most = most.max(sleeping(&observer).await);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        most
    };
    let ((), most_at_once) = futures_util::join!(waves, most_at_once);
    let (transactions, largest): (i64, i64) = observer
        .query_one(
            "SELECT count(*), coalesce(max(n), 0) FROM (SELECT count(*) AS n FROM round_probe GROUP BY tx) t",
            &[],
        )
        .await
        .map(|r| (r.get(0), r.get(1)))
        .expect("read the probe");
    let pass = failed.is_empty()
        && acked == WAVES * FREE_CONVS
        && most_at_once <= 2
        && (transactions as usize) < WAVES * FREE_CONVS
        && largest > 1;
    let observed = json!({
        "acked": acked,
        "failed": failed.len(),
        "first_failures": failed.iter().take(5).collect::<Vec<_>>(),
        "most_transactions_at_once": most_at_once,
        "transactions": transactions,
        "most_conversations_in_one": largest,
    });
    assert!(check.resolve(observed.clone(), pass), "{observed:#}");
}
