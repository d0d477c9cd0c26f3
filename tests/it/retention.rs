//! Retention (P9, PROTOCOL §6) against a real PostgreSQL: a purge next to
//! busy senders, tombstones answering late retries (with their negative
//! control), purges racing, killed midway, on the admin endpoint and on the
//! timer. Events are made old by moving their `created_at` back in SQL, so no
//! check waits for time to pass. Each writes its record to evidence/im-11.

use std::time::{Duration, Instant};

use imcore::domain::Rejection;
use imcore::store::{CreateConversation, GroupSettings, Pace, UNREAD_SCAN_ROWS};
use imcore_actors::ConvId;
use serde_json::json;

use crate::env::{cid, text, uid, Env, Path, WriteErr};
use crate::evidence::Check;

mod faults;
mod wire;

const SUITE: &str = "im-11";
/// Retention of the test groups: events made two hours old are past it,
/// fresh ones well inside.
const HOUR_MS: i64 = 3_600_000;

/// A group of `u-ana` and `others` (users made here), keeping events for an hour.
async fn hour_group(env: &Env, id: &str, others: &[&str]) -> ConvId {
    let mut users = vec!["u-ana"];
    users.extend_from_slice(others);
    env.users(&users).await;
    hour_group_of(env, id, others).await
}

/// A group of `u-ana` and `others`, users already, keeping events for an hour.
pub(crate) async fn hour_group_of(env: &Env, id: &str, others: &[&str]) -> ConvId {
    let settings = GroupSettings { retention_ms: Some(HOUR_MS), ..GroupSettings::default() };
    env.store()
        .create_conversation(&CreateConversation::Group {
            creator: uid("u-ana"),
            conv_id: Some(cid(id)),
            name: id.into(),
            members: others.iter().map(|m| uid(m)).collect(),
            settings,
        })
        .await
        .expect("create group")
        .info
        .conv_id
}

/// Makes every event of `conv` so far two hours old: past the retention.
pub(crate) async fn age_all(c: &tokio_postgres::Client, conv: &ConvId) {
    c.execute("UPDATE events SET created_at = now() - interval '2 hours' WHERE conv_id = $1", &[&conv.as_str()])
        .await
        .expect("age events");
}

/// Appends `n` two-hours-old messages of `u-ana` (keys `old-<seq>`) in SQL,
/// as a long history would have left them.
async fn old_history(c: &tokio_postgres::Client, conv: &ConvId, n: i64) {
    c.execute(
        "WITH c AS (SELECT next_seq FROM conversations WHERE conv_id = $1),
              ins AS (INSERT INTO events (conv_id, seq, kind, message_id, sender_user, sender_device,
                                          client_msg_id, request_hash, body, created_at)
                      SELECT $1, c.next_seq + i, 'msg', gen_random_uuid(), 'u-ana', 'd1',
                             'old-' || (c.next_seq + i), sha256(('old:' || i)::text::bytea),
                             '{\"type\":\"text\",\"text\":\"old\"}', now() - interval '2 hours'
                        FROM c, generate_series(0, $2::int8 - 1) i)
         UPDATE conversations SET next_seq = next_seq + $2::int8 WHERE conv_id = $1",
        &[&conv.as_str(), &n],
    )
    .await
    .expect("old history");
}

/// `(min_seq, next_seq, rows, gapless)`: the rows are exactly `[min_seq, next_seq)` (P1).
pub(crate) async fn log_shape(c: &tokio_postgres::Client, conv: &ConvId) -> (i64, i64, i64, bool) {
    let r = c
        .query_one(
            "SELECT c.min_seq, c.next_seq, count(e.seq), coalesce(min(e.seq), c.next_seq), coalesce(max(e.seq), c.min_seq - 1)
               FROM conversations c LEFT JOIN events e ON e.conv_id = c.conv_id
              WHERE c.conv_id = $1 GROUP BY c.min_seq, c.next_seq",
            &[&conv.as_str()],
        )
        .await
        .expect("log shape");
    let (min_seq, next_seq, rows, lo, hi): (i64, i64, i64, i64, i64) =
        (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4));
    (min_seq, next_seq, rows, rows == next_seq - min_seq && lo == min_seq && hi == next_seq - 1)
}

/// How many of `keys` (of `u-s*` sends) have a row or a tombstone.
async fn stored_or_tombstoned(c: &tokio_postgres::Client, conv: &ConvId, keys: &[&str]) -> i64 {
    c.query_one(
        "SELECT count(*) FROM unnest($2::text[]) k
          WHERE EXISTS (SELECT 1 FROM events e WHERE e.conv_id = $1 AND e.client_msg_id = k)
             OR EXISTS (SELECT 1 FROM idem_tombstones t WHERE t.conv_id = $1 AND t.client_msg_id = k)",
        &[&conv.as_str(), &keys],
    )
    .await
    .expect("acked sends kept")
    .get(0)
}

/// The membership periods of `conv`, as text to compare.
async fn periods(c: &tokio_postgres::Client, conv: &ConvId) -> String {
    let rows = c
        .query(
            "SELECT user_id, from_seq, to_seq FROM membership_periods WHERE conv_id = $1 ORDER BY user_id, from_seq",
            &[&conv.as_str()],
        )
        .await
        .expect("periods");
    let periods: Vec<(String, i64, Option<i64>)> = rows.iter().map(|r| (r.get(0), r.get(1), r.get(2))).collect();
    format!("{periods:?}")
}

/// `(tombstones, distinct seqs among them)` of `conv`.
async fn tombstones(c: &tokio_postgres::Client, conv: &ConvId) -> (i64, i64) {
    let r = c
        .query_one("SELECT count(*), count(DISTINCT seq) FROM idem_tombstones WHERE conv_id = $1", &[&conv.as_str()])
        .await
        .expect("tombstones");
    (r.get(0), r.get(1))
}

fn rejected(r: &Result<impl std::fmt::Debug, WriteErr>, want: &Rejection) -> bool {
    matches!(r, Err(WriteErr::Rejected(got)) if got == want)
}

#[actix_web::test]
async fn a_purged_send_retried_is_answered_from_its_tombstone_and_never_appended_again() {
    let check = Check::start(
        SUITE,
        "11-tombstone-replay",
        "actor",
        "after the purge of send m1: the same request answers IDEMPOTENCY_KEY_EXPIRED, another body under the \
         key IDEMPOTENCY_MISMATCH; head, rows and tombstones unchanged",
    );
    let control = Check::start(
        SUITE,
        "11-control-replay-without-tombstone",
        "actor",
        "negative control: with the tombstone rows deleted from the test database, the same retry appends m1 a \
         second time (dup:false, a new seq)",
    );
    let env = Env::new(Path::Actor).await;
    let conv = hour_group(&env, "g-tomb", &["u-ben"]).await;
    let c = env.db.client().await;
    let first = env.send(&conv, "u-ana", "m1", text("hi")).await.expect("send m1");
    age_all(&c, &conv).await;
    env.send(&conv, "u-ana", "m2", text("kept")).await.expect("send m2");
    let (purged, buried) = env.store().purge_conversation(&conv, Pace::chunk(100)).await.expect("purge");
    let before = (log_shape(&c, &conv).await, tombstones(&c, &conv).await);
    let same = env.send(&conv, "u-ana", "m1", text("hi")).await;
    let other = env.send(&conv, "u-ana", "m1", text("something else")).await;
    let after = (log_shape(&c, &conv).await, tombstones(&c, &conv).await);
    let pass = purged == 3
        && buried == 1
        && rejected(&same, &Rejection::IdempotencyKeyExpired)
        && rejected(&other, &Rejection::IdempotencyMismatch)
        && before == after
        && after.0 .3
        && after.1 .0 == 1;
    let observed = json!({"first_seq": first.seq, "purged": purged, "tombstones_written": buried,
        "same_body": format!("{same:?}"), "other_body": format!("{other:?}"),
        "log_before_retries": format!("{:?}", before.0), "log_after_retries": format!("{:?}", after.0),
        "tombstones_after": after.1 .0});
    let pass = check.resolve(observed, pass);

    c.execute("DELETE FROM idem_tombstones WHERE conv_id = $1", &[&conv.as_str()]).await.expect("drop tombstones");
    let retry = env.send(&conv, "u-ana", "m1", text("hi")).await;
    let appended = matches!(&retry, Ok(ack) if !ack.dup && ack.seq == after.0 .1);
    let rows: i64 = c
        .query_one("SELECT count(*) FROM events WHERE conv_id = $1 AND client_msg_id = 'm1'", &[&conv.as_str()])
        .await
        .expect("rows of m1")
        .get(0);
    let control_pass = control.resolve(
        json!({"retry": format!("{retry:?}"), "head_before": after.0 .1 - 1, "rows_of_m1_now": rows,
               "duplicate_appended": appended}),
        appended && rows == 1,
    );
    assert!(pass && control_pass);
}

/// The latencies (ms) of sends by `senders` tasks, each sending one after
/// another with keys `<tag>-<i>-<n>` until `stop` says so (at least once).
async fn send_until(
    env: &Env,
    conv: &ConvId,
    senders: usize,
    tag: &str,
    stop: impl Fn(usize) -> bool,
) -> (Vec<(String, f64, Instant)>, Vec<String>) {
    let runs = (0..senders).map(|i| {
        let stop = &stop;
        async move {
            let (mut acked, mut failed) = (vec![], vec![]);
            let user = format!("u-s{i}");
            let mut n = 0;
            loop {
                let key = format!("{tag}-{i}-{n}");
                let started = Instant::now();
                match env.send(conv, &user, &key, text("busy")).await {
                    Ok(_) => acked.push((key, started.elapsed().as_secs_f64() * 1000.0, started)),
                    Err(e) => failed.push(format!("{key}: {e:?}")),
                }
                n += 1;
                if stop(n) {
                    return (acked, failed);
                }
            }
        }
    });
    let done = futures_util::future::join_all(runs).await;
    let (mut acked, mut failed) = (vec![], vec![]);
    for (a, f) in done {
        acked.extend(a);
        failed.extend(f);
    }
    (acked, failed)
}

fn p99(acked: &[(String, f64, Instant)]) -> f64 {
    let mut ms: Vec<f64> = acked.iter().map(|(_, ms, _)| *ms).collect();
    ms.sort_by(f64::total_cmp);
    ms.get(ms.len() * 99 / 100).copied().unwrap_or(0.0)
}

fn max_ms(latencies: impl Iterator<Item = f64>) -> f64 {
    latencies.fold(0.0, f64::max)
}

#[actix_web::test]
async fn a_purge_next_to_64_busy_senders_loses_nothing_and_never_holds_them_for_the_purge() {
    const SENDERS: usize = 64;
    const OLD: i64 = 20_000;
    const CHUNK: i64 = 100;
    const BASELINE: Duration = Duration::from_millis(1500);
    let check = Check::start(
        SUITE,
        "11-purge-under-load",
        "actor, chunk 100",
        "20,000 expired events purged while 64 senders write: log gapless from the new min_seq to head, every \
         acked send stored or tombstoned, the longest ack during the purge under a quarter of the purge's length \
         (writers wait at most for a chunk's min_seq UPDATE, never for the purge; max and p99 reported against as \
         long a run before it), \
         sync below min_seq and from the read cursor truncated:true from min_seq, periods and read cursor unchanged",
    );
    let env = Env::with_pool(Path::Actor, 24).await;
    let names: Vec<String> = (0..SENDERS).map(|i| format!("u-s{i}")).collect();
    let others: Vec<&str> = names.iter().map(String::as_str).collect();
    let conv = hour_group(&env, "g-busy", &others).await;
    let c = env.db.client().await;
    old_history(&c, &conv, OLD).await;
    age_all(&c, &conv).await;
    let read_at = env.store().mark_read(&conv, &uid("u-ana"), 10_000).await.expect("mark read");
    let periods_before = periods(&c, &conv).await;

    // As long as a purge takes, so the maxima compare like with like.
    let baseline_started = Instant::now();
    let (baseline, baseline_failed) =
        send_until(&env, &conv, SENDERS, "before", |_| baseline_started.elapsed() > BASELINE).await;
    let purging = std::cell::Cell::new(true);
    let purge = async {
        let started = Instant::now();
        let done = env.store().purge_conversation(&conv, Pace::chunk(CHUNK)).await;
        purging.set(false);
        (done, started, started.elapsed())
    };
    let ((purged, purge_started, purge_took), (during, during_failed)) =
        tokio::join!(purge, send_until(&env, &conv, SENDERS, "during", |_| !purging.get()));
    let (events_purged, tombstones_written) = purged.expect("purge");

    let (min_seq, next_seq, rows, gapless) = log_shape(&c, &conv).await;
    let acked: Vec<&str> = baseline.iter().chain(&during).map(|(k, ..)| k.as_str()).collect();
    let kept = stored_or_tombstoned(&c, &conv, &acked).await;
    let (tombs, distinct_tombs) = tombstones(&c, &conv).await;
    let page = env.sync(&conv, "u-ana", 0).await.expect("sync from 0");
    let read_after = env.store().read_seq(&conv, &uid("u-ana")).await.expect("read seq");
    let from_cursor = env.sync(&conv, "u-ana", read_after).await.expect("sync from the read cursor");
    let periods_after = periods(&c, &conv).await;
    let joins = 1 + SENDERS as i64;
    let overlapping = during.iter().filter(|(_, _, at)| *at < purge_started + purge_took);
    let max_during = max_ms(overlapping.map(|(_, ms, _)| *ms));
    let max_before = max_ms(baseline.iter().map(|(_, ms, _)| *ms));
    let purge_ms = purge_took.as_secs_f64() * 1000.0;
    let chunks = (OLD + joins + CHUNK - 1) / CHUNK;
    let pass = baseline_failed.is_empty()
        && during_failed.is_empty()
        && events_purged == (OLD + joins) as u64
        && tombstones_written == OLD as u64
        && gapless
        && min_seq == OLD + joins + 1
        && kept == acked.len() as i64
        && tombs == OLD
        && distinct_tombs == OLD
        && page.truncated
        && page.events.first().map(|e| e.seq) == Some(min_seq)
        && periods_before == periods_after
        && read_after == read_at
        && from_cursor.truncated
        && from_cursor.events.first().map(|e| e.seq) == Some(min_seq)
        && max_during < purge_ms / 4.0;
    let pass = check.resolve(
        json!({"events_purged": events_purged, "tombstones_written": tombstones_written, "min_seq": min_seq,
               "head": next_seq - 1, "rows": rows, "gapless": gapless, "acked": acked.len(),
               "acked_stored_or_tombstoned": kept, "failed": baseline_failed.len() + during_failed.len(),
               "first_failures": baseline_failed.iter().chain(&during_failed).take(3).collect::<Vec<_>>(),
               "sends_during_purge": during.len(), "purge_ms": purge_ms, "chunks": chunks,
               "mean_chunk_ms": purge_ms / chunks as f64, "max_ack_ms_before": max_before,
               "max_ack_ms_during_purge": max_during, "sync_from_0_truncated": page.truncated,
               "sync_from_0_first_seq": page.events.first().map(|e| e.seq),
               "periods_unchanged": periods_before == periods_after, "read_seq": [read_at, read_after],
               "sync_from_read_seq_truncated": from_cursor.truncated, "p99_ack_ms_before": p99(&baseline),
               "p99_ack_ms_during_purge": p99(&during), "sends_before": baseline.len()}),
        pass,
    );
    assert!(pass);
}

#[actix_web::test]
async fn unread_counts_the_messages_after_a_purge_that_passed_the_read_cursor() {
    let check = Check::start(
        SUITE,
        "11-unread-after-purge",
        "store",
        "u-ben read up to seq 10; retention purges 3,002 events past it (more than the unread scan's rows); \
         u-ana then sends 3: u-ben's inbox keeps read_seq 10 and counts unread 3",
    );
    let env = Env::new(Path::Actor).await;
    let conv = hour_group(&env, "g-unread", &["u-ben"]).await;
    let c = env.db.client().await;
    old_history(&c, &conv, 3_000).await;
    age_all(&c, &conv).await;
    env.store().mark_read(&conv, &uid("u-ben"), 10).await.expect("mark read");
    let (purged, _) = env.store().purge_conversation(&conv, Pace::chunk(1_000)).await.expect("purge");
    for key in ["n1", "n2", "n3"] {
        env.send(&conv, "u-ana", key, text("new")).await.expect("send");
    }
    let inbox = env.store().inbox(&uid("u-ben"), 10, None).await.expect("inbox");
    let item = inbox.items.first().map(|i| (i.read_seq, i.unread));
    let pass = purged as i64 > UNREAD_SCAN_ROWS && item == Some((10, 3));
    let pass = check
        .resolve(json!({"events_purged": purged, "inbox_read_seq_unread": item, "head": env.head(&conv).await}), pass);
    assert!(pass);
}

/// Polls `sql` (one number, `$1` the conversation) until `want` holds, at most 10 s.
async fn eventually(c: &tokio_postgres::Client, sql: &str, conv: &str, want: impl Fn(i64) -> bool) -> Option<i64> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let v: i64 = c.query_one(sql, &[&conv]).await.expect("poll").get(0);
        if want(v) {
            return Some(v);
        }
        if Instant::now() > deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
