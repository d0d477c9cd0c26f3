//! Refusals that change nothing: an invite naming an unknown user, joins and
//! approvals past `max_member`, the roster of a direct conversation, and the
//! bounds of an invite (1,000 users) and of `max_member` (100,000).

use serde_json::json;

use super::{http_op, ok, server, ws_op, SUITE};
use crate::evidence::Check;

#[actix_web::test]
async fn whole_invites_and_joins_are_refused_past_their_rules_and_change_nothing() {
    let check = Check::start(
        SUITE,
        "02-refusals-change-nothing",
        "ws; one free group of max_member 3 (owner + 1), one approval group, one direct chat",
        "an invite naming one unknown user among known ones answers NOT_FOUND and joins nobody; a free \
         join and an approval past max_member answer GROUP_FULL; the head and member_count are unchanged \
         by every refusal; members of a direct chat lists its two members",
    );
    let s = server().await;
    let (own, ben, cai, dan) =
        (s.user("u-own").await, s.user("u-ben").await, s.user("u-cai").await, s.user("u-dan").await);
    let mut owner = s.ws(&own).await;
    let created = |conv: &str, mode: &str| json!({"kind": "group", "conv_id": conv, "name": conv, "members": ["u-ben"], "join_mode": mode, "max_member": 3});
    ok(ws_op(&mut owner, "create_conversation", created("g-free", "free")).await, "create free");
    ok(ws_op(&mut owner, "create_conversation", created("g-appr", "approval")).await, "create approval");
    let state = |conv: &'static str| {
        let port = s.port;
        let own = own.clone();
        async move {
            let (_, c) =
                crate::server::http_raw(port, "GET", &format!("/v1/conversations/{conv}"), Some(&own), None).await;
            (c["head"].as_i64(), c["member_count"].as_i64())
        }
    };
    let before = state("g-free").await;
    let unknown = ws_op(&mut owner, "invite", json!({"conv_id": "g-free", "user_ids": ["u-cai", "u-nobody"]})).await;
    let unknown_refused = unknown == Err("NOT_FOUND".into()) && state("g-free").await == before;

    let mut c = s.ws(&cai).await;
    ok(ws_op(&mut c, "join", json!({"conv_id": "g-free"})).await, "cai joins: 3 of 3");
    let full = state("g-free").await;
    let mut d = s.ws(&dan).await;
    let join_full = ws_op(&mut d, "join", json!({"conv_id": "g-free"})).await;
    let join_refused = join_full == Err("GROUP_FULL".into()) && state("g-free").await == full;

    ok(ws_op(&mut c, "join", json!({"conv_id": "g-appr"})).await, "cai applies");
    ok(ws_op(&mut d, "join", json!({"conv_id": "g-appr"})).await, "dan applies");
    ok(ws_op(&mut owner, "approve", json!({"conv_id": "g-appr", "user_id": "u-cai"})).await, "cai approved");
    let appr_full = state("g-appr").await;
    let approve_full = ws_op(&mut owner, "approve", json!({"conv_id": "g-appr", "user_id": "u-dan"})).await;
    let approve_refused = approve_full == Err("GROUP_FULL".into()) && state("g-appr").await == appr_full;

    let mut b = s.ws(&ben).await;
    let direct =
        ok(ws_op(&mut b, "create_conversation", json!({"kind": "direct", "members": ["u-own"]})).await, "direct");
    let roster = ok(ws_op(&mut b, "members", json!({"conv_id": direct["conv_id"]})).await, "direct roster");
    let mut listed: Vec<&str> =
        roster["members"].as_array().into_iter().flatten().filter_map(|m| m["user_id"].as_str()).collect();
    listed.sort();
    let direct_listed = listed == ["u-ben", "u-own"] && roster["member_count"] == 2;

    let pass = check.resolve(
        json!({"unknown_invite": format!("{unknown:?}"), "join_past_max": format!("{join_full:?}"),
               "approve_past_max": format!("{approve_full:?}"), "direct_roster": listed}),
        unknown_refused && join_refused && approve_refused && direct_listed,
    );
    assert!(pass);
}

#[actix_web::test]
async fn an_invite_past_1000_users_and_a_max_member_past_100000_are_refused_and_change_nothing() {
    let check = Check::start(
        SUITE,
        "02-bounds-invite-and-max-member",
        "ws+http; one invite group of the owner and one member",
        "an invite naming 1,001 users answers BAD_REQUEST (HTTP 400) and 1,000 unknown ones NOT_FOUND (the bound \
         is 1,000, inclusive); update_group max_member 100,001 answers BAD_REQUEST and 100,000 is taken; \
         create_conversation with max_member 100,001 answers BAD_REQUEST and creates nothing; the group's head \
         and settings are unchanged by every refusal",
    );
    let s = server().await;
    let own = s.user("u-own").await;
    s.user("u-ben").await;
    let mut owner = s.ws(&own).await;
    let create = json!({"kind": "group", "conv_id": "g-bounds", "name": "b", "members": ["u-ben"]});
    ok(ws_op(&mut owner, "create_conversation", create).await, "create");
    let state =
        || async { crate::server::http_raw(s.port, "GET", "/v1/conversations/g-bounds", Some(&own), None).await.1 };
    let before = state().await;
    let names = |n: usize| (0..n).map(|i| format!("u-x{i:04}")).collect::<Vec<_>>();
    let invite = |n: usize| json!({"conv_id": "g-bounds", "user_ids": names(n)});
    let over_ws = ws_op(&mut owner, "invite", invite(1_001)).await;
    let over_http = http_op(s.port, &own, "invite", &invite(1_001)).await;
    let at_bound = ws_op(&mut owner, "invite", invite(1_000)).await;
    let after_invites = state().await;
    let max = |n: i64| json!({"conv_id": "g-bounds", "max_member": n});
    let max_ws = ws_op(&mut owner, "update_group", max(100_001)).await;
    let max_http = http_op(s.port, &own, "update_group", &max(100_001)).await;
    let after_max = state().await;
    let max_ok = ws_op(&mut owner, "update_group", max(100_000)).await;
    let big = json!({"kind": "group", "conv_id": "g-too-big", "name": "t", "members": [], "max_member": 100_001});
    let create_big = ws_op(&mut owner, "create_conversation", big).await;
    let (missing, _) = crate::server::http_raw(s.port, "GET", "/v1/conversations/g-too-big", Some(&own), None).await;
    let bad = Err("BAD_REQUEST".to_owned());
    let pass = check.resolve(
        json!({"invite_1001": [format!("{over_ws:?}"), format!("{over_http:?}")],
               "invite_1000_unknown": format!("{at_bound:?}"),
               "max_member_100001": [format!("{max_ws:?}"), format!("{max_http:?}")],
               "max_member_100000": format!("{max_ok:?}"), "create_100001": format!("{create_big:?}"),
               "created_status": missing, "head_before": before["head"], "head_after": after_max["head"]}),
        over_ws == bad
            && over_http == bad
            && at_bound == Err("NOT_FOUND".into())
            && after_invites == before
            && max_ws == bad
            && max_http == bad
            && after_max == before
            && max_ok.is_ok()
            && create_big == bad
            && missing == 403,
    );
    assert!(pass);
}
