//! Live signals across two nodes (PROTOCOL v1.2, ARCHITECTURE §7): typing
//! and read pushes cross the sealed bus to the other node's devices, and a
//! user is online while a device of it is connected on any node, with the
//! grace period before an offline announcement. Real `imcore` processes,
//! a real `nats-server`; each check writes its record to evidence/im-14.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::cluster_harness::Cluster;
use crate::evidence::Check;
use crate::live::SUITE;
use crate::server::{http_raw, Ws};

/// The nodes' presence grace (`IMCORE_PRESENCE_GRACE_MS` default).
const GRACE: Duration = Duration::from_millis(5000);

/// The pushes of `kind` arriving on `ws` within `wait`.
async fn pushes(ws: &mut Ws, kind: &str, wait: Duration) -> Vec<Value> {
    let until = Instant::now() + wait;
    let mut got = vec![];
    while let Some(left) = until.checked_duration_since(Instant::now()) {
        match ws.live_push_within(left).await {
            Some(p) if p["push"] == kind => got.push(p),
            Some(_) => {}
            None => break,
        }
    }
    got
}

/// The first push of `kind` on `ws` within `wait`.
async fn pushes_until_one(ws: &mut Ws, kind: &str, wait: Duration) -> Option<Value> {
    let until = Instant::now() + wait;
    while let Some(left) = until.checked_duration_since(Instant::now()) {
        match ws.live_push_within(left).await {
            Some(p) if p["push"] == kind => return Some(p),
            Some(_) => {}
            None => return None,
        }
    }
    None
}

/// `ws`'s `presence` answer for `user` (its only item).
async fn presence_of(ws: &mut Ws, user: &str) -> Value {
    let reply = ws.request("presence", json!({"user_ids": [user]})).await;
    reply["result"][0].clone()
}

async fn direct(c: &Cluster, token: &str, other: &str) -> String {
    let body = json!({"kind": "direct", "members": [other]}).to_string();
    let (_, v) = http_raw(c.nodes[0].port, "POST", "/v1/conversations", Some(token), Some(&body)).await;
    v["conv_id"].as_str().unwrap_or_else(|| panic!("direct: {v}")).to_owned()
}

#[actix_web::test]
async fn typing_and_read_pushes_cross_to_the_other_node_throttled_like_on_one() {
    let c = Cluster::start(2).await;
    let (ana_t, ben_t) = (c.user("ana").await, c.user("ben").await);
    let conv = direct(&c, &ana_t, "ben").await;
    let mut ana = c.nodes[0].ws(&ana_t).await;
    let mut ben = c.nodes[1].ws(&ben_t).await;
    // Ben's node follows the conversation once a message reaches him there: only then is a
    // signal's loss the rule's fault, not a subscription still loading on a busy machine.
    ana.request("send", json!({"conv_id": conv, "client_msg_id": "m0", "body": {"type": "text", "text": "hello"}}))
        .await;
    assert!(pushes_until_one(&mut ben, "event", Duration::from_secs(10)).await.is_some(), "m0 reaches ben");
    pushes(&mut ben, "*", Duration::from_millis(300)).await;
    let started = Instant::now();
    let mut ids = vec![];
    for _ in 0..20 {
        ids.push(ana.start("typing", json!({"conv_id": conv, "on": true})).await);
    }
    let mut answered_empty = true;
    for id in ids {
        let r = ana.reply(id).await;
        answered_empty &= r["ok"] == true && r.as_object().map(|m| m.len()) == Some(2);
    }
    let burst_ms = started.elapsed().as_millis();
    let to_ben = pushes(&mut ben, "typing", Duration::from_millis(1500)).await;
    let allowed = 1 + (burst_ms / 1000) as usize;
    let back = ben.request("typing", json!({"conv_id": conv, "on": false})).await;
    let to_ana = pushes(&mut ana, "typing", Duration::from_millis(1500)).await;
    let expected_to_ana = json!([{"push": "typing", "conv_id": conv, "user_id": "ben", "on": false}]);
    let pass = answered_empty
        && !to_ben.is_empty()
        && to_ben.len() <= allowed
        && to_ben.iter().all(|p| p["user_id"] == "ana" && p["conv_id"] == conv.as_str() && p["on"] == true)
        && back["ok"] == true
        && json!(to_ana) == expected_to_ana;
    let check = Check::start(
        SUITE,
        "14-typing-two-nodes",
        "ws",
        "20 typing signals on node A: all answered {}, one per started second of the burst reaches the other member on node B; B's typing reaches A",
    );
    let observed = json!({"answered_empty": answered_empty, "burst_ms": burst_ms, "allowed": allowed,
        "a_to_b": to_ben, "b_to_a": to_ana});
    assert!(check.resolve(observed, pass));

    // A read on B reaches the other member on A.
    pushes(&mut ana, "*", Duration::from_millis(200)).await;
    ana.request("send", json!({"conv_id": conv, "client_msg_id": "m1", "body": {"type": "text", "text": "hi"}})).await;
    pushes(&mut ben, "*", Duration::from_millis(500)).await;
    let read = ben.request("read", json!({"conv_id": conv, "seq": 4})).await;
    let got = pushes(&mut ana, "read", Duration::from_millis(1500)).await;
    let expected = json!([{"push": "read", "conv_id": conv, "user_id": "ben", "read_seq": 4}]);
    let check = Check::start(
        SUITE,
        "14-read-push-direct",
        "two-nodes",
        "ben's read on node B is pushed to ana on node A: {push: read, conv_id, user_id: ben, read_seq}",
    );
    assert!(check.resolve(
        json!({"read": read["read_seq"], "pushed_on_a": got}),
        read["read_seq"] == 4 && json!(got) == expected
    ));
}

#[actix_web::test]
async fn a_user_online_on_one_node_is_online_on_the_other_and_going_offline_is_announced_after_the_grace() {
    let c = Cluster::start(2).await;
    let (ana_t, ben_t) = (c.user("ana").await, c.user("ben").await);
    let (_, d2) = c.admin("/v1/admin/users/ben/devices", json!({"device_id": "d2"})).await;
    let ben_d2 = d2["token"].as_str().expect("token").to_owned();
    direct(&c, &ana_t, "ben").await;
    // ana watches from node B; ben comes online on node A.
    let mut ana = c.nodes[1].ws(&ana_t).await;
    let ben_a = c.nodes[0].ws(&ben_t).await;
    let came_online = pushes(&mut ana, "presence", Duration::from_millis(1500)).await;
    let seen_from_b = presence_of(&mut ana, "ben").await;

    // ben's second device comes and goes on B: B has him offline past its
    // grace, A still online — he is online, and nothing is announced.
    let ben_b = c.nodes[1].ws(&ben_d2).await;
    ben_b.close().await;
    let while_a_holds = pushes(&mut ana, "presence", GRACE + Duration::from_millis(1500)).await;
    let still_online = presence_of(&mut ana, "ben").await;

    // ben leaves A and is back within the grace: nothing; then leaves for good.
    ben_a.close().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let ben_a = c.nodes[0].ws(&ben_t).await;
    let flap = pushes(&mut ana, "presence", GRACE + Duration::from_millis(1000)).await;
    ben_a.close().await;
    let left = Instant::now();
    let first = pushes_until_one(&mut ana, "presence", GRACE + Duration::from_millis(3000)).await;
    let after_ms = left.elapsed().as_millis();
    let mut offline: Vec<Value> = first.into_iter().collect();
    offline.extend(pushes(&mut ana, "presence", Duration::from_millis(500)).await);
    let answer = presence_of(&mut ana, "ben").await;

    let pass = came_online.len() == 1
        && came_online[0]["online"] == true
        && seen_from_b["online"] == true
        && while_a_holds.is_empty()
        && still_online["online"] == true
        && flap.is_empty()
        && offline.len() == 1
        && after_ms >= GRACE.as_millis() - 200
        && offline[0]["online"] == false
        && offline[0]["last_seen"].is_string()
        && answer["online"] == false
        && answer["last_seen"] == offline[0]["last_seen"];
    let check = Check::start(
        SUITE,
        "14-presence-two-nodes-grace",
        "grace=5000ms",
        "ben online on node A: announced to ana on node B and answered online there; his device on B gone past B's grace while A holds him: still online, nothing announced; a reconnect on A within the grace: nothing; gone for good: one offline push, not before the grace has passed, with last_seen, which presence then answers",
    );
    let observed = json!({"online_push": came_online, "presence_on_b": seen_from_b, "pushes_while_a_holds": while_a_holds,
        "presence_while_a_holds": still_online, "pushes_on_quick_reconnect": flap, "offline_pushes": offline,
        "offline_push_ms_after_leaving": after_ms, "presence_after": answer});
    assert!(check.resolve(observed, pass));
}

#[actix_web::test]
async fn a_killed_nodes_users_are_no_longer_online_on_the_others() {
    let mut c = Cluster::start(2).await;
    let (ana_t, ben_t) = (c.user("ana").await, c.user("ben").await);
    direct(&c, &ana_t, "ben").await;
    let mut ana = c.nodes[1].ws(&ana_t).await;
    let _ben = c.nodes[0].ws(&ben_t).await;
    pushes(&mut ana, "presence", Duration::from_millis(1000)).await;
    let before = presence_of(&mut ana, "ben").await;
    c.nodes[0].kill().await;
    let killed = Instant::now();
    let mut after = before.clone();
    while killed.elapsed() < Duration::from_secs(10) && after["online"] != false {
        tokio::time::sleep(Duration::from_millis(200)).await;
        after = presence_of(&mut ana, "ben").await;
    }
    let offline_after_ms = killed.elapsed().as_millis();
    let pass = before["online"] == true && after["online"] == false;
    let check = Check::start(
        SUITE,
        "14-presence-node-killed",
        "SIGKILL",
        "ben online only on node A, which is killed: once A's heartbeat is missed, ana on node B reads ben offline",
    );
    let observed = json!({"before": before, "after": after, "offline_read_ms_after_kill": offline_after_ms});
    assert!(check.resolve(observed, pass));
}
