//! The write transaction: a batch of one conversation's ops under its row lock
//! (ARCHITECTURE §3), or the batches of several conversations at once (the
//! commit stage, `merged`). The `direct` write path runs it with one op.
//!
//! Round trips, each a pipeline (`txn`): BEGIN, the lock and every read the
//! checks need (replay + tombstone lookup of every request key, which a
//! merged round leaves to the INSERT's unique index: `merged`; the standings
//! of the users the ops name that the cache does not know, for group ops
//! which invitees exist and their applications, the targets of recalls,
//! edits, reactions and replies, the reaction sets reactions change); the
//! membership and settings changes, if any; the one multi-row INSERT with the
//! `next_seq` UPDATE, and COMMIT.
//!
//! * `ops` — the write requests and their outcomes.
//! * `lookup` — the reads under the lock: rows, request keys, standings, users.
//! * `batch` — the batch being built (pure: unit-tested without a database);
//!   `send`, `membership`, `group`, `status`, `recall`, `edit` and `react`
//!   hold the rules of each op.
//! * `member_rows` — the SQL of membership and settings changes.
//! * `append` — the one INSERT of every event and the row updates.
//! * `txn` — BEGIN and COMMIT, sent along with the statements next to them.
//! * `merged` — the commit stage's transaction: what happens to each job of
//!   it (committed, left out because its row is held elsewhere, rolled back).

mod append;
mod batch;
mod edit;
mod group;
mod lookup;
mod member_rows;
mod membership;
mod merged;
mod one_trip;
mod ops;
mod prepared;
mod react;
mod recall;
mod send;
mod status;
mod txn;

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use imcore_actors::{ConvId, UserId};
use tokio_postgres::Transaction;

use super::{PooledClient, Store, StoreError};
use crate::config::LargeGroupSettings;
use crate::domain::{DeliveryMode, Event, Rejection, Role, Standing};
use append::append_events;
use batch::BatchBuilder;
use lookup::{lock_and_read, read_standings, settle_standings, ConvRow, KeyLookup, LockMode, Reads};
use member_rows::{write_conv_patch, write_member_changes};
pub(super) use merged::Share;
pub use ops::{
    BanOp, EditOp, GroupChange, GroupOp, Invited, JoinOp, LeaveOp, ProfilePatch, ReactOp, RecallAck, RecallOp, SendAck,
    SendOp, WriteOp, WriteOutcome, Written,
};
use prepared::Conn;
pub use prepared::Prepared;
use txn::WriteTx;

/// A committed batch: one outcome per op, and what it appended.
#[derive(Debug)]
pub struct WrittenBatch {
    pub outcomes: Vec<WriteOutcome>,
    pub appended: Appended,
}

/// What a committed batch appended, for delivery (on this node, and through
/// the bus on the others).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct Appended {
    pub conv_id: ConvId,
    /// Ascending seq.
    pub events: Vec<Event>,
    /// The conversation's head after the batch.
    pub head: i64,
    /// `pull` when any part of the batch was in `pull` mode (ARCHITECTURE §9).
    pub delivery_mode: DeliveryMode,
    /// A `push` group past `IMCORE_MEMBERS_SUMMARY_ABOVE`: the `join`s and
    /// `leave`s of others reach a device as one `members_changed` count.
    pub members_summary: bool,
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

    pub(super) fn knows(&self, user: &UserId) -> bool {
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
/// row (every membership, role or mute change bumps it), and the row as its
/// last batch left it (`one_trip`). A stale or empty (`Default`) cache costs
/// a lookup inside the same transaction, never a wrong answer.
#[derive(Debug, Clone, Default)]
pub struct ConvCache {
    member_version: Option<i64>,
    roster: Roster,
    row: Option<ConvRow>,
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
        let written = self.write_job(BatchJob { conv: conv.clone(), cache, ops }).await?;
        self.committed(&written.0.appended);
        Ok(written)
    }

    /// Commits one conversation's batch in a transaction of its own, which
    /// waits for the row lock (at most `lock_timeout`) if another holds it.
    pub(in crate::store) async fn write_job(&self, job: BatchJob) -> Result<(WrittenBatch, ConvCache), StoreError> {
        let mut phase = Phase::start();
        let conn = self.pool.get().await?;
        let written = write_on(&conn, job, self.large_groups, &mut phase).await;
        if let Err(e) = &written {
            conn.note_failure(e);
        }
        written
    }
}

/// [`Store::write_job`] on the connection it checked out.
async fn write_on(
    conn: &PooledClient,
    job: BatchJob,
    large: LargeGroupSettings,
    phase: &mut Phase,
) -> Result<(WrittenBatch, ConvCache), StoreError> {
    let prepared = conn.prepared().await?;
    phase.end("pool");
    let conn = Conn { client: conn, prepared };
    let mut job = job;
    if let Some(plan) = one_trip::plan(&job) {
        let done = in_one_trip(conn, &mut job, plan, LockMode::Wait, large, phase).await;
        if let Some(written) = done.map_err(Unfinished::into_error)? {
            return Ok((written, job.cache));
        }
    }
    let mut jobs = [job];
    let tx = WriteTx::new(conn, &jobs);
    let reads = lock_and_read(tx.conn(), tx.begin(), &mut jobs, LockMode::Wait, KeyLookup::WithLock).await?;
    phase.end("lock");
    let applied = apply_batches(tx.conn(), &mut jobs, reads, large, phase).await?;
    let mut written = append_and_commit(tx, applied, phase).await.map_err(Unfinished::into_error)?;
    let [job] = jobs;
    Ok((written.pop().ok_or(StoreError::Invariant("a write transaction returned no batch"))?, job.cache))
}

/// Commits `job` in one round trip by its `plan` (`one_trip`), and moves
/// its cache on (the row's `next_seq`, the senders the plan took for plain
/// members); `None` when the guard declined it and nothing was written: it
/// takes the full path.
async fn in_one_trip(
    conn: Conn<'_>,
    job: &mut BatchJob,
    plan: one_trip::Plan,
    mode: LockMode,
    large: LargeGroupSettings,
    phase: &mut Phase,
) -> Result<Option<WrittenBatch>, Unfinished> {
    let assumed = plan.assumed.clone();
    let Some(written) = one_trip::commit_plan(conn, plan, mode, large.activity_resolution_ms).await? else {
        phase.end("declined");
        return Ok(None);
    };
    phase.end("one_trip");
    if let Some(row) = &mut job.cache.row {
        row.next_seq = written.appended.head + 1;
    }
    // The guard found them plain members.
    for user in assumed {
        job.cache.roster.insert(user, Standing::new(Role::Member));
    }
    Ok(Some(written))
}

/// Applies one conversation's `ops` inside `tx`, which the caller commits
/// (`prepared` are the statements of its connection).
pub(super) async fn apply_ops(
    tx: &Transaction<'_>,
    prepared: &Prepared,
    conv: &ConvId,
    ops: Vec<WriteOp>,
    large: LargeGroupSettings,
) -> Result<WrittenBatch, StoreError> {
    let mut jobs = [BatchJob { conv: conv.clone(), cache: ConvCache::default(), ops }];
    let mut phase = Phase::start();
    let conn = Conn { client: tx.client(), prepared };
    let ready = std::future::ready(Ok(()));
    let reads = lock_and_read(conn, ready, &mut jobs, LockMode::Wait, KeyLookup::WithLock).await?;
    let mut applied = apply_batches(conn, &mut jobs, reads, large, &mut phase).await?;
    append_events(conn, &applied).await?;
    applied.take_events();
    applied.written.pop().ok_or(StoreError::Invariant("a write transaction returned no batch"))
}

/// The batches of a transaction, applied but not yet appended.
struct Applied {
    written: Vec<WrittenBatch>,
    /// The batches that append, with the index of each in `written`.
    builders: Vec<(usize, BatchBuilder)>,
    /// `LargeGroupSettings::activity_resolution_ms`, for the append.
    activity_ms: i64,
}

impl Applied {
    /// Moves the appended events into `written`.
    fn take_events(&mut self) {
        for (i, b) in self.builders.drain(..) {
            self.written[i].appended.events = b.events;
        }
    }
}

/// How a transaction failed at its last round trip (INSERT and COMMIT).
#[derive(Debug)]
enum Unfinished {
    /// The server refused the INSERT: the transaction was aborted and COMMIT
    /// rolled it back; nothing took effect.
    RolledBack(StoreError),
    /// COMMIT failed, or the connection did before the INSERT's reply (which
    /// COMMIT followed): it may or may not have taken effect.
    Unknown(StoreError),
}

impl Unfinished {
    fn into_error(self) -> StoreError {
        match self {
            Unfinished::RolledBack(e) | Unfinished::Unknown(e) => e,
        }
    }
}

/// Sends the one INSERT and COMMIT together (one round trip), and learns from
/// the INSERT's reply whether COMMIT committed anything.
async fn append_and_commit(
    tx: WriteTx<'_>,
    mut applied: Applied,
    phase: &mut Phase,
) -> Result<Vec<WrittenBatch>, Unfinished> {
    let conn = tx.conn();
    let (appended, committed) = futures_util::join!(append_events(conn, &applied), tx.commit());
    match appended {
        Err(StoreError::Db(e)) if e.as_db_error().is_some() => return Err(Unfinished::RolledBack(e.into())),
        Err(e) => return Err(Unfinished::Unknown(e)),
        Ok(()) => committed.map_err(|e| Unfinished::Unknown(e.into()))?,
    }
    phase.end("commit");
    applied.take_events();
    Ok(applied.written)
}

/// Applies every job against the rows `reads` holds locked (a job without
/// one answers as an unknown conversation), up to the INSERT, which the
/// caller sends. Checks run in the order of PROTOCOL §5 `send`.
async fn apply_batches(
    tx: Conn<'_>,
    jobs: &mut [BatchJob],
    reads: Reads,
    large: LargeGroupSettings,
    phase: &mut Phase,
) -> Result<Applied, StoreError> {
    let unread = settle_standings(jobs, &reads.rows, &reads.standings);
    if !unread.is_empty() {
        // A cache found stale under the lock: its users, read now.
        let standings = read_standings(tx, unread).await?;
        settle_standings(jobs, &reads.rows, &standings);
    }
    let Reads { rows, prior, known_users, blockers, applications, targets, reactions, .. } = reads;
    let (no_applications, no_targets, no_reactions) = (HashSet::new(), HashMap::new(), Default::default());

    let mut written = Vec::with_capacity(jobs.len());
    let mut builders = Vec::with_capacity(jobs.len());
    for job in jobs.iter_mut() {
        let Some(row) = rows.get(&job.conv) else {
            // No existence leak: an unknown conversation answers like a non-member.
            let outcomes = job.ops.iter().map(|_| Err(Rejection::NotMember)).collect();
            let appended = Appended {
                conv_id: job.conv.clone(),
                events: vec![],
                head: 0,
                delivery_mode: DeliveryMode::Push,
                members_summary: false,
            };
            written.push(WrittenBatch { outcomes, appended });
            continue;
        };
        let cache = &mut job.cache;
        let mut b = BatchBuilder::new(&job.conv, row);
        let applications = applications.get(&job.conv).unwrap_or(&no_applications);
        let targets = targets.get(&job.conv).unwrap_or(&no_targets);
        let reactions = reactions.get(&job.conv).unwrap_or(&no_reactions);
        let mut outcomes = Vec::with_capacity(job.ops.len());
        for op in &job.ops {
            let outcome = match op {
                WriteOp::Send(s) => b.send(s, &prior, &cache.roster, targets),
                WriteOp::Join(j) => b.join(j, &known_users, &mut cache.roster),
                WriteOp::Leave(l) => b.leave(l, &mut cache.roster),
                WriteOp::Group(g) => b.group(g, &known_users, &blockers, applications, &mut cache.roster),
                WriteOp::Recall(r) => b.recall(r, targets, &cache.roster),
                WriteOp::Edit(e) => b.edit(e, &prior, targets, &cache.roster),
                WriteOp::React(r) => b.react(r, targets, reactions, &cache.roster),
                WriteOp::Ban(op) => b.ban(op),
            };
            if let (Ok(_), Some(actor)) = (&outcome, op.member_actor()) {
                b.settle_delivery(actor, large.thresholds());
            }
            outcomes.push(outcome);
        }
        write_member_changes(tx.client, &job.conv, &b.member_changes).await?;
        write_conv_patch(tx.client, &job.conv, &b.profile).await?;
        cache.member_version = Some(row.member_version + b.version_bump());
        // A batch that changed the row's settings leaves the next to read it.
        cache.row = b.profile.is_empty().then(|| ConvRow {
            next_seq: b.next_seq,
            member_version: row.member_version + b.version_bump(),
            member_count: b.member_count,
            ..row.clone()
        });
        let appended = Appended {
            conv_id: job.conv.clone(),
            head: b.next_seq - 1,
            events: Vec::new(),
            delivery_mode: if b.pulled { DeliveryMode::Pull } else { DeliveryMode::Push },
            members_summary: !b.pulled && b.group && b.member_count > large.summary_above,
        };
        written.push(WrittenBatch { outcomes, appended });
        builders.push((written.len() - 1, b));
    }
    phase.end("apply");
    Ok(Applied { written, builders, activity_ms: large.activity_resolution_ms })
}
