//! A group of 100,000 members (PROTOCOL §5: `max_member` up to 100,000;
//! `invite` of up to 1,000 users a call; `members` paged and searched, never
//! listed whole): the users are made in SQL, the group is filled through
//! the `invite` op, one send reaches every connected member, and a prefix
//! search is served by the prefix index.

use std::time::Instant;

use futures_util::future::join_all;
use futures_util::stream::{self, StreamExt};
use imcore::store::MEMBERS_PAGE;
use serde_json::{json, Value};

use super::{ok, pushed_seqs, server, ws_op, SUITE};
use crate::evidence::Check;
use crate::server::{TestServer, Ws};

/// Members besides the owner: the group holds 100,000 with it.
const INVITED: usize = 99_999;
const PER_INVITE: usize = 1_000;
const ONLINE: usize = 200;

fn big(i: usize) -> String {
    format!("u-big-{i:06}")
}

/// The roster query of `members` (the store's, with the search's values in place).
/// Fills `conv` with the users `u-big-*` by `invite`s of ≤ 1,000: whether
/// all went right, and what was seen.
async fn fill(owner: &mut Ws, db: &tokio_postgres::Client, conv: &str) -> (bool, Value) {
    let started = Instant::now();
    let (mut calls, mut joined, mut per_call) = (0, 0, vec![]);
    for chunk in (0..INVITED).collect::<Vec<_>>().chunks(PER_INVITE) {
        let ids: Vec<String> = chunk.iter().map(|&i| big(i)).collect();
        let one = Instant::now();
        let r = ok(ws_op(owner, "invite", json!({"conv_id": conv, "user_ids": ids})).await, "invite");
        if calls % 10 == 0 || calls == 99 {
            per_call.push(json!([calls + 1, one.elapsed().as_millis() as u64]));
        }
        joined += r["joined"].as_array().map_or(0, Vec::len);
        calls += 1;
    }
    let invited_in = started.elapsed();
    println!("100k group: {calls} invites in {invited_in:?}: {per_call:?}");
    let full = ws_op(owner, "invite", json!({"conv_id": conv, "user_ids": ["u-extra"]})).await.err();
    let counts = db
        .query_one(
            "SELECT member_count, (SELECT count(*) FROM membership_periods WHERE conv_id = $1 AND to_seq IS NULL)
               FROM conversations WHERE conv_id = $1",
            &[&conv],
        )
        .await
        .expect("counts");
    let (member_count, open): (i32, i64) = (counts.get(0), counts.get(1));
    let right = calls == 100
        && joined == INVITED
        && member_count == 100_000
        && open == 100_000
        && full.as_deref() == Some("GROUP_FULL");
    let seen = json!({"invite_calls": calls, "joined": joined, "invites_ms": invited_in.as_millis() as u64,
                      "invite_ms_by_call": per_call, "member_count": member_count, "open_periods": open,
                      "invite_past_max": full});
    (right, seen)
}

/// `ONLINE` members connect; one send by the owner: how many were pushed it.
async fn push_to_online(s: &TestServer, owner: &mut Ws, conv: &str) -> (bool, Value) {
    let started = Instant::now();
    let online: Vec<usize> = (0..ONLINE).map(|k| k * (INVITED / ONLINE)).collect();
    let tokens: Vec<String> =
        stream::iter(&online).then(|&i| async move { s.device(&big(i), "d1").await }).collect().await;
    let mut clients = join_all(tokens.iter().map(|t| s.ws(t))).await;
    let connected_in = started.elapsed();
    let started = Instant::now();
    let body = json!({"conv_id": conv, "client_msg_id": "hello", "body": {"type": "text", "text": "hi"}});
    let seq = ok(ws_op(owner, "send", body).await, "send")["seq"].as_i64().unwrap_or(0);
    let got = join_all(clients.iter_mut().map(|ws| async move {
        while let Some(push) = ws.push_within(std::time::Duration::from_secs(20)).await {
            if pushed_seqs(&push, conv).contains(&seq) {
                return true;
            }
        }
        false
    }))
    .await;
    let pushed_in = started.elapsed();
    for ws in clients {
        ws.close().await;
    }
    let reached = got.iter().filter(|g| **g).count();
    let seen = json!({"online": ONLINE, "connect_ms": connected_in.as_millis() as u64,
                      "send_to_all_pushed_ms": pushed_in.as_millis() as u64, "pushed_to": reached});
    (reached == ONLINE, seen)
}

/// A prefix search over `members`, and the plan of its query.
async fn search(owner: &mut Ws, db: &tokio_postgres::Client, conv: &str) -> (bool, Value) {
    let page = ok(ws_op(owner, "members", json!({"conv_id": conv, "q": "u-big-0123", "limit": 200})).await, "q");
    let found: Vec<&str> =
        page["members"].as_array().into_iter().flatten().filter_map(|m| m["user_id"].as_str()).collect();
    let want: Vec<String> = (12_300..12_400).map(big).collect();
    db.batch_execute("ANALYZE members").await.expect("analyze");
    let plan: Vec<String> = db
        .query(&format!("EXPLAIN {MEMBERS_PAGE}"), &[&"g-big", &0i64, &"u-big-0123%", &201i64])
        .await
        .expect("explain")
        .iter()
        .map(|r| r.get(0))
        .collect();
    let plan_text = plan.join("\n");
    let by_prefix = plan_text.contains("members_user_prefix");
    let scans_roster = plan_text.contains("Seq Scan on members") || plan_text.contains("members_join_order");
    let right = found == want && page["next"].is_null() && by_prefix && !scans_roster;
    let seen = json!({"search_found": found.len(), "search_right": found == want, "search_next": page["next"],
                      "plan": plan});
    (right, seen)
}

#[actix_web::test]
async fn a_group_of_100000_members_is_filled_by_invites_pushed_to_and_searched_by_index() {
    let check = Check::start(
        SUITE,
        "02-group-100k",
        "ws; 99,999 users inserted in SQL, invited by the owner in 100 calls of ≤ 1,000 into a push-mode \
         group; 200 members online",
        "the group reaches member_count 100,000 (= open periods, SQL) through 100 invite calls, each joining \
         its users; one more invite answers GROUP_FULL; one send is pushed to each of 200 connected members; \
         members?q=u-big-0123 returns exactly u-big-012300..012399 with next null; the roster query's plan \
         (EXPLAIN, after ANALYZE) reads members through members_user_prefix, not a scan of the roster.",
    );
    let _cpu = crate::harness::alone_with_the_cpu().await;
    let s = server().await;
    let own = s.user("u-own").await;
    s.user("u-extra").await;
    let db = s.db.client().await;
    let started = Instant::now();
    db.execute(
        "INSERT INTO users (user_id) SELECT 'u-big-' || lpad(i::text, 6, '0') FROM generate_series(0, $1::int - 1) i",
        &[&(INVITED as i32)],
    )
    .await
    .expect("insert users");
    let users_in = started.elapsed();
    let mut owner = s.ws(&own).await;
    let conv = "g-big";
    let create = json!({"kind": "group", "conv_id": conv, "name": "big", "members": [], "max_member": 100_000,
                        "delivery_mode": "push"});
    let created = owner.request("create_conversation", create).await;
    assert_eq!(created["ok"], true, "{created}");
    let (filled, fill_seen) = fill(&mut owner, &db, conv).await;
    let (pushed, push_seen) = push_to_online(&s, &mut owner, conv).await;
    let (searched, search_seen) = search(&mut owner, &db, conv).await;
    let pass = check.resolve(
        json!({"users_inserted_ms": users_in.as_millis() as u64, "fill": fill_seen, "push": push_seen,
               "search": search_seen}),
        filled && pushed && searched,
    );
    assert!(pass);
}
