//! Read cursors (P8) and the inbox (PROTOCOL §5 `read`, `conversations`)
//! against a real PostgreSQL. Each check writes its record to evidence/im-09.

use std::collections::HashSet;
use std::sync::Arc;

use futures_util::future::join_all;
use imcore::domain::{Event, EventKind, LeaveReason, Rejection, Role};
use imcore::store::{InboxItem, JoinOp, LeaveOp, StoreError, WriteOp, INBOX_PAGE, UNREAD_CAP};
use imcore_actors::ConvId;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use tokio_postgres::types::Type;

use crate::env::{cid, text, uid, Env, Path};
use crate::evidence::Check;

const SUITE: &str = "im-09";
const VARIANT: &str = "direct";

async fn group(env: &Env, id: &str, creator: &str, members: &[&str]) -> ConvId {
    env.group(id, creator, members).await
}

async fn join(env: &Env, conv: &ConvId, user: &str, actor: &str) {
    env.write(conv, WriteOp::Join(JoinOp { user: uid(user), actor: uid(actor), role: Role::Member }))
        .await
        .expect("join");
}

async fn leave(env: &Env, conv: &ConvId, user: &str) {
    env.write(conv, WriteOp::Leave(LeaveOp { user: uid(user), actor: uid(user), reason: LeaveReason::Left }))
        .await
        .expect("leave");
}

/// Simulates a recall of `seq` the way the recall op leaves its target.
async fn recall(env: &Env, conv: &ConvId, seq: i64) {
    env.db
        .client()
        .await
        .execute(
            "UPDATE events SET recalled = true, body = NULL WHERE conv_id = $1 AND seq = $2 AND kind = 'msg'",
            &[&conv.as_str(), &seq],
        )
        .await
        .expect("recall");
    // Written behind the server's back, like a restore: the tail in memory
    // must forget the conversation, as the store does for such changes.
    env.store().tail().forget(conv);
}

/// Appends `n` messages from `sender` in one statement, keeping `next_seq`
/// (P5) and `last_event_at` consistent.
pub async fn bulk_msgs(env: &Env, conv: &str, sender: &str, n: i64) {
    env.db
        .client()
        .await
        .execute(
            "WITH c AS (UPDATE conversations SET next_seq = next_seq + $3, last_event_at = now()
                         WHERE conv_id = $1 RETURNING next_seq - $3 AS first)
             INSERT INTO events (conv_id, seq, kind, message_id, sender_user, sender_device, client_msg_id,
                                 request_hash, body, created_at)
             SELECT $1, c.first + s - 1, 'msg', gen_random_uuid(), $2, 'd1', 'bulk-' || (c.first + s - 1),
                    sha256(('bulk-' || (c.first + s - 1))::bytea), '{\"type\":\"text\",\"text\":\"bulk\"}',
                    date_trunc('milliseconds', now())
               FROM c, generate_series(1, $3) s",
            &[&conv, &sender, &n],
        )
        .await
        .expect("bulk messages");
}

/// Every page of `user`'s inbox, following `next_cursor`.
async fn all_pages(env: &Env, user: &str, limit: i64) -> (Vec<InboxItem>, usize) {
    let (mut items, mut pages, mut cursor) = (vec![], 0, None::<String>);
    loop {
        let page = env.store().inbox(&uid(user), limit, cursor.as_deref()).await.expect("inbox");
        pages += 1;
        items.extend(page.items);
        match page.next_cursor {
            Some(next) => cursor = Some(next),
            None => return (items, pages),
        }
        assert!(pages < 1000, "paging does not end");
    }
}

/// The last event `sync` returns to `user`, reading the whole visible history.
async fn newest_synced(env: &Env, user: &str, conv: ConvId) -> Option<Event> {
    env.sync(&conv, user, 0).await.expect("sync").events.last().map(|e| e.event.clone())
}

async fn item(env: &Env, user: &str, conv: &ConvId) -> InboxItem {
    let (items, _) = all_pages(env, user, 200).await;
    items.into_iter().find(|i| &i.conversation.conv_id == conv).expect("listed")
}

fn is_rejected<T: std::fmt::Debug>(r: &Result<T, StoreError>, want: &Rejection) -> bool {
    matches!(r, Err(StoreError::Rejected(got)) if got == want)
}

#[actix_web::test]
async fn the_read_cursor_never_moves_back_and_never_passes_the_head() {
    let check = Check::start(
        SUITE,
        "09-read-cursor-monotonic-capped",
        VARIANT,
        "P8: marks 10, 5, 1000, 0 at head 42 answer 10, 10, 42, 42; 2 rounds of 32 concurrent tasks x 8 random marks: \
         no task sees its cursor move back, every answer is in [min(request, head), head], the cursor ends at min(max request, head)",
    );
    const TASKS: usize = 32;
    const CALLS: usize = 8;
    let env = Arc::new(Env::with_pool(Path::Direct, TASKS as u32 + 2).await);
    env.users(&["u-ana", "u-ben"]).await;
    let conv = group(&env, "g-read", "u-ana", &["u-ben"]).await;
    for i in 0..40 {
        env.send(&conv, "u-ana", &format!("m{i}"), text("x")).await.expect("send");
    }
    let head = env.head(&conv).await; // 42
    let (ana, store) = (uid("u-ana"), env.store());
    let mut steps = vec![];
    for seq in [10, 5, 1000, 0] {
        steps.push((seq, store.mark_read(&conv, &ana, seq).await.expect("mark read")));
    }
    let stored = store.read_seq(&conv, &ana).await.expect("read_seq");
    let sequential_ok = steps == [(10, 10), (5, 10), (1000, head), (0, head)] && stored == head;

    // Concurrent marks by u-ben: each task sees non-decreasing results, every
    // result is at least its own (capped) request and at most head, and the
    // cursor ends at the highest request (capped). Round 1 stays below head,
    // round 2 reaches past it.
    let mut rng = StdRng::seed_from_u64(0x09);
    let mut rounds = vec![];
    for top in [head - 2, head + 40] {
        let plan: Vec<Vec<i64>> = (0..TASKS).map(|_| (0..CALLS).map(|_| rng.gen_range(0..=top)).collect()).collect();
        let want = plan.iter().flatten().copied().max().unwrap_or(0).min(head);
        let tasks = plan.into_iter().map(|seqs| {
            let (env, conv) = (env.clone(), conv.clone());
            async move {
                let ben = uid("u-ben");
                let mut seen = vec![];
                for seq in seqs {
                    let got = env.store().mark_read(&conv, &ben, seq).await.expect("mark read");
                    seen.push((seq, got));
                }
                seen
            }
        });
        let results = join_all(tasks).await;
        let violations = results
            .iter()
            .flat_map(|seen| {
                seen.windows(2)
                    .filter(|w| w[1].1 < w[0].1)
                    .map(|w| format!("moved back {} -> {}", w[0].1, w[1].1))
                    .chain(
                        seen.iter()
                            .filter(|(seq, got)| *got < (*seq).min(head) || *got > head)
                            .map(|(seq, got)| format!("mark {seq} answered {got}")),
                    )
                    .collect::<Vec<_>>()
            })
            .collect::<Vec<_>>();
        let end = store.read_seq(&conv, &uid("u-ben")).await.expect("read_seq");
        rounds.push(json!({"requests": TASKS * CALLS, "max_request": top, "want": want, "end": end,
                           "violations": violations}));
        if !violations.is_empty() || end != want {
            break;
        }
    }
    let concurrent_ok = rounds.len() == 2 && rounds.iter().all(|r| r["end"] == r["want"]);
    let pass = sequential_ok && concurrent_ok;
    let pass =
        check.resolve(json!({"head": head, "sequential": steps, "stored": stored, "concurrent_rounds": rounds}), pass);
    assert!(pass);
}

#[actix_web::test]
async fn marking_read_without_being_a_current_member_is_not_member() {
    let check = Check::start(
        SUITE,
        "09-read-not-member",
        VARIANT,
        "mark_read by a never-member, a former member, and on an unknown conversation: NOT_MEMBER, no cursor row; seq -1: BAD_REQUEST; a member's mark works",
    );
    let env = Env::new(Path::Direct).await;
    env.users(&["u-ana", "u-ben", "u-cai"]).await;
    let conv = group(&env, "g-nm", "u-ana", &["u-ben"]).await;
    env.send(&conv, "u-ana", "m1", text("hi")).await.expect("send");
    leave(&env, &conv, "u-ben").await;
    let store = env.store();
    let never = store.mark_read(&conv, &uid("u-cai"), 1).await;
    let former = store.mark_read(&conv, &uid("u-ben"), 1).await;
    let unknown = store.mark_read(&cid("g-does-not-exist"), &uid("u-ana"), 1).await;
    let negative = store.mark_read(&conv, &uid("u-ana"), -1).await;
    let member = store.mark_read(&conv, &uid("u-ana"), 3).await;
    let rows: i64 = env
        .db
        .client()
        .await
        .query_one("SELECT count(*) FROM read_cursors WHERE user_id <> 'u-ana'", &[])
        .await
        .expect("count")
        .get(0);
    let pass = is_rejected(&never, &Rejection::NotMember)
        && is_rejected(&former, &Rejection::NotMember)
        && is_rejected(&unknown, &Rejection::NotMember)
        && matches!(negative, Err(StoreError::Rejected(Rejection::BadRequest(_))))
        && matches!(member, Ok(3))
        && rows == 0;
    let pass = check.resolve(
        json!({"never_member": format!("{never:?}"), "former_member": format!("{former:?}"),
               "unknown_conv": format!("{unknown:?}"), "negative_seq": format!("{negative:?}"),
               "member": format!("{member:?}"), "foreign_cursor_rows": rows}),
        pass,
    );
    assert!(pass);
}

#[actix_web::test]
async fn unread_counts_only_visible_unrecalled_messages_from_others_after_the_cursor() {
    let check = Check::start(
        SUITE,
        "09-unread-counts",
        VARIANT,
        "log: joins 1-3, msgs 4,5 (ana), 6 (ben), 7 (cai), 8 (ana, recalled), join 9 (dan), msg 10 (ana). unread: ben 3 then 4, \
         ana 2, dan 1 (period from 9); ben after read 5: 2; after reading to head 10: read_seq 10, unread 0",
    );
    let env = Env::new(Path::Direct).await;
    env.users(&["u-ana", "u-ben", "u-cai", "u-dan"]).await;
    let conv = group(&env, "g-unread", "u-ana", &["u-ben", "u-cai"]).await; // joins 1..3
    env.send(&conv, "u-ana", "a1", text("4")).await.expect("send"); // 4
    env.send(&conv, "u-ana", "a2", text("5")).await.expect("send"); // 5
    env.send(&conv, "u-ben", "b1", text("6")).await.expect("send"); // 6 (ben's own)
    env.send(&conv, "u-cai", "c1", text("7")).await.expect("send"); // 7
    env.send(&conv, "u-ana", "a3", text("8")).await.expect("send"); // 8, recalled below
    recall(&env, &conv, 8).await;
    let ben_initial = item(&env, "u-ben", &conv).await.unread; // 4, 5, 7
    let ana_initial = item(&env, "u-ana", &conv).await.unread; // 6, 7
    join(&env, &conv, "u-dan", "u-ana").await; // 9 (a join from someone else: not a msg)
    env.send(&conv, "u-ana", "a4", text("10")).await.expect("send"); // 10
    let dan = item(&env, "u-dan", &conv).await.unread; // 10 only: 4..8 are before dan's period
    let ben_before_read = item(&env, "u-ben", &conv).await.unread; // 4, 5, 7, 10
    env.store().mark_read(&conv, &uid("u-ben"), 5).await.expect("mark read");
    let ben_after_5 = item(&env, "u-ben", &conv).await; // 7, 10
    let to_head = env.store().mark_read(&conv, &uid("u-ben"), i64::MAX).await.expect("mark read");
    let ben_at_head = item(&env, "u-ben", &conv).await;
    let head = env.head(&conv).await;
    let pass = ben_initial == 3
        && ana_initial == 2
        && dan == 1
        && ben_before_read == 4
        && ben_after_5.read_seq == 5
        && ben_after_5.unread == 2
        && to_head == head
        && ben_at_head.read_seq == head
        && ben_at_head.unread == 0;
    let pass = check.resolve(
        json!({"ben_initial": ben_initial, "ana_initial": ana_initial, "dan": dan, "ben_before_read": ben_before_read,
               "ben_after_read_5": {"read_seq": ben_after_5.read_seq, "unread": ben_after_5.unread},
               "mark_read_max_answer": to_head, "head": head,
               "ben_at_head": {"read_seq": ben_at_head.read_seq, "unread": ben_at_head.unread}}),
        pass,
    );
    assert!(pass);
}

#[actix_web::test]
async fn unread_is_exact_below_1000_and_reports_1000_for_a_larger_backlog() {
    let check = Check::start(
        SUITE,
        "09-unread-cap",
        VARIANT,
        "backlogs of 999, 1000 and 50,000 msgs from ana: ben's unread 999, 1000, 1000 (1000 = 999+); after reading to head-10: 10; \
         the sender's own unread 0",
    );
    let env = Env::new(Path::Direct).await;
    env.users(&["u-ana", "u-ben"]).await;
    let mut convs = vec![];
    for (id, n) in [("g-999", 999), ("g-1000", 1000), ("g-50000", 50_000)] {
        let conv = group(&env, id, "u-ana", &["u-ben"]).await;
        bulk_msgs(&env, conv.as_str(), "u-ana", n).await;
        convs.push((conv, n));
    }
    let mut p5_ok = true;
    for (conv, n) in &convs {
        let (count, _, max, next_seq) = env.log_stats(conv).await;
        p5_ok &= count == n + 2 && max == count && next_seq == max + 1;
    }
    let started = std::time::Instant::now();
    let page = env.store().inbox(&uid("u-ben"), 50, None).await.expect("inbox");
    let inbox_ms = started.elapsed().as_secs_f64() * 1000.0;
    let unread = |conv: &ConvId| page.items.iter().find(|i| &i.conversation.conv_id == conv).map(|i| i.unread);
    let counts: Vec<_> = convs.iter().map(|(c, _)| unread(c)).collect();
    let big = &convs[2].0;
    let head = env.head(big).await;
    env.store().mark_read(big, &uid("u-ben"), head - 10).await.expect("mark read");
    let after_read = item(&env, "u-ben", big).await.unread;
    let sender: Vec<_> = all_pages(&env, "u-ana", 50).await.0.iter().map(|i| i.unread).collect();
    let pass =
        p5_ok && counts == [Some(999), Some(UNREAD_CAP), Some(UNREAD_CAP)] && after_read == 10 && sender == [0, 0, 0];
    let pass = check.resolve(
        json!({"backlogs": convs.iter().map(|(_, n)| n).collect::<Vec<_>>(), "unread": counts,
               "after_read_to_head_minus_10": after_read, "sender_unread": sender, "p5_consistent": p5_ok,
               "inbox_ms": inbox_ms}),
        pass,
    );
    assert!(pass);
}

#[actix_web::test]
async fn the_inbox_lists_most_recent_first_and_paging_covers_every_conversation_once() {
    let check = Check::start(
        SUITE,
        "09-inbox-order-and-paging",
        VARIANT,
        "24 conversations, activity times with ties, one bumped by a send: every page size (1, 4, 5, 24, 200) lists all 24 exactly once \
         in (last_event_at desc, conv_id) order in ceil(24/limit) pages, the last with next_cursor null; limit 0 clamps to 1, \
         10000 to 200; malformed cursors: BAD_REQUEST",
    );
    const CONVS: usize = 24;
    let env = Env::new(Path::Direct).await;
    env.users(&["u-ana", "u-ben"]).await;
    let mut convs = vec![];
    for i in 0..CONVS {
        convs.push(group(&env, &format!("g-{i:02}"), "u-ana", &["u-ben"]).await);
    }
    // Activity times with ties (7 distinct minutes), so paging crosses equal times.
    env.db
        .client()
        .await
        .execute(
            "UPDATE conversations SET last_event_at = '2020-01-01T00:00:00Z'::timestamptz
                                                    + (substr(conv_id, 3)::int % 7) * interval '1 minute'",
            &[],
        )
        .await
        .expect("set activity");
    // A message makes a conversation the most recent, through the real write path.
    env.send(&convs[3], "u-ben", "b1", text("bump")).await.expect("send");
    let minute = |i: usize| i % 7;
    let mut expected: Vec<(bool, std::cmp::Reverse<usize>, String)> =
        (0..CONVS).map(|i| (i != 3, std::cmp::Reverse(minute(i)), format!("g-{i:02}"))).collect();
    expected.sort();
    let expected: Vec<String> = expected.into_iter().map(|(_, _, id)| id).collect();

    let mut runs = vec![];
    let mut all_ok = true;
    for limit in [1, 4, 5, 24, 200] {
        let (items, pages) = all_pages(&env, "u-ana", limit).await;
        let order: Vec<String> = items.iter().map(|i| i.conversation.conv_id.to_string()).collect();
        let distinct = order.iter().collect::<HashSet<_>>().len();
        let want_pages = CONVS.div_ceil(limit.min(200) as usize);
        let ok = order == expected && distinct == CONVS && pages == want_pages;
        all_ok &= ok;
        runs.push(json!({"limit": limit, "pages": pages, "want_pages": want_pages, "items": order.len(),
                         "distinct": distinct, "in_expected_order": order == expected}));
    }
    let clamped_low = env.store().inbox(&uid("u-ana"), 0, None).await.expect("inbox").items.len();
    let clamped_high = env.store().inbox(&uid("u-ana"), 10_000, None).await.expect("inbox").items.len();
    let mut bad = vec![];
    for cursor in ["not-a-cursor", "abc", &hex::encode("123"), &hex::encode("x:g-01"), &hex::encode("1:bad id")] {
        bad.push(env.store().inbox(&uid("u-ana"), 10, Some(cursor)).await);
    }
    let bad_ok = bad.iter().all(|r| matches!(r, Err(StoreError::Rejected(Rejection::BadRequest(_)))));
    let pass = all_ok && clamped_low == 1 && clamped_high == CONVS && bad_ok;
    let pass = check.resolve(
        json!({"expected": expected, "runs": runs, "limit_0_items": clamped_low, "limit_10000_items": clamped_high,
               "malformed_cursors": bad.iter().map(|r| format!("{:?}", r.as_ref().map(|p| p.items.len()))).collect::<Vec<_>>()}),
        pass,
    );
    assert!(pass);
}

#[actix_web::test]
async fn a_former_members_conversation_is_not_listed() {
    let check = Check::start(
        SUITE,
        "09-former-member-not-listed",
        VARIANT,
        "after u-ben leaves g-left, his inbox lists only g-stay (ana's lists both); after rejoining, g-left is listed again \
         and unread counts only the new period (1: the msg at 7, not the ones at 3 and 5)",
    );
    let env = Env::new(Path::Direct).await;
    env.users(&["u-ana", "u-ben"]).await;
    let stay = group(&env, "g-stay", "u-ana", &["u-ben"]).await;
    let left = group(&env, "g-left", "u-ana", &["u-ben"]).await;
    env.send(&left, "u-ana", "a1", text("before")).await.expect("send"); // 3
    leave(&env, &left, "u-ben").await; // 4
    env.send(&left, "u-ana", "a2", text("while away")).await.expect("send"); // 5
    let listed = |items: &[InboxItem]| items.iter().map(|i| i.conversation.conv_id.to_string()).collect::<Vec<_>>();
    let away = listed(&all_pages(&env, "u-ben", 50).await.0);
    let ana = listed(&all_pages(&env, "u-ana", 50).await.0);
    join(&env, &left, "u-ben", "u-ana").await; // 6
    env.send(&left, "u-ana", "a3", text("welcome back")).await.expect("send"); // 7
    let back = item(&env, "u-ben", &left).await;
    let pass = away == [stay.to_string()]
        && ana.len() == 2
        && back.unread == 1
        && back.last_event.as_ref().map(|e| e.seq) == Some(7);
    let pass = check.resolve(
        json!({"ben_while_away": away, "ana": ana, "ben_after_rejoin": {"unread": back.unread,
               "last_seq": back.last_event.as_ref().map(|e| e.seq)}}),
        pass,
    );
    assert!(pass);
}

#[actix_web::test]
async fn last_event_is_the_newest_event_the_user_can_see() {
    let record = Check::start(
        SUITE,
        "09-last-event-newest-visible",
        VARIANT,
        "the inbox's last_event equals the last event sync returns to the same user after create (join@2), a send (msg@3), \
         its recall (msg@3 recalled, body null) and a join (join@4, seen by the joiner)",
    );
    let env = Env::new(Path::Direct).await;
    env.users(&["u-ana", "u-ben", "u-cai"]).await;
    let conv = group(&env, "g-last", "u-ana", &["u-ben"]).await;
    let mut steps = vec![];
    let mut ok = true;
    let mut check = |label: &str, item: InboxItem, synced: Option<Event>| {
        let same = item.last_event == synced && item.last_event.is_some();
        ok &= same;
        steps.push(json!({"after": label, "inbox_last": item.last_event.as_ref().map(|e| (e.seq, e.kind.name())),
                          "sync_last": synced.as_ref().map(|e| (e.seq, e.kind.name())), "equal": same}));
        item.last_event
    };
    check("create", item(&env, "u-ben", &conv).await, newest_synced(&env, "u-ben", conv.clone()).await);
    env.send(&conv, "u-ana", "a1", text("hello")).await.expect("send"); // 3
    let sent = check("send", item(&env, "u-ben", &conv).await, newest_synced(&env, "u-ben", conv.clone()).await);
    recall(&env, &conv, 3).await;
    let recalled = check("recall", item(&env, "u-ben", &conv).await, newest_synced(&env, "u-ben", conv.clone()).await);
    join(&env, &conv, "u-cai", "u-ana").await; // 4
    let joined = check("join", item(&env, "u-cai", &conv).await, newest_synced(&env, "u-cai", conv.clone()).await);
    let kinds_ok =
        matches!(sent.as_ref().map(|e| &e.kind), Some(EventKind::Msg { body: Some(_), recalled: false, .. }))
            && matches!(recalled.as_ref().map(|e| &e.kind), Some(EventKind::Msg { body: None, recalled: true, .. }))
            && matches!(joined.as_ref().map(|e| (e.seq, &e.kind)), Some((4, EventKind::Join { .. })));
    let pass = ok && kinds_ok;
    let pass = record.resolve(json!({"steps": steps, "kinds_ok": kinds_ok}), pass);
    assert!(pass);
}

#[actix_web::test]
async fn the_inbox_probes_events_by_primary_key_per_listed_conversation() {
    let check = Check::start(
        SUITE,
        "09-inbox-plan",
        VARIANT,
        "EXPLAIN ANALYZE of the inbox query for a user in 301 of 20,301 conversations over 800,000 events (one with a 200,000 \
         unread backlog): no Seq Scan on events, members or membership_periods; the last-event, unread and unread-mentions LATERALs \
         probe events_pkey (an ordered or a bitmap range scan, as the planner picks) once per page row (51 = limit + 1); first c-big (read_seq 0, \
         unread 1000), then c-300 (read_seq 1700, unread 150)",
    );
    const CONVS: i64 = 300;
    const PER_CONV: i64 = 2_000;
    // Other users' conversations, so the tables are not all ana's (no events).
    const NOISE: i64 = 20_000;
    // One conversation with a backlog far past the unread cap, the most recent.
    const BIG: i64 = 200_000;
    let env = Env::new(Path::Direct).await;
    env.users(&["u-ana", "u-ben", "u-cai"]).await;
    let c = env.db.client().await;
    c.batch_execute(&format!(
        "INSERT INTO conversations (conv_id, kind, next_seq, member_count, last_event_at)
           SELECT 'c-' || i, 'group', {PER_CONV} + 1, 2, '2020-01-01'::timestamptz + i * interval '1 second'
             FROM generate_series(1, {CONVS}) i;
         INSERT INTO membership_periods (conv_id, user_id, from_seq)
           SELECT 'c-' || i, u, s FROM generate_series(1, {CONVS}) i, unnest(ARRAY['u-ana', 'u-ben'], ARRAY[1, 2]) m(u, s);
         INSERT INTO members (conv_id, user_id, joined_seq)
           SELECT 'c-' || i, u, s FROM generate_series(1, {CONVS}) i, unnest(ARRAY['u-ana', 'u-ben'], ARRAY[1, 2]) m(u, s);
         INSERT INTO read_cursors (user_id, conv_id, read_seq)
           SELECT 'u-ana', 'c-' || i, {PER_CONV} - i FROM generate_series(1, {CONVS}) i;
         INSERT INTO events (conv_id, seq, kind, message_id, sender_user, sender_device, client_msg_id,
                             request_hash, body, created_at)
           SELECT 'c-' || i, s, 'msg', gen_random_uuid(), CASE WHEN s % 2 = 0 THEN 'u-ben' ELSE 'u-ana' END, 'd1',
                  'k' || s, sha256(('c-' || i || ':' || s)::bytea), '{{\"type\":\"text\",\"text\":\"x\"}}', now()
             FROM generate_series(1, {CONVS}) i, generate_series(1, {PER_CONV}) s;
         INSERT INTO conversations (conv_id, kind, next_seq, member_count, last_event_at)
           VALUES ('c-big', 'group', {BIG} + 1, 2, '2021-01-01');
         INSERT INTO membership_periods (conv_id, user_id, from_seq) VALUES ('c-big', 'u-ana', 1), ('c-big', 'u-ben', 2);
         INSERT INTO members (conv_id, user_id, joined_seq) VALUES ('c-big', 'u-ana', 1), ('c-big', 'u-ben', 2);
         INSERT INTO events (conv_id, seq, kind, message_id, sender_user, sender_device, client_msg_id,
                             request_hash, body, created_at)
           SELECT 'c-big', s, 'msg', gen_random_uuid(), 'u-ben', 'd1', 'k' || s, sha256(('c-big:' || s)::bytea),
                  '{{\"type\":\"text\",\"text\":\"x\"}}', now()
             FROM generate_series(1, {BIG}) s;
         INSERT INTO conversations (conv_id, kind, next_seq, member_count)
           SELECT 'noise-' || i, 'group', 3, 2 FROM generate_series(1, {NOISE}) i;
         INSERT INTO membership_periods (conv_id, user_id, from_seq)
           SELECT 'noise-' || i, u, s FROM generate_series(1, {NOISE}) i, unnest(ARRAY['u-ben', 'u-cai'], ARRAY[1, 2]) m(u, s);
         INSERT INTO members (conv_id, user_id, joined_seq)
           SELECT 'noise-' || i, u, s FROM generate_series(1, {NOISE}) i, unnest(ARRAY['u-ben', 'u-cai'], ARRAY[1, 2]) m(u, s);
         ANALYZE"
    ))
    .await
    .expect("load events");
    let total: i64 = c.query_one("SELECT count(*) FROM events", &[]).await.expect("count").get(0);
    let fetch = 51i64;
    let plan: Vec<String> = c
        .query_typed(
            &format!("EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY ON) {}", *INBOX_PAGE),
            &[
                (&"u-ana", Type::TEXT),
                (&None::<chrono::DateTime<chrono::Utc>>, Type::TIMESTAMPTZ),
                (&None::<&str>, Type::TEXT),
                (&fetch, Type::INT8),
            ],
        )
        .await
        .expect("explain")
        .iter()
        .map(|r| r.get::<_, String>(0))
        .collect();
    let text = plan.join("\n");
    let full_scans: Vec<&str> = text
        .lines()
        .filter(|l| {
            ["Seq Scan on events", "Seq Scan on membership_periods", "Seq Scan on members"]
                .iter()
                .any(|s| l.contains(s))
        })
        .collect();
    // The three LATERALs (last event, unread, unread mentions) run once per row of the page, on events_pkey.
    let pk_probes_per_page_row =
        text.lines().filter(|l| l.contains("events_pkey") && l.contains(&format!("loops={fetch}"))).count();
    let started = std::time::Instant::now();
    let page = env.store().inbox(&uid("u-ana"), 50, None).await.expect("inbox");
    let inbox_ms = started.elapsed().as_secs_f64() * 1000.0;
    // c-big is the most recent: 200,000 of ben's msgs, never read: the cap.
    // Then c-300: ana read to 2000 - 300 = 1700: 300 after it, 150 of them ben's.
    let first: Vec<_> =
        page.items.iter().take(2).map(|i| (i.conversation.conv_id.to_string(), i.read_seq, i.unread)).collect();
    let pass = total == CONVS * PER_CONV + BIG
        && full_scans.is_empty()
        && pk_probes_per_page_row == 3
        && page.items.len() == 50
        && first == [("c-big".to_string(), 0, UNREAD_CAP), ("c-300".to_string(), 1700, 150)]
        && page.next_cursor.is_some();
    let pass = check.resolve(
        json!({"events": total, "conversations": CONVS + 1, "noise_conversations": NOISE, "plan": plan, "full_scans": full_scans, "inbox_50_ms": inbox_ms, "first": first}),
        pass,
    );
    assert!(pass, "{text}");
}
