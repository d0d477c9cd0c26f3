//! Large groups by themselves (PROTOCOL "Large groups"): an `auto` group
//! switches to `pull` above one member count and back to `push` only below a
//! lower one, each switch a `group` event `{"delivery":…}` in the transaction
//! of the op that crossed; an explicit `delivery_mode` wins; a `push` group
//! past the summary size pushes a batch's joins and leaves of others as one
//! `members_changed` frame while `sync` returns every one. Small thresholds
//! (the defaults are 500, 400 and 100) keep the groups small.

use std::time::Duration;

use imcore::config::LargeGroupSettings;
use serde_json::{json, Value};

use super::{ok, visible_events, ws_op, SUITE};
use crate::evidence::Check;
use crate::server::{TestServer, Ws};

const QUIET: Duration = Duration::from_millis(300);
const WAIT: Duration = Duration::from_secs(20);

async fn server(large_groups: LargeGroupSettings) -> TestServer {
    TestServer::with(|c| {
        c.limits.create_per_minute = 0;
        c.store.large_groups = large_groups;
    })
    .await
}

/// Creates users `{prefix}-{i}` for `i` in `range`: their ids.
async fn users(s: &TestServer, prefix: &str, range: std::ops::Range<usize>) -> Vec<String> {
    let mut ids = vec![];
    for i in range {
        let id = format!("{prefix}-{i:02}");
        s.user(&id).await;
        ids.push(id);
    }
    ids
}

/// The `delivery` change of a `group` event, if it is one.
fn delivery(e: &Value) -> Option<&Value> {
    (e["kind"] == "group").then(|| &e["change"]["delivery"]).filter(|d| !d.is_null())
}

/// `(seq, mode)` of every `delivery` event `ws`'s user sees in `conv`.
async fn switches(ws: &mut Ws, conv: &str) -> Vec<(i64, String)> {
    let events = visible_events(ws, conv).await;
    events.iter().filter_map(|e| Some((e["seq"].as_i64()?, delivery(e)?["mode"].as_str()?.to_owned()))).collect()
}

/// The pushes of `conv` that arrive until none came for a while.
async fn pushes_of(ws: &mut Ws, conv: &str) -> Vec<Value> {
    let mut out = vec![];
    while let Some(p) = ws.push_within(QUIET).await {
        if p["conv_id"] == conv {
            out.push(p);
        }
    }
    out
}

/// The first push of `conv` within [`WAIT`].
async fn next_push_of(ws: &mut Ws, conv: &str) -> Option<Value> {
    let until = tokio::time::Instant::now() + WAIT;
    while let Some(left) = until.checked_duration_since(tokio::time::Instant::now()) {
        let p = ws.push_within(left).await?;
        if p["conv_id"] == conv {
            return Some(p);
        }
    }
    None
}

async fn mode(ws: &mut Ws, conv: &str) -> (String, String, i64) {
    let c = ok(ws_op(ws, "get_conversation", json!({"conv_id": conv})).await, "get_conversation");
    let s = |k: &str| c[k].as_str().unwrap_or("?").to_owned();
    (s("delivery_mode"), s("delivery_setting"), c["member_count"].as_i64().unwrap_or(-1))
}

async fn send(ws: &mut Ws, conv: &str, key: &str) -> i64 {
    let body = json!({"conv_id": conv, "client_msg_id": key, "body": {"type": "text", "text": key}});
    ok(ws_op(ws, "send", body).await, "send")["seq"].as_i64().unwrap_or(0)
}

#[actix_web::test]
async fn an_auto_group_switches_to_pull_above_one_count_and_back_to_push_only_below_a_lower_one() {
    let check = Check::start(
        SUITE,
        "29-auto-pull-hysteresis",
        "ws; IMCORE_AUTO_PULL_ABOVE_MEMBERS 6, IMCORE_AUTO_PUSH_BELOW_MEMBERS 4; an auto group of owner + \
         watcher grown by one invite to 7 members, kicked down to 5, 4 and 3, then invited back to 6 and 7",
        "the invite to 7 appends, right after its joins, a group event {\"delivery\":{\"mode\":\"pull\",\
         \"setting\":\"auto\",\"member_count\":7}}; the watcher's device is told that batch by one `head` \
         push, and a send after it by a `head`; at 5 and 4 the group stays pull (no event); the kick to 3 \
         appends {\"delivery\":{\"mode\":\"push\",…,\"member_count\":3}} and the next send is pushed as an \
         `event`; growing to 6 stays push, to 7 switches again; get_conversation says the mode and \
         `delivery_setting: auto` each time; sync returns the switches in that order.",
    );
    let s = server(LargeGroupSettings {
        pull_above: 6,
        push_below: 4,
        summary_above: 1_000,
        ..LargeGroupSettings::default()
    })
    .await;
    let own = s.user("u-own").await;
    let watch = s.user("u-watch").await;
    let others = users(&s, "u-grow", 0..5).await;
    let (mut owner, mut watcher) = (s.ws(&own).await, s.ws(&watch).await);
    let conv = "g-auto";
    let create = json!({"kind": "group", "conv_id": conv, "name": "auto", "members": ["u-watch"]});
    ok(ws_op(&mut owner, "create_conversation", create).await, "create");
    pushes_of(&mut watcher, conv).await;

    let invited = ok(ws_op(&mut owner, "invite", json!({"conv_id": conv, "user_ids": others.clone()})).await, "invite");
    let invite_head = invited["head"].as_i64().unwrap_or(0);
    let told = next_push_of(&mut watcher, conv).await;
    let at_7 = mode(&mut owner, conv).await;
    let pulled_send = send(&mut owner, conv, "m1").await;
    let pull_push = next_push_of(&mut watcher, conv).await;
    let mut steps = vec![];
    for (kicked, count) in [(&others[0], 6), (&others[1], 5), (&others[2], 4), (&others[3], 3)] {
        ok(ws_op(&mut owner, "kick", json!({"conv_id": conv, "user_id": kicked})).await, "kick");
        steps.push(json!([count, mode(&mut owner, conv).await]));
    }
    pushes_of(&mut watcher, conv).await;
    let pushed_send = send(&mut owner, conv, "m2").await;
    let push_push = next_push_of(&mut watcher, conv).await;
    for (back, count) in [(&others[0], 4), (&others[1], 5), (&others[2], 6), (&others[3], 7)] {
        ok(ws_op(&mut owner, "invite", json!({"conv_id": conv, "user_ids": [back]})).await, "invite back");
        steps.push(json!([count, mode(&mut owner, conv).await]));
    }
    let seen = switches(&mut watcher, conv).await;
    let events = visible_events(&mut watcher, conv).await;
    let first = events.iter().find_map(|e| delivery(e).cloned());

    let m = |m: &str, n: i64| json!([m, "auto", n]);
    let want_steps = vec![
        json!([6, m("pull", 6)]),
        json!([5, m("pull", 5)]),
        json!([4, m("pull", 4)]),
        json!([3, m("push", 3)]),
        json!([4, m("push", 4)]),
        json!([5, m("push", 5)]),
        json!([6, m("push", 6)]),
        json!([7, m("pull", 7)]),
    ];
    let switch_seqs: Vec<i64> = seen.iter().map(|(s, _)| *s).collect();
    let modes: Vec<&str> = seen.iter().map(|(_, m)| m.as_str()).collect();
    let right = at_7 == ("pull".into(), "auto".into(), 7)
        && first == Some(json!({"mode": "pull", "setting": "auto", "member_count": 7}))
        && switch_seqs.first() == Some(&(invite_head + 1))
        && told.as_ref().is_some_and(|p| p["push"] == "head" && p["head"] == invite_head + 1)
        && pull_push.as_ref().is_some_and(|p| p["push"] == "head" && p["head"] == pulled_send)
        && push_push.as_ref().is_some_and(|p| p["push"] == "event" && p["event"]["seq"] == pushed_send)
        && steps == want_steps
        && modes == ["pull", "push", "pull"];
    let pass = check.resolve(
        json!({"invite_head": invite_head, "pushed_for_the_invite": told, "at_7": at_7, "first_switch": first,
               "push_for_a_send_in_pull": pull_push, "steps_count_mode": steps,
               "push_for_a_send_back_in_push": push_push, "switches_seq_mode": seen}),
        right,
    );
    assert!(pass);
}

#[actix_web::test]
async fn an_explicit_delivery_mode_wins_over_the_member_count_and_auto_takes_it_back() {
    let check = Check::start(
        SUITE,
        "29-explicit-mode-wins",
        "ws; IMCORE_AUTO_PULL_ABOVE_MEMBERS 3, IMCORE_AUTO_PUSH_BELOW_MEMBERS 2; a group created with \
         delivery_mode push, grown to 6; update_group delivery_mode auto; then pull; then a group created \
         with pull of 2 members",
        "the push group stays push at 6 members (no delivery event); update_group auto appends its profile \
         event then {\"delivery\":{\"mode\":\"pull\",\"setting\":\"auto\",\"member_count\":6}}; setting push \
         then switches it back ({\"mode\":\"push\",\"setting\":\"push\"}) whatever its size; a group created \
         pull of 2 is pull; get_conversation shows both fields; `delivery_mode: \"sometimes\"` answers \
         BAD_REQUEST.",
    );
    let s = server(LargeGroupSettings {
        pull_above: 3,
        push_below: 2,
        summary_above: 1_000,
        ..LargeGroupSettings::default()
    })
    .await;
    let own = s.user("u-own").await;
    let others = users(&s, "u-x", 0..5).await;
    let mut owner = s.ws(&own).await;
    let conv = "g-fixed";
    let create = json!({"kind": "group", "conv_id": conv, "name": "fixed", "members": others,
                        "delivery_mode": "push"});
    ok(ws_op(&mut owner, "create_conversation", create).await, "create");
    let fixed = mode(&mut owner, conv).await;
    let auto =
        ok(ws_op(&mut owner, "update_group", json!({"conv_id": conv, "delivery_mode": "auto"})).await, "update auto")
            ["seq"]
            .as_i64()
            .unwrap_or(0);
    let after_auto = mode(&mut owner, conv).await;
    ok(ws_op(&mut owner, "update_group", json!({"conv_id": conv, "delivery_mode": "push"})).await, "update push");
    let after_push = mode(&mut owner, conv).await;
    let bad = ws_op(&mut owner, "update_group", json!({"conv_id": conv, "delivery_mode": "sometimes"})).await.err();
    let events = visible_events(&mut owner, conv).await;
    let changes: Vec<Value> = events.iter().filter_map(|e| delivery(e).map(|d| json!([e["seq"], d]))).collect();
    let profile = events.iter().find(|e| e["seq"] == auto).map(|e| e["change"].clone());

    let small = "g-small-pull";
    let create =
        json!({"kind": "group", "conv_id": small, "name": "p", "members": ["u-x-00"], "delivery_mode": "pull"});
    ok(ws_op(&mut owner, "create_conversation", create).await, "create pull");
    let small_mode = mode(&mut owner, small).await;

    let right = fixed == ("push".into(), "push".into(), 6)
        && after_auto == ("pull".into(), "auto".into(), 6)
        && after_push == ("push".into(), "push".into(), 6)
        && profile == Some(json!({"profile": {"delivery_mode": "auto"}}))
        && changes
            == vec![
                json!([auto + 1, {"mode": "pull", "setting": "auto", "member_count": 6}]),
                json!([auto + 3, {"mode": "push", "setting": "push", "member_count": 6}]),
            ]
        && small_mode == ("pull".into(), "pull".into(), 2)
        && bad.as_deref() == Some("BAD_REQUEST");
    let pass = check.resolve(
        json!({"created_push_at_6": fixed, "update_auto_seq": auto, "profile_change": profile,
               "after_auto": after_auto, "after_push": after_push, "delivery_events": changes,
               "created_pull_at_2": small_mode, "bad_setting": bad}),
        right,
    );
    assert!(pass);
}

/// The byte length of every frame in `pushes`.
fn sizes(pushes: &[Value]) -> Vec<usize> {
    pushes.iter().map(|p| p.to_string().len()).collect()
}

#[actix_web::test]
async fn a_push_group_past_the_summary_size_pushes_one_count_per_batch_and_sync_returns_every_join() {
    let check = Check::start(
        SUITE,
        "29-members-changed-summary",
        "ws; IMCORE_MEMBERS_SUMMARY_ABOVE 4, a push group of owner + watcher + 2; online: the watcher and \
         two users about to be invited (one later kicked); one invite of 20 users, then a kick of one of \
         them; control: an invite of 2 into a group that stays at the size (4)",
        "the watcher gets one frame {\"push\":\"members_changed\",\"joined\":20,\"left\":0,\"from_seq\",\
         \"head\",\"events\":[]} for the invite instead of an `events` frame of 20 joins (the control \
         group's device gets its 2 joins as one `events` frame), and {\"left\":1} for the kick; an online \
         invitee (the 4th) gets a members_changed frame from its own join on: joined 16 and its own `join` as \
         the one event; the kicked one gets its `leave` as an `event`; \
         the watcher's sync returns all 20 joins and the leave.",
    );
    let s = server(LargeGroupSettings {
        pull_above: 10_000,
        push_below: 9_000,
        summary_above: 4,
        ..LargeGroupSettings::default()
    })
    .await;
    let own = s.user("u-own").await;
    let watch = s.user("u-watch").await;
    let two = users(&s, "u-two", 0..2).await;
    let many = users(&s, "u-many", 0..20).await;
    let (mut owner, mut watcher) = (s.ws(&own).await, s.ws(&watch).await);
    let mut joiner = s.ws(&s.device(&many[3], "d1").await).await;
    let mut kicked = s.ws(&s.device(&many[7], "d1").await).await;

    // Control: below the size, the same invite is pushed as its joins.
    let small = "g-below";
    let create = json!({"kind": "group", "conv_id": small, "name": "b", "members": ["u-watch"]});
    ok(ws_op(&mut owner, "create_conversation", create).await, "create small");
    pushes_of(&mut watcher, small).await;
    let in_small: Vec<String> = many[..2].to_vec();
    ok(ws_op(&mut owner, "invite", json!({"conv_id": small, "user_ids": in_small})).await, "invite small");
    let below = pushes_of(&mut watcher, small).await;

    let conv = "g-summed";
    let members = json!(["u-watch", two[0], two[1]]);
    let create = json!({"kind": "group", "conv_id": conv, "name": "s", "members": members, "delivery_mode": "push"});
    ok(ws_op(&mut owner, "create_conversation", create).await, "create");
    pushes_of(&mut watcher, conv).await;
    let invited = ok(ws_op(&mut owner, "invite", json!({"conv_id": conv, "user_ids": many.clone()})).await, "invite");
    let head = invited["head"].as_i64().unwrap_or(0);
    let for_invite = pushes_of(&mut watcher, conv).await;
    let for_joiner = pushes_of(&mut joiner, conv).await;
    let kick = ok(ws_op(&mut owner, "kick", json!({"conv_id": conv, "user_id": many[7]})).await, "kick");
    let kick_seq = kick["seq"].as_i64().unwrap_or(0);
    let for_kick = pushes_of(&mut watcher, conv).await;
    let for_kicked = pushes_of(&mut kicked, conv).await;
    let events = visible_events(&mut watcher, conv).await;
    let joins = events.iter().filter(|e| e["kind"] == "join" && e["seq"].as_i64() > Some(4)).count();
    let leaves = events.iter().filter(|e| e["kind"] == "leave").count();

    let summary = |joined: i64, left: i64, from: i64, to: i64| {
        move |p: &Value| {
            p["push"] == "members_changed"
                && p["joined"] == joined
                && p["left"] == left
                && p["from_seq"] == from
                && p["head"] == to
        }
    };
    let own_join = |p: &Value, user: &str| {
        p["events"].as_array().is_some_and(|e| e.len() == 1 && e[0]["kind"] == "join" && e[0]["subject_user"] == user)
    };
    let right = below.len() == 1
        && below[0]["push"] == "events"
        && below[0]["events"].as_array().map(Vec::len) == Some(2)
        && for_invite.len() == 1
        && summary(20, 0, head - 19, head)(&for_invite[0])
        && for_invite[0]["events"] == json!([])
        && for_joiner.len() == 1
        && summary(16, 0, head - 16, head)(&for_joiner[0])
        && own_join(&for_joiner[0], &many[3])
        && for_kick.len() == 1
        && summary(0, 1, kick_seq, kick_seq)(&for_kick[0])
        && for_kicked
            .iter()
            .any(|p| p["push"] == "event" && p["event"]["kind"] == "leave" && p["event"]["seq"] == kick_seq)
        && joins == 20
        && leaves == 1;
    let pass = check.resolve(
        json!({"control_below_size": {"frames": below.len(), "bytes": sizes(&below)},
               "invite_head": head, "watcher_for_invite": for_invite, "watcher_bytes": sizes(&for_invite),
               "invitee_for_invite": for_joiner, "watcher_for_kick": for_kick, "kicked_got": for_kicked,
               "sync_joins_after_creation": joins, "sync_leaves": leaves}),
        right,
    );
    assert!(pass);
}
