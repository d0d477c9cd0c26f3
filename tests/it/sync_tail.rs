//! The tail cache (ARCHITECTURE §4): forward `sync` pages answered from
//! memory are the SQL path's, byte for byte on the wire, over a matrix of
//! callers (members, a kicked and rejoined one, a former member, a stranger),
//! recalled, edited and reacted messages, limits and byte budgets; a load
//! of a conversation's ring is shared by the `sync`s that wait for it; pull
//! devices that sync on every `head` get each message once, in order.
//! Records go to evidence/im-05.

use std::sync::atomic::Ordering;

use imcore::domain::{Emoji, EventKind, LeaveReason, Role};
use imcore::protocol::sync_page;
use imcore::store::{EditOp, JoinOp, LeaveOp, ReactOp, RecallOp, StoreError, SyncPage, SyncRequest, WriteOp};
use imcore_actors::{ClientMsgId, ConvId, DeviceId};
use serde_json::{json, Value};

use crate::env::{text, uid, Env, Path, PathName};
use crate::evidence::record;
use crate::server::{TestServer, Ws};

const SUITE: &str = "im-05";

fn wire(page: &Result<SyncPage, StoreError>) -> Value {
    match page {
        Ok(p) => serde_json::to_value(sync_page(p)).expect("page json"),
        Err(e) => json!({"error": e.to_string()}),
    }
}

fn device() -> DeviceId {
    DeviceId::parse("d1").expect("device")
}

/// The writes of the matrix, after the ring was loaded at `base`.
async fn history(env: &Env, conv: &ConvId) {
    let op = |op: WriteOp| async move { env.write(conv, op).await.expect("write") };
    let mut seqs = vec![];
    for i in 0..4 {
        seqs.push(env.send(conv, "u-ana", &format!("a{i}"), text(&"x".repeat(10 * (i + 1)))).await.expect("send").seq);
    }
    op(WriteOp::Leave(LeaveOp { user: uid("u-cai"), actor: uid("u-ana"), reason: LeaveReason::Kicked })).await;
    env.send(conv, "u-ben", "b0", text("while cai is out")).await.expect("send");
    op(WriteOp::Join(JoinOp { user: uid("u-cai"), actor: uid("u-ana"), role: Role::Member })).await;
    op(WriteOp::Leave(LeaveOp { user: uid("u-dan"), actor: uid("u-dan"), reason: LeaveReason::Left })).await;
    env.send(conv, "u-cai", "c0", text("back")).await.expect("send");
    op(WriteOp::Recall(RecallOp { actor: uid("u-ana"), device: device(), target_seq: seqs[0] })).await;
    let edit = EditOp {
        sender: uid("u-ana"),
        device: device(),
        client_msg_id: ClientMsgId::parse("e0").expect("key"),
        target_seq: seqs[1],
        body: text("edited"),
    };
    op(WriteOp::Edit(edit)).await;
    let emoji = Emoji::parse("👍").expect("emoji");
    op(WriteOp::React(ReactOp { actor: uid("u-ben"), device: device(), target_seq: seqs[2], emoji, on: true })).await;
    for i in 0..3 {
        env.send(conv, "u-ben", &format!("b{}", i + 1), text("tail")).await.expect("send");
    }
}

/// Every forward page of `conv` from `base` on, for every caller, limit and
/// budget of the matrix, from the tail and from the SQL path: how many were
/// compared, and those that differ. A ring's event is encoded by the first
/// page that shows it, and every later page, of any caller, reuses that
/// encoding: those are compared with the SQL path's fresh ones too.
async fn compare(env: &Env, conv: &ConvId, base: i64, head: i64) -> (u64, Vec<Value>) {
    let (mut compared, mut differ) = (0, vec![]);
    for user in ["u-ana", "u-ben", "u-cai", "u-dan", "u-zed"] {
        for after in base..=head {
            for (limit, max_bytes) in [(1000, 1 << 20), (1, 1 << 20), (2, 1 << 20), (1000, 25), (3, 1)] {
                let mut req = SyncRequest::forward(conv.clone(), uid(user), after);
                (req.limit, req.max_bytes) = (limit, max_bytes);
                let (cached, sql) = (wire(&env.store().sync(&req).await), wire(&env.store().sync_sql(&req).await));
                compared += 1;
                if cached != sql {
                    differ.push(json!({"user": user, "after": after, "limit": limit, "tail": cached, "sql": sql}));
                }
            }
        }
    }
    (compared, differ)
}

async fn tail_pages_are_the_sql_pages(path: Path) {
    let env = Env::new(path).await;
    env.users(&["u-ana", "u-ben", "u-cai", "u-dan", "u-zed"]).await;
    let conv = env.group("g-tail", "u-ana", &["u-ben", "u-cai", "u-dan"]).await;
    let late = env.group("g-tail-late", "u-ana", &["u-ben", "u-cai", "u-dan"]).await;
    let base = env.head(&conv).await;
    let tail = env.store().tail().clone();
    // The first `sync` loads the ring at the head; `late`'s ring is loaded
    // only after its history, which it must then hold from before its head.
    env.sync(&conv, "u-ben", base).await.expect("sync");
    history(&env, &conv).await;
    history(&env, &late).await;
    let head = env.head(&conv).await;
    let hits_before = tail.counts.hits.load(Ordering::Relaxed);
    let (mut compared, mut differ) = compare(&env, &conv, base, head).await;
    let hits_live = tail.counts.hits.load(Ordering::Relaxed) - hits_before;
    let (late_compared, late_differ) = compare(&env, &late, base, head).await;
    let late_hits = tail.counts.hits.load(Ordering::Relaxed) - hits_before - hits_live;
    compared += late_compared;
    differ.extend(late_differ);
    let hits = hits_live + late_hits;
    // The kicked member's page from the ring ends at its `leave`, then resumes at its rejoin.
    let cai = env.store().sync(&SyncRequest::forward(conv.clone(), uid("u-cai"), base)).await.expect("sync");
    let cai_seqs: Vec<i64> = cai.events.iter().map(|e| e.seq).collect();
    let all: Vec<i64> = (base + 1..=head).collect();
    let dan = env.store().sync(&SyncRequest::forward(conv.clone(), uid("u-dan"), base)).await.expect("sync");
    // Negative control: a ring ignoring periods answers cai like ana; the comparison tells them apart.
    let ana = env.store().sync_sql(&SyncRequest::forward(conv.clone(), uid("u-ana"), base)).await;
    let naive_caught =
        wire(&ana) != wire(&env.store().sync_sql(&SyncRequest::forward(conv.clone(), uid("u-cai"), base)).await);
    let pass = differ.is_empty()
        && hits > compared / 4
        && late_hits > late_compared / 4
        && cai_seqs.len() < all.len()
        && cai_seqs.windows(2).any(|w| w[1] > w[0] + 1)
        && dan.head < head
        && naive_caught;
    record(
        SUITE,
        "31-tail-sync-equals-sql",
        path.name(),
        "every forward page answered from the tail in memory equals the SQL path's on the wire (callers with periods, kicked and rejoined, former member, stranger; recalled, edited, reacted messages; limits, byte budgets), for a ring loaded before that history and for one loaded after it (the history preloaded from before its head); a kicked member's page skips its absence; a period-blind answer is caught",
        json!({"compared": compared, "tail_hits": hits, "late_loaded_hits": late_hits, "differ": differ.iter().take(3).collect::<Vec<_>>(),
               "cai_seqs": cai_seqs, "head": head, "dan_head": dan.head, "naive_caught": naive_caught}),
        pass,
    );
    assert!(pass, "{differ:?}");
}

async fn concurrent_misses_share_one_load(path: Path) {
    let env = Env::new(path).await;
    env.users(&["u-ana", "u-ben"]).await;
    let conv = env.group("g-flight", "u-ana", &["u-ben"]).await;
    let tail = env.store().tail().clone();
    let (loads, coalesced) = (tail.counts.loads.load(Ordering::Relaxed), tail.counts.coalesced.load(Ordering::Relaxed));
    let syncs = (0..64).map(|i| env.sync(&conv, if i % 2 == 0 { "u-ana" } else { "u-ben" }, 0));
    let pages = futures_util::future::join_all(syncs).await;
    let loads = tail.counts.loads.load(Ordering::Relaxed) - loads;
    let coalesced = tail.counts.coalesced.load(Ordering::Relaxed) - coalesced;
    let ok = pages.iter().all(|p| p.as_ref().is_ok_and(|p| !p.events.is_empty()));
    let pass = ok && loads == 1 && coalesced > 0;
    record(
        SUITE,
        "31-tail-load-single-flight",
        path.name(),
        "64 concurrent syncs of a conversation without a ring: one load of it, the others wait for it and are answered",
        json!({"loads": loads, "coalesced": coalesced, "all_answered": ok}),
        pass,
    );
    assert!(pass, "loads {loads}, coalesced {coalesced}, ok {ok}");
}

/// A `sync` whose ring cannot be loaded (a conversation that does not exist
/// has no snapshot) tries the load once, then reads PostgreSQL; and under a
/// steady writer a conversation's ring is loaded once, not again per commit.
async fn ring_loads_are_bounded(path: Path) {
    let env = Env::new(path).await;
    env.users(&["u-ana", "u-ben"]).await;
    let tail = env.store().tail().clone();
    let loads = || tail.counts.loads.load(Ordering::Relaxed);
    let before = loads();
    let ghost = ConvId::parse("g-ghost").expect("conv");
    let ghost_answers = tokio::time::timeout(LOAD_WAIT, async {
        let mut answers = vec![];
        for _ in 0..GHOST_SYNCS {
            answers.push(env.sync(&ghost, "u-ana", 0).await);
        }
        answers
    })
    .await;
    let ghost_loads = loads() - before;
    let ghost_ok = ghost_answers.as_ref().is_ok_and(|answers| {
        answers.iter().all(|a| matches!(a, Err(StoreError::Rejected(imcore::domain::Rejection::NotMember))))
    });

    let conv = env.group("g-steady", "u-ana", &["u-ben"]).await;
    let before = loads();
    let writer = async {
        for i in 0..STEADY_SENDS {
            env.send(&conv, "u-ana", &format!("s{i}"), text("steady")).await.expect("send");
        }
    };
    // Two readers follow the log as a pull-mode device would, each until it has every send.
    let reader = |user: &'static str| {
        let env = &env;
        let conv = &conv;
        async move {
            let (mut after, mut msgs, mut syncs) = (0, vec![], 0);
            while msgs.len() < STEADY_SENDS {
                let page = env.sync(conv, user, after).await.expect("sync");
                syncs += 1;
                msgs.extend(page.events.iter().filter(|e| matches!(e.kind, EventKind::Msg { .. })).map(|e| e.seq));
                // Nothing new: wait a little, as a device waits for its next `head` push (a
                // page from memory never yields, so a tight loop would starve the writer).
                if page.events.is_empty() {
                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                }
                after = page.next_after;
            }
            (msgs.windows(2).all(|w| w[0] < w[1]), syncs)
        }
    };
    let done = tokio::time::timeout(LOAD_WAIT, async {
        let ((), ana, ben) = tokio::join!(writer, reader("u-ana"), reader("u-ben"));
        (ana, ben)
    })
    .await;
    let steady_loads = loads() - before;
    let readers_ok = done.as_ref().is_ok_and(|((ana, _), (ben, _))| *ana && *ben);
    let syncs = done.as_ref().map_or(0, |((_, a), (_, b))| a + b);
    let pass = ghost_ok && ghost_loads <= GHOST_SYNCS as u64 && readers_ok && steady_loads <= 2;
    record(
        SUITE,
        "31-tail-loads-bounded",
        path.name(),
        "10 syncs of a conversation that does not exist each answer NOT_MEMBER after at most one ring load; two \
         readers following a steady writer's 200 sends get every message in order while the ring is loaded at most twice",
        json!({"ghost_answered": ghost_answers.is_ok(), "ghost_not_member": ghost_ok, "ghost_loads": ghost_loads,
               "steady_sends": STEADY_SENDS, "reader_syncs": syncs, "readers_in_order": readers_ok,
               "steady_loads": steady_loads}),
        pass,
    );
    assert!(pass, "ghost {ghost_ok} ({ghost_loads} loads), readers {readers_ok}, steady loads {steady_loads}");
}

/// Syncs of a conversation that does not exist.
const GHOST_SYNCS: usize = 10;
/// Sends of the steady writer.
const STEADY_SENDS: usize = 200;
/// Generous bound on each half of [`ring_loads_are_bounded`] (a loaded machine).
const LOAD_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// Members of the pull group of [`pull_devices_get_every_message_once`], and the messages sent to it.
const PULL_MEMBERS: usize = 80;
const PULL_MESSAGES: usize = 50;
/// Generous bound on the whole fan-out (a loaded machine).
const FOLLOW_WAIT: std::time::Duration = std::time::Duration::from_secs(90);

/// A pull-mode device: on every `head` push it syncs forward from where it
/// is until it has that head (a refused sync is sent again shortly), and
/// collects the seqs of the `msg` events it is given, as they come.
async fn follow(mut ws: Ws, conv: &str) -> Vec<i64> {
    let until = tokio::time::Instant::now() + FOLLOW_WAIT;
    let (mut synced, mut head, mut msgs) = (0i64, 0i64, vec![]);
    while msgs.len() < PULL_MESSAGES {
        let Some(left) = until.checked_duration_since(tokio::time::Instant::now()) else { break };
        let Some(push) = ws.push_within(left).await else { break };
        if push["push"] != "head" || push["conv_id"] != conv {
            continue;
        }
        head = head.max(push["head"].as_i64().unwrap_or(0));
        while synced < head && tokio::time::Instant::now() < until {
            let page = ws.request("sync", json!({"conv_id": conv, "after_seq": synced, "limit": 1000})).await;
            if page["ok"] != true {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
            let events = page["events"].as_array().cloned().unwrap_or_default();
            msgs.extend(events.iter().filter(|e| e["kind"] == "msg").filter_map(|e| e["seq"].as_i64()));
            synced = page["next_after"].as_i64().unwrap_or(synced);
        }
    }
    msgs
}

/// What one fan-out run saw: the acked seqs, and how many devices got
/// exactly those, once each, in order.
async fn fan_out(tail_bytes: usize) -> (Vec<i64>, usize, Vec<Value>, u64) {
    let s = TestServer::with(|c| {
        c.limits.create_per_minute = 0;
        c.store.sync_tail_bytes = tail_bytes;
    })
    .await;
    let owner = s.user("u-own").await;
    let members: Vec<String> = (0..PULL_MEMBERS).map(|i| format!("u-pm-{i:03}")).collect();
    let mut devices = vec![];
    for m in &members {
        let token = s.user(m).await;
        devices.push(s.ws(&token).await);
    }
    let conv = "g-pull-tail";
    let mut sender = s.ws(&owner).await;
    let created = sender
        .request(
            "create_conversation",
            json!({"kind": "group", "conv_id": conv, "name": conv, "members": members, "delivery_mode": "pull"}),
        )
        .await;
    assert_eq!(created["ok"], true, "{created}");
    let send = async {
        let mut acked = vec![];
        for n in 0..PULL_MESSAGES {
            let frame =
                json!({"conv_id": conv, "client_msg_id": format!("p{n}"), "body": {"type": "text", "text": "x"}});
            loop {
                let ack = sender.request("send", frame.clone()).await;
                if let Some(seq) = ack["seq"].as_i64() {
                    acked.push(seq);
                    break;
                }
                assert_eq!(ack["error"]["code"], "OVERLOADED", "{ack}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            // Lets the devices' syncs (and the ring's load) interleave with the stream.
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        acked
    };
    let (acked, got) =
        tokio::join!(send, futures_util::future::join_all(devices.into_iter().map(|ws| follow(ws, conv))));
    let exact = got.iter().filter(|seqs| **seqs == acked).count();
    let wrong: Vec<Value> = got
        .iter()
        .enumerate()
        .filter(|(_, seqs)| **seqs != acked)
        .take(3)
        .map(|(i, seqs)| json!({"device": i, "seqs": seqs}))
        .collect();
    // As an operator sees it.
    let hits = s.metric("imcore_sync_tail{state=\"hits_total\"}").await.unwrap_or(0.0) as u64;
    (acked, exact, wrong, hits)
}

#[actix_web::test]
async fn pull_devices_get_every_message_once() {
    let (acked, exact, wrong, hits) = fan_out(imcore::config::StoreSettings::default().sync_tail_bytes).await;
    let (acked_off, exact_off, wrong_off, hits_off) = fan_out(0).await;
    let pass = acked.len() == PULL_MESSAGES
        && exact == PULL_MEMBERS
        && hits > 0
        && acked_off.len() == PULL_MESSAGES
        && exact_off == PULL_MEMBERS
        && hits_off == 0;
    record(
        SUITE,
        "31-tail-pull-fanout-exactly-once",
        "ws",
        "a pull group of 80 devices, each syncing on every `head` push while the owner sends 50 messages (the \
         ring loaded mid-stream by the first sync): every device gets every acked message exactly once, in \
         order, with the tail in memory (pages from the ring) as without it (IMCORE_SYNC_TAIL_BYTES=0)",
        json!({"devices": PULL_MEMBERS, "messages": acked.len(), "exact_devices": exact, "tail_hits": hits,
               "wrong": wrong, "tail_off": {"messages": acked_off.len(), "exact_devices": exact_off,
               "tail_hits": hits_off, "wrong": wrong_off}}),
        pass,
    );
    assert!(pass, "tail: {exact}/{PULL_MEMBERS} exact, {hits} hits, {wrong:?}; off: {exact_off}, {wrong_off:?}");
}

on_path!(
    actor,
    super::Path::Actor,
    [tail_pages_are_the_sql_pages, concurrent_misses_share_one_load, ring_loads_are_bounded]
);
on_path!(direct, super::Path::Direct, [tail_pages_are_the_sql_pages, ring_loads_are_bounded]);
