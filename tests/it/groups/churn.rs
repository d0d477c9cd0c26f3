//! `members` paging while others join and leave (PROTOCOL §5): a page is in
//! join order after the `after` cursor, so a member present for the whole
//! paging is returned exactly once, and nobody twice; `q` is a literal
//! prefix of user id or alias; `limit` is at most 200.

use std::cell::Cell;
use std::collections::BTreeSet;

use futures_util::future::join_all;
use serde_json::{json, Value};

use super::{http_op, ok, server, ws_op, SUITE};
use crate::evidence::Check;
use crate::server::Ws;

const STABLE: usize = 40;
const LEAVERS: usize = 40;
const JOINERS: usize = 40;
const PAGE: i64 = 7;

fn name(prefix: &str, i: usize) -> String {
    format!("u-{prefix}-{i:02}")
}

fn user_ids(page: &Value) -> Vec<String> {
    page["members"].as_array().into_iter().flatten().filter_map(|m| m["user_id"].as_str().map(str::to_owned)).collect()
}

/// One paging pass over the roster: the users in order, the `joined_seq`s
/// ascending, and whether every page kept to the limit and the last said `next: null`.
async fn pass(ws: &mut Ws, conv: &str) -> (Vec<String>, bool) {
    let (mut users, mut last_seq, mut right) = (vec![], 0, true);
    let mut after = 0;
    for _ in 0..1000 {
        let page = ok(ws_op(ws, "members", json!({"conv_id": conv, "after": after, "limit": PAGE})).await, "members");
        let members = page["members"].as_array().cloned().unwrap_or_default();
        right &= members.len() as i64 <= PAGE;
        for m in &members {
            let seq = m["joined_seq"].as_i64().unwrap_or(0);
            right &= seq > last_seq;
            last_seq = seq;
        }
        users.extend(user_ids(&page));
        match page["next"].as_i64() {
            Some(next) => after = next,
            None => return (users, right),
        }
    }
    (users, false)
}

/// The users a `q` search finds, and the page's `member_count`.
async fn search(ws: &mut Ws, conv: &str, q: &'static str) -> (&'static str, Vec<String>, Value) {
    let page = ok(ws_op(ws, "members", json!({"conv_id": conv, "q": q, "limit": 200})).await, "search");
    (q, user_ids(&page), page["member_count"].clone())
}

/// `members` with `limit` 201, 0 and 200 over both transports: only 200 is taken.
async fn limits(ws: &mut Ws, port: u16, token: &str, conv: &str) -> (bool, Vec<Value>) {
    let mut limits = vec![];
    for limit in [201, 0, 200] {
        let fields = json!({"conv_id": conv, "limit": limit.to_string()});
        let over_ws = ws_op(ws, "members", json!({"conv_id": conv, "limit": limit})).await.err();
        let over_http = http_op(port, token, "members", &fields).await.err();
        limits.push(json!({"limit": limit, "ws": over_ws, "http": over_http}));
    }
    let refused = |l: &Value| l["ws"] == "BAD_REQUEST" && l["http"] == "BAD_REQUEST";
    let right = refused(&limits[0]) && refused(&limits[1]) && limits[2]["ws"].is_null() && limits[2]["http"].is_null();
    (right, limits)
}

#[actix_web::test]
async fn members_pages_under_churn_return_each_member_once() {
    let check = Check::start(
        SUITE,
        "02-members-paging-churn",
        "ws, free group of owner + 40 stable + 40 leaving members, 40 users joining; pages of 7 while the 80 \
         join/leave over HTTP",
        "every paging pass run during the churn (and one after) returns no user twice, every stable member (and \
         the owner) exactly once, joined_seq strictly ascending, pages ≤ limit, and ends with next null; after \
         the churn the roster is owner + stable + joiners and member_count says so; q is a literal prefix of \
         user_id (u-st-1 → the 10 users u-st-10..19, u-jn → the 40 joiners, u-lv → none, u-st-% → none) and of \
         alias; limit 201 and 0 → BAD_REQUEST over WebSocket and HTTP, 200 → ok",
    );
    let s = server().await;
    let own = s.user("u-own").await;
    let stable: Vec<String> = (0..STABLE).map(|i| name("st", i)).collect();
    let leavers: Vec<String> = (0..LEAVERS).map(|i| name("lv", i)).collect();
    let joiners: Vec<String> = (0..JOINERS).map(|i| name("jn", i)).collect();
    let mut churn_tokens = vec![];
    for u in &stable {
        s.admin("/v1/admin/users", json!({"user_id": u})).await;
    }
    for u in leavers.iter().chain(&joiners) {
        churn_tokens.push((u.clone(), s.user(u).await));
    }
    let conv = "g-churn";
    let mut ws = s.ws(&own).await;
    let initial: Vec<&String> = stable.iter().chain(&leavers).collect();
    let created = ws
        .request(
            "create_conversation",
            json!({"kind": "group", "conv_id": conv, "name": conv, "members": initial, "join_mode": "free",
                   "delivery_mode": "pull"}),
        )
        .await;
    assert_eq!(created["ok"], true, "{created}");

    let done = Cell::new(false);
    let churn = async {
        let streams = churn_tokens.chunks(20).map(|chunk| async move {
            for (u, token) in chunk {
                let op = if u.starts_with("u-lv") { "leave" } else { "join" };
                ok(http_op(s.port, token, op, &json!({"conv_id": conv})).await, op);
            }
        });
        join_all(streams).await;
        done.set(true);
    };
    let paging = async {
        let mut passes = vec![];
        loop {
            let finished = done.get();
            passes.push(pass(&mut ws, conv).await);
            if finished {
                return passes;
            }
        }
    };
    let ((), passes) = futures_util::join!(churn, paging);
    let mut must: BTreeSet<String> = stable.iter().cloned().collect();
    must.insert("u-own".into());
    let mut passes_right = true;
    let mut summary = vec![];
    for (users, right) in &passes {
        let distinct: BTreeSet<&String> = users.iter().collect();
        let stable_once = must.iter().all(|u| users.iter().filter(|x| *x == u).count() == 1);
        passes_right &= *right && distinct.len() == users.len() && stable_once;
        summary.push(json!({"returned": users.len(), "distinct": distinct.len(), "stable_once": stable_once,
                            "ordered_and_bounded": right}));
    }
    let (last, _) = passes.last().cloned().unwrap_or_default();
    let final_roster: BTreeSet<String> = last.into_iter().collect();
    let want_roster: BTreeSet<String> = must.iter().cloned().chain(joiners.iter().cloned()).collect();
    ok(ws_op(&mut ws, "set_alias", json!({"conv_id": conv, "alias": "boss"})).await, "alias");
    let st1 = search(&mut ws, conv, "u-st-1").await;
    let jn = search(&mut ws, conv, "u-jn").await;
    let lv = search(&mut ws, conv, "u-lv").await;
    let literal = search(&mut ws, conv, "u-st-%").await;
    let alias = search(&mut ws, conv, "bo").await;
    let want_st1: Vec<String> = (10..20).map(|i| name("st", i)).collect();
    let searches_right = st1.1 == want_st1
        && jn.1.iter().collect::<BTreeSet<_>>() == joiners.iter().collect()
        && lv.1.is_empty()
        && literal.1.is_empty()
        && alias.1 == ["u-own"]
        && st1.2 == 1 + STABLE + JOINERS;
    let (limits_right, limits) = limits(&mut ws, s.port, &own, conv).await;
    let pass = passes_right && passes.len() >= 2 && final_roster == want_roster && searches_right && limits_right;
    let pass = check.resolve(
        json!({"passes": summary, "final_roster": final_roster.len(), "final_roster_right": final_roster == want_roster,
               "searches": [st1, jn.1.len(), lv, literal, alias], "limits": limits}),
        pass,
    );
    assert!(pass);
}
