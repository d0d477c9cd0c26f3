//! The cluster bus as a trust boundary (ARCHITECTURE §7): three nodes on a
//! NATS server with authorization, and an attacker who holds the nodes' NATS
//! password (leaked) but not the cluster key. Every forgery of the audit —
//! ops forwarded to a home node, batches, revocations, route claims,
//! garbage, fake home nodes — is dropped, counted in
//! `imcore_bus_rejected_total`, and changes nothing; the same forgery
//! signed with the cluster key is what gets through (the negative controls).
//! Without the NATS credentials a node cannot join at all.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_nats::{Client, ConnectOptions};
use bytes::Bytes;
use futures_util::StreamExt;
use hmac::{Hmac, Mac};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::cluster_harness::{Cluster, Node, CLUSTER_KEY, NODE_PASSWORD, NODE_USER, OUTSIDER, OUTSIDER_PASSWORD};
use crate::evidence::Check;
use crate::gateway::{hi, WAIT};
use crate::server::Ws;

const SUITE: &str = "im-16";
/// As long as the cluster key, and not it.
const WRONG_KEY: &str = "not-the-cluster-key-though-as-long-0123456789";
const REASONS: [&str; 6] = ["unsigned", "bad_signature", "stale", "replayed", "malformed", "refused_op"];
/// The forger's counter: increasing, as a node's is.
static COUNTER: AtomicU64 = AtomicU64::new(1);
/// How long a forgery is given to do harm (an answer, a push, a close).
const HARM: Duration = Duration::from_millis(1500);

/// How a forgery is signed.
#[derive(Clone, Copy)]
enum Signed {
    Not,
    WrongKey,
    /// With the cluster key, as a node: the negative control.
    ClusterKey,
}

/// `payload` sealed as a node named `node` with `key` seals it (the wire form
/// of `seal.rs`, written again here), `age` ago.
fn seal_as(node: &str, key: &str, subject: &str, reply: Option<&str>, payload: &[u8], age: Duration) -> Bytes {
    let at = (SystemTime::now() - age).duration_since(UNIX_EPOCH).expect("after 1970").as_millis() as u64;
    let mut signed = vec![node.len() as u8];
    signed.extend(node.as_bytes());
    signed.extend(at.to_be_bytes());
    signed.extend(COUNTER.fetch_add(1, Ordering::Relaxed).to_be_bytes());
    let mut mac = Hmac::<Sha256>::new_from_slice(key.as_bytes()).expect("any key length");
    mac.update(b"imcore bus v1\0");
    for part in [subject.as_bytes(), reply.unwrap_or("").as_bytes(), &signed] {
        mac.update(&(part.len() as u64).to_be_bytes());
        mac.update(part);
    }
    mac.update(payload);
    let mut out = b"imc1".to_vec();
    out.extend(&signed);
    out.extend(mac.finalize().into_bytes());
    out.extend(payload);
    Bytes::from(out)
}

fn sealed(how: Signed, subject: &str, reply: Option<&str>, payload: &[u8]) -> Bytes {
    match how {
        Signed::Not => Bytes::copy_from_slice(payload),
        Signed::WrongKey => seal_as("imcore-forger", WRONG_KEY, subject, reply, payload, Duration::ZERO),
        Signed::ClusterKey => seal_as("imcore-forger", CLUSTER_KEY, subject, reply, payload, Duration::ZERO),
    }
}

/// The sender and payload of a sealed message (not checked).
fn unsealed(sealed: &[u8]) -> (String, &[u8]) {
    let len = usize::from(sealed[4]);
    (String::from_utf8_lossy(&sealed[5..5 + len]).into_owned(), &sealed[5 + len + 16 + 32..])
}

/// A NATS client with the nodes' credentials: a leaked password.
async fn leaked(c: &Cluster) -> Client {
    ConnectOptions::new()
        .user_and_password(NODE_USER.into(), NODE_PASSWORD.into())
        .connect(c.nats.url())
        .await
        .expect("connect with the nodes' credentials")
}

/// The names of the `n` nodes, from their heartbeats.
async fn node_names(nats: &Client, n: usize) -> Vec<String> {
    let mut heartbeats = nats.subscribe("imcore.node").await.expect("subscribe to heartbeats");
    let mut names = std::collections::BTreeSet::new();
    tokio::time::timeout(WAIT, async {
        while names.len() < n {
            let m = heartbeats.next().await.expect("a heartbeat");
            names.insert(unsealed(&m.payload).0);
        }
    })
    .await
    .expect("every node's heartbeat");
    names.into_iter().collect()
}

/// Messages dropped by every node so far, by reason.
async fn rejections(nodes: &[Node]) -> BTreeMap<&'static str, f64> {
    let mut by_reason = BTreeMap::new();
    for reason in REASONS {
        let mut sum = 0.0;
        for node in nodes {
            sum += node.metric(&format!("imcore_bus_rejected_total{{reason=\"{reason}\"}}")).await;
        }
        by_reason.insert(reason, sum);
    }
    by_reason
}

/// The drops since `before`, once they reach `expected` in all (or [`WAIT`] passed).
async fn rejected_since(
    nodes: &[Node],
    before: &BTreeMap<&'static str, f64>,
    expected: f64,
) -> BTreeMap<&'static str, f64> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let now = rejections(nodes).await;
        let delta: BTreeMap<&'static str, f64> = now.iter().map(|(r, n)| (*r, n - before[r])).collect();
        if delta.values().sum::<f64>() >= expected || tokio::time::Instant::now() > deadline {
            return delta;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Forwards `forward` to each node in `to` as a request (`imcore.write.<node>`),
/// signed as `how`; the answers that came within [`HARM`], opened.
async fn forge_write(nats: &Client, to: &[String], forward: &Value, how: Signed) -> Vec<Value> {
    let inbox = format!("imcore.inbox.forger{}", rand::random::<u32>());
    let mut answers = nats.subscribe(format!("{inbox}.*")).await.expect("subscribe to answers");
    let payload = forward.to_string();
    for (i, node) in to.iter().enumerate() {
        let (subject, reply) = (format!("imcore.write.{node}"), format!("{inbox}.{i}"));
        let body = sealed(how, &subject, Some(&reply), payload.as_bytes());
        nats.publish_with_reply(subject, reply, body).await.expect("publish a forged write");
    }
    nats.flush().await.expect("flush");
    let mut got = Vec::new();
    while let Ok(Some(m)) = tokio::time::timeout(HARM, answers.next()).await {
        let payload = if m.payload.starts_with(b"imc1") { unsealed(&m.payload).1.to_vec() } else { m.payload.to_vec() };
        got.push(serde_json::from_slice(&payload).unwrap_or(Value::Null));
    }
    got
}

async fn publish(nats: &Client, subject: &str, how: Signed, payload: &[u8]) {
    nats.publish(subject.to_owned(), sealed(how, subject, None, payload)).await.expect("publish");
    nats.flush().await.expect("flush");
}

/// Whether `ws` is still open: no `kicked` push, and a ping answered.
async fn alive(ws: &mut Ws) -> bool {
    while let Some(push) = ws.push_within(Duration::from_millis(100)).await {
        if push["push"] == "kicked" {
            return false;
        }
    }
    let id = ws.start("ping", json!({})).await;
    ws.reply_or_close(id).await.is_ok()
}

async fn all_alive(devices: &mut [Ws]) -> Vec<bool> {
    let mut alive_now = Vec::new();
    for ws in devices.iter_mut() {
        alive_now.push(alive(ws).await);
    }
    alive_now
}

/// `conv`'s messages as `ws`'s user syncs them: `(seq, client_msg_id, recalled)`.
async fn log(ws: &mut Ws, conv: &str) -> Vec<(i64, String, bool)> {
    let page = ws.request("sync", json!({"conv_id": conv, "after_seq": 0, "limit": 1000})).await;
    page["events"]
        .as_array()
        .unwrap_or_else(|| panic!("sync: {page}"))
        .iter()
        .filter(|e| e["kind"] == "msg")
        .map(|e| {
            let key = e["client_msg_id"].as_str().unwrap_or("").to_owned();
            (e["seq"].as_i64().expect("seq"), key, e["recalled"] == true)
        })
        .collect()
}

/// `conv`'s roster as `ws`'s user reads it: user → role.
async fn roster(ws: &mut Ws, conv: &str) -> BTreeMap<String, String> {
    let page = ws.request("members", json!({"conv_id": conv})).await;
    page["members"]
        .as_array()
        .unwrap_or_else(|| panic!("members: {page}"))
        .iter()
        .map(|m| (m["user_id"].as_str().unwrap_or("").to_owned(), m["role"].as_str().unwrap_or("").to_owned()))
        .collect()
}

fn failed(answers: &[Value]) -> bool {
    answers.iter().all(|a| a.get("Failed").is_some())
}

/// alice (owner), bob and carol in `g-t`, each online on a node of their own;
/// mallory a user who is in nothing.
struct Scene {
    c: Cluster,
    nats: Client,
    names: Vec<String>,
    /// alice, bob, carol.
    devices: Vec<Ws>,
}

impl Scene {
    async fn start() -> Self {
        let c = Cluster::start(3).await;
        let tokens = [c.user("alice").await, c.user("bob").await, c.user("carol").await];
        c.user("mallory").await;
        c.group(&tokens[0], "g-t", &["bob", "carol"]).await;
        c.group(&tokens[0], "g-b", &["bob"]).await;
        let mut devices = Vec::new();
        for (i, token) in tokens.iter().enumerate() {
            devices.push(c.nodes[i].ws(token).await);
        }
        let nats = leaked(&c).await;
        let names = node_names(&nats, 3).await;
        Self { c, nats, names, devices }
    }

    async fn send(&mut self, conv: &str, key: &str) -> i64 {
        let ack = self.devices[0].request("send", hi(key, conv, key)).await;
        ack["seq"].as_i64().unwrap_or_else(|| panic!("send {key}: {ack}"))
    }
}

#[actix_web::test]
async fn forgeries_on_the_bus_are_dropped_counted_and_change_nothing() {
    let mut s = Scene::start().await;
    forged_join(&mut s).await;
    forged_send(&mut s).await;
    forged_recall(&mut s).await;
    forged_transfer(&mut s).await;
    forged_revoke_and_route(&mut s).await;
    garbage(&mut s).await;
    fuzz(&mut s).await;
    replayed_revocation(&mut s).await;
    // Last: its control pushes a message that is not in the database.
    forged_batch(&mut s).await;
}

async fn forged_join(s: &mut Scene) {
    let check = Check::start(
        SUITE,
        "16-bus-join-forgery",
        "3 nodes; a leaked NATS password; `Join{mallory, Owner}` forwarded to every node, unsigned and with a wrong key; control: signed with the cluster key",
        "unsigned and wrongly signed: no answer, 6 counted (unsigned, bad_signature); signed: every home refuses it (refused_op) — a join without checks is never forwarded; mallory never a member",
    );
    let forward = json!({"conv": "g-t", "op": {"Join": {"user": "mallory", "actor": "mallory", "role": "Owner"}}});
    let before = rejections(&s.c.nodes).await;
    let mut answers = forge_write(&s.nats, &s.names, &forward, Signed::Not).await;
    answers.extend(forge_write(&s.nats, &s.names, &forward, Signed::WrongKey).await);
    let dropped = rejected_since(&s.c.nodes, &before, 6.0).await;
    let before = rejections(&s.c.nodes).await;
    let signed = forge_write(&s.nats, &s.names, &forward, Signed::ClusterKey).await;
    let refused = rejected_since(&s.c.nodes, &before, 3.0).await;
    let roster = roster(&mut s.devices[0], "g-t").await;
    let pass = answers.is_empty()
        && dropped["unsigned"] == 3.0
        && dropped["bad_signature"] == 3.0
        && signed.len() == 3
        && failed(&signed)
        && refused["refused_op"] == 3.0
        && !roster.contains_key("mallory")
        && roster.get("alice").map(String::as_str) == Some("owner");
    let observed = json!({"answers_unsigned": answers, "dropped": dropped, "signed_answers": signed, "signed_counted": refused, "roster": roster});
    assert!(check.resolve(observed.clone(), pass), "{observed}");
}

async fn forged_send(s: &mut Scene) {
    let check = Check::start(
        SUITE,
        "16-bus-send-forgery",
        "a Send as alice with a 200,039-byte body forwarded to every node, unsigned and with a wrong key; controls signed with the cluster key: the same (over the 16 KiB limit) and a small one",
        "unsigned and wrongly signed: dropped and counted, nothing stored; signed oversized: refused at the home (refused_op); signed small: stored (the key is what tells a node from an outsider)",
    );
    let big = format!("{{\"t\":\"{}\"}}", "x".repeat(200_039 - 8));
    let send = |key: &str, body: &str| json!({"conv": "g-t", "op": {"Send": {"sender": "alice", "device": "d1", "client_msg_id": key, "body": body}}});
    let before = rejections(&s.c.nodes).await;
    let mut answers = forge_write(&s.nats, &s.names, &send("forged-big", &big), Signed::Not).await;
    answers.extend(forge_write(&s.nats, &s.names, &send("forged-big", &big), Signed::WrongKey).await);
    let dropped = rejected_since(&s.c.nodes, &before, 6.0).await;
    let before = rejections(&s.c.nodes).await;
    let signed_big = forge_write(&s.nats, &s.names, &send("forged-big", &big), Signed::ClusterKey).await;
    let refused = rejected_since(&s.c.nodes, &before, 3.0).await;
    let small = forge_write(&s.nats, &s.names[..1], &send("signed-small", r#"{"t":"hi"}"#), Signed::ClusterKey).await;
    let stored: Vec<String> = log(&mut s.devices[1], "g-t").await.into_iter().map(|(_, k, _)| k).collect();
    let pass = answers.is_empty()
        && dropped["unsigned"] == 3.0
        && dropped["bad_signature"] == 3.0
        && failed(&signed_big)
        && refused["refused_op"] == 3.0
        && small.len() == 1
        && small[0]["Written"]["Sent"]["seq"].is_i64()
        && !stored.iter().any(|k| k == "forged-big")
        && stored.iter().any(|k| k == "signed-small");
    let observed = json!({"dropped": dropped, "answers_unsigned": answers, "signed_oversized_answers": signed_big, "signed_oversized_counted": refused, "signed_small_answer": small, "stored_keys": stored});
    assert!(check.resolve(observed.clone(), pass), "{observed}");
}

async fn forged_recall(s: &mut Scene) {
    let check = Check::start(
        SUITE,
        "16-bus-recall-forgery",
        "a Recall of alice's message as alice forwarded to every node, unsigned and with a wrong key; control: another of her messages, signed with the cluster key",
        "unsigned and wrongly signed: dropped and counted, the message stays; signed: recalled (what the check refuses is the signature)",
    );
    let (target, control) = (s.send("g-t", "to-keep").await, s.send("g-t", "to-recall").await);
    let recall =
        |seq: i64| json!({"conv": "g-t", "op": {"Recall": {"actor": "alice", "device": "d1", "target_seq": seq}}});
    let before = rejections(&s.c.nodes).await;
    let mut answers = forge_write(&s.nats, &s.names, &recall(target), Signed::Not).await;
    answers.extend(forge_write(&s.nats, &s.names, &recall(target), Signed::WrongKey).await);
    let dropped = rejected_since(&s.c.nodes, &before, 6.0).await;
    let signed = forge_write(&s.nats, &s.names[..1], &recall(control), Signed::ClusterKey).await;
    let log = log(&mut s.devices[1], "g-t").await;
    let recalled = |seq: i64| log.iter().find(|(s, _, _)| *s == seq).map(|(_, _, r)| *r);
    let pass = answers.is_empty()
        && dropped["unsigned"] == 3.0
        && dropped["bad_signature"] == 3.0
        && recalled(target) == Some(false)
        && recalled(control) == Some(true);
    let observed = json!({"dropped": dropped, "answers_unsigned": answers, "target_recalled": recalled(target), "control_answer": signed, "control_recalled": recalled(control)});
    assert!(check.resolve(observed.clone(), pass), "{observed}");
}

async fn forged_transfer(s: &mut Scene) {
    let check = Check::start(
        SUITE,
        "16-bus-transfer-forgery",
        "`transfer_owner` to bob as alice forwarded to every node, unsigned and with a wrong key",
        "dropped and counted; alice stays the owner",
    );
    let forward = json!({"conv": "g-t", "op": {"Group": {"actor": "alice", "change": {"TransferOwner": "bob"}}}});
    let before = rejections(&s.c.nodes).await;
    let mut answers = forge_write(&s.nats, &s.names, &forward, Signed::Not).await;
    answers.extend(forge_write(&s.nats, &s.names, &forward, Signed::WrongKey).await);
    let dropped = rejected_since(&s.c.nodes, &before, 6.0).await;
    let roster = roster(&mut s.devices[0], "g-t").await;
    let pass = answers.is_empty()
        && dropped["unsigned"] == 3.0
        && dropped["bad_signature"] == 3.0
        && roster.get("alice").map(String::as_str) == Some("owner")
        && roster.get("bob").map(String::as_str) == Some("member");
    let observed = json!({"dropped": dropped, "answers": answers, "roster": roster});
    assert!(check.resolve(observed.clone(), pass), "{observed}");
}

async fn forged_revoke_and_route(s: &mut Scene) {
    let revoke_check = Check::start(
        SUITE,
        "16-bus-revoke-forgery",
        "`imcore.revoke {bob, d1}` unsigned and with a wrong key, bob online on node 2",
        "dropped and counted on every node; bob's connection stays open",
    );
    let route_check = Check::start(
        SUITE,
        "16-bus-route-forgery",
        "`imcore.route {bob, d1, conn 2^63}` unsigned, with a wrong key, and signed with the cluster key",
        "unsigned and wrongly signed: bad signature; signed: malformed (no connection id is past the bigint sequence); bob's connection stays open",
    );
    let revoke = json!({"user": "bob", "device": "d1"}).to_string();
    let before = rejections(&s.c.nodes).await;
    publish(&s.nats, "imcore.revoke", Signed::Not, revoke.as_bytes()).await;
    publish(&s.nats, "imcore.revoke", Signed::WrongKey, revoke.as_bytes()).await;
    let revoke_dropped = rejected_since(&s.c.nodes, &before, 6.0).await;
    tokio::time::sleep(HARM).await;
    let bob_after_revoke = alive(&mut s.devices[1]).await;
    let pass = revoke_dropped["unsigned"] == 3.0 && revoke_dropped["bad_signature"] == 3.0 && bob_after_revoke;
    let observed = json!({"dropped": revoke_dropped, "bob_open": bob_after_revoke});
    assert!(revoke_check.resolve(observed.clone(), pass), "{observed}");

    let claim = r#"{"user":"bob","device":"d1","conn":9223372036854775808}"#;
    let before = rejections(&s.c.nodes).await;
    for how in [Signed::Not, Signed::WrongKey, Signed::ClusterKey] {
        publish(&s.nats, "imcore.route", how, claim.as_bytes()).await;
    }
    let route_dropped = rejected_since(&s.c.nodes, &before, 9.0).await;
    tokio::time::sleep(HARM).await;
    let bob_after_route = alive(&mut s.devices[1]).await;
    let pass = route_dropped["unsigned"] == 3.0
        && route_dropped["bad_signature"] == 3.0
        && route_dropped["malformed"] == 3.0
        && bob_after_route;
    let observed = json!({"dropped": route_dropped, "bob_open": bob_after_route});
    assert!(route_check.resolve(observed.clone(), pass), "{observed}");
}

async fn garbage(s: &mut Scene) {
    let check = Check::start(
        SUITE,
        "16-bus-garbage",
        "garbage on `imcore.batch.x` and `imcore.batch.g-t`, and an empty and a JSON message on `imcore.lost`, unsigned",
        "12 dropped and counted (unsigned); no connection on any node closed (no 1013), a send after still reaches every member",
    );
    let before = rejections(&s.c.nodes).await;
    publish(&s.nats, "imcore.batch.x", Signed::Not, b"\x00garbage{").await;
    publish(&s.nats, "imcore.batch.g-t", Signed::Not, b"not json").await;
    publish(&s.nats, "imcore.lost", Signed::Not, b"").await;
    publish(&s.nats, "imcore.lost", Signed::Not, b"{}").await;
    let dropped = rejected_since(&s.c.nodes, &before, 12.0).await;
    tokio::time::sleep(HARM).await;
    let open = all_alive(&mut s.devices).await;
    let reached = delivered_everywhere(s, "after-garbage").await;
    let pass = dropped["unsigned"] == 12.0 && open.iter().all(|o| *o) && reached;
    let observed = json!({"dropped": dropped, "devices_open": open, "send_after_reached_bob_and_carol": reached});
    assert!(check.resolve(observed.clone(), pass), "{observed}");
}

/// alice sends `key` to `g-t`; whether bob and carol (on the other nodes) are pushed it.
async fn delivered_everywhere(s: &mut Scene, key: &str) -> bool {
    let seq = s.send("g-t", key).await;
    let mut reached = true;
    for ws in &mut s.devices[1..] {
        reached &= pushed(ws, "g-t", WAIT, |e| e["seq"] == seq).await.is_some();
    }
    reached
}

/// The events of `conv` in `push`.
fn events_of<'a>(push: &'a Value, conv: &str) -> Vec<&'a Value> {
    if push["conv_id"] != conv {
        return vec![];
    }
    match push["push"].as_str() {
        Some("event") => vec![&push["event"]],
        Some("events") => push["events"].as_array().map(|a| a.iter().collect()).unwrap_or_default(),
        _ => vec![],
    }
}

/// The first event of `conv` pushed to `ws` within `wait` that `pick` takes.
async fn pushed(ws: &mut Ws, conv: &str, wait: Duration, pick: impl Fn(&Value) -> bool) -> Option<Value> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            return None;
        }
        let push = ws.push_within(left).await?;
        if let Some(event) = events_of(&push, conv).into_iter().find(|e| pick(e)) {
            return Some(event.clone());
        }
    }
}

async fn fuzz(s: &mut Scene) {
    let check = Check::start(
        SUITE,
        "16-bus-fuzz",
        "every subject a node hears (batch, route, revoke, lost, node, write.<node>): per subject 8 one-byte flips and 4 truncations of a message sealed with the cluster key, 4 random byte strings, the plain JSON, a wrong key, a copy 10 min old, and a copy sealed for another subject",
        "every message dropped and counted (exactly one count per node that hears it); the log and roster of g-t unchanged; no connection closed; a send after reaches every member",
    );
    let log_before = log(&mut s.devices[0], "g-t").await;
    let roster_before = roster(&mut s.devices[0], "g-t").await;
    let mut rng = StdRng::seed_from_u64(16);
    let claim = json!({"user": "bob", "device": "d1", "conn": 1}).to_string();
    let revoke = json!({"user": "bob", "device": "d1"}).to_string();
    let forward = json!({"conv": "g-t", "op": {"Send": {"sender": "alice", "device": "d1", "client_msg_id": "fuzz", "body": "{}"}}}).to_string();
    // (subject, a plausible payload, nodes hearing it)
    let mut subjects = vec![
        (
            "imcore.batch.g-t".to_owned(),
            r#"{"conv_id":"g-t","events":[],"head":1,"delivery_mode":"Push"}"#.to_owned(),
            3.0,
        ),
        ("imcore.batch.x".to_owned(), "{}".to_owned(), 3.0),
        ("imcore.route".to_owned(), claim, 3.0),
        ("imcore.revoke".to_owned(), revoke, 3.0),
        ("imcore.lost".to_owned(), String::new(), 3.0),
        ("imcore.node".to_owned(), String::new(), 3.0),
    ];
    subjects.extend(s.names.iter().map(|n| (format!("imcore.write.{n}"), forward.clone(), 1.0)));
    let before = rejections(&s.c.nodes).await;
    let (mut expected, mut messages) = (0.0, 0);
    for (subject, payload, hearers) in &subjects {
        let reply = subject.starts_with("imcore.write.").then_some("imcore.inbox.fuzz.0");
        let good = seal_as("imcore-forger", CLUSTER_KEY, subject, reply, payload.as_bytes(), Duration::ZERO);
        let mut variants: Vec<Bytes> = Vec::new();
        for _ in 0..8 {
            let mut flipped = good.to_vec();
            let at = rng.gen_range(0..flipped.len());
            flipped[at] ^= 1 << rng.gen_range(0..8);
            variants.push(flipped.into());
        }
        for _ in 0..4 {
            variants.push(good.slice(..rng.gen_range(0..good.len())));
        }
        for _ in 0..4 {
            let len = rng.gen_range(0..200);
            variants.push((0..len).map(|_| rng.gen::<u8>()).collect::<Vec<u8>>().into());
        }
        variants.push(Bytes::from(payload.clone()));
        variants.push(seal_as("imcore-forger", WRONG_KEY, subject, reply, payload.as_bytes(), Duration::ZERO));
        variants.push(seal_as(
            "imcore-forger",
            CLUSTER_KEY,
            subject,
            reply,
            payload.as_bytes(),
            Duration::from_secs(600),
        ));
        variants.push(seal_as("imcore-forger", CLUSTER_KEY, "imcore.other", reply, payload.as_bytes(), Duration::ZERO));
        for v in variants {
            match reply {
                Some(r) => s.nats.publish_with_reply(subject.clone(), r.to_owned(), v).await.expect("publish"),
                None => s.nats.publish(subject.clone(), v).await.expect("publish"),
            }
            expected += hearers;
            messages += 1;
        }
    }
    s.nats.flush().await.expect("flush");
    let dropped = rejected_since(&s.c.nodes, &before, expected).await;
    tokio::time::sleep(HARM).await;
    let counted: f64 = rejections(&s.c.nodes).await.iter().map(|(r, n)| n - before[r]).sum();
    let open = all_alive(&mut s.devices).await;
    let log_after = log(&mut s.devices[0], "g-t").await;
    let roster_after = roster(&mut s.devices[0], "g-t").await;
    let known = nodes_known(&s.c).await;
    let reached = delivered_everywhere(s, "after-fuzz").await;
    let pass = counted == expected
        && open.iter().all(|o| *o)
        && log_after == log_before
        && roster_after == roster_before
        && known.iter().all(|n| *n == 3.0)
        && reached;
    let observed = json!({
        "messages": messages, "deliveries_expected_dropped": expected, "counted": counted, "by_reason": dropped,
        "devices_open": open, "log_unchanged": log_after == log_before, "roster_unchanged": roster_after == roster_before,
        "cluster_nodes": known, "send_after_reached_bob_and_carol": reached,
    });
    assert!(check.resolve(observed.clone(), pass), "{observed}");
}

async fn replayed_revocation(s: &mut Scene) {
    let check = Check::start(
        SUITE,
        "16-bus-replay",
        "carol's token rotated through node 1: its genuine `imcore.revoke` sniffed with the leaked password; carol reconnects on node 3 with the new token; the sniffed message published again as it was",
        "the genuine revocation kicks carol (the message has teeth); the replay is dropped on all 3 nodes (`replayed`: nodes 2 and 3 took it before, node 1 never hears its own) and carol stays connected",
    );
    let mut revocations = s.nats.subscribe("imcore.revoke").await.expect("sniff revocations");
    s.nats.flush().await.expect("flush");
    let (status, issued) = s.c.admin("/v1/admin/users/carol/devices", json!({"device_id": "d1"})).await;
    assert_eq!(status, 201, "rotate carol's token: {issued}");
    let kicked = s.devices[2].closed().await.pushes.iter().any(|p| p["reason"] == "token_revoked");
    let genuine = tokio::time::timeout(WAIT, revocations.next()).await.expect("a revocation").expect("a message");
    s.devices[2] = s.c.nodes[2].ws(issued["token"].as_str().expect("token")).await;
    let before = rejections(&s.c.nodes).await;
    s.nats.publish("imcore.revoke", genuine.payload.clone()).await.expect("replay");
    s.nats.flush().await.expect("flush");
    let dropped = rejected_since(&s.c.nodes, &before, 3.0).await;
    tokio::time::sleep(HARM).await;
    let carol_open = alive(&mut s.devices[2]).await;
    let pass = kicked && dropped["replayed"] == 3.0 && carol_open;
    let observed = json!({"genuine_kicked": kicked, "replay_dropped": dropped, "carol_open_after_replay": carol_open});
    assert!(check.resolve(observed.clone(), pass), "{observed}");
}

async fn forged_batch(s: &mut Scene) {
    let check = Check::start(
        SUITE,
        "16-bus-batch-forgery",
        "a real batch of g-b sniffed with the leaked password, rewritten into the next seq with a message that is not in the database, published unsigned and with a wrong key; control: signed with the cluster key",
        "unsigned and wrongly signed: 6 dropped and counted, bob (node 2) is pushed nothing; signed: bob is pushed it (what the check refuses is the signature; ARCHITECTURE §7: a node holding the key can do this); the message is never in the database",
    );
    let mut batches = s.nats.subscribe("imcore.batch.g-b").await.expect("sniff batches");
    s.nats.flush().await.expect("flush");
    let seq = s.send("g-b", "real").await;
    let pushed_real = pushed(&mut s.devices[1], "g-b", WAIT, |e| e["seq"] == seq).await;
    let sniffed = tokio::time::timeout(WAIT, batches.next()).await.expect("a batch of g-b").expect("a message");
    let mut batch: Value = serde_json::from_slice(unsealed(&sniffed.payload).1).expect("a batch is JSON");
    let forged_seq = seq + 1;
    batch["head"] = json!(forged_seq);
    let event = &mut batch["events"][0];
    event["seq"] = json!(forged_seq);
    let msg = &mut event["kind"]["Msg"];
    msg["client_msg_id"] = json!("forged-batch");
    msg["message_id"] = json!(uuid::Uuid::new_v4());
    msg["body"] = json!(r#"{"text":"not in the database"}"#);
    let payload = batch.to_string();
    let before = rejections(&s.c.nodes).await;
    publish(&s.nats, "imcore.batch.g-b", Signed::Not, payload.as_bytes()).await;
    publish(&s.nats, "imcore.batch.g-b", Signed::WrongKey, payload.as_bytes()).await;
    let dropped = rejected_since(&s.c.nodes, &before, 6.0).await;
    let forged = |e: &Value| e["client_msg_id"] == "forged-batch";
    let pushed_forged = pushed(&mut s.devices[1], "g-b", HARM, forged).await;
    publish(&s.nats, "imcore.batch.g-b", Signed::ClusterKey, payload.as_bytes()).await;
    let pushed_signed = pushed(&mut s.devices[1], "g-b", WAIT, forged).await;
    let stored: Vec<String> = log(&mut s.devices[1], "g-b").await.into_iter().map(|(_, k, _)| k).collect();
    let control_pushed = pushed_signed.is_some();
    let pass = pushed_real.is_some()
        && dropped["unsigned"] == 3.0
        && dropped["bad_signature"] == 3.0
        && pushed_forged.is_none()
        && control_pushed
        && !stored.iter().any(|k| k == "forged-batch");
    let observed = json!({"dropped": dropped, "pushed_unsigned_or_wrong_key": pushed_forged, "control_pushed": pushed_signed, "stored_keys": stored});
    assert!(check.resolve(observed.clone(), pass), "{observed}");
}

/// Eight fake home nodes announcing themselves every 400 ms as `node` would
/// (`how`), answering every write forwarded to them with a fake `Sent`.
fn fake_homes(nats: &Client, how: Signed, tag: &str) -> Vec<tokio::task::JoinHandle<()>> {
    (0..8)
        .map(|i| {
            let (nats, name) = (nats.clone(), format!("imcore-fake{tag}{i}"));
            tokio::spawn(async move {
                let key = match how {
                    Signed::ClusterKey => CLUSTER_KEY,
                    _ => WRONG_KEY,
                };
                let mut writes = nats.subscribe(format!("imcore.write.{name}")).await.expect("subscribe as a fake home");
                let mut beat = tokio::time::interval(Duration::from_millis(400));
                loop {
                    tokio::select! {
                        _ = beat.tick() => {
                            let heartbeat = match how {
                                Signed::Not => Bytes::from(name.clone()),
                                _ => seal_as(&name, key, "imcore.node", None, &[], Duration::ZERO),
                            };
                            let _ = nats.publish("imcore.node", heartbeat).await;
                        }
                        Some(m) = writes.next() => {
                            let Some(reply) = m.reply else { continue };
                            let ack = json!({"Written": {"Sent": {"seq": 1, "message_id": uuid::Uuid::new_v4(), "dup": false, "created_at": "2026-01-01T00:00:00Z"}}});
                            let body = ack.to_string();
                            let answer = match how {
                                Signed::Not => Bytes::from(body),
                                _ => seal_as(&name, key, &reply, None, body.as_bytes(), Duration::ZERO),
                            };
                            let _ = nats.publish(reply, answer).await;
                        }
                    }
                }
            })
        })
        .collect()
}

/// alice (node 1) and bob (node 2) send 50 each to `conv`: acked, and stored.
async fn acked_and_stored(devices: &mut [Ws], conv: &str, prefix: &str) -> (usize, usize) {
    let mut acked = 0;
    for (d, ws) in devices.iter_mut().enumerate() {
        let mut ids = Vec::new();
        for i in 0..50 {
            ids.push(ws.start("send", hi(&format!("{prefix}-{d}-{i}"), conv, "hello")).await);
        }
        for id in ids {
            acked += usize::from(ws.reply(id).await["seq"].is_i64());
        }
    }
    let stored = log(&mut devices[0], conv).await.iter().filter(|(_, k, _)| k.starts_with(prefix)).count();
    (acked, stored)
}

/// `conv`'s home among `nodes`, picked as `cluster::home` picks it (rendezvous, SHA-256).
fn home_of<'a>(nodes: &'a [String], conv: &str) -> &'a str {
    let weight = |node: &&String| {
        let digest = Sha256::new().chain_update(node.as_bytes()).chain_update([0]).chain_update(conv).finalize();
        u64::from_be_bytes(digest[..8].try_into().expect("8 bytes"))
    };
    nodes.iter().max_by_key(weight).expect("some nodes")
}

async fn nodes_known(c: &Cluster) -> Vec<f64> {
    let mut v = Vec::new();
    for node in &c.nodes {
        v.push(node.metric("imcore_cluster_nodes").await);
    }
    v
}

#[actix_web::test]
async fn fake_home_nodes_cannot_capture_writes() {
    let check = Check::start(
        SUITE,
        "16-bus-fake-home",
        "3 nodes; 8 fake nodes announce on `imcore.node` every 400 ms (unsigned, and with a wrong key) and answer forwarded writes with a fake `Sent`; 100 sends (50 via node 1, 50 via node 2); control: the same fakes signing with the cluster key",
        "every node keeps knowing 3 nodes, the announcements are counted, and all 100 acked sends are stored; control: the fakes are taken for homes and acked sends go missing (what keeps them out is the signature)",
    );
    let c = Cluster::start(3).await;
    let tokens = [c.user("alice").await, c.user("bob").await];
    c.group(&tokens[0], "g-h", &["bob"]).await;
    let mut devices = vec![c.nodes[0].ws(&tokens[0]).await, c.nodes[1].ws(&tokens[1]).await];
    let nats = leaked(&c).await;
    // The control's conversation: one the signed fakes would be home of.
    let mut all = node_names(&nats, 3).await;
    all.extend((0..8).map(|i| format!("imcore-fakek{i}")));
    let control = (0..).map(|i| format!("g-c{i}")).find(|g| home_of(&all, g).starts_with("imcore-fake")).expect("one");
    c.group(&tokens[0], &control, &["bob"]).await;
    let before = rejections(&c.nodes).await;
    let mut fakes = fake_homes(&nats, Signed::Not, "u");
    fakes.extend(fake_homes(&nats, Signed::WrongKey, "w"));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let known_during = nodes_known(&c).await;
    let (acked, stored) = acked_and_stored(&mut devices, "g-h", "real").await;
    let dropped = rejected_since(&c.nodes, &before, 1.0).await;
    for fake in fakes.drain(..) {
        fake.abort();
    }
    // The control: the same fakes, signing as nodes.
    let fakes = fake_homes(&nats, Signed::ClusterKey, "k");
    let deadline = tokio::time::Instant::now() + WAIT;
    while nodes_known(&c).await.iter().any(|n| *n < 11.0) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let known_control = nodes_known(&c).await;
    let (control_acked, control_stored) = acked_and_stored(&mut devices, &control, "control").await;
    for fake in fakes {
        fake.abort();
    }
    let pass = known_during.iter().all(|n| *n == 3.0)
        && dropped["unsigned"] > 0.0
        && dropped["bad_signature"] > 0.0
        && acked == 100
        && stored == 100
        && control_stored < control_acked;
    let observed = json!({
        "cluster_nodes_during": known_during, "dropped": dropped, "acked": acked, "stored": stored,
        "control": {"conv": control, "home": home_of(&all, &control), "cluster_nodes": known_control, "acked": control_acked, "stored": control_stored},
    });
    assert!(check.resolve(observed.clone(), pass), "{observed}");
}

/// Variables set (`Some`) or removed (`None`) for a node.
type Env<'a> = Vec<(&'a str, Option<&'a str>)>;

#[actix_web::test]
async fn without_the_credentials_or_the_key_nothing_joins() {
    let check = Check::start(
        SUITE,
        "16-bus-no-credentials",
        "NATS with authorization: a node without NATS credentials, with a wrong password, without the cluster key, with a 31-byte key; a raw client with a wrong password; a NATS user who is not a node publishing on `imcore.route`",
        "each node refuses to start (exit status non-zero, the cause printed); the raw client is refused; the outsider's message never reaches a subscriber of `imcore.route` (while a node's does)",
    );
    let c = Cluster::start_writing_locally(1).await;
    let mut refusals = Vec::new();
    let cases: [(&str, Env, &str); 4] = [
        ("no credentials", vec![("IMCORE_NATS_USER", None), ("IMCORE_NATS_PASSWORD", None)], "authorization"),
        ("wrong password", vec![("IMCORE_NATS_PASSWORD", Some("wrong"))], "authorization"),
        ("no cluster key", vec![("IMCORE_CLUSTER_KEY", None)], "IMCORE_CLUSTER_KEY"),
        ("31-byte key", vec![("IMCORE_CLUSTER_KEY", Some(&CLUSTER_KEY[..31]))], "IMCORE_CLUSTER_KEY"),
    ];
    let mut pass = true;
    for (case, env, cause) in cases {
        let (status, printed) = c.node_refused(&env).await;
        let said = printed.to_lowercase().contains(&cause.to_lowercase());
        pass &= status.is_some_and(|s| s != 0) && said && !printed.contains("imcore is listening");
        let last = printed.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("").to_owned();
        refusals.push(json!({"case": case, "exit_status": status, "cause_printed": said, "last_line": last}));
    }
    let wrong = ConnectOptions::new().user_and_password(NODE_USER.into(), "wrong".into()).connect(c.nats.url()).await;
    let raw_refused = wrong.is_err();
    let node_nats = leaked(&c).await;
    let mut sniffer = node_nats.subscribe("imcore.route").await.expect("subscribe as a node");
    node_nats.flush().await.expect("flush");
    let outsider = ConnectOptions::new()
        .user_and_password(OUTSIDER.into(), OUTSIDER_PASSWORD.into())
        .connect(c.nats.url())
        .await
        .expect("the outsider is a NATS user");
    let _ = outsider.publish("imcore.route", Bytes::from_static(b"from an outsider")).await;
    let _ = outsider.flush().await;
    let outsider_heard = tokio::time::timeout(HARM, sniffer.next()).await.is_ok();
    let other_node = leaked(&c).await;
    other_node.publish("imcore.route", Bytes::from_static(b"from a node")).await.expect("publish as a node");
    other_node.flush().await.expect("flush");
    let node_heard = tokio::time::timeout(WAIT, sniffer.next()).await.ok().flatten().map(|m| m.payload.to_vec());
    pass &= raw_refused && !outsider_heard && node_heard.as_deref() == Some(b"from a node".as_slice());
    let observed = json!({
        "nodes": refusals, "raw_client_wrong_password_refused": raw_refused,
        "outsider_message_heard": outsider_heard, "node_message_heard": node_heard.is_some(),
    });
    assert!(check.resolve(observed.clone(), pass), "{observed}");
}

#[actix_web::test]
async fn a_node_reaches_nats_over_tls_only_trusting_the_configured_ca() {
    let check = Check::start(
        SUITE,
        "16-bus-tls",
        "NATS with TLS (a certificate for 127.0.0.1 from a CA of the test's own) and authorization; a node with IMCORE_NATS_TLS_CA set to that CA, and one without it",
        "the node given the CA joins and listens; the one without it refuses to start (it does not trust the server)",
    );
    let c = Cluster::start_writing_locally(1).await;
    let (tls, ca) = crate::cluster_harness::Nats::start_tls().await;
    let ca_path = ca.to_string_lossy().into_owned();
    let with_ca = c.try_node(&tls.url(), &[("IMCORE_NATS_TLS_CA", &ca_path)]).await;
    let joined = with_ca.is_ok();
    drop(with_ca);
    let without_ca = c.try_node(&tls.url(), &[]).await;
    let refused = without_ca.as_ref().err().cloned();
    let pass = joined && refused.as_deref().is_some_and(|e| e.contains("cannot connect to NATS"));
    let observed = json!({"with_ca_joined": joined, "without_ca_error": refused});
    assert!(check.resolve(observed.clone(), pass), "{observed}");
}
