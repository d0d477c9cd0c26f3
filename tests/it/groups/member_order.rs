//! The orders of `members` besides join order (PROTOCOL §5 "members: orders
//! and cursors"): `order=active` against the log itself, under concurrent
//! sends over both write paths, paged while members send; a search paged by
//! its cursor over both transports; cursors and orders refused.

use std::collections::{BTreeMap, BTreeSet};

use futures_util::future::join_all;
use serde_json::{json, Value};

use imcore::config::LargeGroupSettings;

use super::{http_op, ok, server, with_self, ws_op, SUITE};
use crate::evidence::Check;
use crate::server::{TestServer, Ws};

const MEMBERS: usize = 30;
/// Members 0..SENDERS send; the rest never do.
const SENDERS: usize = 20;
const SENDS_EACH: usize = 3;
const PAGE: i64 = 4;

/// A server whose activity moves with every batch (`activity_resolution_ms`
/// 0), so `last_active_seq` is exactly the log's.
async fn exact_server() -> TestServer {
    TestServer::with(|c| {
        c.limits.create_per_minute = 0;
        c.store.large_groups = LargeGroupSettings { activity_resolution_ms: 0, ..LargeGroupSettings::default() };
    })
    .await
}

fn name(i: usize) -> String {
    format!("u-ac-{i:02}")
}

/// `(user_id, last_active_seq)` of a page's members.
fn entries(page: &Value) -> Vec<(String, i64)> {
    let members = page["members"].as_array().into_iter().flatten();
    members
        .map(|m| (m["user_id"].as_str().unwrap_or("?").to_owned(), m["last_active_seq"].as_i64().unwrap_or(-1)))
        .collect()
}

/// A text message by `token`'s user over HTTP; odd `n` mentions the owner,
/// which takes the full write path (a plain send takes the one-trip one).
async fn send(s: &TestServer, token: &str, conv: &str, key: String, n: usize) -> i64 {
    let mut fields = json!({"conv_id": conv, "client_msg_id": key, "body": {"type": "text", "text": "hi"}});
    if n % 2 == 1 {
        fields["mentions"] = json!(["u-own"]);
    }
    ok(http_op(s.port, token, "send", &fields).await, "send")["seq"].as_i64().unwrap_or(0)
}

/// One `order=active` paging pass; before fetching each page after the
/// first, `mover` (if any) sends once: the user it moved and the pages' users.
async fn active_pass(
    ws: &mut Ws,
    s: &TestServer,
    conv: &str,
    mut mover: impl FnMut(&[(String, i64)]) -> Option<(String, String)>,
) -> (Vec<(String, i64)>, Vec<String>) {
    let (mut seen, mut moved, mut after) = (vec![], vec![], Value::Null);
    for round in 0..100 {
        if let Some((user, token)) = mover(&seen) {
            send(s, &token, conv, format!("move-{round}"), 0).await;
            moved.push(user);
        }
        let fields = json!({"conv_id": conv, "order": "active", "limit": PAGE, "after": after});
        let page = ok(ws_op(ws, "members", fields).await, "active page");
        seen.extend(entries(&page));
        match &page["next"] {
            Value::String(_) => after = page["next"].clone(),
            _ => return (seen, moved),
        }
    }
    (seen, moved)
}

/// The members' `last_active_seq` as the log says: the seq of each sender's
/// last `msg` since its current membership began.
async fn from_the_log(db: &tokio_postgres::Client, conv: &str) -> BTreeMap<String, i64> {
    let rows = db
        .query(
            "SELECT m.user_id, coalesce(max(e.seq), 0) FROM members m
               LEFT JOIN events e ON e.conv_id = m.conv_id AND e.sender_user = m.user_id AND e.kind = 'msg'
                                 AND e.seq > m.joined_seq
              WHERE m.conv_id = $1 GROUP BY m.user_id",
            &[&conv],
        )
        .await
        .expect("log");
    rows.iter().map(|r| (r.get(0), r.get(1))).collect()
}

/// Newest first, ties by user id descending: the order PROTOCOL gives.
fn in_order(seen: &[(String, i64)]) -> bool {
    seen.windows(2).all(|w| (w[0].1, &w[0].0) > (w[1].1, &w[1].0))
}

#[actix_web::test]
async fn members_by_activity_follow_the_log_newest_first_and_page_each_member_once() {
    let check = Check::start(
        SUITE,
        "29-members-order-active",
        "ws + http; free pull group of owner + 30 members; members 0..19 send 3 messages each concurrently \
         over HTTP (odd ones with a mention: full write path; even: one-trip), member 19 then leaves and joins \
         again; order=active paged by 4",
        "every page's last_active_seq equals, for every member, the seq of its last msg since it joined (SQL \
         over events; 0 for the 10 silent members, the owner and the member who joined again); the pages come \
         newest first, ties by user_id descending, each member exactly once; a second pass in which, before \
         each page, a member not yet returned sends: no member twice, every member that did not send during the \
         pass exactly once, next null at the end",
    );
    let s = exact_server().await;
    let own = s.user("u-own").await;
    let mut tokens = vec![];
    for i in 0..MEMBERS {
        tokens.push(s.user(&name(i)).await);
    }
    let conv = "g-active";
    let mut ws = s.ws(&own).await;
    let members: Vec<String> = (0..MEMBERS).map(name).collect();
    let create = json!({"kind": "group", "conv_id": conv, "name": conv, "members": members, "join_mode": "free",
                        "delivery_mode": "pull"});
    ok(ws_op(&mut ws, "create_conversation", create).await, "create");
    let s = &s;
    join_all(tokens.iter().take(SENDERS).enumerate().map(|(i, token)| async move {
        for n in 0..SENDS_EACH {
            send(s, token, conv, format!("m-{i}-{n}"), i + n).await;
        }
    }))
    .await;
    let rejoiner = &tokens[SENDERS - 1];
    ok(http_op(s.port, rejoiner, "leave", &json!({"conv_id": conv})).await, "leave");
    ok(http_op(s.port, rejoiner, "join", &json!({"conv_id": conv})).await, "join");

    let db = s.db.client().await;
    let truth = from_the_log(&db, conv).await;
    let (first, _) = active_pass(&mut ws, s, conv, |_| None).await;
    let read: BTreeMap<String, i64> = first.iter().cloned().collect();
    let silent = truth.values().filter(|seq| **seq == 0).count();
    let exact = read == truth && first.len() == truth.len() && silent == MEMBERS - SENDERS + 2;

    let mut left: Vec<(String, String)> = (0..SENDERS - 1).rev().map(|i| (name(i), tokens[i].clone())).collect();
    let (second, moved) = active_pass(&mut ws, s, conv, |seen| {
        let shown: BTreeSet<&String> = seen.iter().map(|(u, _)| u).collect();
        left.retain(|(u, _)| !shown.contains(u));
        (!seen.is_empty()).then(|| left.pop()).flatten()
    })
    .await;
    let users: Vec<&String> = second.iter().map(|(u, _)| u).collect();
    let distinct: BTreeSet<&String> = users.iter().copied().collect();
    let still: Vec<&String> = truth.keys().filter(|u| !moved.contains(u)).collect();
    let once = still.iter().all(|u| users.iter().filter(|x| *x == u).count() == 1);
    let second_right = distinct.len() == users.len() && once && !moved.is_empty() && in_order(&second);

    let pass = exact && in_order(&first) && second_right;
    let pass = check.resolve(
        json!({"first_pass": first, "from_the_log_matches": read == truth, "silent": silent,
               "second_pass": {"returned": users.len(), "distinct": distinct.len(), "moved_during": moved,
                               "others_once": once}}),
        pass,
    );
    assert!(pass);
}

/// Every page of a search for `q` by `limit`, over WebSocket or (with
/// `http`) HTTP: the user ids in order, and whether each page kept to it.
async fn search_pages(ws: &mut Ws, http: Option<(u16, &str)>, conv: &str, q: &str) -> (Vec<String>, bool) {
    let (mut users, mut after, mut bounded) = (vec![], None::<String>, true);
    for _ in 0..50 {
        let mut fields = json!({"conv_id": conv, "q": q, "limit": 2});
        if let Some(a) = &after {
            fields["after"] = json!(a);
        }
        let page = match http {
            Some((port, token)) => ok(http_op(port, token, "members", &fields).await, "search"),
            None => ok(ws_op(ws, "members", fields).await, "search"),
        };
        let found = entries(&page);
        bounded &= found.len() <= 2;
        users.extend(found.into_iter().map(|(u, _)| u));
        match page["next"].as_str() {
            Some(next) => after = Some(next.to_owned()),
            None => return (users, bounded),
        }
    }
    (users, false)
}

#[actix_web::test]
async fn a_search_pages_by_the_matched_key_each_member_once_and_bad_cursors_are_refused() {
    let check = Check::start(
        SUITE,
        "29-members-search-order",
        "ws + http; group of u-own and 9 users, 3 of them with an alias matching `al` (one also matching by \
         user_id), one with an alias that does not; q=al paged by 2",
        "the search returns every member whose user_id or alias starts with `al` exactly once, ordered by the \
         key that matched (user_id if it does, else alias), then user_id, byte-wise: al-01, al-03, al-03x \
         (u-b1), al-04 (the one matching twice, by user_id), al-A (u-b2), al-b (u-b3); the same over HTTP with \
         the cursor in the query string; a cursor that is not one (zz, an integer, a join-order next), an \
         unknown order and q with order=active → BAD_REQUEST",
    );
    let s = server().await;
    let own = s.user("u-own").await;
    let users = ["al-01", "al-03", "al-04", "u-b1", "u-b2", "u-b3", "u-c", "u-d", "x-al"];
    let mut tokens = BTreeMap::new();
    for u in users {
        tokens.insert(u, s.user(u).await);
    }
    let conv = "g-search";
    let mut ws = s.ws(&own).await;
    ok(
        ws_op(
            &mut ws,
            "create_conversation",
            json!({"kind": "group", "conv_id": conv, "name": conv, "members": users}),
        )
        .await,
        "create",
    );
    for (u, alias) in [("u-b1", "al-03x"), ("u-b2", "al-A"), ("u-b3", "al-b"), ("al-04", "al-zz"), ("u-c", "xx")] {
        let fields = with_self("set_alias", json!({"conv_id": conv, "alias": alias}), u);
        ok(http_op(s.port, &tokens[u], "set_alias", &fields).await, "alias");
    }
    let want = ["al-01", "al-03", "u-b1", "al-04", "u-b2", "u-b3"];
    let (over_ws, ws_bounded) = search_pages(&mut ws, None, conv, "al").await;
    let (over_http, http_bounded) = search_pages(&mut ws, Some((s.port, &own)), conv, "al").await;
    let joined_next = ok(ws_op(&mut ws, "members", json!({"conv_id": conv, "limit": 2})).await, "page")["next"].clone();
    let mut refused = vec![];
    for fields in [
        json!({"conv_id": conv, "q": "al", "after": "zz"}),
        json!({"conv_id": conv, "q": "al", "after": 3}),
        json!({"conv_id": conv, "order": "active", "after": joined_next}),
        json!({"conv_id": conv, "order": "active", "after": hex::encode("x~u-own")}),
        json!({"conv_id": conv, "order": "loudest"}),
        json!({"conv_id": conv, "order": "active", "q": "al"}),
    ] {
        refused.push(json!([fields.clone(), ws_op(&mut ws, "members", fields).await.err()]));
    }
    let all_refused = refused.iter().all(|r| r[1] == "BAD_REQUEST");
    let pass = over_ws == want && over_http == want && ws_bounded && http_bounded && all_refused;
    let pass = check.resolve(json!({"ws": over_ws, "http": over_http, "refused": refused}), pass);
    assert!(pass);
}

/// A member's `last_active_seq` after it sends twice, a moment apart.
async fn after_two_sends(s: &TestServer) -> (i64, i64, i64) {
    let (own, ana) = (s.user("u-own").await, s.user("u-ana").await);
    let mut ws = s.ws(&own).await;
    let create = json!({"kind": "group", "conv_id": "g-res", "name": "g-res", "members": ["u-ana"]});
    ok(ws_op(&mut ws, "create_conversation", create).await, "create");
    let first = send(s, &ana, "g-res", "r-1".into(), 0).await;
    let second = send(s, &ana, "g-res", "r-2".into(), 1).await;
    let page = ok(ws_op(&mut ws, "members", json!({"conv_id": "g-res", "order": "active"})).await, "active");
    let held = entries(&page).into_iter().find(|(u, _)| u == "u-ana").map_or(-1, |(_, seq)| seq);
    (first, second, held)
}

#[actix_web::test]
async fn activity_moves_at_most_once_per_resolution_and_every_batch_at_zero() {
    let check = Check::start(
        SUITE,
        "29-members-activity-resolution",
        "one-trip then full path",
        "a member sends twice within the resolution (default 60 s): last_active_seq stays at its first message \
         (no roster row write for the second); at resolution 0 it is the second",
    );
    let (first, second, held) = after_two_sends(&server().await).await;
    let (first0, second0, held0) = after_two_sends(&exact_server().await).await;
    let observed = json!({"default": {"first": first, "second": second, "last_active_seq": held},
                          "zero": {"first": first0, "second": second0, "last_active_seq": held0}});
    assert!(check.resolve(observed, first > 0 && second > first && held == first && held0 == second0));
}
