//! The conversation-actor write path against a real PostgreSQL (issue
//! "Conversation actors with group commit", item 4): issue order (P6), two
//! writers on one log, a backend killed mid-batch, overload shedding, idle
//! eviction racing sends, and the commit stage merging many conversations.
//! Each check runs with one transaction per conversation batch and, where
//! the commit stage changes what happens, with the merged commit stage too;
//! each writes its record to evidence/im-04.

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use futures_util::future::join_all;
use imcore::config::{EngineSettings, WriteSettings};
use imcore::store::{CreateConversation, GroupSettings, SendAck, Store, Written};
use imcore::writer::{Engine, WriteFailure, Writer};
use imcore_actors::ConvId;
use serde_json::json;
use uuid::Uuid;

use crate::env::{cid, send_op, text, uid, Path};
use crate::evidence::record;
use crate::harness::TestDb;

const SUITE: &str = "im-04";

/// The evidence variant of an actor writer with `workers` commit-stage workers.
fn variant(workers: usize) -> &'static str {
    if workers == 0 {
        "actor"
    } else {
        "actor+commit-stage"
    }
}

/// A writer over `store`, built as the server builds its own.
fn writer(store: Store, write: WriteSettings) -> Writer {
    Engine::start(store, &EngineSettings { write, ..EngineSettings::default() }).writer
}

/// The server's actor path with `workers` commit-stage workers (0: one
/// transaction per conversation batch) on `arbiters` arbiters.
fn actor_path(workers: usize, arbiters: usize) -> WriteSettings {
    WriteSettings { commit_workers: workers, arbiters, ..WriteSettings::on(Path::Actor) }
}

/// Creates `users` and a group of them, created by the first.
async fn group(store: &Store, id: &str, users: &[&str]) -> ConvId {
    for u in users {
        store.create_user(&uid(u), None).await.expect("create user");
    }
    create_group(store, id, users).await
}

/// A group of existing `users`, created by the first.
async fn create_group(store: &Store, id: &str, users: &[&str]) -> ConvId {
    store
        .create_conversation(&CreateConversation::Group {
            creator: uid(users[0]),
            conv_id: Some(cid(id)),
            name: id.into(),
            members: users[1..].iter().map(|m| uid(m)).collect(),
            settings: GroupSettings::default(),
        })
        .await
        .expect("create group")
        .info
        .conv_id
}

fn ack(r: &Result<Written, WriteFailure>) -> Option<&SendAck> {
    match r {
        Ok(Written::Sent(a)) => Some(a),
        _ => None,
    }
}

/// A stored message as a caller's ack describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Row {
    seq: i64,
    message_id: Uuid,
    created_at: DateTime<Utc>,
}

impl Row {
    fn of(a: &SendAck) -> Self {
        Self { seq: a.seq, message_id: a.message_id, created_at: a.created_at }
    }
}

/// `(conv_id, sender_user, client_msg_id)`.
type Key = (String, String, String);

fn key(conv: &ConvId, user: &str, k: &str) -> Key {
    (conv.to_string(), user.to_owned(), k.to_owned())
}

/// Every stored message of the database, by request key, and how many rows
/// there are (more rows than keys would be a duplicate).
async fn stored_messages(c: &tokio_postgres::Client) -> (HashMap<Key, Row>, usize) {
    let rows = c
        .query(
            "SELECT conv_id, sender_user, client_msg_id, seq, message_id, created_at FROM events WHERE kind = 'msg'",
            &[],
        )
        .await
        .expect("stored messages");
    let n = rows.len();
    let map = rows
        .iter()
        .map(|r| {
            let k = (r.get(0), r.get(1), r.get(2));
            (k, Row { seq: r.get(3), message_id: r.get(4), created_at: r.get(5) })
        })
        .collect();
    (map, n)
}

/// `(count, max(seq), next_seq)` of one conversation's log.
async fn log_stats(c: &tokio_postgres::Client, conv: &ConvId) -> (i64, i64, i64) {
    let r = c
        .query_one(
            "SELECT count(e.seq), coalesce(max(e.seq), 0), (SELECT next_seq FROM conversations WHERE conv_id = $1)
               FROM events e WHERE e.conv_id = $1",
            &[&conv.as_str()],
        )
        .await
        .expect("log stats");
    (r.get(0), r.get(1), r.get(2))
}

fn gapless((count, max, next_seq): (i64, i64, i64)) -> bool {
    count == max && next_seq == max + 1
}

/// Waits until a backend of this database other than `c`'s own matches
/// `condition` (a `pg_stat_activity` predicate) and returns its pid.
async fn stalled_backend(c: &tokio_postgres::Client, condition: &str) -> Option<i32> {
    let sql = format!(
        "SELECT pid FROM pg_stat_activity
          WHERE datname = current_database() AND pid <> pg_backend_pid() AND {condition}"
    );
    let deadline = Instant::now() + Duration::from_secs(4);
    while Instant::now() < deadline {
        if let Some(r) = c.query_opt(&sql, &[]).await.expect("pg_stat_activity") {
            return Some(r.get(0));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    None
}

/// The writer's transaction waiting for a conversation row lock.
const WAITING_FOR_ROW_LOCK: &str = "wait_event_type = 'Lock' AND query LIKE '%FOR NO KEY UPDATE%'";

// ---------------------------------------------------------------------------
// 1. P6: one client's sends commit in issue order.

async fn issue_order(workers: usize) {
    const N: usize = 500;
    let db = TestDb::with_pool(16).await;
    let conv = group(&db.store, "g-p6", &["u-ana", "u-ben"]).await;
    let w = writer(db.store.clone(), actor_path(workers, 2));
    // Every future is created (and its op queued) before any is awaited.
    let pending: Vec<_> =
        (0..N).map(|i| w.write(conv.clone(), send_op("u-ana", &format!("p6-{i}"), text(&format!("m{i}"))))).collect();
    let results = join_all(pending).await;
    let seqs: Vec<i64> = results.iter().filter_map(ack).map(|a| a.seq).collect();
    let failed: Vec<String> = results.iter().filter_map(|r| r.as_ref().err()).map(|e| format!("{e:?}")).collect();
    let increasing = seqs.windows(2).all(|p| p[0] < p[1]);
    let c = db.client().await;
    let stats = log_stats(&c, &conv).await;
    let transactions: i64 = c
        .query_one(
            "SELECT count(DISTINCT xmin::text) FROM events WHERE conv_id = $1 AND kind = 'msg'",
            &[&conv.as_str()],
        )
        .await
        .expect("transactions")
        .get(0);
    let pass = failed.is_empty() && seqs.len() == N && increasing && gapless(stats) && seqs.last() == Some(&stats.1);
    record(
        SUITE,
        "actor-p6-issue-order",
        variant(workers),
        "one client's 500 sends to one conversation, futures created in order then joined: all succeed, seqs strictly \
         increasing in issue order, the last is the head, log gapless",
        json!({"sends": N, "failed": failed.len(), "first_failures": &failed[..failed.len().min(3)],
               "strictly_increasing": increasing, "first_seq": seqs.first(), "last_seq": seqs.last(),
               "log": {"count": stats.0, "max": stats.1, "next_seq": stats.2}, "transactions": transactions}),
        pass,
    );
    assert!(pass);
}

// ---------------------------------------------------------------------------
// 2. Two writers on one database and one conversation, every key through both.

async fn two_writers_one_log(second: Path, workers: usize) {
    const KEYS: usize = 300;
    const TASKS: usize = 24;
    let db = TestDb::with_pool(16).await;
    let conv = group(&db.store, "g-two", &["u-ana", "u-ben"]).await;
    // As two nodes would be: separate pools, separate hubs (or no hub).
    let other = Store::connect(&db.url, 16).await.expect("second store");
    let writers = [
        writer(db.store.clone(), actor_path(workers, 2)),
        writer(other, WriteSettings { path: second, ..actor_path(workers, 2) }),
    ];
    let user = |i: usize| if i % 2 == 0 { "u-ana" } else { "u-ben" };
    // TASKS tasks, each going through its share of the keys one at a time:
    // both sends of a key start together (which one first alternates), so
    // each key is a retry racing its original, while the other tasks' keys
    // keep both writers busy.
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let (writers, conv) = (writers.clone(), conv.clone());
            actix_web::rt::spawn(async move {
                let mut answers = vec![];
                for i in (t..KEYS).step_by(TASKS) {
                    let op = send_op(user(i), &format!("k{i}"), text(&format!("both {i}")));
                    let first = i / TASKS % 2;
                    let a = writers[first].write(conv.clone(), op.clone());
                    let b = writers[1 - first].write(conv.clone(), op);
                    let (a, b) = futures_util::join!(a, b);
                    answers.push((i, first, a));
                    answers.push((i, 1 - first, b));
                }
                answers
            })
        })
        .collect();
    let mut acks: Vec<[Option<SendAck>; 2]> = vec![[None, None]; KEYS];
    let mut failures = vec![];
    for done in join_all(tasks).await {
        for (i, side, result) in done.expect("send task") {
            match result {
                Ok(Written::Sent(a)) => acks[i][side] = Some(a),
                other => failures.push(format!("k{i} via {side}: {other:?}")),
            }
        }
    }
    let c = db.client().await;
    let (stored, rows) = stored_messages(&c).await;
    let stats = log_stats(&c, &conv).await;
    let (mut disagree, mut unlike_stored, mut fresh_not_one) = (vec![], vec![], vec![]);
    let mut fresh_by = [0usize; 2];
    for (i, pair) in acks.iter().enumerate() {
        let [Some(a), Some(b)] = pair else { continue };
        if Row::of(a) != Row::of(b) {
            disagree.push(format!("k{i}: {a:?} vs {b:?}"));
        }
        if stored.get(&key(&conv, user(i), &format!("k{i}"))) != Some(&Row::of(a)) {
            unlike_stored.push(format!("k{i}"));
        }
        match (a.dup, b.dup) {
            (false, true) => fresh_by[0] += 1,
            (true, false) => fresh_by[1] += 1,
            _ => fresh_not_one.push(format!("k{i}")),
        }
    }
    let pass = failures.is_empty()
        && disagree.is_empty()
        && unlike_stored.is_empty()
        && fresh_not_one.is_empty()
        && rows == KEYS
        && stored.len() == KEYS
        && gapless(stats);
    let second_name = match second {
        Path::Actor => "actor",
        Path::Direct => "direct",
    };
    let (id, v) = match second {
        Path::Actor => ("actor-two-hubs-one-log", variant(workers).to_owned()),
        Path::Direct => ("actor-and-direct-one-log", format!("{}+{second_name}", variant(workers))),
    };
    record(
        SUITE,
        id,
        &v,
        "two writers on one database write one conversation, every one of 300 keys sent through both at once: all \
         succeed, one row per key, exactly one fresh ack per key, both acks equal (seq, message_id, created_at) \
         and equal the stored row, log gapless",
        json!({"keys": KEYS, "second_writer": second_name, "failures": failures.len(),
               "first_failures": &failures[..failures.len().min(3)], "acks_disagree": disagree.len(),
               "acks_unlike_stored": unlike_stored.len(), "keys_without_exactly_one_fresh_ack": fresh_not_one.len(),
               "fresh_by_first_writer": fresh_by[0], "fresh_by_second_writer": fresh_by[1],
               "message_rows": rows, "distinct_keys": stored.len(),
               "log": {"count": stats.0, "max": stats.1, "next_seq": stats.2}}),
        pass,
    );
    assert!(pass);
}

// ---------------------------------------------------------------------------
// 3. A backend killed in the middle of a batch.

#[derive(Clone, Copy, PartialEq, Eq)]
enum Stall {
    /// A test connection holds the conversation row lock; the batch waits for it.
    RowLock,
    /// A deferred constraint trigger sleeps at COMMIT for a body with "STALL".
    AtCommit,
}

/// Sleeps 2 s at COMMIT — after the events INSERT and the next_seq UPDATE ran —
/// for a body carrying "STALL" (the pattern of store_rules' commit fault).
const INJECT_COMMIT_STALL: &str = "
CREATE FUNCTION stall_at_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.body LIKE '%STALL%' THEN PERFORM pg_sleep(2); END IF;
  RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER stall_at_commit AFTER INSERT ON events
  DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION stall_at_commit();";

const REMOVE_COMMIT_STALL: &str = "DROP TRIGGER stall_at_commit ON events; DROP FUNCTION stall_at_commit();";

async fn killed_mid_batch(stall: Stall, workers: usize) {
    const N: usize = 50;
    let db = TestDb::with_pool(8).await;
    let conv = group(&db.store, "g-kill", &["u-ana", "u-ben"]).await;
    // Arbiter 0: the actor runs on this thread, so the 50 ops queued below
    // without yielding are all in its mailbox at its next poll: one batch.
    let w = writer(db.store.clone(), actor_path(workers, 0));
    w.write(conv.clone(), send_op("u-ana", "warm", text("warm"))).await.expect("warm-up send");
    let watcher = db.client().await;
    let holder = db.client().await;
    let before = log_stats(&watcher, &conv).await;
    let condition = match stall {
        Stall::RowLock => {
            holder
                .batch_execute(&format!("BEGIN; SELECT 1 FROM conversations WHERE conv_id = '{conv}' FOR UPDATE"))
                .await
                .expect("hold the row lock");
            WAITING_FOR_ROW_LOCK
        }
        Stall::AtCommit => {
            holder.batch_execute(INJECT_COMMIT_STALL).await.expect("inject stall");
            "wait_event = 'PgSleep'"
        }
    };
    let op = |i: usize| {
        let body = if stall == Stall::AtCommit && i == N / 2 { format!("STALL {i}") } else { format!("batch {i}") };
        send_op(if i % 2 == 0 { "u-ana" } else { "u-ben" }, &format!("b{i}"), text(&body))
    };
    let pending: Vec<_> = (0..N).map(|i| w.write(conv.clone(), op(i))).collect();
    let stalled = stalled_backend(&watcher, condition).await;
    let terminated = match stalled {
        Some(pid) => {
            watcher.query_one("SELECT pg_terminate_backend($1)", &[&pid]).await.expect("terminate").get::<_, bool>(0)
        }
        None => false,
    };
    let results = join_all(pending).await;
    if stall == Stall::RowLock {
        holder.batch_execute("ROLLBACK").await.expect("release the row lock");
    }
    let internal = results.iter().filter(|r| matches!(r, Err(WriteFailure::Internal(_)))).count();
    let others: Vec<String> =
        results.iter().filter(|r| !matches!(r, Err(WriteFailure::Internal(_)))).map(|r| format!("{r:?}")).collect();
    let keys: Vec<String> = (0..N).map(|i| format!("b{i}")).collect();
    let count_keys = "SELECT count(*) FROM events WHERE conv_id = $1 AND client_msg_id = ANY($2)";
    let stored_of_batch: i64 =
        watcher.query_one(count_keys, &[&conv.as_str(), &keys]).await.expect("batch rows").get(0);
    let after_kill = log_stats(&watcher, &conv).await;

    // The actor carries on.
    let next = w.write(conv.clone(), send_op("u-ana", "after-kill", text("after"))).await;
    let next_seq_ok = ack(&next).is_some_and(|a| !a.dup && a.seq == before.1 + 1);
    if stall == Stall::AtCommit {
        holder.batch_execute(REMOVE_COMMIT_STALL).await.expect("remove stall");
    }
    // Every failed send again, same key and body: exactly one row each.
    let failed: Vec<usize> = (0..N).filter(|&i| results[i].is_err()).collect();
    let retried = join_all(failed.iter().map(|&i| w.write(conv.clone(), op(i)))).await;
    let retry_failures = retried.iter().filter(|r| !matches!(ack(r), Some(a) if !a.dup)).count();
    let rows_per_key: Vec<i64> = watcher
        .query(
            "SELECT count(e.seq) FROM unnest($2::text[]) AS k(key)
               LEFT JOIN events e ON e.conv_id = $1 AND e.client_msg_id = k.key GROUP BY k.key",
            &[&conv.as_str(), &keys],
        )
        .await
        .expect("rows per key")
        .iter()
        .map(|r| r.get(0))
        .collect();
    let one_row_each = rows_per_key.len() == N && rows_per_key.iter().all(|&n| n == 1);
    let fin = log_stats(&watcher, &conv).await;
    let pass = terminated
        && internal == N
        && stored_of_batch == 0
        && after_kill == before
        && next_seq_ok
        && retry_failures == 0
        && one_row_each
        && gapless(fin)
        && fin.0 == before.0 + 1 + N as i64;
    let (id, expected) = match stall {
        Stall::RowLock => (
            "actor-backend-killed-waiting-for-row-lock",
            "50 sends in one batch whose backend is terminated while it waits for the conversation row lock: all 50 \
             get INTERNAL, none stored, log unchanged; the actor then appends the next send at the next seq; \
             retrying the 50 with the same keys gives one row each, log gapless",
        ),
        Stall::AtCommit => (
            "actor-backend-killed-at-commit",
            "50 sends in one batch whose backend is terminated while a deferred trigger sleeps at COMMIT: all 50 get \
             INTERNAL, none stored, log unchanged; the actor then appends the next send at the next seq; after \
             dropping the trigger, retrying the 50 with the same keys gives one row each, log gapless",
        ),
    };
    record(
        SUITE,
        id,
        variant(workers),
        expected,
        json!({"batch": N, "stalled_backend_found": stalled.is_some(), "terminated": terminated, "internal": internal,
               "other_answers": &others[..others.len().min(3)], "batch_rows_stored": stored_of_batch,
               "log_before": before, "log_after_kill": after_kill, "next_send": format!("{next:?}"),
               "retried": failed.len(), "retry_failures": retry_failures, "one_row_per_key": one_row_each,
               "log_final": fin}),
        pass,
    );
    assert!(pass);
}

// ---------------------------------------------------------------------------
// 4. OVERLOADED: a flood against a stalled batch is shed, nothing acked is lost.

async fn overload_sheds(workers: usize) {
    const N: usize = 1_000;
    let db = TestDb::with_pool(8).await;
    let conv = group(&db.store, "g-flood", &["u-ana", "u-ben"]).await;
    // The actor on an arbiter of its own: it drains its mailbox into its queue
    // while the flood goes on, so both bounds are met.
    let w = writer(db.store.clone(), WriteSettings { max_queue: 32, actor_mailbox: 16, ..actor_path(workers, 1) });
    w.write(conv.clone(), send_op("u-ana", "warm", text("warm"))).await.expect("warm-up send");
    let watcher = db.client().await;
    let holder = db.client().await;
    holder
        .batch_execute(&format!("BEGIN; SELECT 1 FROM conversations WHERE conv_id = '{conv}' FOR UPDATE"))
        .await
        .expect("hold the row lock");

    let released = Rc::new(Cell::new(false));
    let mut tasks = Vec::with_capacity(N);
    for i in 0..N {
        let reply = w.write(conv.clone(), send_op("u-ana", &format!("f{i}"), text(&format!("flood {i}"))));
        let released = released.clone();
        tasks.push(actix_web::rt::spawn(async move {
            let result = reply.await;
            (i, result, !released.get())
        }));
        if i % 50 == 49 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    let waiting = stalled_backend(&watcher, WAITING_FOR_ROW_LOCK).await.is_some();
    tokio::time::sleep(Duration::from_millis(100)).await;
    released.set(true);
    holder.batch_execute("ROLLBACK").await.expect("release the row lock");

    let (mut acked, mut overloaded, mut other) = (vec![], vec![], vec![]);
    let (mut overloaded_while_held, mut acked_while_held) = (0, 0);
    for done in join_all(tasks).await {
        let (i, result, while_held) = done.expect("send task");
        match result {
            Ok(Written::Sent(a)) => {
                acked_while_held += usize::from(while_held);
                acked.push((i, a));
            }
            Err(WriteFailure::Overloaded) => {
                overloaded_while_held += usize::from(while_held);
                overloaded.push(i);
            }
            r => other.push(format!("f{i}: {r:?}")),
        }
    }
    let after = w.write(conv.clone(), send_op("u-ana", "after-flood", text("after"))).await;
    let c = db.client().await;
    let (stored, rows) = stored_messages(&c).await;
    let stats = log_stats(&c, &conv).await;
    let acked_unlike_stored = acked
        .iter()
        .filter(|(i, a)| a.dup || stored.get(&key(&conv, "u-ana", &format!("f{i}"))) != Some(&Row::of(a)))
        .count();
    let overloaded_stored =
        overloaded.iter().filter(|i| stored.contains_key(&key(&conv, "u-ana", &format!("f{i}")))).count();
    let pass = waiting
        && overloaded_while_held > 0
        && acked_while_held == 0
        && !acked.is_empty()
        && other.is_empty()
        && acked.len() + overloaded.len() == N
        && acked_unlike_stored == 0
        && overloaded_stored == 0
        && ack(&after).is_some()
        && rows == acked.len() + 2
        && gapless(stats);
    record(
        SUITE,
        "actor-overloaded-sheds",
        variant(workers),
        "max_queue 32, mailbox 16, a batch stalled on the row lock, 1,000 sends: OVERLOADED answers arrive while the \
         lock is still held and no send is acked then; after release every send is acked or OVERLOADED, every acked \
         send is stored exactly as acked, no OVERLOADED key is stored, the next send succeeds, log gapless",
        json!({"sends": N, "writer_waiting_on_lock": waiting, "overloaded_while_held": overloaded_while_held,
               "acked_while_held": acked_while_held, "acked": acked.len(), "overloaded": overloaded.len(),
               "other": &other[..other.len().min(3)], "acked_unlike_stored": acked_unlike_stored,
               "overloaded_stored": overloaded_stored, "send_after_flood": format!("{:?}", after.map(|_| "ok")),
               "message_rows": rows, "log": stats}),
        pass,
    );
    assert!(pass);
}

// ---------------------------------------------------------------------------
// 5. Idle eviction racing sends.

async fn eviction_races(workers: usize) {
    const TASKS: usize = 4;
    const ROUNDS: usize = 200;
    let db = TestDb::with_pool(8).await;
    let users = ["u-ana", "u-t0", "u-t1", "u-t2", "u-t3"];
    let conv = group(&db.store, "g-idle", &users).await;
    let w = writer(db.store.clone(), WriteSettings { actor_idle_ms: 5, ..actor_path(workers, 2) });
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let (w, conv) = (w.clone(), conv.clone());
            actix_web::rt::spawn(async move {
                let user = format!("u-t{t}");
                let mut answers = vec![];
                for r in 0..ROUNDS {
                    // 1–3 ops issued back to back, then a pause of 2–8 ms
                    // around the 5 ms idle timeout.
                    let pending: Vec<_> = (0..1 + (r + t) % 3)
                        .map(|j| {
                            let k = format!("t{t}-r{r}-{j}");
                            let reply = w.write(conv.clone(), send_op(&user, &k, text(&k)));
                            async move { (k, reply.await) }
                        })
                        .collect();
                    answers.extend(join_all(pending).await);
                    tokio::time::sleep(Duration::from_millis(2 + ((r * 7 + t * 3) % 7) as u64)).await;
                }
                (user, answers)
            })
        })
        .collect();
    let answered: Vec<_> = join_all(tasks).await.into_iter().map(|done| done.expect("sender task")).collect();
    let c = db.client().await;
    let (stored, rows) = stored_messages(&c).await;
    let (mut sends, mut failures, mut out_of_order, mut unlike_stored) = (0, vec![], 0, 0);
    for (user, answers) in answered {
        let mut last = 0;
        for (k, result) in answers {
            sends += 1;
            match ack(&result) {
                Some(a) if !a.dup => {
                    out_of_order += usize::from(a.seq <= last);
                    last = a.seq;
                    unlike_stored += usize::from(stored.get(&key(&conv, &user, &k)) != Some(&Row::of(a)));
                }
                _ => failures.push(format!("{k}: {result:?}")),
            }
        }
    }
    let stats = log_stats(&c, &conv).await;
    let started = match &w {
        Writer::Actor(hub) => hub.actors_started(),
        Writer::Direct(_) => 0,
    };
    let pass = failures.is_empty()
        && out_of_order == 0
        && unlike_stored == 0
        && rows == sends
        && stored.len() == sends
        && gapless(stats)
        && started > 1;
    record(
        SUITE,
        "actor-idle-eviction-races-sends",
        variant(workers),
        "idle_timeout 5 ms, 4 senders x 200 rounds of 1-3 back-to-back sends and a 2-8 ms pause: every send acked \
         fresh, each sender's seqs increasing in issue order, one row per key as acked, log gapless, actors evicted \
         and restarted along the way",
        json!({"senders": TASKS, "rounds": ROUNDS, "sends": sends, "failures": failures.len(),
               "first_failures": &failures[..failures.len().min(3)], "out_of_order": out_of_order,
               "acked_unlike_stored": unlike_stored, "message_rows": rows, "distinct_keys": stored.len(),
               "log": stats, "actors_started": started}),
        pass,
    );
    assert!(pass);
}

// ---------------------------------------------------------------------------
// 6. The commit stage merging many conversations beside a direct writer.

#[actix_web::test]
async fn the_commit_stage_merges_many_conversations_without_deadlock_beside_a_direct_writer() {
    const CONVS: usize = 300;
    const SENDERS: usize = 256;
    const DIRECT_SENDERS: usize = 8;
    /// The direct writer hits the first of the conversations the actors write.
    const DIRECT_CONVS: usize = 30;
    const RUN: Duration = Duration::from_secs(2);
    let db = TestDb::with_pool(16).await;
    for u in ["u-ana", "u-ben"] {
        db.store.create_user(&uid(u), None).await.expect("create user");
    }
    let mut convs = Vec::with_capacity(CONVS);
    for chunk in (0..CONVS).collect::<Vec<_>>().chunks(12) {
        let created = join_all(chunk.iter().map(|i| {
            let store = db.store.clone();
            async move { create_group(&store, &format!("g-m{i:03}"), &["u-ana", "u-ben"]).await }
        }))
        .await;
        convs.extend(created);
    }
    let convs = Arc::new(convs);
    let actor = writer(db.store.clone(), actor_path(2, 2));
    let direct_store = Store::connect(&db.url, 8).await.expect("direct store");
    let direct = writer(direct_store, WriteSettings { arbiters: 0, ..WriteSettings::on(Path::Direct) });

    let deadline = Instant::now() + RUN;
    let spawn_sender = |w: Writer, user: &'static str, prefix: String, pick: Box<dyn Fn(usize) -> usize>| {
        let convs = convs.clone();
        actix_web::rt::spawn(async move {
            let mut answers = vec![];
            let mut n = 0;
            while Instant::now() < deadline {
                let conv = convs[pick(n)].clone();
                let k = format!("{prefix}-{n}");
                let result = w.write(conv.clone(), send_op(user, &k, text(&k))).await;
                answers.push((key(&conv, user, &k), result));
                n += 1;
            }
            answers
        })
    };
    let mut tasks = Vec::with_capacity(SENDERS + DIRECT_SENDERS);
    for s in 0..SENDERS {
        tasks.push(spawn_sender(actor.clone(), "u-ana", format!("a{s}"), Box::new(move |n| (s * 7 + n * 13) % CONVS)));
    }
    for d in 0..DIRECT_SENDERS {
        tasks.push(spawn_sender(
            direct.clone(),
            "u-ben",
            format!("d{d}"),
            Box::new(move |n| (d * 3 + n * 7) % DIRECT_CONVS),
        ));
    }
    let mut acked: Vec<(Key, SendAck)> = vec![];
    let mut failures = vec![];
    for done in join_all(tasks).await {
        for (k, result) in done.expect("sender task") {
            match result {
                Ok(Written::Sent(a)) => acked.push((k, a)),
                other => failures.push(format!("{k:?}: {other:?}")),
            }
        }
    }
    let direct_acked = acked.iter().filter(|(k, _)| k.1 == "u-ben").count();

    let c = db.client().await;
    let (stored, rows) = stored_messages(&c).await;
    let unlike_stored = acked.iter().filter(|(k, a)| a.dup || stored.get(k) != Some(&Row::of(a))).count();
    let not_gapless: Vec<(String, i64, i64, i64)> = c
        .query(
            "SELECT c.conv_id, count(e.seq), coalesce(max(e.seq), 0), c.next_seq
               FROM conversations c LEFT JOIN events e USING (conv_id)
              GROUP BY c.conv_id, c.next_seq
             HAVING count(e.seq) <> coalesce(max(e.seq), 0) OR c.next_seq <> coalesce(max(e.seq), 0) + 1",
            &[],
        )
        .await
        .expect("gapless per conversation")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    let merging = c
        .query_one(
            "SELECT count(*), coalesce(max(n), 0), count(*) FILTER (WHERE n > 1)
               FROM (SELECT count(DISTINCT conv_id) AS n FROM events WHERE kind = 'msg' GROUP BY xmin::text) t",
            &[],
        )
        .await
        .expect("conversations per transaction");
    let (transactions, most_convs, merged): (i64, i64, i64) = (merging.get(0), merging.get(1), merging.get(2));
    let deadlocks: i64 = c
        .query_one("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()", &[])
        .await
        .expect("deadlock count")
        .get(0);
    let mut per_conv: BTreeMap<&str, usize> = BTreeMap::new();
    for (k, _) in &acked {
        *per_conv.entry(k.0.as_str()).or_default() += 1;
    }
    let pass = failures.is_empty()
        && unlike_stored == 0
        && rows == acked.len()
        && stored.len() == acked.len()
        && not_gapless.is_empty()
        && direct_acked > 0
        && most_convs > 1
        && deadlocks == 0;
    record(
        SUITE,
        "actor-commit-stage-merges",
        "actor+commit-stage+direct",
        "300 conversations, 2 commit-stage workers, 256 actor-path senders for 2 s beside 8 direct senders on 30 of \
         the same conversations: every send succeeds (no 40P01), every acked send stored once as acked, every \
         conversation gapless with next_seq = max + 1, and some transaction holds messages of several conversations",
        json!({"conversations": CONVS, "actor_senders": SENDERS, "direct_senders": DIRECT_SENDERS,
               "seconds": RUN.as_secs_f64(), "acked": acked.len(), "direct_acked": direct_acked,
               "conversations_written": per_conv.len(), "failures": failures.len(),
               "first_failures": &failures[..failures.len().min(3)], "acked_unlike_stored": unlike_stored,
               "message_rows": rows, "not_gapless": &not_gapless[..not_gapless.len().min(3)],
               "message_transactions": transactions, "most_conversations_in_one_transaction": most_convs,
               "transactions_with_several_conversations": merged, "pg_stat_database_deadlocks": deadlocks}),
        pass,
    );
    assert!(pass);
}

macro_rules! on_both_commit_modes {
    ($($name:ident => $check:ident($($arg:expr),*);)*) => {
        /// One transaction per conversation batch.
        mod one_transaction_per_batch {
            use super::*;
            $(
                #[actix_web::test]
                async fn $name() {
                    $check($($arg,)* 0).await
                }
            )*
        }

        /// Batches merged across conversations by two commit-stage workers.
        mod merged_commit_stage {
            use super::*;
            $(
                #[actix_web::test]
                async fn $name() {
                    $check($($arg,)* 2).await
                }
            )*
        }
    };
}

// The last argument of each check is its number of commit-stage workers.
on_both_commit_modes! {
    one_clients_sends_get_strictly_increasing_seqs_in_issue_order => issue_order();
    two_hubs_sending_every_key_write_one_gapless_log_and_agree_on_every_ack => two_writers_one_log(Path::Actor);
    an_actor_and_a_direct_writer_sending_every_key_write_one_gapless_log_and_agree_on_every_ack =>
        two_writers_one_log(Path::Direct);
    a_batch_killed_while_waiting_for_the_row_lock_fails_as_a_whole_and_retries_once_each =>
        killed_mid_batch(Stall::RowLock);
    a_batch_killed_during_commit_fails_as_a_whole_and_retries_once_each => killed_mid_batch(Stall::AtCommit);
    a_flood_against_a_stalled_batch_is_shed_with_overloaded_and_loses_nothing_acked => overload_sheds();
    sends_racing_idle_eviction_are_all_answered_in_order_and_stored_once => eviction_races();
}
