//! A purge meeting other transactions: a send committing while the purge
//! waits for the row lock, sends and a retry while its sweep is held, a
//! second purge on another pool, a purge whose connection is killed midway.
//! Each race is arranged with locks the test holds, so it happens every run
//! rather than when the scheduler allows.

use std::time::{Duration, Instant};

use imcore::store::{Pace, Store};
use imcore_actors::ConvId;
use serde_json::json;

use super::{age_all, hour_group, log_shape, old_history, tombstones, SUITE};
use crate::env::{text, Env, Path};
use crate::evidence::Check;
use crate::persistence::races::waiting_on_locks;

#[actix_web::test]
async fn a_send_committed_while_the_purge_waits_for_the_row_is_not_purged() {
    let check = Check::start(
        SUITE,
        "11-purge-spares-a-send-it-waited-for",
        "actor",
        "all of a quiet group's events expired; a send holds the row lock while a purge waits for it: the purge \
         deletes the two expired joins only; the fresh message (inside the hour's retention) stays, untombstoned",
    );
    let env = Env::new(Path::Actor).await;
    let conv = hour_group(&env, "g-quiet", &["u-ben"]).await;
    let c = env.db.client().await;
    age_all(&c, &conv).await;
    // The send takes the row, then waits at its INSERT behind this SHARE lock.
    let gate = env.db.client().await;
    gate.batch_execute("BEGIN; LOCK TABLE events IN SHARE MODE").await.expect("hold inserts");
    let send = env.send(&conv, "u-ana", "fresh", text("just now"));
    let purge = async {
        assert!(waiting_on_locks(&c, 1).await, "the send never waited at the gate");
        let purge = env.store().purge_conversation(&conv, Pace::chunk(100));
        let release = async {
            assert!(waiting_on_locks(&c, 2).await, "the purge never waited for the row");
            gate.batch_execute("COMMIT").await.expect("release inserts");
        };
        tokio::join!(purge, release).0
    };
    let (sent, purged) = tokio::join!(send, purge);
    let ack = sent.expect("send");
    let (purged, buried) = purged.expect("purge");
    let fresh_rows: i64 = c
        .query_one("SELECT count(*) FROM events WHERE conv_id = $1 AND seq = $2", &[&conv.as_str(), &ack.seq])
        .await
        .expect("fresh row")
        .get(0);
    let (min_seq, next_seq, _, gapless) = log_shape(&c, &conv).await;
    let (tombs, _) = tombstones(&c, &conv).await;
    let pass = ack.seq == 3 && purged == 2 && buried == 0 && fresh_rows == 1 && min_seq == 3 && gapless && tombs == 0;
    let pass = check.resolve(
        json!({"fresh_seq": ack.seq, "events_purged": purged, "tombstones_written": buried,
               "fresh_row_kept": fresh_rows == 1, "min_seq": min_seq, "next_seq": next_seq, "gapless": gapless,
               "tombstones": tombs}),
        pass,
    );
    assert!(pass);
}

#[actix_web::test]
async fn two_purges_racing_purge_each_event_once_and_bury_each_send_once() {
    const OLD: i64 = 2_000;
    let check = Check::start(
        SUITE,
        "11-racing-purges",
        "two pools",
        "two purges of one conversation (chunk 50) on separate pools, released together: events purged sum to \
         the expired 2,002 exactly, tombstones written sum to the 2,000 sends, one tombstone row each, gapless",
    );
    let env = Env::new(Path::Actor).await;
    let conv = hour_group(&env, "g-race", &["u-ben"]).await;
    let c = env.db.client().await;
    old_history(&c, &conv, OLD).await;
    age_all(&c, &conv).await;
    let kept = env.send(&conv, "u-ana", "kept", text("fresh")).await.expect("fresh send");
    let (a, b) = (node(&env).await, node(&env).await);
    // Both start behind a row lock the test holds, then contend chunk by chunk.
    let gate = env.db.client().await;
    gate.batch_execute("BEGIN").await.expect("begin");
    gate.execute("SELECT 1 FROM conversations WHERE conv_id = $1 FOR NO KEY UPDATE", &[&conv.as_str()])
        .await
        .expect("hold the row");
    let release = async {
        let met = waiting_on_locks(&c, 2).await;
        gate.batch_execute("COMMIT").await.expect("release");
        met
    };
    let (ra, rb, met) = tokio::join!(
        a.purge_conversation(&conv, Pace::chunk(50)),
        b.purge_conversation(&conv, Pace::chunk(50)),
        release
    );
    let ((ea, ta), (eb, tb)) = (ra.expect("purge a"), rb.expect("purge b"));
    let (min_seq, _, _, gapless) = log_shape(&c, &conv).await;
    let (tombs, distinct) = tombstones(&c, &conv).await;
    let expired = (OLD + 2) as u64;
    let pass = met
        && ea + eb == expired
        && ta + tb == OLD as u64
        && tombs == OLD
        && distinct == OLD
        && min_seq == kept.seq
        && gapless;
    let pass = check.resolve(
        json!({"both_waited_on_the_row": met, "purge_a": [ea, ta], "purge_b": [eb, tb],
               "events_purged_total": ea + eb, "tombstones_written_total": ta + tb, "tombstone_rows": tombs,
               "distinct_tombstone_seqs": distinct, "min_seq": min_seq, "first_kept_seq": kept.seq,
               "gapless": gapless}),
        pass,
    );
    assert!(pass);
}

/// A store of its own on the test database, as a second node would have.
async fn node(env: &Env) -> Store {
    Store::connect(&env.db.url, 2).await.expect("a node's store")
}

#[actix_web::test]
async fn a_purge_killed_midway_is_finished_by_the_next_run() {
    const OLD: i64 = 1_000;
    let check = Check::start(
        SUITE,
        "11-purge-killed-midway",
        "pg_terminate_backend",
        "a purge (chunk 100) whose backend is terminated in its 4th chunk's sweep leaves 3 chunks done and the \
         4th's range [301, 401) below min_seq 401, every row from 301 to the head there; the next run sweeps it \
         first, then purges the rest: 1,002 events purged in all, 1,000 tombstones, none twice, gapless",
    );
    let env = Env::new(Path::Actor).await;
    let conv = hour_group(&env, "g-killed", &["u-ben"]).await;
    let c = env.db.client().await;
    old_history(&c, &conv, OLD).await;
    age_all(&c, &conv).await;
    let kept = env.send(&conv, "u-ana", "kept", text("fresh")).await.expect("fresh send");
    // An uncommitted tombstone for seq 350 stops the 4th chunk ([301, 401)) at its INSERT.
    let blocker = env.db.client().await;
    hold_tombstone(&blocker, &conv, 350).await;
    let purger = node(&env).await;
    let kill = async {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let pid: Option<i32> = c
                .query_opt(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()
                        AND wait_event_type = 'Lock' AND query LIKE '%idem_tombstones%'",
                    &[],
                )
                .await
                .expect("find the purge")
                .map(|r| r.get(0));
            if let Some(pid) = pid {
                c.execute("SELECT pg_terminate_backend($1)", &[&pid]).await.expect("terminate");
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    let (first, killed) = tokio::join!(purger.purge_conversation(&conv, Pace::chunk(100)), kill);
    blocker.batch_execute("ROLLBACK").await.expect("rollback the blocker");
    let midway = (log_shape(&c, &conv).await, tombstones(&c, &conv).await);
    let second = purger.purge_conversation(&conv, Pace::chunk(100)).await;
    let (min_seq, next_seq, _, gapless) = log_shape(&c, &conv).await;
    let (tombs, distinct) = tombstones(&c, &conv).await;
    let second_counts = second.as_ref().ok().copied();
    let pass = killed
        && first.is_err()
        && midway.0 .0 == 401
        && midway.0 .2 == midway.0 .1 - 301
        && midway.1 .0 == 298
        && second_counts == Some((702, 702))
        && tombs == OLD
        && distinct == OLD
        && min_seq == kept.seq
        && gapless;
    let pass = check.resolve(
        json!({"killed": killed, "first_run": format!("{first:?}").chars().take(200).collect::<String>(),
               "midway_min_seq": midway.0 .0, "midway_rows": midway.0 .2, "midway_next_seq": midway.0 .1,
               "midway_tombstones": midway.1 .0,
               "second_run": format!("{second:?}"), "min_seq": min_seq, "next_seq": next_seq, "gapless": gapless,
               "tombstones": tombs, "distinct_tombstone_seqs": distinct}),
        pass,
    );
    assert!(pass);
}

#[actix_web::test]
async fn sends_and_a_retry_while_a_sweep_is_held_neither_wait_nor_append_a_purged_key_again() {
    const EARLY: i64 = 10;
    const OLD: i64 = 290;
    let check = Check::start(
        SUITE,
        "11-sweep-holds-no-row-lock",
        "actor, chunk 100",
        "a purge's first sweep ([1, 101): 2 joins, 10 sends early-*, 88 old) is held at its tombstones by a test \
         lock after min_seq moved to 101: a fresh send acks meanwhile (no row lock held), a retry of early-3 is \
         answered dup seq 3 (its event still there) and not appended; released, the purge ends: 302 purged, 300 \
         tombstones, one per seq, gapless from min_seq = the fresh send's seq, no event left for early-3",
    );
    let env = Env::new(Path::Actor).await;
    let conv = hour_group(&env, "g-held", &["u-ben"]).await;
    let c = env.db.client().await;
    for i in 0..EARLY {
        env.send(&conv, "u-ana", &format!("early-{}", i + 3), text("early")).await.expect("early send");
    }
    old_history(&c, &conv, OLD).await;
    age_all(&c, &conv).await;
    // An uncommitted tombstone for seq 50 holds the first sweep at its INSERT.
    let blocker = env.db.client().await;
    hold_tombstone(&blocker, &conv, 50).await;
    let purge = env.store().purge_conversation(&conv, Pace::chunk(100));
    let meanwhile = async {
        let held = waiting_on_locks(&c, 1).await;
        let (min_seq_held, ..) = log_shape(&c, &conv).await;
        let within = Duration::from_secs(20);
        let fresh = tokio::time::timeout(within, env.send(&conv, "u-ana", "fresh", text("now"))).await;
        let retry = tokio::time::timeout(within, env.send(&conv, "u-ana", "early-3", text("early"))).await;
        blocker.batch_execute("ROLLBACK").await.expect("release the sweep");
        (held, min_seq_held, fresh, retry)
    };
    let (purged, (held, min_seq_held, fresh, retry)) = tokio::join!(purge, meanwhile);
    let (events, buried) = purged.expect("purge");
    let fresh = fresh.ok().and_then(Result::ok);
    let retry = retry.ok().and_then(Result::ok);
    let (min_seq, next_seq, _, gapless) = log_shape(&c, &conv).await;
    let (tombs, distinct) = tombstones(&c, &conv).await;
    let early_rows: i64 = c
        .query_one("SELECT count(*) FROM events WHERE conv_id = $1 AND client_msg_id = 'early-3'", &[&conv.as_str()])
        .await
        .expect("early-3 rows")
        .get(0);
    let fresh_seq = fresh.as_ref().map(|a| a.seq);
    let sends = EARLY + OLD;
    let pass = held
        && min_seq_held == 101
        && retry.as_ref().is_some_and(|a| a.dup && a.seq == 3)
        && fresh_seq == Some(2 + sends + 1)
        && events == (2 + sends) as u64
        && buried == sends as u64
        && tombs == sends
        && distinct == sends
        && early_rows == 0
        && min_seq == 2 + sends + 1
        && gapless;
    let pass = check.resolve(
        json!({"sweep_held": held, "min_seq_while_held": min_seq_held, "fresh_seq": fresh_seq,
               "retry": retry.map(|a| json!({"seq": a.seq, "dup": a.dup})), "events_purged": events,
               "tombstones_written": buried, "tombstone_rows": tombs, "distinct_tombstone_seqs": distinct,
               "early_3_rows": early_rows, "min_seq": min_seq, "next_seq": next_seq, "gapless": gapless}),
        pass,
    );
    assert!(pass);
}

/// Opens a transaction on `blocker` that inserts, uncommitted, the tombstone
/// of `conv`'s event at `seq`: a sweep burying that event waits at its INSERT
/// until `blocker` rolls back.
async fn hold_tombstone(blocker: &tokio_postgres::Client, conv: &ConvId, seq: i64) {
    blocker.batch_execute("BEGIN").await.expect("begin");
    blocker
        .execute(
            "INSERT INTO idem_tombstones (conv_id, sender_user, client_msg_id, request_hash, seq)
             SELECT conv_id, sender_user, client_msg_id, request_hash, seq FROM events WHERE conv_id = $1 AND seq = $2",
            &[&conv.as_str(), &seq],
        )
        .await
        .expect("hold a sweep at its tombstone");
}
