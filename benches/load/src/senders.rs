//! Closed-loop (or paced) senders through the library's `Writer`, and what a
//! run of them measured and verified: the machinery the in-process
//! benchmarks (`write`, `retention`) share.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use imcore::config::{EngineSettings, WritePath, WriteSettings};
use imcore::domain::Body;
use imcore::metrics::{write_phase_totals, WRITE_PHASES};
use imcore::store::{CreateConversation, GroupSettings, SendOp, Store, WriteOp, Written};
use imcore::writer::{Engine, WriteFailure, Writer};
use imcore_actors::{ClientMsgId, ConvId, DeviceId, UserId};
use serde_json::{json, Value};

use crate::environment::BoxError;
use crate::percentiles::Percentiles;

/// Members of every benchmark group.
pub const GROUP_MEMBERS: usize = 64;

/// Where a run stops: at whichever comes first.
#[derive(Debug, Clone, Copy)]
pub struct Budget {
    pub messages: u64,
    pub seconds: u64,
}

pub fn uid(s: &str) -> UserId {
    UserId::parse(s).unwrap_or_else(|_| unreachable!("generated ids are valid"))
}

/// `users` as fresh accounts.
pub async fn create_users(store: &Store, prefix: &str) -> Result<Vec<UserId>, BoxError> {
    let users: Vec<UserId> = (0..GROUP_MEMBERS).map(|i| uid(&format!("{prefix}-u{i}"))).collect();
    for u in &users {
        store.create_user(u, None).await?;
    }
    Ok(users)
}

pub fn path_name(p: WritePath) -> &'static str {
    match p {
        WritePath::Actor => "actor",
        WritePath::Direct => "direct",
    }
}

/// A group of `users` (the first its owner) named `id`.
pub async fn group(store: &Store, users: &[UserId], id: &str, settings: GroupSettings) -> Result<ConvId, BoxError> {
    let created = store
        .create_conversation(&CreateConversation::Group {
            creator: users[0].clone(),
            conv_id: Some(ConvId::parse(id)?),
            name: id.into(),
            members: users[1..].to_vec(),
            settings: GroupSettings { max_member: 10_000, ..settings },
        })
        .await?;
    Ok(created.info.conv_id)
}

pub struct Run {
    pub scenario: &'static str,
    pub write_path: &'static str,
    pub senders: usize,
    pub conversations: usize,
    pub messages: u64,
    pub acked_per_s: f64,
    pub ack_ms: Percentiles,
    pub batch: (f64, i64),
    pub failed: u64,
    pub verified: bool,
    pub target_rate: Option<f64>,
    /// Mean ms per write transaction, by phase (`None`: no transaction of it).
    pub phase_ms: Vec<(&'static str, Option<f64>)>,
    /// Write transactions that went through each phase.
    pub phase_count: Vec<(&'static str, u64)>,
}

/// Mean ms per transaction and phase, and transactions per phase, between
/// two `write_phase_totals` readings.
#[allow(clippy::type_complexity)]
fn phases(before: &[(f64, u64)], after: &[(f64, u64)]) -> (Vec<(&'static str, Option<f64>)>, Vec<(&'static str, u64)>) {
    WRITE_PHASES
        .iter()
        .zip(before.iter().zip(after))
        .map(|(phase, ((s0, n0), (s1, n1)))| {
            let n = n1.saturating_sub(*n0);
            ((*phase, (n > 0).then(|| (s1 - s0) * 1000.0 / n as f64)), (*phase, n))
        })
        .unzip()
}

impl Run {
    pub fn json(&self) -> Value {
        json!({
            "scenario": self.scenario,
            "write_path": self.write_path,
            "senders": self.senders,
            "conversations": self.conversations,
            "messages": self.messages,
            "acked_per_s": self.acked_per_s.round(),
            "ack_ms": self.ack_ms.json(),
            "batch": {"mean": self.batch.0, "max": self.batch.1},
            "failed": self.failed,
            "target_rate": self.target_rate,
            "transaction_phase_ms": self.phase_ms.iter().map(|(p, ms)| (p.to_string(), json!(ms))).collect::<serde_json::Map<_, _>>(),
            "transaction_phase_count": self.phase_count.iter().map(|(p, n)| (p.to_string(), json!(n))).collect::<serde_json::Map<_, _>>(),
            "verified": self.verified,
        })
    }
}

pub fn summary_line(r: &Run) -> String {
    let phases: Vec<String> =
        r.phase_ms.iter().map(|(p, ms)| ms.map_or_else(|| format!("{p} n/a"), |ms| format!("{p} {ms:.2}"))).collect();
    format!(
        "{:<18} {:<6} C={:<4} convs={:<5} msgs={:<6} {:>8.0} acked/s  ack {}  batch mean {:.1} max {}  failed {}  verified {}  txn ms: {}",
        r.scenario, r.write_path, r.senders, r.conversations, r.messages, r.acked_per_s, r.ack_ms.text(),
        r.batch.0, r.batch.1, r.failed, r.verified, phases.join(", ")
    )
}

pub fn body(n: u64) -> Body {
    let v = json!({"type": "text", "text": format!("load message {n:08} {}", "x".repeat(64))});
    Body::parse(&v, 16 * 1024).unwrap_or_else(|_| unreachable!("small body"))
}

pub fn writer(store: &Store, path: WritePath, commit_workers: usize) -> Writer {
    let write = WriteSettings { commit_workers, arbiters: 2, ..WriteSettings::on(path) };
    Engine::start(store.clone(), &EngineSettings { write, ..EngineSettings::default() }).writer
}

/// What senders are given to drive.
pub struct Load<'a> {
    pub convs: &'a [ConvId],
    pub users: &'a [UserId],
    pub senders: usize,
    /// Prefix of the run's client_msg_ids: runs on one conversation keep apart.
    pub keys: &'static str,
    pub budget: Budget,
    /// Open loop at this many msgs/s in all; `None`: closed loop.
    pub rate: Option<f64>,
}

/// Drives `load` through `writer`, shuts the writer down, then verifies what
/// the run wrote and reads the batch sizes PostgreSQL saw.
pub async fn measured(
    store: &Store,
    writer: &Writer,
    scenario: &'static str,
    path: WritePath,
    load: &Load<'_>,
) -> Result<Run, BoxError> {
    let shards = [Shard { store, writer }];
    measured_on(&shards, &vec![0; load.convs.len()], scenario, path, load, || {}).await
}

/// One PostgreSQL of a run whose storage is split by conversation: its store
/// and the writer committing to it.
pub struct Shard<'a> {
    pub store: &'a Store,
    pub writer: &'a Writer,
}

/// [`measured`] with conversation `i` stored on `shards[shard_of[i]]` (each
/// send goes to that shard's writer; each shard's part is verified on it).
/// `window` is called right before the senders start and right after they end.
pub async fn measured_on(
    shards: &[Shard<'_>],
    shard_of: &[usize],
    scenario: &'static str,
    path: WritePath,
    load: &Load<'_>,
    mut window: impl FnMut(),
) -> Result<Run, BoxError> {
    // Per shard: its conversations (indexes into `load.convs`) and their first seqs.
    let mut parts = vec![];
    for (k, shard) in shards.iter().enumerate() {
        let idx: Vec<usize> = (0..load.convs.len()).filter(|&i| shard_of[i] == k).collect();
        let convs: Vec<ConvId> = idx.iter().map(|&i| load.convs[i].clone()).collect();
        let first = next_seqs(shard.store, &convs).await?;
        parts.push((idx, convs, first));
    }
    let writers: Vec<Writer> = shards.iter().map(|s| s.writer.clone()).collect();
    let phases_before = write_phase_totals();
    window();
    let (acks, failed, elapsed) = drive(&writers, shard_of, load).await;
    window();
    let (phase_ms, phase_count) = phases(&phases_before, &write_phase_totals());
    for w in &writers {
        w.shutdown().await;
    }
    let (mut verified, mut rows, mut txns, mut max) = (true, 0.0, 0.0, 0);
    for (shard, (idx, convs, first)) in shards.iter().zip(&parts) {
        // The shard's acks, their conversation renumbered into its own list.
        let local: HashMap<usize, usize> = idx.iter().enumerate().map(|(j, &i)| (i, j)).collect();
        let acks: Vec<Ack> = acks
            .iter()
            .filter_map(|a| local.get(&a.conv).map(|&j| Ack { conv: j, seq: a.seq, key: a.key.clone(), ms: a.ms }))
            .collect();
        verified &= verify(shard.store, convs, first, &acks).await?;
        let (r, t, m) = batch_sizes(shard.store, convs, first).await?;
        (rows, txns, max) = (rows + r, txns + t, max.max(m));
    }
    Ok(Run {
        scenario,
        write_path: path_name(path),
        senders: load.senders,
        conversations: load.convs.len(),
        messages: acks.len() as u64,
        acked_per_s: acks.len() as f64 / elapsed.as_secs_f64(),
        ack_ms: Percentiles::of(acks.iter().map(|a| a.ms).collect()),
        batch: (if txns > 0.0 { rows / txns } else { 0.0 }, max),
        failed,
        verified,
        target_rate: load.rate,
        phase_ms,
        phase_count,
    })
}

struct Ack {
    conv: usize,
    seq: i64,
    key: String,
    ms: f64,
}

/// Runs the senders until the budget's messages are issued or its seconds
/// pass: closed loop (each sender waits for its ack), or open loop at `rate`
/// msgs/s in all (each write its own task, so acks are timed when they
/// arrive). With several conversations a sender picks one at random per
/// message and sends as one of its members (group i holds users i..i+3 mod 64),
/// through the writer of its shard (`writers[shard_of[i]]`).
async fn drive(writers: &[Writer], shard_of: &[usize], load: &Load<'_>) -> (Vec<Ack>, u64, Duration) {
    type Done = (Result<Written, WriteFailure>, usize, String, Duration);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Done>();
    let issued = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs(load.budget.seconds);
    let started = Instant::now();
    let (budget, rate, senders, keys) = (load.budget.messages, load.rate, load.senders, load.keys);
    for s in 0..senders {
        let (writers, shard_of, issued, tx) = (writers.to_vec(), shard_of.to_vec(), issued.clone(), tx.clone());
        let device = DeviceId::parse(&format!("dev-{s}")).unwrap_or_else(|_| unreachable!("valid"));
        let (convs, users) = (load.convs.to_vec(), load.users.to_vec());
        actix::spawn(async move {
            let mut rng = (s as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15).wrapping_add(1);
            // Open loop: each sender's first tick is staggered over the period
            // (as `ws` does), so the offered load arrives evenly, not as one
            // burst of every sender per period.
            let mut interval = rate.map(|r| {
                let period = Duration::from_secs_f64(senders as f64 / r.max(1.0));
                let first = started + period.mul_f64(s as f64 / senders.max(1) as f64);
                let mut i = tokio::time::interval_at(first.into(), period);
                i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
                i
            });
            for n in 0u64.. {
                if let Some(i) = interval.as_mut() {
                    i.tick().await;
                }
                if Instant::now() >= deadline || issued.fetch_add(1, Ordering::Relaxed) >= budget {
                    break;
                }
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let (ci, user) = if convs.len() == 1 {
                    (0, users[s % users.len()].clone())
                } else {
                    let ci = (rng % convs.len() as u64) as usize;
                    (ci, users[(ci + 1 + ((rng >> 32) % 3) as usize) % users.len()].clone())
                };
                let key = format!("{keys}s{s}-{n}");
                let op = WriteOp::Send(SendOp {
                    sender: user,
                    device: device.clone(),
                    client_msg_id: ClientMsgId::parse(&key).unwrap_or_else(|_| unreachable!("valid")),
                    body: body(n),
                    reply_to: None,
                    mentions: Vec::new(),
                });
                let t = Instant::now();
                let write = writers[shard_of[ci]].write(convs[ci].clone(), op);
                let tx = tx.clone();
                let done = async move {
                    let result = write.await;
                    let _ = tx.send((result, ci, key, t.elapsed()));
                };
                if interval.is_some() {
                    actix::spawn(done);
                } else {
                    done.await;
                }
            }
        });
    }
    drop(tx);
    let (mut acks, mut failed) = (vec![], 0);
    while let Some((result, conv, key, took)) = rx.recv().await {
        match result {
            Ok(Written::Sent(ack)) => acks.push(Ack { conv, seq: ack.seq, key, ms: took.as_secs_f64() * 1000.0 }),
            _ => failed += 1,
        }
    }
    (acks, failed, started.elapsed())
}

/// Each conversation's `next_seq`: where a run about to start will append.
async fn next_seqs(store: &Store, convs: &[ConvId]) -> Result<Vec<i64>, BoxError> {
    let conn = store.pool().get().await?;
    let ids: Vec<&str> = convs.iter().map(|c| c.as_str()).collect();
    let rows = conn.query("SELECT conv_id, next_seq FROM conversations WHERE conv_id = ANY($1)", &[&ids]).await?;
    let by_id: HashMap<&str, i64> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    Ok(ids.iter().map(|id| by_id.get(id).copied().unwrap_or(1)).collect())
}

/// P1 (gapless from `min_seq`, next_seq = max + 1; retention may have purged
/// a prefix), P2 (one row per request key), every ack equals the stored row,
/// and the run's messages (from `first_seqs` on) are exactly the acked ones.
async fn verify(store: &Store, convs: &[ConvId], first_seqs: &[i64], acks: &[Ack]) -> Result<bool, BoxError> {
    let conn = store.pool().get().await?;
    let ids: Vec<&str> = convs.iter().map(|c| c.as_str()).collect();
    let r = conn
        .query_one(
            "SELECT count(*) FILTER (WHERE NOT ok) FROM (
               SELECT c.conv_id, count(e.seq) = max(e.seq) - c.min_seq + 1 AND min(e.seq) = c.min_seq
                      AND c.next_seq = max(e.seq) + 1
                      AND count(e.client_msg_id) = count(DISTINCT (e.sender_user, e.client_msg_id))
                          FILTER (WHERE e.client_msg_id IS NOT NULL) AS ok
                 FROM conversations c JOIN events e USING (conv_id)
                WHERE c.conv_id = ANY($1) GROUP BY c.conv_id, c.min_seq, c.next_seq) t",
            &[&ids],
        )
        .await?;
    let broken: i64 = r.get(0);
    let (conv_idx, seqs, keys): (Vec<&str>, Vec<i64>, Vec<&str>) =
        acks.iter().fold((vec![], vec![], vec![]), |(mut c, mut s, mut k), a| {
            c.push(ids[a.conv]);
            s.push(a.seq);
            k.push(&a.key);
            (c, s, k)
        });
    let mismatched: i64 = conn
        .query_one(
            "SELECT count(*) FROM unnest($1::text[], $2::int8[], $3::text[]) AS a(conv_id, seq, key)
              WHERE NOT EXISTS (SELECT 1 FROM events e WHERE e.conv_id = a.conv_id AND e.seq = a.seq
                                                        AND e.client_msg_id = a.key)",
            &[&conv_idx, &seqs, &keys],
        )
        .await?
        .get(0);
    let stored: i64 = conn
        .query_one(
            "SELECT count(*) FROM unnest($1::text[], $2::int8[]) AS r(conv_id, first_seq)
               JOIN events e ON e.conv_id = r.conv_id AND e.seq >= r.first_seq AND e.kind = 'msg'",
            &[&ids, &first_seqs],
        )
        .await?
        .get(0);
    let ok = broken == 0 && mismatched == 0 && stored == acks.len() as i64;
    if !ok {
        eprintln!(
            "verification failed: {broken} broken logs, {mismatched} acks unlike their rows, {stored} rows for {} acks",
            acks.len()
        );
    }
    Ok(ok)
}

/// Batch sizes as PostgreSQL saw them: the run's rows, the inserting
/// transactions (by xmin), and the most rows one of them inserted.
async fn batch_sizes(store: &Store, convs: &[ConvId], first_seqs: &[i64]) -> Result<(f64, f64, i64), BoxError> {
    let conn = store.pool().get().await?;
    let ids: Vec<&str> = convs.iter().map(|c| c.as_str()).collect();
    let r = conn
        .query_one(
            "SELECT coalesce(sum(n)::float8, 0), count(*)::float8, coalesce(max(n), 0) FROM (
               SELECT count(*) AS n FROM unnest($1::text[], $2::int8[]) AS r(conv_id, first_seq)
                 JOIN events e ON e.conv_id = r.conv_id AND e.seq >= r.first_seq AND e.kind = 'msg'
                GROUP BY e.xmin::text) t",
            &[&ids, &first_seqs],
        )
        .await?;
    Ok((r.get(0), r.get(1), r.get(2)))
}
