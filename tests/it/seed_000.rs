//! Seed 000 §7: the persistence-boundary checks, each under its id, run
//! against every write path. Each writes its record to evidence/im-04.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;
use imcore::domain::Rejection;
use imcore::domain::{LeaveReason, Role};
use imcore::store::{CreateConversation, GroupSettings, JoinOp, LeaveOp, SyncRequest, WriteOp, SYNC_FORWARD};
use serde_json::json;
use tokio::sync::Barrier;

use crate::env::{cid, text, uid, Env, Path, PathName, WriteErr};
use crate::evidence::record;

const SUITE: &str = "im-04";

async fn direct_chat(env: &Env) -> imcore_actors::ConvId {
    env.users(&["u-ana", "u-ben", "u-cai"]).await;
    let created = env
        .store()
        .create_conversation(&CreateConversation::Direct { creator: uid("u-ana"), other: uid("u-ben") })
        .await
        .expect("create direct");
    created.info.conv_id
}

fn is_rejected(r: &Result<impl std::fmt::Debug, WriteErr>, want: &Rejection) -> bool {
    matches!(r, Err(WriteErr::Rejected(got)) if got == want)
}

pub async fn normal_history(path: Path) {
    let env = Env::new(path).await;
    let conv = direct_chat(&env).await;
    let head_after_create = env.head(&conv).await;
    let ack = env.send(&conv, "u-ana", "m1", text("hi")).await.expect("send");
    let ana = env.visible_seqs(&conv, "u-ana").await;
    let ben = env.visible_seqs(&conv, "u-ben").await;
    let pass = head_after_create == 2 && ack.seq == 3 && !ack.dup && ana == [1, 2, 3] && ben == [2, 3];
    record(
        SUITE,
        "04-normal-history",
        path.name(),
        "head 2 after create; first message seq 3; u-ana sees join@1, join@2, msg@3; u-ben sees join@2, msg@3",
        json!({"head_after_create": head_after_create, "first_seq": ack.seq, "ana_sees": ana, "ben_sees": ben}),
        pass,
    );
    assert!(pass);
}

pub async fn non_member_rejected(path: Path) {
    let env = Env::new(path).await;
    let conv = direct_chat(&env).await;
    env.send(&conv, "u-ana", "m1", text("hi")).await.expect("send");
    let refused = env.send(&conv, "u-cai", "c1", text("let me in")).await;
    let head = env.head(&conv).await;
    let sync = env.sync(&conv, "u-cai", 0).await;
    let pass = is_rejected(&refused, &Rejection::NotMember)
        && head == 3
        && matches!(sync, Err(imcore::store::StoreError::Rejected(Rejection::NotMember)));
    record(
        SUITE,
        "04-non-member-rejected",
        path.name(),
        "non-member u-cai's send gets NOT_MEMBER, head stays 3; its sync gets NOT_MEMBER",
        json!({"send": format!("{refused:?}"), "head": head, "sync": format!("{:?}", sync.map(|p| p.head))}),
        pass,
    );
    assert!(pass);
}

pub async fn unknown_conv_same_error(path: Path) {
    let env = Env::new(path).await;
    let conv = direct_chat(&env).await;
    let ghost = cid("g-does-not-exist");
    let to_ghost = env.send(&ghost, "u-ana", "m1", text("hello?")).await;
    let non_member = env.send(&conv, "u-cai", "m1", text("hello?")).await;
    let sync_ghost = env.sync(&ghost, "u-ana", 0).await.map(|p| p.head);
    let get_ghost = env.store().get_conversation(&ghost, &uid("u-ana")).await.map(|c| c.head);
    let same = format!("{to_ghost:?}") == format!("{non_member:?}");
    let pass = is_rejected(&to_ghost, &Rejection::NotMember)
        && same
        && matches!(sync_ghost, Err(imcore::store::StoreError::Rejected(Rejection::NotMember)))
        && matches!(get_ghost, Err(imcore::store::StoreError::Rejected(Rejection::NotMember)));
    record(
        SUITE,
        "04-unknown-conv-same-error",
        path.name(),
        "send, sync and get on a conversation that does not exist answer NOT_MEMBER, identical to a non-member's answer",
        json!({"unknown_conv_send": format!("{to_ghost:?}"), "non_member_send": format!("{non_member:?}"),
               "unknown_conv_sync": format!("{sync_ghost:?}"), "unknown_conv_get": format!("{get_ghost:?}")}),
        pass,
    );
    assert!(pass);
}

pub async fn idempotency_mismatch(path: Path) {
    let env = Env::new(path).await;
    let conv = direct_chat(&env).await;
    let first = env.send(&conv, "u-ana", "m1", text("hi")).await.expect("send");
    let mismatch = env.send(&conv, "u-ana", "m1", text("something else")).await;
    let replay = env.send(&conv, "u-ana", "m1", text("hi")).await.expect("replay");
    let (count, ..) = env.log_stats(&conv).await;
    let pass = is_rejected(&mismatch, &Rejection::IdempotencyMismatch)
        && replay.dup
        && replay.seq == first.seq
        && replay.message_id == first.message_id
        && replay.created_at == first.created_at
        && count == 3;
    record(
        SUITE,
        "04-idempotency-mismatch",
        path.name(),
        "same client_msg_id with another body: IDEMPOTENCY_MISMATCH; with the same body: dup=true, original seq and message_id; one row",
        json!({"mismatch": format!("{mismatch:?}"), "replay_dup": replay.dup, "replay_seq": replay.seq,
               "first_seq": first.seq, "same_message_id": replay.message_id == first.message_id, "events": count}),
        pass,
    );
    assert!(pass);
}

pub async fn concurrent_replay_one_row(path: Path) {
    const N: usize = 32;
    let env = Arc::new(Env::with_pool(path, N as u32 + 2).await);
    let conv = direct_chat(&env).await;
    // Hold N pooled connections open so each send runs on its own connection.
    {
        let held: Vec<_> = join_all((0..N).map(|_| env.store().pool().get())).await;
        assert!(held.iter().all(Result::is_ok), "pool of {N}");
    }
    let barrier = Arc::new(Barrier::new(N));
    let tasks = (0..N).map(|_| {
        let (env, conv, barrier) = (env.clone(), conv.clone(), barrier.clone());
        async move {
            barrier.wait().await;
            env.send(&conv, "u-ana", "same-key", text("once")).await
        }
    });
    let acks: Vec<_> = join_all(tasks).await.into_iter().map(|r| r.expect("send")).collect();
    let c = env.db.client().await;
    let rows: i64 = c
        .query_one("SELECT count(*) FROM events WHERE conv_id = $1 AND client_msg_id = 'same-key'", &[&conv.as_str()])
        .await
        .expect("count")
        .get(0);
    let mut mids: Vec<_> = acks.iter().map(|a| a.message_id).collect();
    mids.dedup();
    let mut seqs: Vec<_> = acks.iter().map(|a| a.seq).collect();
    seqs.dedup();
    let fresh = acks.iter().filter(|a| !a.dup).count();
    let pass = rows == 1 && mids.len() == 1 && seqs.len() == 1 && fresh == 1;
    record(
        SUITE,
        "04-concurrent-replay-one-row",
        path.name(),
        "32 concurrent identical sends on 32 connections: 1 row, 1 message_id, 1 seq, exactly one dup=false",
        json!({"senders": N, "rows": rows, "distinct_message_id": mids.len(), "distinct_seq": seqs.len(), "fresh": fresh}),
        pass,
    );
    assert!(pass);
}

/// Negative control: the same race without the row lock and the unique index
/// ("check, then insert") does duplicate, so the check above has teeth.
pub async fn control_check_then_insert_duplicates(path: Path) {
    const N: usize = 32;
    let env = Env::new(path).await;
    let setup = env.db.client().await;
    setup.batch_execute("CREATE TABLE naive_events (client_msg_id text NOT NULL)").await.expect("naive table");
    let clients = join_all((0..N).map(|_| env.db.client())).await;
    let barrier = Arc::new(Barrier::new(N));
    join_all(clients.iter().map(|c| {
        let barrier = barrier.clone();
        async move {
            barrier.wait().await;
            let seen = c
                .query_opt("SELECT 1 FROM naive_events WHERE client_msg_id = 'same-key'", &[])
                .await
                .expect("check")
                .is_some();
            tokio::time::sleep(Duration::from_millis(5)).await; // widen the window, as seed 000 did
            if !seen {
                c.execute("INSERT INTO naive_events VALUES ('same-key')", &[]).await.expect("insert");
            }
        }
    }))
    .await;
    let rows: i64 = setup.query_one("SELECT count(*) FROM naive_events", &[]).await.expect("count").get(0);
    let pass = rows > 1;
    record(
        SUITE,
        "04-control-check-then-insert-duplicates",
        path.name(),
        "negative control: 32 concurrent check-then-insert without lock or unique index write more than 1 row",
        json!({"senders": N, "rows": rows}),
        pass,
    );
    assert!(pass, "the naive version should have duplicated");
}

pub async fn seq_gapless(path: Path) {
    const N: usize = 200;
    let env = Arc::new(Env::with_pool(path, 64).await);
    let conv = direct_chat(&env).await;
    let barrier = Arc::new(Barrier::new(N));
    let tasks = (0..N).map(|i| {
        let (env, conv, barrier) = (env.clone(), conv.clone(), barrier.clone());
        async move {
            barrier.wait().await;
            let user = if i % 2 == 0 { "u-ana" } else { "u-ben" };
            env.send(&conv, user, &format!("k{i}"), text(&format!("burst {i}"))).await
        }
    });
    let acks: Vec<_> = join_all(tasks).await;
    let failed = acks.iter().filter(|a| a.is_err()).count();
    let (count, min, max, next_seq) = env.log_stats(&conv).await;
    let mut seqs: Vec<i64> = acks.iter().flatten().map(|a| a.seq).collect();
    seqs.sort_unstable();
    seqs.dedup();
    let pass = failed == 0 && count == max && min == 1 && next_seq == max + 1 && max == 2 + N as i64 && seqs.len() == N;
    record(
        SUITE,
        "04-seq-gapless",
        path.name(),
        "200 concurrent distinct sends: count = max(seq), min = 1, next_seq = max + 1, 200 distinct acked seqs",
        json!({"senders": N, "failed": failed, "count": count, "min_seq": min, "max_seq": max, "next_seq": next_seq,
               "distinct_acked_seqs": seqs.len()}),
        pass,
    );
    assert!(pass);
}

/// Negative control: a database sequence does not give gapless numbers when
/// transactions roll back (seed 000 §5.1, option A).
pub async fn control_sequence_gaps(path: Path) {
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
        "04-control-sequence-gaps",
        path.name(),
        "negative control: 10 transactions take nextval, 3 roll back: 7 rows, max seq 10 (gaps)",
        json!({"transactions": 10, "rolled_back": 3, "rows": rows, "max_seq": max}),
        pass,
    );
    assert!(pass);
}

pub async fn history_uses_pk(path: Path) {
    const CONVS: i64 = 1_000;
    const PER_CONV: i64 = 1_000;
    let env = Env::new(path).await;
    env.users(&["u-ana"]).await;
    let c = env.db.client().await;
    c.batch_execute(&format!(
        "INSERT INTO conversations (conv_id, kind, next_seq)
           SELECT 'c-' || i, 'group', {PER_CONV} + 1 FROM generate_series(1, {CONVS}) i;
         INSERT INTO membership_periods (conv_id, user_id, from_seq)
           SELECT 'c-' || i, 'u-ana', 1 FROM generate_series(1, {CONVS}) i;
         INSERT INTO events (conv_id, seq, kind, message_id, sender_user, sender_device, client_msg_id,
                             request_hash, body, created_at)
           SELECT 'c-' || i, s, 'msg', gen_random_uuid(), 'u-ana', 'd1', 'k' || s,
                  sha256(('c-' || i || ':' || s)::bytea), '{{\"type\":\"text\",\"text\":\"' || repeat('x', 80) || '\"}}', now()
             FROM generate_series(1, {CONVS}) i, generate_series(1, {PER_CONV}) s;
         ANALYZE"
    ))
    .await
    .expect("load 1,000,000 events");
    let total: i64 = c.query_one("SELECT count(*) FROM events", &[]).await.expect("count").get(0);
    let plan: Vec<String> = c
        .query(&format!("EXPLAIN {SYNC_FORWARD}"), &[&"c-500", &"u-ana", &500i64, &(PER_CONV), &101i64])
        .await
        .expect("explain")
        .iter()
        .map(|r| r.get::<_, String>(0))
        .collect();
    let text = plan.join("\n");
    let uses_pk = text.contains("events_pkey") && text.contains("Index Cond");
    let seq_scan_on_events = text.lines().any(|l| l.contains("Seq Scan on events"));
    // And the store's own sync answers from that plan, quickly.
    let started = std::time::Instant::now();
    let mut req = SyncRequest::forward(cid("c-500"), uid("u-ana"), 500);
    req.limit = 100;
    let page = env.store().sync(&req).await.expect("sync");
    let sync_ms = started.elapsed().as_secs_f64() * 1000.0;
    let pass =
        total >= 1_000_000 && uses_pk && !seq_scan_on_events && page.events.len() == 100 && page.events[0].seq == 501;
    record(
        SUITE,
        "04-history-uses-pk",
        path.name(),
        "EXPLAIN of the real sync query on >= 1,000,000 events across 1,000 conversations: a range scan of events_pkey, no Seq Scan on events",
        json!({"events": total, "conversations": CONVS, "plan": plan, "sync_100_ms": sync_ms}),
        pass,
    );
    assert!(pass, "{text}");
}

pub async fn leave_closes_interval(path: Path) {
    let env = Env::new(path).await;
    env.users(&["u-ana", "u-ben"]).await;
    let created = env
        .store()
        .create_conversation(&CreateConversation::Group {
            creator: uid("u-ana"),
            conv_id: Some(cid("g-team")),
            name: "team".into(),
            members: vec![uid("u-ben")],
            settings: GroupSettings::default(),
        })
        .await
        .expect("create group");
    let conv = created.info.conv_id;
    env.send(&conv, "u-ana", "a1", text("before")).await.expect("send"); // 3
    let leave = env
        .write(&conv, WriteOp::Leave(LeaveOp { user: uid("u-ben"), actor: uid("u-ben"), reason: LeaveReason::Left }))
        .await
        .expect("leave"); // 4
    env.send(&conv, "u-ana", "a2", text("while away 1")).await.expect("send"); // 5
    env.send(&conv, "u-ana", "a3", text("while away 2")).await.expect("send"); // 6
    let away_view = env.visible_seqs(&conv, "u-ben").await;
    let refused = env.send(&conv, "u-ben", "b1", text("am I in?")).await;
    let rejoin = env
        .write(&conv, WriteOp::Join(JoinOp { user: uid("u-ben"), actor: uid("u-ana"), role: Role::Member }))
        .await
        .expect("rejoin"); // 7
    env.send(&conv, "u-ana", "a4", text("welcome back")).await.expect("send"); // 8
    let back_view = env.visible_seqs(&conv, "u-ben").await;
    let page_after_leave = env.sync(&conv, "u-ben", 4).await.expect("sync");
    let pass = away_view == [2, 3, 4]
        && is_rejected(&refused, &Rejection::NotMember)
        && back_view == [2, 3, 4, 7, 8]
        && page_after_leave.events.first().map(|e| e.seq) == Some(7);
    record(
        SUITE,
        "08-leave-closes-interval",
        path.name(),
        "the leaver sees its own leave event and nothing after; rejoin opens a new period; the stretch between stays invisible",
        json!({"leave": format!("{leave:?}"), "rejoin": format!("{rejoin:?}"), "ben_sees_while_away": away_view,
               "ben_sees_after_rejoin": back_view, "send_while_away": format!("{refused:?}")}),
        pass,
    );
    assert!(pass);
}

on_path!(
    direct,
    super::Path::Direct,
    [
        normal_history,
        non_member_rejected,
        unknown_conv_same_error,
        idempotency_mismatch,
        concurrent_replay_one_row,
        control_check_then_insert_duplicates,
        seq_gapless,
        control_sequence_gaps,
        history_uses_pk,
        leave_closes_interval,
    ]
);

// The negative controls and the plan check do not depend on the write path.
on_path!(
    actor,
    super::Path::Actor,
    [
        normal_history,
        non_member_rejected,
        unknown_conv_same_error,
        idempotency_mismatch,
        concurrent_replay_one_row,
        seq_gapless,
        leave_closes_interval,
    ]
);
