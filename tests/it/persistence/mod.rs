//! The persistence-boundary checks, each under its id, run against every
//! write path: history and visibility, rejections, replay (P2), gapless seqs
//! (P1, P5) under concurrency with their negative controls, the history
//! query's plan, leave and rejoin (P3, P4). Each writes its record to
//! evidence/im-04.

use imcore::domain::Rejection;
use imcore::domain::{LeaveReason, Role};
use imcore::store::{CreateConversation, GroupSettings, JoinOp, LeaveOp, SyncRequest, WriteOp, SYNC_FORWARD};
use imcore_actors::ConvId;
use serde_json::json;

use crate::env::{cid, text, uid, Env, Path, PathName, WriteErr};
use crate::evidence::record;

pub mod races;

use races::{
    concurrent_replay_one_row, control_gapless_without_row_lock, control_replay_without_row_lock, demo_sequence_gaps,
    seq_gapless,
};

const SUITE: &str = "im-04";

async fn direct_chat(env: &Env) -> ConvId {
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
        control_replay_without_row_lock,
        seq_gapless,
        control_gapless_without_row_lock,
        demo_sequence_gaps,
        history_uses_pk,
        leave_closes_interval,
    ]
);

// The demonstration and the plan check do not depend on the write path.
on_path!(
    actor,
    super::Path::Actor,
    [
        normal_history,
        non_member_rejected,
        unknown_conv_same_error,
        idempotency_mismatch,
        concurrent_replay_one_row,
        control_replay_without_row_lock,
        seq_gapless,
        control_gapless_without_row_lock,
        leave_closes_interval,
    ]
);
