//! Wire behaviours of PROTOCOL §3, §5 and §6 over the real server: backward
//! `sync` across membership periods, the admin endpoints' refusals, and two
//! users creating the same direct chat at once. Records go to evidence/im-05.

use std::sync::Arc;

use futures_util::future::join_all;
use serde_json::{json, Value};

use imcore::domain::{LeaveReason, Role};
use imcore::store::{ConvCache, CreateConversation, GroupSettings, JoinOp, LeaveOp, Store, WriteOp};

use crate::env::{cid, send_op, text, uid};
use crate::evidence::Check;
use crate::server::{http_raw, TestServer, Ws, ADMIN};

const SUITE: &str = "im-05";

fn code(v: &Value) -> &str {
    v["error"]["code"].as_str().unwrap_or("")
}

fn seqs(page: &Value) -> Vec<i64> {
    page["events"].as_array().into_iter().flatten().filter_map(|e| e["seq"].as_i64()).collect()
}

/// Every seq `ws` sees, by forward paging from the start.
async fn visible(ws: &mut Ws, conv: &str) -> Vec<i64> {
    let mut out = vec![];
    let mut after = 0;
    loop {
        let page = ws.request("sync", json!({"conv_id": conv, "after_seq": after, "limit": 1000})).await;
        out.extend(seqs(&page));
        after = page["next_after"].as_i64().unwrap_or(after);
        if page["has_more"] != true {
            return out;
        }
    }
}

/// g-back by u-ana with u-cai (joins 1, 2); msgs 3-7; u-ben joins at 8;
/// msgs 9-14; u-ben leaves at 15; msgs 16-18; u-ben joins again at 19; msgs 20-24.
async fn arrange_periods(store: &Store, conv: &str) {
    store
        .create_conversation(&CreateConversation::Group {
            creator: uid("u-ana"),
            conv_id: Some(cid(conv)),
            name: conv.into(),
            members: vec![uid("u-cai")],
            settings: GroupSettings::default(),
        })
        .await
        .expect("create group");
    let conv = cid(conv);
    let join = || WriteOp::Join(JoinOp { user: uid("u-ben"), actor: uid("u-ana"), role: Role::Member });
    let leave = || WriteOp::Leave(LeaveOp { user: uid("u-ben"), actor: uid("u-ben"), reason: LeaveReason::Left });
    for seq in 3..=24 {
        let op = match seq {
            8 | 19 => join(),
            15 => leave(),
            _ => send_op("u-ana", &format!("m{seq}"), text("x")),
        };
        store.write_batch(&conv, ConvCache::default(), vec![op]).await.unwrap_or_else(|e| panic!("write {seq}: {e:?}"));
    }
}

#[actix_web::test]
async fn backward_sync_pages_the_newest_visible_events_below_before_seq() {
    const LIMIT: usize = 4;
    let check = Check::start(
        SUITE,
        "05-sync-backward",
        "ws, limit 4, a member with two periods (8-15, 19-24) of a 24-event log",
        "paging back from head+1 with before_seq = next_before returns, per page, the newest 4 events the caller \
         can see below before_seq, ascending, next_before = the page's first seq, has_more until the oldest; the \
         pages together are exactly the forward sync's events (periods 8-15 and 19-24, nothing in between); \
         before_seq inside the gap (18) starts below it (12-15); a member since seq 2 asking below 5 gets 2-4 \
         with has_more false; a never-member gets NOT_MEMBER",
    );
    let s = TestServer::start().await;
    let (ben, cai) = (s.user("u-ben").await, s.user("u-cai").await);
    let (_ana, eve) = (s.user("u-ana").await, s.user("u-eve").await);
    let conv = "g-back";
    // The gateway has no membership ops yet: the log is arranged through the
    // store, in the database the server serves, before the server touches it.
    arrange_periods(&s.db.store, conv).await;
    let mut b = s.ws(&ben).await;
    let forward = visible(&mut b, conv).await;
    let want_forward: Vec<i64> = (8..=15).chain(19..=24).collect();

    let mut pages = vec![];
    let mut paged: Vec<i64> = vec![];
    let mut before = 25;
    let mut pages_right = true;
    loop {
        let page = b.request("sync", json!({"conv_id": conv, "before_seq": before, "limit": LIMIT})).await;
        let got = seqs(&page);
        let below: Vec<i64> = forward.iter().copied().filter(|&q| q < before).collect();
        let want = below[below.len().saturating_sub(LIMIT)..].to_vec();
        let more = below.len() > LIMIT;
        pages_right &=
            got == want && page["has_more"] == more && page["next_before"] == json!(got.first()) && page["head"] == 24;
        pages.push(json!({"before_seq": before, "seqs": got, "next_before": page["next_before"],
                          "has_more": page["has_more"]}));
        paged.splice(0..0, got.iter().copied());
        match page["next_before"].as_i64() {
            Some(next) if page["has_more"] == true && pages.len() < 20 => before = next,
            _ => break,
        }
    }
    let in_gap = seqs(&b.request("sync", json!({"conv_id": conv, "before_seq": 18, "limit": LIMIT})).await);
    let mut c = s.ws(&cai).await;
    let early = c.request("sync", json!({"conv_id": conv, "before_seq": 5, "limit": 10})).await;
    let mut e = s.ws(&eve).await;
    let stranger = e.request("sync", json!({"conv_id": conv, "before_seq": 25})).await;
    let pass = forward == want_forward
        && pages_right
        && pages.len() == 4
        && paged == forward
        && in_gap == [12, 13, 14, 15]
        && seqs(&early) == [2, 3, 4]
        && early["has_more"] == false
        && code(&stranger) == "NOT_MEMBER";
    let pass = check.resolve(
        json!({"forward": forward, "pages": pages, "in_gap_18": in_gap, "member_since_2_below_5": early,
               "never_member": stranger["error"]}),
        pass,
    );
    assert!(pass);
}

#[actix_web::test]
async fn admin_endpoints_refuse_a_wrong_token_a_taken_user_and_an_unknown_conversation() {
    let check = Check::start(
        SUITE,
        "05-admin-refusals",
        "http",
        "each admin endpoint (create user, issue device, bump epoch) with no token, a wrong token or a device's \
         token: 401 UNAUTHORIZED, and nothing changes (the user can then be created: 201); a taken user_id: 409 \
         ALREADY_EXISTS; a device of an unknown user and the epoch of an unknown conversation: 404 NOT_FOUND; a \
         known conversation's epoch bump answers the new epoch and a client holding the old one gets EPOCH_CHANGED",
    );
    let s = TestServer::start().await;
    let ana = s.user("u-ana").await;
    s.user("u-ben").await;
    let conv = s.direct(&ana, "u-ben").await;
    let endpoints = [
        ("/v1/admin/users", json!({"user_id": "u-new"})),
        ("/v1/admin/users/u-ana/devices", json!({"device_id": "d9"})),
        (&*format!("/v1/admin/conversations/{conv}/epoch"), json!({})),
    ]
    .map(|(p, b)| (p.to_owned(), b));
    let mut refusals = vec![];
    for (path, body) in &endpoints {
        for token in [None, Some("wrong-admin-token"), Some(ana.as_str())] {
            let (status, v) = http_raw(s.port, "POST", path, token, Some(&body.to_string())).await;
            refusals.push(json!({"path": path, "token": token.map(|t| if t == ana { "device" } else { t }),
                                 "status": status, "code": code(&v)}));
        }
    }
    let refused = refusals.iter().all(|r| r["status"] == 401 && r["code"] == "UNAUTHORIZED");
    let (new_status, _) = s.admin("/v1/admin/users", json!({"user_id": "u-new"})).await;
    let (taken_status, taken) = s.admin("/v1/admin/users", json!({"user_id": "u-ana"})).await;
    let (unknown_user_status, unknown_user) =
        s.admin("/v1/admin/users/u-nobody/devices", json!({"device_id": "d1"})).await;
    let (unknown_conv_status, unknown_conv) = s.admin("/v1/admin/conversations/g-nowhere/epoch", json!({})).await;
    let mut a = s.ws(&ana).await;
    let old_epoch = a.request("sync", json!({"conv_id": conv})).await["epoch"].clone();
    let (bump_status, bumped) = s.admin(&format!("/v1/admin/conversations/{conv}/epoch"), json!({})).await;
    let stale = a.request("sync", json!({"conv_id": conv, "epoch": old_epoch})).await;
    let pass = refused
        && new_status == 201
        && taken_status == 409
        && code(&taken) == "ALREADY_EXISTS"
        && unknown_user_status == 404
        && code(&unknown_user) == "NOT_FOUND"
        && unknown_conv_status == 404
        && code(&unknown_conv) == "NOT_FOUND"
        && old_epoch == 1
        && bump_status == 200
        && bumped["epoch"] == 2
        && code(&stale) == "EPOCH_CHANGED"
        && stale["error"]["epoch"] == 2;
    let pass = check.resolve(
        json!({"refusals": refusals, "create_after_refusals": new_status, "taken": [taken_status, taken],
               "unknown_user_device": [unknown_user_status, unknown_user],
               "unknown_conv_epoch": [unknown_conv_status, unknown_conv], "bump": [bump_status, bumped],
               "old_epoch_sync": stale}),
        pass,
    );
    assert!(pass);
}

#[actix_web::test]
async fn two_users_creating_the_same_direct_chat_at_once_get_one_conversation() {
    const PAIRS: usize = 8;
    let check = Check::start(
        SUITE,
        "05-direct-create-race",
        "ws, 8 pairs, each side creates at once",
        "when both users of a pair create their direct chat at the same moment: both answers carry the same \
         conv_id, one is 201 and the other 200, the conversation has head 2, and its joins are the 201 \
         creator's order (join@1 the creator, join@2 the other)",
    );
    let s = TestServer::start().await;
    let mut pairs = vec![];
    for i in 0..PAIRS {
        let (x, y) = (format!("u-p{i}x"), format!("u-p{i}y"));
        let (tx, ty) = (s.user(&x).await, s.user(&y).await);
        pairs.push([(x, tx), (y, ty)]);
    }
    let barrier = Arc::new(tokio::sync::Barrier::new(2 * PAIRS));
    let creates = pairs.iter().flat_map(|pair| {
        [(0, 1), (1, 0)].map(|(me, other)| {
            let (barrier, token, other) = (barrier.clone(), pair[me].1.clone(), pair[other].0.clone());
            let s = &s;
            async move {
                let body = json!({"kind": "direct", "members": [other]});
                barrier.wait().await;
                s.http("POST", "/v1/conversations", Some(&token), Some(&body)).await
            }
        })
    });
    let answers = join_all(creates).await;
    let mut outcomes = vec![];
    let mut all_right = true;
    for (pair, two) in pairs.iter().zip(answers.chunks(2)) {
        let [(sx, vx), (sy, vy)] = [&two[0], &two[1]].map(|(st, v)| (*st, v.clone()));
        let conv = vx["conv_id"].as_str().unwrap_or("").to_owned();
        let winner = match (sx, sy) {
            (201, 200) => Some(&pair[0]),
            (200, 201) => Some(&pair[1]),
            _ => None,
        };
        let mut ws = s.ws(&winner.unwrap_or(&pair[0]).1).await;
        let page = ws.request("sync", json!({"conv_id": conv, "after_seq": 0})).await;
        let joins: Vec<Value> = page["events"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|e| json!([e["seq"], e["kind"], e["subject_user"]]))
            .collect();
        let loser = winner.map(|w| if w.0 == pair[0].0 { &pair[1].0 } else { &pair[0].0 });
        let right = !conv.is_empty()
            && vy["conv_id"] == conv.as_str()
            && page["head"] == 2
            && winner.is_some()
            && joins == [json!([1, "join", winner.map(|w| &w.0)]), json!([2, "join", loser])];
        all_right &= right;
        outcomes.push(json!({"statuses": [sx, sy], "conv_ids": [vx["conv_id"], vy["conv_id"]], "joins": joins,
                             "right": right}));
        ws.close().await;
    }
    let pass = check.resolve(json!({"pairs": outcomes}), all_right);
    assert!(pass);
}

#[actix_web::test]
async fn the_admin_token_is_not_a_device_token() {
    let check = Check::start(
        SUITE,
        "05-admin-token-not-a-device",
        "ws+http",
        "the admin token opens no WebSocket (401) and no user route (401 UNAUTHORIZED)",
    );
    let s = TestServer::start().await;
    let ws = Ws::connect(s.port, Some(ADMIN)).await.err();
    let (status, v) = s.http("GET", "/v1/conversations", Some(ADMIN), None).await;
    let pass = ws == Some(401) && status == 401 && code(&v) == "UNAUTHORIZED";
    let pass = check.resolve(json!({"ws_upgrade": ws, "http": [status, v]}), pass);
    assert!(pass);
}
