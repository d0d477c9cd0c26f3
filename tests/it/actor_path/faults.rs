//! Faults: a backend killed mid-batch, and a flood shed with OVERLOADED.

use super::*;

// 3. A backend killed in the middle of a batch.

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Stall {
    /// A test connection holds the conversation row lock; the batch waits for it.
    RowLock,
    /// A deferred constraint trigger sleeps at COMMIT for a body with "STALL".
    AtCommit,
}

/// Sleeps 2 s at COMMIT — after the events INSERT and the next_seq UPDATE ran —
/// for a body carrying "STALL" (the pattern of store_rules' commit fault).
pub(super) const INJECT_COMMIT_STALL: &str = "
CREATE FUNCTION stall_at_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.body LIKE '%STALL%' THEN PERFORM pg_sleep(2); END IF;
  RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER stall_at_commit AFTER INSERT ON events
  DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION stall_at_commit();";

pub(super) const REMOVE_COMMIT_STALL: &str = "DROP TRIGGER stall_at_commit ON events; DROP FUNCTION stall_at_commit();";

pub(super) async fn killed_mid_batch(stall: Stall, workers: usize) {
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

// 4. OVERLOADED: a flood against a stalled batch is shed, nothing acked is lost.

pub(super) async fn overload_sheds(workers: usize) {
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
