//! A group of 100,000 members (PROTOCOL §5: `max_member` up to 100,000;
//! `invite` of up to 1,000 users a call; `members` paged and searched, never
//! listed whole): the users are made in SQL, the group is filled through
//! the `invite` op, one send reaches every connected member, and a search of
//! any breadth, like `order=active`, reads an index range the size of its page.

use std::time::Instant;

use futures_util::future::join_all;
use futures_util::stream::{self, StreamExt};
use imcore::store::{past_prefix, MEMBERS_ACTIVE, MEMBERS_SEARCH};
use serde_json::{json, Value};
use tokio_postgres::types::ToSql;

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

/// A prefix search over `members`: the first page of a narrow and of a broad
/// prefix, and the second page of the broad one by its cursor.
async fn search(owner: &mut Ws, conv: &str) -> (bool, Value) {
    async fn page(owner: &mut Ws, conv: &str, q: &str, after: Option<Value>) -> Value {
        let fields = json!({"conv_id": conv, "q": q, "limit": 200, "after": after});
        ok(ws_op(owner, "members", fields).await, q)
    }
    let users = |page: &Value| -> Vec<String> {
        page["members"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|m| m["user_id"].as_str().map(str::to_owned))
            .collect()
    };
    let narrow = page(owner, conv, "u-big-0123", None).await;
    let broad = page(owner, conv, "u-big-0", None).await;
    let broad_2 = page(owner, conv, "u-big-0", Some(broad["next"].clone())).await;
    let right = users(&narrow) == (12_300..12_400).map(big).collect::<Vec<_>>()
        && narrow["next"].is_null()
        && users(&broad) == (0..200).map(big).collect::<Vec<_>>()
        && users(&broad_2) == (200..400).map(big).collect::<Vec<_>>()
        && broad_2["next"].is_string();
    let seen = json!({"narrow_found": users(&narrow).len(), "broad_first": users(&broad).first(),
                      "broad_second_page": [users(&broad_2).first(), users(&broad_2).last()], "right": right});
    (right, seen)
}

/// The largest row count any node of an `EXPLAIN ANALYZE` plan produced or
/// removed by a filter: a range scan that stops at the page's end keeps it
/// near the page's size, whatever the prefix.
fn rows_touched(plan: &[String]) -> u64 {
    let number_after = |line: &str, tag: &str| -> Option<u64> {
        let rest = &line[line.find(tag)? + tag.len()..];
        rest.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
    };
    let actual_rows = |line: &str| number_after(&line[line.find("(actual time=")?..], " rows=");
    plan.iter()
        .flat_map(|l| [actual_rows(l), number_after(l, "Rows Removed by Filter: ")])
        .flatten()
        .max()
        .unwrap_or(u64::MAX)
}

/// `EXPLAIN (ANALYZE, BUFFERS)` of `sql` with `params`, after `ANALYZE`.
async fn explain(db: &tokio_postgres::Client, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Vec<String> {
    let rows = db.query(&format!("EXPLAIN (ANALYZE, BUFFERS) {sql}"), params).await.expect("explain");
    rows.iter().map(|r| r.get(0)).collect()
}

/// The plans of a narrow and of broad searches (0.1%, 1% and 10% of the
/// roster, every member) and of `order=active`: each reads its index range
/// and stops at the page's end. Negative control: the roster query this
/// search replaced (join order, both prefixes filtered) on the 1% prefix,
/// whose members joined last.
async fn plans(db: &tokio_postgres::Client, conv: &str) -> (bool, Value) {
    db.batch_execute("ANALYZE members").await.expect("analyze");
    let rows = 201i64;
    let (mut right, mut seen) = (true, serde_json::Map::new());
    let prefixes =
        [("narrow", "u-big-0123"), ("broad_1pct", "u-big-099"), ("broad_10pct", "u-big-09"), ("broad_all", "u-big-")];
    for (name, q) in prefixes {
        let past = past_prefix(q);
        let plan = explain(db, MEMBERS_SEARCH, &[&conv, &q, &past, &"", &"", &rows]).await;
        let text = plan.join("\n");
        let by_index = text.contains("Index Scan using members_user_prefix");
        let no_roster_scan = !text.contains("Seq Scan") && !text.contains("members_join_order");
        let touched = rows_touched(&plan);
        right &= by_index && no_roster_scan && touched <= 2 * rows as u64;
        seen.insert(name.into(), json!({"q": q, "plan": plan, "by_prefix_index": by_index, "rows_touched": touched}));
    }
    db.execute(
        "UPDATE members SET last_active_seq = joined_seq + 1 WHERE conv_id = $1 AND user_id LIKE 'u-big-000%'",
        &[&conv],
    )
    .await
    .expect("activity");
    db.batch_execute("ANALYZE members").await.expect("analyze");
    let active = explain(db, MEMBERS_ACTIVE, &[&conv, &i64::MAX, &"", &rows]).await;
    let active_text = active.join("\n");
    let active_by_index = active_text.contains("Index Scan Backward using members_by_activity");
    let active_touched = rows_touched(&active);
    right &= active_by_index && active_touched <= rows as u64;
    seen.insert("active".into(), json!({"plan": active, "rows_touched": active_touched}));
    let naive = explain(db, REPLACED_SEARCH, &[&conv, &0i64, &"u-big-099%", &rows]).await;
    let naive_touched = rows_touched(&naive);
    right &= naive_touched > 2 * rows as u64;
    seen.insert("negative_control_join_order_filter".into(), json!({"plan": naive, "rows_touched": naive_touched}));
    (right, Value::Object(seen))
}

/// The roster query of `members?q=` before it became [`MEMBERS_SEARCH`]:
/// join order, the two prefixes OR-ed in its filter.
const REPLACED_SEARCH: &str = "
SELECT user_id FROM members
 WHERE conv_id = $1 AND joined_seq > $2 AND (user_id LIKE $3 OR alias LIKE $3)
 ORDER BY joined_seq LIMIT $4";

#[actix_web::test]
async fn a_group_of_100000_members_is_filled_by_invites_pushed_to_and_searched_by_index() {
    let check = Check::start(
        SUITE,
        "02-group-100k",
        "ws; 99,999 users inserted in SQL, invited by the owner in 100 calls of ≤ 1,000 into a push-mode \
         group; 200 members online",
        "the group reaches member_count 100,000 (= open periods, SQL) through 100 invite calls, each joining \
         its users; one more invite answers GROUP_FULL; one send is pushed to each of 200 connected members; \
         members?q=u-big-0123 returns exactly u-big-012300..012399 with next null; members?q=u-big-0 (10,000 \
         matches) returns u-big-000000..000199, and its next as after the 200 after them.",
    );
    let plan_check = Check::start(
        SUITE,
        "29-member-search-plans-100k",
        "the 100,000-member group of 02-group-100k; EXPLAIN (ANALYZE, BUFFERS) after ANALYZE, 201 rows asked",
        "the search query for a narrow prefix (u-big-0123: 100 members), broad ones (u-big-099: 1,000, the \
         last to join; u-big-09: 10,000) and one matching every member (u-big-: 99,999) reads members by an \
         Index Scan using members_user_prefix, no Seq Scan nor members_join_order, and no plan node returns or \
         filters out more than 402 rows; order=active (1,000 members with activity) is an Index Scan Backward \
         using members_by_activity touching ≤ 201 rows. Negative control: the replaced query (join order, \
         prefixes in its filter) on u-big-099 touches more than 402 rows.",
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
    let (searched, search_seen) = search(&mut owner, conv).await;
    let pass = check.resolve(
        json!({"users_inserted_ms": users_in.as_millis() as u64, "fill": fill_seen, "push": push_seen,
               "search": search_seen}),
        filled && pushed && searched,
    );
    let (planned, plans_seen) = plans(&db, conv).await;
    let plans_pass = plan_check.resolve(plans_seen, planned);
    assert!(pass && plans_pass);
}
