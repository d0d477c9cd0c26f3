//! The reconnect storm (ARCHITECTURE §7): `--storm-devices` devices, whose
//! users share `--storm-groups` groups, online on the last of `--nodes` nodes,
//! which is killed (SIGKILL) while a sender keeps writing through the first
//! (to groups of its own, homed on every node). After the devices took their
//! tokens, `CHANGED` of their groups get a message; once the node is killed
//! every device reconnects to a survivor like a client of PROTOCOL §4 and §7
//! (full jitter, doubling from `FIRST_RETRY` up to `MAX_RETRY`) and asks
//! `conversations` with its `since` token. Reports the time until all are back
//! and synced and what PostgreSQL and the survivors spent; verifies that every
//! device got a delta (not a reset) and every acked send is in the log exactly
//! once. Writes `storm.json`.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::{stream, StreamExt};
use imcore_client::{ClientError, Ws};
use rand::Rng;
use serde_json::{json, Value};
use tokio::task::JoinSet;

use super::nodes::Nodes;
use super::provision::{self, BoxError};
use super::server::CpuWindow;
use super::{start_nodes, stop_nodes, write_evidence, Ctx};
use crate::percentiles::Percentiles;

/// The first reconnect waits up to this (uniformly); each failed attempt
/// doubles the bound, up to `MAX_RETRY`.
const FIRST_RETRY: Duration = Duration::from_secs(1);
const MAX_RETRY: Duration = Duration::from_secs(8);
/// Longest a storm may take before the run is called unverified.
const STORM_LIMIT: Duration = Duration::from_secs(180);
/// Sends in flight on the sender's connection.
const SEND_WINDOW: usize = 8;
/// The devices' groups written to while they are away.
const CHANGED: usize = 10;

/// What each device's reconnection went like.
#[derive(Default)]
struct Back {
    /// Seconds from the kill until the delta was answered.
    seconds: Mutex<Vec<f64>>,
    attempts: AtomicU64,
    /// Failed attempts by why: the upgrade's HTTP status, the connection
    /// closing (with its code) before the delta, an i/o error.
    failed: Mutex<BTreeMap<String, u64>>,
    resets: AtomicU64,
}

impl Back {
    fn failed(&self, why: String) {
        if let Ok(mut f) = self.failed.lock() {
            *f.entry(why).or_default() += 1;
        }
    }
}

/// A failed attempt's kind, for [`Back::failed`].
fn why(e: &ClientError) -> String {
    match e {
        ClientError::Refused(status) => format!("upgrade_{status}"),
        ClientError::Closed { code } => format!("closed_{}", code.map_or("none".into(), |c| c.to_string())),
        ClientError::Io(e) => format!("io: {e}"),
        other => other.to_string(),
    }
}

pub async fn run(ctx: &Ctx) -> Result<Vec<String>, BoxError> {
    let n = usize::from(ctx.args.nodes);
    let (mut nodes, db, db_name) = start_nodes(ctx, "storm", "actor", n, &[]).await?;
    let result = storm(ctx, &mut nodes, &db).await;
    stop_nodes(ctx, nodes, db, &db_name).await;
    write_evidence(ctx, "storm.json", vec![result?], json!({}))
}

async fn storm(ctx: &Ctx, nodes: &mut Nodes, db: &imcore::store::Store) -> Result<Value, BoxError> {
    let a = &ctx.args;
    let victim = nodes.count() - 1;
    let first = nodes.first().port;
    // The victim and this process hold one descriptor per device, within the
    // open-file limit (which the nodes inherit): more devices are clamped.
    let devices = a.storm_devices.min((ctx.nofile as usize).saturating_sub(1000));
    let admin = nodes.first().admin.clone();
    let users_n = devices.div_ceil(a.devices_per_user.max(1)).clamp(1, 1000);
    let users: Vec<String> = (0..users_n).map(|i| format!("su{i}")).collect();
    let t = Instant::now();
    // The sender's user, and a member of its own groups with no device (no fan-out).
    let (writer, quiet) = ("storm-writer".to_owned(), "storm-quiet".to_owned());
    provision::create_users(first, &admin, [&users[..], &[writer.clone(), quiet.clone()]].concat()).await?;
    let mut pairs: Vec<(String, String)> =
        (0..devices).map(|i| (users[i % users_n].clone(), format!("d{}", i / users_n))).collect();
    pairs.push((writer.clone(), "sender".to_owned()));
    pairs.push((writer, "changer".to_owned()));
    let mut tokens = provision::issue_tokens(first, &admin, pairs).await?;
    let changer_token = tokens.pop().ok_or("no changer token")?;
    let sender_token = tokens.pop().ok_or("no sender token")?;
    let groups: Vec<String> = (0..a.storm_groups).map(|g| format!("storm-{g}")).collect();
    let own: Vec<String> = (0..a.storm_groups).map(|g| format!("storm-load-{g}")).collect();
    for g in &groups {
        let body = json!({"kind": "group", "conv_id": g, "name": g, "members": users, "max_member": users_n + 1});
        provision::create_group(first, &sender_token, body).await?;
    }
    for g in &own {
        provision::create_group(
            first,
            &sender_token,
            json!({"kind": "group", "conv_id": g, "name": g, "members": [quiet]}),
        )
        .await?;
    }
    eprintln!(
        "storm: {users_n} users in {} groups, {devices} devices, set up in {:.1} s",
        groups.len(),
        t.elapsed().as_secs_f64()
    );

    // Every device online on the victim, holding its inbox token.
    let t = Instant::now();
    let (victim_port, addrs) = (nodes.servers()[victim].port, a.source_addrs);
    let mut online = stream::iter(tokens.iter().enumerate())
        .map(|(i, token)| async move {
            let mut ws = provision::connect_retry(victim_port, provision::source_addr(i, addrs), token).await?;
            let page = ws.request("conversations", json!({"limit": 1})).await?;
            let since = page["since"].as_str().ok_or_else(|| format!("no since token: {page}"))?.to_owned();
            Ok::<_, BoxError>((i, ws, since))
        })
        .buffer_unordered(a.connect_concurrency);
    let back = Arc::new(Back::default());
    let (killed_at, killed) = tokio::sync::watch::channel(None);
    let survivors: Arc<Vec<u16>> = Arc::new(nodes.servers()[..victim].iter().map(|s| s.port).collect());
    let mut tasks = JoinSet::new();
    while let Some(r) = online.next().await {
        let (i, ws, since) = r?;
        let device = Device { i, token: tokens[i].clone(), since, survivors: survivors.clone(), addrs };
        tasks.spawn(device.ride_out(ws, killed.clone(), back.clone()));
    }
    drop(online);
    let connect_s = t.elapsed().as_secs_f64();
    eprintln!("storm: {devices} devices online on node {victim} in {connect_s:.1} s");

    let mut changer = provision::connect_retry(first, provision::source_addr(1, addrs), &changer_token).await?;
    for (n, g) in groups.iter().take(CHANGED).enumerate() {
        let fields = json!({"conv_id": g, "client_msg_id": format!("changed-{n}"), "body": {"type": "text", "text": "while you were away"}});
        changer.request("send", fields).await?;
    }
    changer.close().await;
    let sending = Arc::new(AtomicBool::new(true));
    let sender = tokio::spawn(send(first, sender_token, own.clone(), sending.clone()));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let xacts_before = committed(db).await?;
    let reads_before = nodes.sync_reads(Some(victim)).await?;
    nodes.kill(victim)?;
    let kill = Instant::now();
    let _ = killed_at.send(Some(kill));
    let cpu = CpuWindow::start(&*nodes, &ctx.pg);
    let mut all_back = true;
    let deadline = tokio::time::Instant::now() + STORM_LIMIT;
    while !tasks.is_empty() {
        match tokio::time::timeout_at(deadline, tasks.join_next()).await {
            Ok(_) => {}
            Err(_) => {
                all_back = false;
                tasks.abort_all();
                break;
            }
        }
    }
    let storm_s = kill.elapsed().as_secs_f64();
    let cpu = cpu.end(&*nodes, &ctx.pg);
    let xacts = committed(db).await? - xacts_before;
    // The survivors' (the killed node's counters went with it).
    let sync_reads = super::nodes::reads_since(&reads_before, nodes.sync_reads(Some(victim)).await?);
    // Sends carry on a moment after the storm, then stop and are checked.
    tokio::time::sleep(Duration::from_secs(1)).await;
    sending.store(false, Ordering::Relaxed);
    let sent = sender.await??;
    let logged = sender_log(db).await?;
    let lost: Vec<&String> = sent
        .acked
        .iter()
        .filter(|(k, seq)| logged.get(*k).map(|s| s.as_slice()) != Some(&[**seq]))
        .map(|(k, _)| k)
        .collect();
    let doubled = logged.values().filter(|s| s.len() > 1).count();

    let seconds = std::mem::take(&mut *back.seconds.lock().map_err(|_| "poisoned")?);
    let synced = seconds.len();
    let resets = back.resets.load(Ordering::Relaxed);
    let failed = std::mem::take(&mut *back.failed.lock().map_err(|_| "poisoned")?);
    let verified = all_back && synced == devices && resets == 0 && lost.is_empty() && doubled == 0;
    let latency = Percentiles::of(seconds.iter().map(|s| s * 1000.0).collect());
    eprintln!(
        "storm: {synced}/{devices} back and synced in {storm_s:.1} s (ms from the kill: {}), attempts {}, failed {failed:?}, \
         resets {resets}, postgres {xacts} commits ({:.0}/s), sends acked {} (lost {}, doubled {doubled}) verified {verified}",
        latency.text(),
        back.attempts.load(Ordering::Relaxed),
        xacts as f64 / storm_s,
        sent.acked.len(),
        lost.len(),
    );
    Ok(json!({
        "scenario": "storm", "nodes": nodes.count(), "killed_node": victim, "devices": devices,
        "devices_requested": a.storm_devices, "open_file_limit": ctx.nofile, "users": users_n,
        "groups": groups.len(), "groups_changed": CHANGED.min(groups.len()), "connect_s": connect_s,
        "reconnect": {"first_retry_ms": FIRST_RETRY.as_millis() as u64, "max_retry_ms": MAX_RETRY.as_millis() as u64,
                      "rule": "full jitter: a random delay below a bound that starts at first_retry and doubles per failed attempt up to max_retry; survivors in turn"},
        "back_and_synced": synced, "storm_s": storm_s, "back_ms": latency.json(),
        "attempts": back.attempts.load(Ordering::Relaxed), "failed_attempts": failed, "since_resets": resets,
        "postgres_commits": xacts, "postgres_commits_per_s": xacts as f64 / storm_s, "sync_reads": sync_reads, "cpu": cpu,
        "sender": {"acked": sent.acked.len(), "refused": sent.refused, "unanswered": sent.unanswered, "lost": lost.len(), "doubled": doubled},
        "verified": verified,
    }))
}

/// One device: idle on its node until the connection ends, then back on a
/// survivor with its `since` delta.
struct Device {
    i: usize,
    token: String,
    since: String,
    survivors: Arc<Vec<u16>>,
    addrs: usize,
}

impl Device {
    async fn ride_out(self, mut ws: Ws, mut killed: tokio::sync::watch::Receiver<Option<Instant>>, back: Arc<Back>) {
        while ws.next_text().await.is_ok() {}
        // Its descriptor goes now: the new connection needs one.
        drop(ws);
        let Ok(Some(lost_at)) = killed.wait_for(Option::is_some).await.map(|at| *at) else { return };
        let mut bound = FIRST_RETRY;
        for attempt in 0.. {
            let wait = bound.mul_f64(rand::thread_rng().gen::<f64>());
            tokio::time::sleep(wait).await;
            bound = (bound * 2).min(MAX_RETRY);
            back.attempts.fetch_add(1, Ordering::Relaxed);
            let port = self.survivors[(self.i + attempt) % self.survivors.len()];
            let src = provision::source_addr(self.i, self.addrs);
            let mut ws = match Ws::connect_from(src, port, Some(&self.token)).await {
                Ok(ws) => ws,
                Err(e) => {
                    back.failed(why(&e));
                    continue;
                }
            };
            match ws.request("conversations", json!({"since": self.since})).await {
                Ok(delta) if delta["since"].is_string() => {
                    if let Ok(mut s) = back.seconds.lock() {
                        s.push(lost_at.elapsed().as_secs_f64());
                    }
                    return;
                }
                Ok(delta) if delta["reset"] == true => {
                    back.resets.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                Ok(other) => back.failed(format!("answered_{}", other["error"]["code"].as_str().unwrap_or("?"))),
                Err(e) => back.failed(why(&e)),
            }
        }
    }
}

/// What the sender got acked, by client_msg_id; how many sends were refused,
/// and how many were in flight on a connection that closed (their outcome
/// unknown: they are not retried, and not checked).
struct Sent {
    acked: HashMap<String, i64>,
    refused: u64,
    unanswered: u64,
}

/// Sends round robin over `groups` through the node on `port`, `SEND_WINDOW`
/// in flight, until told to stop; a closed connection is opened again.
async fn send(port: u16, token: String, groups: Vec<String>, sending: Arc<AtomicBool>) -> Result<Sent, BoxError> {
    let mut sent = Sent { acked: HashMap::new(), refused: 0, unanswered: 0 };
    let mut n = 0usize;
    while sending.load(Ordering::Relaxed) {
        let mut ws = provision::connect_retry(port, provision::source_addr(0, 1), &token).await?;
        let mut in_flight = std::collections::VecDeque::new();
        let closed = loop {
            while sending.load(Ordering::Relaxed) && in_flight.len() < SEND_WINDOW {
                let key = format!("storm-{n}");
                let fields = json!({"conv_id": groups[n % groups.len()], "client_msg_id": key,
                                    "body": {"type": "text", "text": "through the storm", "n": n}});
                n += 1;
                match ws.start("send", fields).await {
                    Ok(id) => in_flight.push_back((id, key)),
                    Err(_) => break,
                }
            }
            let Some((id, key)) = in_flight.pop_front() else { break false };
            match ws.reply(id).await {
                Ok(reply) => match reply["seq"].as_i64() {
                    Some(seq) => drop(sent.acked.insert(key, seq)),
                    None => sent.refused += 1,
                },
                Err(_) => break true,
            }
        };
        if closed {
            sent.unanswered += in_flight.len() as u64 + 1;
        }
    }
    Ok(sent)
}

/// Transactions PostgreSQL committed so far in the benchmark's database.
async fn committed(db: &imcore::store::Store) -> Result<i64, BoxError> {
    let conn = db.pool().get().await?;
    let row =
        conn.query_one("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()", &[]).await?;
    Ok(row.get(0))
}

/// The sender's messages in the log: seqs by client_msg_id.
async fn sender_log(db: &imcore::store::Store) -> Result<HashMap<String, Vec<i64>>, BoxError> {
    let conn = db.pool().get().await?;
    let rows = conn
        .query("SELECT client_msg_id, seq FROM events WHERE kind = 'msg' AND sender_device = 'sender'", &[])
        .await?;
    let mut log: HashMap<String, Vec<i64>> = HashMap::new();
    for r in rows {
        log.entry(r.get(0)).or_default().push(r.get(1));
    }
    Ok(log)
}
