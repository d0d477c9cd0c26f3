//! Idle eviction racing sends.

use super::*;

// 5. Idle eviction racing sends.

pub(super) async fn eviction_races(workers: usize) {
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
