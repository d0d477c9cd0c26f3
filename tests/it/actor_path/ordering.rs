//! Order: one client's sends (P6), and two writers on one log.

use super::*;

// 1. P6: one client's sends commit in issue order.

pub(super) async fn issue_order(workers: usize) {
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

// 2. Two writers on one database and one conversation, every key through both.

/// Whether the conversation row lock guards the log, or a negative control
/// took it away from the test's database.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RowLock {
    Held,
    TakenAway,
}

/// Most ops an actor commits in one transaction here: a key's two sends
/// meet across batches and across writers, not inside one batch.
pub(super) const SMALL_BATCH: usize = 4;

/// Runs of the control: a race needs the two writers' transactions to
/// overlap, and one-round-trip transactions overlap less; the control stops
/// at its first failing run.
const CONTROL_ROUNDS: usize = 5;

pub(super) async fn two_writers_one_log(second: Path, lock: RowLock, workers: usize) {
    let rounds = if lock == RowLock::TakenAway { CONTROL_ROUNDS } else { 1 };
    for round in 1..=rounds {
        // The last run records its verdict and asserts it.
        if !two_writers_round(second, lock, workers, round).await {
            return;
        }
    }
}

/// One run; whether the check held. Records and asserts the verdict when it
/// is the last run (the only one with the lock held).
async fn two_writers_round(second: Path, lock: RowLock, workers: usize, round: usize) -> bool {
    const KEYS: usize = 300;
    const TASKS: usize = 24;
    let db = TestDb::with_pool(16).await;
    let conv = group(&db.store, "g-two", &["u-ana", "u-ben"]).await;
    if lock == RowLock::TakenAway {
        db.take_away_conversation_row_lock().await;
    }
    // As two nodes would be: separate pools, separate hubs (or no hub).
    let other = Store::connect(&db.url, 16).await.expect("second store");
    let small = WriteSettings { max_batch: SMALL_BATCH, ..actor_path(workers, 2) };
    let writers = [writer(db.store.clone(), small.clone()), writer(other, WriteSettings { path: second, ..small })];
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
    let check = failures.is_empty()
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
    let (id, v) = match (second, lock) {
        (Path::Actor, RowLock::Held) => ("actor-two-hubs-one-log", variant(workers).to_owned()),
        (Path::Actor, RowLock::TakenAway) => ("actor-two-hubs-control-without-row-lock", variant(workers).to_owned()),
        (Path::Direct, _) => ("actor-and-direct-one-log", format!("{}+{second_name}", variant(workers))),
    };
    let expected = "two writers on one database write one conversation, actor batches of at most 4, every one of \
                    300 keys sent through both at once: all succeed, one row per key, exactly one fresh ack per key, \
                    both acks equal (seq, message_id, created_at) and equal the stored row, log gapless";
    let (expected, pass) = match lock {
        RowLock::Held => (expected.to_owned(), check),
        RowLock::TakenAway => (
            format!(
                "negative control, the row lock taken away, fails this check (in one of up to {CONTROL_ROUNDS} \
                 runs): {expected}"
            ),
            !check,
        ),
    };
    let last_round = lock == RowLock::Held || !check || round == CONTROL_ROUNDS;
    if last_round {
        record(
            SUITE,
            id,
            &v,
            &expected,
            json!({"keys": KEYS, "second_writer": second_name, "runs": round, "failures": failures.len(),
                   "first_failures": &failures[..failures.len().min(3)], "acks_disagree": disagree.len(),
                   "acks_unlike_stored": unlike_stored.len(), "keys_without_exactly_one_fresh_ack": fresh_not_one.len(),
                   "fresh_by_first_writer": fresh_by[0], "fresh_by_second_writer": fresh_by[1],
                   "message_rows": rows, "distinct_keys": stored.len(),
                   "log": {"count": stats.0, "max": stats.1, "next_seq": stats.2}}),
            pass,
        );
        assert!(pass);
    }
    check
}
