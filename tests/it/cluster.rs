//! Three nodes on one PostgreSQL and one NATS server (ARCHITECTURE §7):
//! batches reach members on every node once and in order, a conversation is
//! written by its home node and moves when that node dies, a device's newest
//! connection keeps its route across nodes, a killed node's devices carry on
//! elsewhere with nothing acked lost or doubled, and a NATS restart degrades
//! delivery to resync and recovers by itself.

use std::collections::{BTreeMap, BTreeSet};

use futures_util::future::join_all;
use serde_json::{json, Value};

use crate::cluster_harness::{homes_settled, Cluster, Node};
use crate::evidence::Check;
use crate::gateway::{hi, WAIT};
use crate::server::Ws;
use crate::sync_points::pushed_seqs;

const SUITE: &str = "im-13";
/// The close code of a connection that must reconnect and sync (PROTOCOL §4).
const TRY_AGAIN_LATER: u16 = 1013;

/// The whole log of `conv` as `ws`'s user reads it: `(seq, client_msg_id)`
/// of every message, in order.
pub(crate) async fn sync_all(ws: &mut Ws, conv: &str) -> Vec<(i64, String)> {
    try_sync_all(ws, conv).await.expect("the connection closed while syncing")
}

/// [`sync_all`], or `None` if the connection closes first.
pub(crate) async fn try_sync_all(ws: &mut Ws, conv: &str) -> Option<Vec<(i64, String)>> {
    let (mut after, mut log) = (0, Vec::new());
    loop {
        let id = ws.try_start("sync", json!({"conv_id": conv, "after_seq": after, "limit": 500})).await?;
        let page = ws.reply_or_close(id).await.ok()?;
        for e in page["events"].as_array().unwrap_or_else(|| panic!("sync: {page}")) {
            if e["kind"] == "msg" {
                log.push((e["seq"].as_i64().expect("seq"), e["client_msg_id"].as_str().expect("key").to_owned()));
            }
        }
        if page["has_more"] != true {
            return Some(log);
        }
        after = page["next_after"].as_i64().expect("next_after");
    }
}

/// Sends `keys` on `ws` all at once; the acked seq of each (see [`send_keys`]).
async fn send_all(ws: &mut Ws, conv: &str, keys: &[String]) -> Vec<i64> {
    send_keys(ws, conv, keys).await.0
}

/// Sends `keys` on `ws` all at once, and again any answered `INTERNAL` (a
/// write forwarded to a home node that died with it in flight) with the same
/// key, as a client does; the acked seq of each key, and the number of such
/// retries.
async fn send_keys(ws: &mut Ws, conv: &str, keys: &[String]) -> (Vec<i64>, usize) {
    let mut seqs: BTreeMap<&String, i64> = BTreeMap::new();
    let mut retries = 0;
    let mut left: Vec<&String> = keys.iter().collect();
    while !left.is_empty() {
        let mut ids = Vec::new();
        for key in &left {
            ids.push(ws.start("send", hi(key, conv, "hello")).await);
        }
        let mut again = Vec::new();
        for (id, key) in ids.into_iter().zip(left) {
            let ack = ws.reply(id).await;
            match (ack["seq"].as_i64(), ack["error"]["code"].as_str()) {
                (Some(seq), _) => drop(seqs.insert(key, seq)),
                (None, Some("INTERNAL")) if retries < keys.len() => again.push(key),
                _ => panic!("send not acked: {ack}"),
            }
        }
        retries += again.len();
        left = again;
    }
    (keys.iter().map(|k| seqs[k]).collect(), retries)
}

/// The seq of a send of `key` to "g-p" from `device`; a resync close (1013:
/// the node resyncs its devices once more when its NATS link is back)
/// reconnects it to `node` and sends the same key again (idempotent), at most
/// 3 times.
async fn send_through_resyncs(device: &mut Device, node: &Node, key: &str) -> i64 {
    for _ in 0..3 {
        let id = device.ws.start("send", hi(key, "g-p", "hello")).await;
        match device.ws.reply_or_close(id).await {
            Ok(ack) => return ack["seq"].as_i64().unwrap_or_else(|| panic!("send not acked: {ack}")),
            Err(_) => device.reconnect(&[node], "g-p").await,
        }
    }
    panic!("{key}: the connection kept closing");
}

/// The seqs of `conv` pushed to `ws` until `expected` of them came, a
/// connection closed, or nothing came for `WAIT`.
async fn pushed_until(ws: &mut Ws, conv: &str, expected: usize) -> Vec<i64> {
    let mut seqs = Vec::new();
    while seqs.len() < expected {
        match ws.push_within(WAIT).await {
            Some(push) => seqs.extend(pushed_seqs(&push, conv)),
            None => break,
        }
    }
    seqs
}

pub(crate) fn keys(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|k| format!("{prefix}-{k}")).collect()
}

/// `users` created, a group `conv` of them all; tokens in order.
pub(crate) async fn members(c: &Cluster, conv: &str, users: &[&str]) -> Vec<String> {
    let mut tokens = Vec::new();
    for u in users {
        tokens.push(c.user(u).await);
    }
    c.group(&tokens[0], conv, &users[1..]).await;
    tokens
}

/// A WebSocket per token, token `i` on node `i` modulo the nodes.
async fn online(c: &Cluster, tokens: &[String]) -> Vec<Ws> {
    let mut devices = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        devices.push(c.nodes[i % c.nodes.len()].ws(t).await);
    }
    devices
}

#[actix_web::test]
async fn a_batch_reaches_the_online_members_on_every_node_once_and_in_seq_order() {
    let check = Check::start(
        SUITE,
        "13-cross-node-delivery",
        "3 nodes, 6 members (2 per node), each sends 10 at once",
        "every device is pushed each other member's message exactly once, ascending seq, and is never closed",
    );
    // Every node writes the group itself (no home node): batches reach each
    // node from its own actor and from the bus, interleaved.
    let c = Cluster::start_writing_locally(3).await;
    let users = ["u0", "u1", "u2", "u3", "u4", "u5"];
    let tokens = members(&c, "g-x", &users).await;
    let mut devices = online(&c, &tokens).await;
    let sends = devices
        .iter_mut()
        .enumerate()
        .map(|(i, ws)| async move { send_all(ws, "g-x", &keys(&format!("k{i}"), 10)).await });
    let own: Vec<Vec<i64>> = join_all(sends).await;
    let mut observed = Vec::new();
    let mut pass = true;
    for (i, ws) in devices.iter_mut().enumerate() {
        let mut expected: Vec<i64> =
            own.iter().enumerate().filter(|(j, _)| *j != i).flat_map(|(_, s)| s.clone()).collect();
        expected.sort_unstable();
        let got = pushed_until(ws, "g-x", expected.len()).await;
        pass &= got == expected;
        observed.push(json!({"device": users[i], "node": i % 3, "expected": expected.len(), "pushed": got.len(), "in_order_once": got == expected}));
    }
    assert!(check.resolve(json!({"devices": observed}), pass), "cross-node delivery: {observed:?}");
}

/// A node's forwarded writes so far: `[served, answered, not_there]`.
async fn forwarding(node: &Node) -> [f64; 3] {
    let mut counts = [0.0; 3];
    for (count, outcome) in counts.iter_mut().zip(["served", "answered", "not_there"]) {
        *count = node.metric(&format!("imcore_forwarded_writes_total{{outcome=\"{outcome}\"}}")).await;
    }
    counts
}

/// Whether `log` is gapless from its first seq, with every key once.
fn gapless_once(log: &[(i64, String)]) -> bool {
    let keys: BTreeSet<&String> = log.iter().map(|(_, k)| k).collect();
    keys.len() == log.len() && log.windows(2).all(|w| w[1].0 == w[0].0 + 1)
}

#[actix_web::test]
async fn a_conversation_spread_over_the_nodes_is_written_by_its_home_node_alone() {
    let check = Check::start(
        SUITE,
        "13-home-node",
        "3 nodes, 3 members one per node, each sends 20 at once",
        "one node (the home) writes all 60: it serves the other two nodes' 40 over the bus and forwards none; the log is gapless, every key once",
    );
    let c = Cluster::start(3).await;
    let tokens = members(&c, "g-h", &["h0", "h1", "h2"]).await;
    let mut devices = online(&c, &tokens).await;
    let sends = devices
        .iter_mut()
        .enumerate()
        .map(|(i, ws)| async move { send_all(ws, "g-h", &keys(&format!("h{i}"), 20)).await });
    join_all(sends).await;
    let counts = join_all(c.nodes.iter().map(forwarding)).await;
    let homes: Vec<usize> = (0..3).filter(|&i| counts[i][0] > 0.0).collect();
    let home_alone = homes.len() == 1
        && (0..3).all(|i| match i == homes[0] {
            true => counts[i] == [40.0, 0.0, 0.0],
            false => counts[i] == [0.0, 20.0, 0.0],
        });
    let log = sync_all(&mut devices[0], "g-h").await;
    let observed = json!({"served_answered_not_there": counts, "home": homes, "logged": log.len(), "gapless_once": gapless_once(&log)});
    let pass = home_alone && log.len() == 60 && gapless_once(&log);
    assert!(check.resolve(observed.clone(), pass), "{observed}");
}

#[actix_web::test]
async fn a_killed_home_nodes_conversations_move_to_the_survivors_and_every_ack_stands() {
    let check = Check::start(
        SUITE,
        "13-home-moves",
        "3 nodes, 3 members one per node; SIGKILL the conversation's home; the survivors send at once, then again once they have forgotten it",
        "sends right after the kill are written where they arrive (nobody at the home); the survivors forget the dead node within the node timeout and agree on a new home that serves the other's sends; every acked key once, gapless",
    );
    let mut c = Cluster::start(3).await;
    let tokens = members(&c, "g-m", &["m0", "m1", "m2"]).await;
    let mut devices = online(&c, &tokens).await;
    for (i, ws) in devices.iter_mut().enumerate() {
        send_all(ws, "g-m", &keys(&format!("a{i}"), 1)).await;
    }
    let before = join_all(c.nodes.iter().map(forwarding)).await;
    let home = (0..3).find(|&i| before[i][0] > 0.0).expect("one node served the others");
    c.nodes[home].kill().await;
    let killed = tokio::time::Instant::now();
    let survivors: Vec<usize> = (0..3).filter(|&i| i != home).collect();
    // Right away: the survivors still take the dead node for the home; nobody listens there.
    let mut retried = 0;
    let b_phase = tokio::time::Instant::now();
    for &i in &survivors {
        retried += send_keys(&mut devices[i], "g-m", &keys(&format!("b{i}"), 5)).await.1;
    }
    let b_phase_ms = b_phase.elapsed().as_millis();
    let mid = join_all(survivors.iter().map(|&i| forwarding(&c.nodes[i]))).await;
    homes_settled(&survivors.iter().map(|&i| &c.nodes[i]).collect::<Vec<_>>()).await;
    let moved_ms = killed.elapsed().as_millis();
    for &i in &survivors {
        send_all(&mut devices[i], "g-m", &keys(&format!("c{i}"), 10)).await;
    }
    let after = join_all(survivors.iter().map(|&i| forwarding(&c.nodes[i]))).await;
    let served: Vec<f64> = (0..2).map(|j| after[j][0] - mid[j][0]).collect();
    let answered: Vec<f64> = (0..2).map(|j| after[j][1] - mid[j][1]).collect();
    let not_there: f64 = (0..2).map(|j| mid[j][2] - before[survivors[j]][2]).sum();
    let new_home = served.iter().filter(|&&s| s == 10.0).count() == 1 && answered.iter().sum::<f64>() == 10.0;
    let log = sync_all(&mut devices[survivors[0]], "g-m").await;
    let observed = json!({
        "home": home, "written_where_they_arrived": not_there, "retried": retried, "b_phase_ms": b_phase_ms, "moved_ms": moved_ms,
        "new_home_served": served, "answered_by_new_home": answered, "logged": log.len(), "gapless_once": gapless_once(&log),
    });
    // A send racing NATS's notice of the dead connection is lost with it: its
    // retry is written where it arrives, or (after the move) at the new home.
    // A phase slower than the node timeout may see the survivors move on.
    let arrived = not_there + retried as f64 >= 10.0 || b_phase_ms >= 2_000;
    let pass = arrived && new_home && log.len() == 3 + 10 + 20 && gapless_once(&log);
    assert!(check.resolve(observed.clone(), pass), "{observed}");
}

#[actix_web::test]
async fn a_token_rotated_through_one_node_kicks_the_devices_connection_on_another() {
    let check = Check::start(
        SUITE,
        "13-token-rotation",
        "3 nodes; a device connected to node 3; its token rotated through node 1's admin API",
        "the connection on node 3 is told `kicked: token_revoked` and closed; the old token is refused on every node, the new one accepted",
    );
    let c = Cluster::start(3).await;
    let old = c.user("r0").await;
    let mut ws = c.nodes[2].ws(&old).await;
    let (status, issued) = c.admin("/v1/admin/users/r0/devices", json!({"device_id": "d1"})).await;
    assert_eq!(status, 201, "rotate: {issued}");
    let new = issued["token"].as_str().expect("new token");
    let closed = ws.closed().await;
    let kicked = closed.pushes.iter().any(|p| p["push"] == "kicked" && p["reason"] == "token_revoked");
    let mut old_refused = Vec::new();
    for node in &c.nodes {
        old_refused.push(node.try_ws(&old).await.err());
    }
    let new_accepted = c.nodes[2].try_ws(new).await.is_ok();
    let observed = json!({"kicked_token_revoked": kicked, "close_code": closed.code, "old_token_upgrade": old_refused, "new_token_accepted": new_accepted});
    let pass = kicked && old_refused.iter().all(|s| *s == Some(401)) && new_accepted;
    assert!(check.resolve(observed.clone(), pass), "{observed}");
}

/// Whether `ws` was told `kicked: replaced` and closed.
async fn kicked_replaced(ws: &mut Ws) -> bool {
    ws.closed().await.pushes.iter().any(|p| p["push"] == "kicked" && p["reason"] == "replaced")
}

#[actix_web::test]
async fn a_device_alternating_between_nodes_keeps_one_route_its_newest_connection() {
    let check = Check::start(
        SUITE,
        "13-cross-node-routing",
        "one device: 7 connections one after the other over 3 nodes, then 6 at once",
        "each older connection gets kicked: replaced; exactly one connection (the newest) gets the next message",
    );
    let c = Cluster::start(3).await;
    let tokens = members(&c, "g-r", &["ben", "ann"]).await;
    let (ben, ann) = (&tokens[0], &tokens[1]);
    let mut sender = c.nodes[1].ws(ben).await;

    // One after the other: each new connection replaces the one before, wherever it is.
    let mut conns: Vec<Ws> = Vec::new();
    for i in 0..7 {
        conns.push(c.nodes[i % 3].ws(ann).await);
    }
    let newest = conns.pop();
    let kicked = join_all(conns.iter_mut().map(kicked_replaced)).await;
    let mut newest = newest.expect("seven connections");
    let ack = sender.request("send", hi("m1", "g-r", "one")).await;
    let pushed = pushed_until(&mut newest, "g-r", 1).await;
    let sequential_ok = kicked.iter().all(|k| *k) && pushed == [ack["seq"].as_i64().expect("seq")];

    // All at once, over the three nodes: whichever connection has the highest
    // cluster-wide id stays; every other one is kicked, whatever order the
    // claims and the cleanups of the kicked ones take.
    let attempts = (0..6).map(|i| c.nodes[i % 3].try_ws(ann));
    let mut burst: Vec<Ws> = join_all(attempts).await.into_iter().map(|r| r.expect("upgrade")).collect();
    let superseded = kicked_replaced(&mut newest).await;
    let ack = sender.request("send", hi("m2", "g-r", "two")).await;
    let seq = ack["seq"].as_i64().expect("seq");
    let mut outcomes: BTreeMap<&str, usize> = BTreeMap::new();
    for ws in &mut burst {
        let outcome = match ws.push_within(WAIT).await {
            Some(p) if p["push"] == "kicked" && p["reason"] == "replaced" => "kicked",
            Some(p) if pushed_seqs(&p, "g-r") == [seq] => "pushed",
            _ => "other",
        };
        *outcomes.entry(outcome).or_default() += 1;
    }
    let burst_ok = superseded && outcomes.get("pushed") == Some(&1) && outcomes.get("kicked") == Some(&5);
    let observed = json!({"sequential_kicked": kicked, "sequential_newest_pushed": pushed, "burst": outcomes, "burst_superseded_the_newest": superseded});
    assert!(check.resolve(observed.clone(), sequential_ok && burst_ok), "{observed}");
}

/// A device that keeps what it was pushed and reconnects (to `fallback`
/// when its node is gone) and syncs whenever its connection ends.
pub(crate) struct Device {
    token: String,
    pub(crate) node: usize,
    pub(crate) ws: Ws,
    /// Message seqs it has, pushed or synced.
    pub(crate) seen: BTreeSet<i64>,
    /// Seqs pushed twice to one connection, or below one already pushed to it.
    pub(crate) disorder: Vec<i64>,
    last_pushed: i64,
    pub(crate) reconnects: usize,
}

impl Device {
    /// A device per token, token `i` on node `i` modulo the nodes.
    pub(crate) async fn each_on_a_node(c: &Cluster, tokens: &[String]) -> Vec<Self> {
        let mut devices = Vec::new();
        for (i, t) in tokens.iter().enumerate() {
            devices.push(Device::connect(c, t, i % c.nodes.len()).await);
        }
        devices
    }

    async fn connect(c: &Cluster, token: &str, node: usize) -> Self {
        let ws = c.nodes[node].ws(token).await;
        Self {
            token: token.to_owned(),
            node,
            ws,
            seen: BTreeSet::new(),
            disorder: vec![],
            last_pushed: 0,
            reconnects: 0,
        }
    }

    pub(crate) fn take(&mut self, push: &Value, conv: &str) {
        for seq in pushed_seqs(push, conv) {
            if seq <= self.last_pushed {
                self.disorder.push(seq);
            }
            self.last_pushed = seq;
            self.seen.insert(seq);
        }
    }

    /// Reconnects to the first live node from its own, then syncs; again
    /// (at most 5 times) if the new connection is closed meanwhile (a resync).
    pub(crate) async fn reconnect(&mut self, nodes: &[&Node], conv: &str) {
        self.reconnects += 1;
        for _ in 0..5 {
            for node in nodes {
                let Ok(mut ws) = node.try_ws(&self.token).await else { continue };
                let Some(log) = try_sync_all(&mut ws, conv).await else { break };
                self.seen.extend(log.into_iter().map(|(seq, _)| seq));
                self.ws = ws;
                self.last_pushed = 0;
                return;
            }
        }
        panic!("no node took the reconnect");
    }

    /// Reads pushes until it has `seq`; a closed connection reconnects
    /// (through `nodes`, in order) and syncs.
    async fn until(&mut self, seq: i64, nodes: &[&Node], conv: &str) {
        let deadline = tokio::time::Instant::now() + WAIT * 3;
        while !self.seen.contains(&seq) {
            assert!(tokio::time::Instant::now() < deadline, "device never got seq {seq}");
            match self.ws.push_within(WAIT).await {
                Some(push) => self.take(&push, conv),
                None => self.reconnect(nodes, conv).await,
            }
        }
    }
}

#[actix_web::test]
async fn a_killed_nodes_devices_reconnect_elsewhere_and_nothing_acked_is_lost_or_doubled() {
    let check = Check::start(
        SUITE,
        "13-node-killed",
        "3 nodes, 6 members; SIGKILL one node with sends in flight on it; its devices retry their keys on another node",
        "every acked key is in the log exactly once; the log is gapless; every device ends with every message, none pushed out of order",
    );
    let mut c = Cluster::start(3).await;
    let users = ["k0", "k1", "k2", "k3", "k4", "k5"];
    let tokens = members(&c, "g-k", &users).await;
    let mut devices = Device::each_on_a_node(&c, &tokens).await;
    // Acked key → seq, and the seqs each device sent (not pushed back to it).
    let mut acked: BTreeMap<String, i64> = BTreeMap::new();
    let mut own: Vec<BTreeSet<i64>> = vec![BTreeSet::new(); devices.len()];
    for (i, d) in devices.iter_mut().enumerate() {
        let ks = keys(&format!("a{i}"), 5);
        let seqs = send_all(&mut d.ws, "g-k", &ks).await;
        own[i].extend(&seqs);
        acked.extend(ks.into_iter().zip(seqs));
    }
    // The third node's devices have sends in flight when it dies; they never see those replies
    // (the sends may still commit: forwarded to a home node elsewhere). Retried below with the
    // same key and body, as a client does.
    let mut in_flight = BTreeMap::new();
    for (i, d) in devices.iter_mut().enumerate().filter(|(_, d)| d.node == 2) {
        let ks = keys(&format!("b{i}"), 5);
        for k in &ks {
            d.ws.start("send", hi(k, "g-k", "hello")).await;
        }
        in_flight.insert(i, ks);
    }
    c.nodes[2].kill().await;
    let live: Vec<&Node> = c.nodes[..2].iter().collect();
    // Its devices reconnect to the others and retry the same keys: each is appended once.
    for (i, ks) in &in_flight {
        let d = &mut devices[*i];
        d.reconnect(&live, "g-k").await;
        let seqs = send_all(&mut d.ws, "g-k", ks).await;
        own[*i].extend(&seqs);
        acked.extend(ks.iter().cloned().zip(seqs));
    }
    // Everyone keeps sending; then a marker that every other device must get to.
    for (i, d) in devices.iter_mut().enumerate() {
        let ks = keys(&format!("c{i}"), 3);
        let seqs = send_all(&mut d.ws, "g-k", &ks).await;
        own[i].extend(&seqs);
        acked.extend(ks.into_iter().zip(seqs));
    }
    let marker = send_all(&mut devices[0].ws, "g-k", &["marker".to_owned()]).await[0];
    for d in devices.iter_mut().skip(1) {
        // Its own node first, while it lives.
        let nodes: Vec<&Node> = if d.node == 2 { live.clone() } else { vec![live[d.node], live[1 - d.node]] };
        d.until(marker, &nodes, "g-k").await;
    }
    let log = sync_all(&mut devices[1].ws, "g-k").await;
    let mut by_key: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    for (seq, key) in &log {
        by_key.entry(key.as_str()).or_default().push(*seq);
    }
    let doubled: Vec<&&str> = by_key.iter().filter(|(_, s)| s.len() > 1).map(|(k, _)| k).collect();
    let lost: Vec<&String> =
        acked.iter().filter(|(k, seq)| by_key.get(k.as_str()) != Some(&vec![**seq])).map(|(k, _)| k).collect();
    let increasing = log.windows(2).all(|w| w[1].0 > w[0].0);
    let mut behind = Vec::new();
    for (i, d) in devices.iter().enumerate().skip(1) {
        let missing: Vec<i64> =
            log.iter().map(|(s, _)| *s).filter(|s| !d.seen.contains(s) && !own[i].contains(s)).collect();
        if !missing.is_empty() || !d.disorder.is_empty() {
            behind.push(json!({"device": users[i], "missing": missing, "disorder": d.disorder}));
        }
    }
    let reconnects: Vec<usize> = devices.iter().map(|d| d.reconnects).collect();
    let observed = json!({
        "acked": acked.len(), "logged": log.len(), "doubled": doubled, "lost": lost, "increasing": increasing,
        "devices_behind": behind, "reconnects": reconnects,
    });
    let pass = doubled.is_empty() && lost.is_empty() && increasing && behind.is_empty() && log.len() == acked.len() + 1;
    assert!(check.resolve(observed.clone(), pass), "{observed}");
}

/// Waits until every device's connection is closed; the close codes. Each
/// then comes back to its node and syncs.
async fn closed_then_back(devices: &mut [Device], c: &Cluster) -> Vec<Option<u16>> {
    let codes = join_all(devices.iter_mut().map(|d| async move { d.ws.closed().await.code })).await;
    for d in devices {
        d.reconnect(&[&c.nodes[d.node]], "g-n").await;
    }
    codes
}

#[actix_web::test]
async fn a_nats_restart_closes_connections_to_resync_and_delivery_recovers_by_itself() {
    let check = Check::start(
        SUITE,
        "13-nats-restart",
        "3 nodes, a member on each; NATS killed, sends go on, NATS restarted on its port",
        "every device is closed with 1013 at the disconnect and again at the reconnect (never left behind), has every message, and is pushed across nodes again",
    );
    let mut c = Cluster::start(3).await;
    let tokens = members(&c, "g-n", &["n0", "n1", "n2"]).await;
    let mut devices = Device::each_on_a_node(&c, &tokens).await;
    let first = send_all(&mut devices[0].ws, "g-n", &["before".to_owned()]).await[0];
    let before: Vec<Vec<i64>> =
        join_all(devices[1..].iter_mut().map(|d| async move { pushed_until(&mut d.ws, "g-n", 1).await })).await;

    c.nats.kill().await;
    // Every node hears of the disconnect and closes its connections: 1013.
    let at_disconnect = closed_then_back(&mut devices, &c).await;
    // Writes go on without the bus (PostgreSQL is fine).
    let during = send_all(&mut devices[0].ws, "g-n", &keys("during", 3)).await;
    c.nats.restart().await;
    // Back on the bus, each node closes the connections made meanwhile (they
    // may have missed the others' batches).
    let at_reconnect = closed_then_back(&mut devices, &c).await;
    // Cross-node pushes flow again, with nobody asking.
    let after = send_all(&mut devices[0].ws, "g-n", &keys("after", 3)).await;
    let pushed_after: Vec<Vec<i64>> =
        join_all(devices[1..].iter_mut().map(|d| async move { pushed_until(&mut d.ws, "g-n", 3).await })).await;
    let missing: Vec<Vec<i64>> =
        devices[1..].iter().map(|d| during.iter().filter(|s| !d.seen.contains(s)).copied().collect()).collect();
    let all_1013 = |codes: &[Option<u16>]| codes.iter().all(|c| *c == Some(TRY_AGAIN_LATER));
    let pass = before.iter().all(|p| p == &[first])
        && all_1013(&at_disconnect)
        && all_1013(&at_reconnect)
        && missing.iter().all(Vec::is_empty)
        && pushed_after.iter().all(|p| *p == after);
    let observed = json!({
        "pushed_before": before, "close_codes_at_disconnect": at_disconnect, "close_codes_at_reconnect": at_reconnect,
        "synced_missing": missing, "pushed_after_recovery": pushed_after, "sent_after_recovery": after,
    });
    assert!(check.resolve(observed.clone(), pass), "{observed}");
}

#[actix_web::test]
async fn what_a_node_published_as_its_own_connection_dropped_reaches_the_others_once_it_reconnects() {
    let check = Check::start(
        SUITE,
        "13-publisher-disconnect",
        "3 nodes; the third's link to NATS swallows what it sends, a message is sent there, then the link is cut (NATS and the others stay up)",
        "the member on the first node is pushed that message once reconnected, then the next one, in order, with nothing else sent and no close",
    );
    let (c, relay) = Cluster::start_relayed(3, Some(2)).await;
    let relay = relay.expect("a relayed node");
    let tokens = members(&c, "g-p", &["p0", "p2"]).await;
    let mut near = c.nodes[0].ws(&tokens[0]).await;
    let mut far = Device::connect(&c, &tokens[1], 2).await;
    let first = send_all(&mut far.ws, "g-p", &["first".to_owned()]).await[0];
    let before = pushed_until(&mut near, "g-p", 1).await;

    relay.blackhole();
    let id = far.ws.start("send", hi("swallowed", "g-p", "hello")).await;
    // The ack comes first as a rule; the node may also resync its devices
    // (1013) before it, when its unconfirmed publishes time out first.
    let early_close = far.ws.reply_or_close(id).await.err();
    relay.cut();
    // The third node resyncs its own devices on the disconnect and publishes
    // again what NATS never confirmed.
    let far_closed = match early_close {
        Some(code) => code,
        None => far.ws.closed().await.code,
    };
    far.reconnect(&[&c.nodes[2]], "g-p").await;
    // Its seq: the same key again answers dup:true with it (or stores it, if
    // the first attempt never committed).
    let swallowed = send_through_resyncs(&mut far, &c.nodes[2], "swallowed").await;
    let next = send_through_resyncs(&mut far, &c.nodes[2], "next").await;
    let after = pushed_until(&mut near, "g-p", 2).await;
    let pass = before == [first] && after == [swallowed, next];
    let observed = json!({"pushed_before": before, "pushed_after_the_cut": after, "expected_after": [swallowed, next], "far_close_code": far_closed});
    assert!(check.resolve(observed.clone(), pass), "{observed}");
}
