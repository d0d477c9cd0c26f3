//! The write transaction: a batch of one conversation's ops under its row lock
//! (ARCHITECTURE §3), or the batches of several conversations at once (the
//! commit stage, `merged`). The `direct` write path runs it with one op.
//!
//! Round trips: lock; one replay + tombstone lookup for every request key of the
//! batch; the standings of the users the ops name that the cache does not
//! know; for group ops, which invitees exist and their applications; the
//! membership and settings changes, if any; one multi-row INSERT with the
//! `next_seq` UPDATE; COMMIT.
//!
//! * `ops` — the write requests and their outcomes.
//! * `lookup` — the reads under the lock: rows, request keys, standings, users.
//! * `batch` — the batch being built (pure: unit-tested without a database);
//!   `send`, `membership` and `group` hold the rules of each op.
//! * `member_rows` — the SQL of membership and settings changes.
//! * `append` — the one INSERT of every event and the row updates.
//! * `merged` — the commit stage's transaction: what happens to each job of
//!   it (committed, left out because its row is held elsewhere, rolled back).

mod append;
mod batch;
mod group;
mod lookup;
mod member_rows;
mod membership;
mod merged;
mod ops;
mod recall;
mod send;

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use imcore_actors::{ConvId, UserId};
use tokio_postgres::Transaction;

use super::{Store, StoreError};
use crate::domain::{DeliveryMode, Event, Rejection, Standing};
use append::append_events;
use batch::BatchBuilder;
use lookup::{
    load_standings, lock_conversations, lookup_applications, lookup_joiners, lookup_recall_targets,
    lookup_request_keys, ConvRow, LockMode,
};
use member_rows::{write_conv_patch, write_member_changes};
pub(super) use merged::Share;
pub use ops::{
    GroupChange, GroupOp, Invited, JoinOp, LeaveOp, ProfilePatch, RecallAck, RecallOp, SendAck, SendOp, WriteOp,
    WriteOutcome, Written,
};

/// A committed batch: one outcome per op, and what it appended.
#[derive(Debug)]
pub struct WrittenBatch {
    pub outcomes: Vec<WriteOutcome>,
    pub appended: Appended,
}

/// What a committed batch appended, for delivery.
#[derive(Debug)]
pub struct Appended {
    pub conv_id: ConvId,
    /// Ascending seq.
    pub events: Vec<Event>,
    /// The conversation's head after the batch.
    pub head: i64,
    pub delivery_mode: DeliveryMode,
}

/// Most users whose standing a conversation's cache keeps; past it the
/// cache starts again from the users of the batch at hand.
pub const ROSTER_CACHE_USERS: usize = 4096;

/// Where the users that a conversation's batches named stand: a current
/// member's [`Standing`], or `None` for someone known not to be one. Never
/// the whole member list: a batch looks up, by primary key, only the users
/// its ops name that this does not know (ARCHITECTURE §9).
#[derive(Debug, Clone, Default)]
pub struct Roster {
    known: HashMap<UserId, Option<Standing>>,
}

impl Roster {
    /// `user`'s standing if it is a current member. Only meaningful for a
    /// user the batch's lookup covered.
    pub fn get(&self, user: &UserId) -> Option<&Standing> {
        self.known.get(user).and_then(Option::as_ref)
    }

    pub fn contains_key(&self, user: &UserId) -> bool {
        self.get(user).is_some()
    }

    pub fn insert(&mut self, user: UserId, standing: Standing) {
        self.known.insert(user, Some(standing));
    }

    pub fn remove(&mut self, user: &UserId) {
        self.known.insert(user.clone(), None);
    }

    fn knows(&self, user: &UserId) -> bool {
        self.known.contains_key(user)
    }

    pub fn len(&self) -> usize {
        self.known.len()
    }

    pub fn is_empty(&self) -> bool {
        self.known.is_empty()
    }
}

/// What a conversation actor keeps between batches: the [`Roster`] of the
/// users its batches named, valid while `member_version` matches the locked
/// row (every membership, role or mute change bumps it). A stale or empty
/// (`Default`) cache costs a lookup inside the same transaction, never a
/// wrong answer.
#[derive(Debug, Clone, Default)]
pub struct ConvCache {
    member_version: Option<i64>,
    roster: Roster,
}

/// Times the phases of a write transaction into `metrics::write_phase`.
struct Phase(Instant);

impl Phase {
    fn start() -> Self {
        Self(Instant::now())
    }

    fn end(&mut self, name: &'static str) {
        let now = Instant::now();
        crate::metrics::observe_write_phase(name, now - self.0);
        self.0 = now;
    }
}

/// One conversation's share of a write transaction.
#[derive(Debug)]
pub struct BatchJob {
    pub conv: ConvId,
    pub cache: ConvCache,
    pub ops: Vec<WriteOp>,
}

impl Store {
    /// Commits `ops` in order in one transaction (`cache` may be stale or empty).
    pub async fn write_batch(
        &self,
        conv: &ConvId,
        cache: ConvCache,
        ops: Vec<WriteOp>,
    ) -> Result<(WrittenBatch, ConvCache), StoreError> {
        self.write_job(BatchJob { conv: conv.clone(), cache, ops }).await
    }

    /// Commits one conversation's batch in a transaction of its own, which
    /// waits for the row lock (at most `lock_timeout`) if another holds it.
    pub(in crate::store) async fn write_job(&self, job: BatchJob) -> Result<(WrittenBatch, ConvCache), StoreError> {
        let mut phase = Phase::start();
        let mut conn = self.pool.get().await?;
        phase.end("pool");
        let tx = conn.transaction().await?;
        phase.end("begin");
        let written = apply_job(&tx, job, &mut phase).await?;
        tx.commit().await?;
        phase.end("commit");
        Ok(written)
    }
}

/// Applies one conversation's `ops` inside `tx`, which the caller commits.
pub(super) async fn apply_ops(
    tx: &Transaction<'_>,
    conv: &ConvId,
    ops: Vec<WriteOp>,
) -> Result<WrittenBatch, StoreError> {
    let job = BatchJob { conv: conv.clone(), cache: ConvCache::default(), ops };
    Ok(apply_job(tx, job, &mut Phase::start()).await?.0)
}

/// Locks `job`'s conversation row (waiting for it) and applies the job inside
/// `tx`; the batch written and the cache after it.
async fn apply_job(
    tx: &Transaction<'_>,
    job: BatchJob,
    phase: &mut Phase,
) -> Result<(WrittenBatch, ConvCache), StoreError> {
    let mut jobs = [job];
    let rows = lock_conversations(tx, &jobs, LockMode::Wait).await?;
    phase.end("lock");
    let mut written = apply_batches(tx, &mut jobs, &rows, phase).await?;
    let [job] = jobs;
    Ok((written.pop().ok_or(StoreError::Invariant("a write transaction returned no batch"))?, job.cache))
}

/// Applies every job inside `tx`, which the caller commits, against `rows`:
/// the conversation rows `tx` holds locked (a job without one answers as an
/// unknown conversation). Checks run in the order of PROTOCOL §5 `send`.
async fn apply_batches(
    tx: &Transaction<'_>,
    jobs: &mut [BatchJob],
    rows: &HashMap<ConvId, ConvRow>,
    phase: &mut Phase,
) -> Result<Vec<WrittenBatch>, StoreError> {
    load_standings(tx, jobs, rows).await?;
    let prior = lookup_request_keys(tx, jobs, rows).await?;
    let known_users = lookup_joiners(tx, jobs).await?;
    let applications = lookup_applications(tx, jobs).await?;
    let recall_targets = lookup_recall_targets(tx, jobs).await?;
    let (no_applications, no_targets) = (HashSet::new(), HashMap::new());
    phase.end("lookup");

    let mut written = Vec::with_capacity(jobs.len());
    let mut builders = Vec::with_capacity(jobs.len());
    for job in jobs.iter_mut() {
        let Some(row) = rows.get(&job.conv) else {
            // No existence leak: an unknown conversation answers like a non-member.
            let outcomes = job.ops.iter().map(|_| Err(Rejection::NotMember)).collect();
            let appended =
                Appended { conv_id: job.conv.clone(), events: vec![], head: 0, delivery_mode: DeliveryMode::Push };
            written.push(WrittenBatch { outcomes, appended });
            continue;
        };
        let cache = &mut job.cache;
        let mut b = BatchBuilder::new(&job.conv, row);
        let applications = applications.get(&job.conv).unwrap_or(&no_applications);
        let targets = recall_targets.get(&job.conv).unwrap_or(&no_targets);
        let mut outcomes = Vec::with_capacity(job.ops.len());
        for op in &job.ops {
            let outcome = match op {
                WriteOp::Send(s) => b.send(s, &prior, &cache.roster),
                WriteOp::Join(j) => b.join(j, &known_users, &mut cache.roster),
                WriteOp::Leave(l) => b.leave(l, &mut cache.roster),
                WriteOp::Group(g) => b.group(g, &known_users, applications, &mut cache.roster),
                WriteOp::Recall(r) => b.recall(r, targets, &cache.roster),
            };
            outcomes.push(outcome);
        }
        write_member_changes(tx, &job.conv, &b.member_changes).await?;
        write_conv_patch(tx, &job.conv, &b.profile).await?;
        cache.member_version = Some(row.member_version + b.version_bump());
        let appended = Appended {
            conv_id: job.conv.clone(),
            head: b.next_seq - 1,
            events: Vec::new(),
            delivery_mode: b.delivery_mode,
        };
        written.push(WrittenBatch { outcomes, appended });
        builders.push((written.len() - 1, b));
    }
    append_events(tx, &builders).await?;
    phase.end("append");
    for (i, b) in builders {
        written[i].appended.events = b.events;
    }
    Ok(written)
}
