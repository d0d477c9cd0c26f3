//! The bus on a NATS cluster (ARCHITECTURE §7, "NATS as a cluster"): three
//! nodes on three `nats-server`s routed to each other (with the recipe's
//! authorization), every node given all three URLs. The server most nodes
//! are on is SIGKILLed under concurrent sends: its nodes reconnect to
//! another, every node resyncs its devices (the others told by the moved
//! node's `imcore.lost`), every acked send is in the log once, every device
//! ends with every message (pushed, or synced after a 1013), and pushes flow
//! across nodes again. Records go to evidence/im-13.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use serde_json::json;

use crate::cluster::{keys, members, sync_all, try_sync_all, Device};
use crate::cluster_harness::{Cluster, Nats, Node};
use crate::evidence::Check;
use crate::gateway::{hi, WAIT};

const SUITE: &str = "im-13";
const CONV: &str = "g-q";
/// Sends per sender (one sender per node, all at once).
const PER_SENDER: usize = 40;
/// The NATS server is killed once this many sends were acked.
const KILL_AFTER: usize = 30;
/// A node's "every device here resyncs" count.
const RESYNCS: &str = "imcore_ws_closed_total{reason=\"bus_lost\"}";
/// Attempts of one send (a close reconnects, an error waits a little).
const ATTEMPTS: usize = 50;
/// How long every node's resync count holds still before the cluster is
/// taken for quiet: a moved node says `imcore.lost` after its reconnect
/// resync, once its publisher is through up to two confirmation round trips
/// (a second each at most), and a loaded machine adds its delays.
const QUIET: Duration = Duration::from_secs(3);

/// What the senders saw.
#[derive(Default)]
struct Sent {
    acked: BTreeMap<String, i64>,
    /// Error answers by code (retried with the same key).
    errors: BTreeMap<String, u32>,
}

/// Sends `key` from `d` until acked: a closed connection comes back to its
/// node and sends again, an error answer waits and sends again, with the
/// same key each time (idempotent, P2).
async fn send_until_acked(d: &mut Device, nodes: &[Node], key: &str, sent: &RefCell<Sent>) -> i64 {
    for _ in 0..ATTEMPTS {
        let reply = match d.ws.try_start("send", hi(key, CONV, "hello")).await {
            Some(id) => d.ws.reply_or_close(id).await.ok(),
            None => None,
        };
        match reply {
            Some(ack) => match ack["seq"].as_i64() {
                Some(seq) => {
                    d.seen.insert(seq);
                    sent.borrow_mut().acked.insert(key.to_owned(), seq);
                    return seq;
                }
                None => {
                    let code = ack["error"]["code"].as_str().unwrap_or("?").to_owned();
                    *sent.borrow_mut().errors.entry(code).or_default() += 1;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            },
            None => d.reconnect(&[&nodes[d.node]], CONV).await,
        }
    }
    panic!("{key}: not acked in {ATTEMPTS} attempts");
}

/// Takes `d`'s pushes until it has `seqs`; a closed connection comes back to
/// its node and syncs. False if nothing came for [`WAIT`] with some missing.
async fn catch_up(d: &mut Device, nodes: &[Node], seqs: &[i64]) -> bool {
    while !seqs.iter().all(|s| d.seen.contains(s)) {
        let asked = Instant::now();
        match d.ws.push_within(WAIT).await {
            Some(push) => d.take(&push, CONV),
            None if asked.elapsed() < WAIT => d.reconnect(&[&nodes[d.node]], CONV).await,
            None => return false,
        }
    }
    true
}

/// Each node's resync count once it has reached what `moved` nodes moving
/// makes certain and then held still for [`QUIET`] (or at `deadline`). A
/// moved node resyncs at its disconnect and at its reconnect; every node
/// resyncs on each moved node's `imcore.lost` it hears, which a node still
/// disconnected misses: so the final counts vary, their floors do not
/// (2 on a moved node, `moved` on the others, which hear every notice).
async fn settled_resyncs(nodes: &[Node], moved: usize, deadline: Instant) -> Vec<f64> {
    let mut floors: Vec<f64> = (0..nodes.len()).map(|i| if i < moved { 2.0 } else { moved as f64 }).collect();
    floors.sort_by(f64::total_cmp);
    let (mut last, mut since) = (Vec::new(), Instant::now());
    loop {
        let counts = join_all(nodes.iter().map(|n| n.metric(RESYNCS))).await;
        if counts != last {
            (last, since) = (counts.clone(), Instant::now());
        }
        let mut sorted = counts.clone();
        sorted.sort_by(f64::total_cmp);
        let floored = sorted.iter().zip(&floors).all(|(count, floor)| count >= floor);
        if (floored && since.elapsed() >= QUIET) || Instant::now() >= deadline {
            return counts;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A round trip on `d`'s connection, so that a close the server sent before
/// it is seen now: the connection comes back and syncs. The answer is not
/// taken for seen: an open connection must have been pushed everything.
async fn notice_close(d: &mut Device, nodes: &[Node]) {
    if try_sync_all(&mut d.ws, CONV).await.is_none() {
        d.reconnect(&[&nodes[d.node]], CONV).await;
    }
}

fn servers(c: &Cluster) -> Vec<&Nats> {
    std::iter::once(&c.nats).chain(&c.nats_peers).collect()
}

/// The client connections of each server still running (`None`: killed).
async fn connections(servers: &[&Nats], killed: usize) -> Vec<Option<u64>> {
    let mut counts = Vec::new();
    for (i, s) in servers.iter().enumerate() {
        counts.push(if i == killed { None } else { Some(s.connections().await) });
    }
    counts
}

#[actix_web::test]
async fn a_nats_server_killed_under_load_moves_its_nodes_to_another_and_loses_no_acked_send() {
    let check = Check::start(
        SUITE,
        "34-nats-server-killed",
        "3 nodes on a 3-server NATS cluster (routes on loopback, authorized), 2 devices per node, 3 concurrent senders; SIGKILL the NATS server most nodes are on mid-burst",
        "its nodes reconnect to the other servers; every node resyncs its devices; every acked key is in the log exactly once; every device ends with every message, never pushed out of order; pushes flow across nodes again",
    );
    let mut c = Cluster::start_on_nats_cluster(3, 3).await;
    let users = ["q0", "q1", "q2", "q3", "q4", "q5"];
    let tokens = members(&c, CONV, &users).await;
    // Devices 0–2 send (one per node), 3–5 only listen (one per node).
    let mut devices = Device::each_on_a_node(&c, &tokens).await;
    let before = connections(&servers(&c), usize::MAX).await;
    let victim = (0..before.len()).max_by_key(|&i| before[i]).expect("servers");
    let on_victim = before[victim].unwrap_or(0);
    let Cluster { nats, nats_peers, nodes, .. } = &mut c;
    let (nodes, victim_nats): (&[Node], &mut Nats) = match victim {
        0 => (nodes, nats),
        i => (nodes, &mut nats_peers[i - 1]),
    };

    let sent = RefCell::new(Sent::default());
    let (killed_at, marker) = (Cell::new(None::<usize>), Cell::new(None::<i64>));
    let started = Instant::now();
    let (senders, listeners) = devices.split_at_mut(3);
    let sending = async {
        join_all(senders.iter_mut().enumerate().map(|(i, d)| {
            let sent = &sent;
            async move {
                for key in keys(&format!("s{i}"), PER_SENDER) {
                    send_until_acked(d, nodes, &key, sent).await;
                }
            }
        }))
        .await;
        marker.set(Some(send_until_acked(&mut senders[0], nodes, "marker", &sent).await));
    };
    let killing = async {
        while sent.borrow().acked.len() < KILL_AFTER {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        killed_at.set(Some(sent.borrow().acked.len()));
        victim_nats.kill().await;
    };
    let listening = join_all(listeners.iter_mut().map(|d| {
        let marker = &marker;
        async move {
            // Takes pushes (and resyncs) while the senders run.
            while marker.get().is_none() {
                let asked = Instant::now();
                match d.ws.push_within(Duration::from_millis(200)).await {
                    Some(push) => d.take(&push, CONV),
                    None if asked.elapsed() < Duration::from_millis(200) => d.reconnect(&[&nodes[d.node]], CONV).await,
                    None => {}
                }
            }
        }
    }));
    futures_util::join!(sending, killing, listening);
    let burst = started.elapsed();
    let marker = marker.get().expect("the marker was sent");

    // The victim's nodes are on the other servers now.
    let deadline = Instant::now() + WAIT;
    let mut after_kill = connections(&servers(&c), victim).await;
    while after_kill.iter().flatten().sum::<u64>() < 3 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
        after_kill = connections(&servers(&c), victim).await;
    }
    let nodes = &c.nodes[..];
    // Every node resynced its devices: those on the killed server at the
    // disconnect, the others on the `imcore.lost` of a node that moved.
    let resyncs = settled_resyncs(nodes, on_victim as usize, deadline + WAIT).await;
    let mut caught_up = Vec::new();
    for d in devices.iter_mut() {
        notice_close(d, nodes).await;
        caught_up.push(catch_up(d, nodes, &[marker]).await);
    }
    // Pushes flow across nodes again, with nobody reconnecting.
    let reconnects_before: Vec<usize> = devices.iter().map(|d| d.reconnects).collect();
    let mut after = Vec::new();
    for key in keys("after", 3) {
        after.push(send_until_acked(&mut devices[0], nodes, &key, &sent).await);
    }
    let mut pushed_after = Vec::new();
    for d in devices[3..].iter_mut() {
        pushed_after.push(catch_up(d, nodes, &after).await);
    }
    let resumed = pushed_after.iter().all(|p| *p)
        && devices[3..].iter().zip(&reconnects_before[3..]).all(|(d, before)| d.reconnects == *before);

    let log = sync_all(&mut devices[3].ws, CONV).await;
    let logged: Vec<i64> = log.iter().map(|(seq, _)| *seq).collect();
    for d in devices.iter_mut() {
        caught_up.push(catch_up(d, nodes, &logged).await);
    }
    let sent = sent.into_inner();
    let mut by_key: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    for (seq, key) in &log {
        by_key.entry(key.as_str()).or_default().push(*seq);
    }
    let doubled: Vec<&&str> = by_key.iter().filter(|(_, s)| s.len() > 1).map(|(k, _)| k).collect();
    let lost: Vec<&String> =
        sent.acked.iter().filter(|(k, seq)| by_key.get(k.as_str()) != Some(&vec![**seq])).map(|(k, _)| k).collect();
    let mut behind = Vec::new();
    for (i, d) in devices.iter().enumerate() {
        let missing: Vec<i64> = logged.iter().filter(|s| !d.seen.contains(s)).copied().collect();
        if !missing.is_empty() || !d.disorder.is_empty() {
            behind.push(json!({"device": users[i], "missing": missing, "disorder": d.disorder}));
        }
    }
    let moved = after_kill.iter().flatten().sum::<u64>() == 3;
    let observed = json!({
        "connections_before": before, "killed_server": victim, "nodes_on_killed_server": on_victim,
        "connections_after": after_kill, "resyncs_per_node": resyncs, "killed_after_acks": killed_at.get(), "burst_ms": burst.as_millis() as u64,
        "acked": sent.acked.len(), "logged": log.len(), "doubled": doubled, "lost": lost, "errors_retried": sent.errors,
        "devices_behind": behind, "caught_up": caught_up, "reconnects": devices.iter().map(|d| d.reconnects).collect::<Vec<_>>(),
        "pushed_after_recovery": pushed_after,
    });
    let pass = on_victim > 0
        && moved
        && resyncs.iter().all(|r| *r >= 1.0)
        && doubled.is_empty()
        && lost.is_empty()
        && log.len() == sent.acked.len()
        && behind.is_empty()
        && caught_up.iter().all(|c| *c)
        && resumed;
    assert!(check.resolve(observed.clone(), pass), "{observed}");
}
