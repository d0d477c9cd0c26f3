//! The commit stage merging many conversations beside a direct writer.

use super::*;

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
