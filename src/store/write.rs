//! The write transaction: a batch of one conversation's ops under its row lock
//! (ARCHITECTURE §3). The `direct` write path runs it with one op.
//!
//! Round trips: lock; one replay + tombstone lookup for every request key of the
//! batch; member rows only for users the cache lacks; membership changes, if
//! any; one multi-row INSERT with the `next_seq` UPDATE; COMMIT.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use chrono::{DateTime, Utc};
use imcore_actors::{ClientMsgId, ConvId, DeviceId, UserId};
use tokio_postgres::types::Type;
use tokio_postgres::Transaction;
use uuid::Uuid;

use super::{Store, StoreError};
use crate::domain::{Body, DeliveryMode, Event, EventKind, JoinMode, LeaveReason, Permission, Rejection, Role};

/// One write request against one conversation.
#[derive(Debug, Clone)]
pub enum WriteOp {
    Send(SendOp),
    Join(JoinOp),
    Leave(LeaveOp),
}

#[derive(Debug, Clone)]
pub struct SendOp {
    pub sender: UserId,
    pub device: DeviceId,
    pub client_msg_id: ClientMsgId,
    pub body: Body,
}

/// `user` joins with `role`; `actor` is who added them (the user itself for a self-join).
#[derive(Debug, Clone)]
pub struct JoinOp {
    pub user: UserId,
    pub actor: UserId,
    pub role: Role,
}

#[derive(Debug, Clone)]
pub struct LeaveOp {
    pub user: UserId,
    pub actor: UserId,
    pub reason: LeaveReason,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendAck {
    pub seq: i64,
    pub message_id: Uuid,
    pub dup: bool,
    pub created_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Written {
    Sent(SendAck),
    Joined { seq: i64 },
    Left { seq: i64 },
}

pub type WriteOutcome = Result<Written, Rejection>;

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
    /// The complete member map before the batch: replaying the batch's
    /// join/leave events on it gives who sees each event.
    pub members_before: Arc<MemberMap>,
    pub delivery_mode: DeliveryMode,
}

/// Current members and their attributes.
pub type MemberMap = HashMap<UserId, MemberState>;

/// What a conversation actor keeps between batches: the whole member map, valid
/// while `member_version` matches the locked row (every membership, role or
/// mute change bumps it). A stale or empty (`Default`) cache costs a reload
/// inside the same transaction, never a wrong answer.
#[derive(Debug, Clone, Default)]
pub struct ConvCache {
    member_version: Option<i64>,
    members: Arc<MemberMap>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberState {
    pub role: Role,
    pub mute_until: Option<DateTime<Utc>>,
}

/// The locked conversation row.
struct ConvRow {
    dismissed: bool,
    next_seq: i64,
    member_version: i64,
    member_count: i32,
    max_member: i32,
    mute_all: bool,
    join_mode: JoinMode,
    delivery_mode: DeliveryMode,
    /// Retention purged something once (`min_seq > 1`), so tombstones may exist.
    purged: bool,
    /// Transaction time, in ms: the `created_at` of everything the batch appends.
    now: DateTime<Utc>,
}

/// Rows are locked in `conv_id` order, so two transactions that each lock
/// several conversations never deadlock. `NO KEY UPDATE` serialises writers of
/// a conversation just as well (it conflicts with itself) without blocking
/// other transactions' foreign-key checks against the row.
const LOCK_CONVERSATIONS: &str = "
SELECT conv_id, status = 'dismissed', next_seq, member_version, member_count, max_member, mute_all, join_mode,
       delivery_mode, min_seq, date_trunc('milliseconds', now())
  FROM conversations WHERE conv_id = ANY($1::text[]) ORDER BY conv_id FOR NO KEY UPDATE";

/// One index probe per key on each unique index (a LATERAL `LIMIT 1`; a plain
/// join against the key list can scan the whole conversation). Tombstones are
/// probed only where retention ever purged (`min_seq > 1`).
const LOOKUP_REQUEST_KEYS: &str = "
SELECT k.conv, k.u, k.c, e.seq, e.message_id, e.request_hash, e.created_at, t.request_hash IS NOT NULL
  FROM unnest($1::text[], $2::text[], $3::text[], $4::bool[]) AS k(conv, u, c, purged)
  LEFT JOIN LATERAL (SELECT seq, message_id, request_hash, created_at FROM events
                      WHERE conv_id = k.conv AND sender_user = k.u AND client_msg_id = k.c LIMIT 1) e ON true
  LEFT JOIN LATERAL (SELECT request_hash FROM idem_tombstones
                      WHERE k.purged AND conv_id = k.conv AND sender_user = k.u AND client_msg_id = k.c) t ON true
 WHERE e.seq IS NOT NULL OR t.request_hash IS NOT NULL";

const LOAD_MEMBERS: &str = "SELECT conv_id, user_id, role, mute_until FROM members WHERE conv_id = ANY($1::text[])";

const LOOKUP_USERS: &str = "SELECT user_id FROM users WHERE user_id = ANY($1::text[])";

/// Every event of every conversation of the transaction, and every
/// conversation row, in one statement.
const APPEND_EVENTS: &str = "
WITH appended AS (
  INSERT INTO events (conv_id, seq, kind, message_id, sender_user, sender_device, client_msg_id, request_hash,
                      body, subject_user, actor, reason, created_at)
  SELECT e.*, $13
    FROM unnest($1::text[], $2::int8[], $3::text[], $4::uuid[], $5::text[], $6::text[], $7::text[], $8::bytea[],
                $9::text[], $10::text[], $11::text[], $12::text[]) AS e)
UPDATE conversations c
   SET next_seq = u.next_seq, member_version = c.member_version + u.bump, member_count = u.members,
       last_event_at = $13
  FROM unnest($14::text[], $15::int8[], $16::int8[], $17::int4[]) AS u(conv, next_seq, bump, members)
 WHERE c.conv_id = u.conv";

const OPEN_PERIODS: &str = "
WITH opened AS (
  INSERT INTO membership_periods (conv_id, user_id, from_seq)
  SELECT $1, u, s FROM unnest($2::text[], $3::int8[]) AS j(u, s))
INSERT INTO members (conv_id, user_id, role, joined_seq)
SELECT $1, u, r, s FROM unnest($2::text[], $3::int8[], $4::text[]) AS j(u, s, r)";

const CLOSE_PERIODS: &str = "
WITH closed AS (
  UPDATE membership_periods p SET to_seq = l.s
    FROM unnest($2::text[], $3::int8[]) AS l(u, s)
   WHERE p.conv_id = $1 AND p.user_id = l.u AND p.to_seq IS NULL)
DELETE FROM members WHERE conv_id = $1 AND user_id = ANY($2)";

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
        ops: &[WriteOp],
    ) -> Result<(WrittenBatch, ConvCache), StoreError> {
        let job = BatchJob { conv: conv.clone(), cache, ops: ops.to_vec() };
        let mut done = self.write_batches(vec![job]).await?;
        done.pop().ok_or(StoreError::Invariant("a write transaction returned no batch"))
    }

    /// Commits the batches of several conversations (distinct `conv`s) in one
    /// transaction: one lock statement (rows in `conv_id` order), one lookup of
    /// every request key, one INSERT of every event. Each conversation's ops
    /// keep their order and their own outcomes; a database error fails all.
    pub async fn write_batches(&self, mut jobs: Vec<BatchJob>) -> Result<Vec<(WrittenBatch, ConvCache)>, StoreError> {
        let mut phase = Phase::start();
        let mut conn = self.pool.get().await?;
        phase.end("pool");
        let tx = conn.transaction().await?;
        phase.end("begin");
        let written = apply_batches(&tx, &mut jobs, &mut phase).await?;
        tx.commit().await?;
        phase.end("commit");
        Ok(written.into_iter().zip(jobs.into_iter().map(|j| j.cache)).collect())
    }
}

/// Applies one conversation's `ops` inside `tx`, which the caller commits.
pub(super) async fn apply_ops(
    tx: &Transaction<'_>,
    conv: &ConvId,
    cache: &mut ConvCache,
    ops: &[WriteOp],
) -> Result<WrittenBatch, StoreError> {
    let mut jobs = vec![BatchJob { conv: conv.clone(), cache: std::mem::take(cache), ops: ops.to_vec() }];
    let mut written = apply_batches(tx, &mut jobs, &mut Phase::start()).await?;
    *cache = std::mem::take(&mut jobs[0].cache);
    written.pop().ok_or(StoreError::Invariant("a write transaction returned no batch"))
}

/// Applies every job inside `tx`, which the caller commits. Checks run in the
/// order of PROTOCOL §5 `send`, all under the conversation row locks.
async fn apply_batches(
    tx: &Transaction<'_>,
    jobs: &mut [BatchJob],
    phase: &mut Phase,
) -> Result<Vec<WrittenBatch>, StoreError> {
    let rows = lock_conversations(tx, jobs).await?;
    phase.end("lock");
    load_members(tx, jobs, &rows).await?;
    let prior = lookup_request_keys(tx, jobs, &rows).await?;
    let known_users = lookup_joiners(tx, jobs).await?;
    phase.end("lookup");

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
                members_before: Arc::default(),
                delivery_mode: DeliveryMode::Push,
            };
            written.push(WrittenBatch { outcomes, appended });
            continue;
        };
        let cache = &mut job.cache;
        let members_before = cache.members.clone();
        let mut b = BatchBuilder::new(&job.conv, row);
        let mut outcomes = Vec::with_capacity(job.ops.len());
        for op in &job.ops {
            let outcome = match op {
                WriteOp::Send(s) => b.send(s, &prior, &cache.members),
                WriteOp::Join(j) => b.join(j, &known_users, Arc::make_mut(&mut cache.members)),
                WriteOp::Leave(l) => b.leave(l, Arc::make_mut(&mut cache.members)),
            };
            outcomes.push(outcome);
        }
        write_member_changes(tx, &job.conv, &b.member_changes).await?;
        cache.member_version = Some(row.member_version + b.version_bump());
        let appended = Appended {
            conv_id: job.conv.clone(),
            head: b.next_seq - 1,
            events: Vec::new(),
            members_before,
            delivery_mode: row.delivery_mode,
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

async fn lock_conversations(tx: &Transaction<'_>, jobs: &[BatchJob]) -> Result<HashMap<ConvId, ConvRow>, StoreError> {
    let ids: Vec<&str> = jobs.iter().map(|j| j.conv.as_str()).collect();
    let rows = tx.query_typed(LOCK_CONVERSATIONS, &[(&ids, Type::TEXT_ARRAY)]).await?;
    Ok(rows
        .iter()
        .filter_map(|r| {
            let conv = ConvId::parse(r.get(0)).ok()?;
            let row = ConvRow {
                dismissed: r.get(1),
                next_seq: r.get(2),
                member_version: r.get(3),
                member_count: r.get(4),
                max_member: r.get(5),
                mute_all: r.get(6),
                join_mode: r.get::<_, &str>(7).parse().unwrap_or(JoinMode::Invite),
                delivery_mode: r.get::<_, &str>(8).parse().unwrap_or(DeliveryMode::Push),
                purged: r.get::<_, i64>(9) > 1,
                now: r.get(10),
            };
            Some((conv, row))
        })
        .collect())
}

/// An earlier event or tombstone of a request key.
struct Prior {
    event: Option<SendAckWithHash>,
    tombstone: bool,
}

#[derive(Clone)]
struct SendAckWithHash {
    ack: SendAck,
    hash: Vec<u8>,
}

type RequestKey = (ConvId, UserId, ClientMsgId);

async fn lookup_request_keys(
    tx: &Transaction<'_>,
    jobs: &[BatchJob],
    rows: &HashMap<ConvId, ConvRow>,
) -> Result<HashMap<RequestKey, Prior>, StoreError> {
    let (mut convs, mut users, mut keys, mut purged) = (vec![], vec![], vec![], vec![]);
    for job in jobs {
        let Some(row) = rows.get(&job.conv) else { continue };
        for op in &job.ops {
            if let WriteOp::Send(s) = op {
                convs.push(job.conv.as_str());
                users.push(s.sender.as_str());
                keys.push(s.client_msg_id.as_str());
                purged.push(row.purged);
            }
        }
    }
    if keys.is_empty() {
        return Ok(HashMap::new());
    }
    let rows = tx
        .query_typed(
            LOOKUP_REQUEST_KEYS,
            &[
                (&convs, Type::TEXT_ARRAY),
                (&users, Type::TEXT_ARRAY),
                (&keys, Type::TEXT_ARRAY),
                (&purged, Type::BOOL_ARRAY),
            ],
        )
        .await?;
    let mut prior = HashMap::with_capacity(rows.len());
    for r in rows {
        let (Ok(conv), Ok(user), Ok(key)) =
            (ConvId::parse(r.get(0)), UserId::parse(r.get(1)), ClientMsgId::parse(r.get(2)))
        else {
            continue;
        };
        let event = r.get::<_, Option<i64>>(3).map(|seq| SendAckWithHash {
            ack: SendAck { seq, message_id: r.get(4), dup: true, created_at: r.get(6) },
            hash: r.get(5),
        });
        prior.insert((conv, user, key), Prior { event, tombstone: r.get(7) });
    }
    Ok(prior)
}

/// Reloads the member map of each job whose cache is stale or empty.
async fn load_members(
    tx: &Transaction<'_>,
    jobs: &mut [BatchJob],
    rows: &HashMap<ConvId, ConvRow>,
) -> Result<(), StoreError> {
    // The row's version where the job's cache does not have it.
    let stale = |job: &BatchJob| {
        rows.get(&job.conv).map(|row| row.member_version).filter(|&v| job.cache.member_version != Some(v))
    };
    let reload: Vec<&str> = jobs.iter().filter(|j| stale(j).is_some()).map(|j| j.conv.as_str()).collect();
    if reload.is_empty() {
        return Ok(());
    }
    let found = tx.query_typed(LOAD_MEMBERS, &[(&reload, Type::TEXT_ARRAY)]).await?;
    let mut loaded = member_rows(&found);
    for job in jobs.iter_mut() {
        if let Some(version) = stale(job) {
            job.cache.members = Arc::new(loaded.remove(&job.conv).unwrap_or_default());
            job.cache.member_version = Some(version);
        }
    }
    Ok(())
}

fn member_rows(rows: &[tokio_postgres::Row]) -> HashMap<ConvId, MemberMap> {
    let mut maps: HashMap<ConvId, MemberMap> = HashMap::new();
    for r in rows {
        let (Ok(conv), Ok(user)) = (ConvId::parse(r.get(0)), UserId::parse(r.get(1))) else { continue };
        let role = r.get::<_, &str>(2).parse().unwrap_or(Role::Member);
        maps.entry(conv).or_default().insert(user, MemberState { role, mute_until: r.get(3) });
    }
    maps
}

/// Which of the users that `ops` want to add exist (a join of an unknown user is `NOT_FOUND`).
async fn lookup_joiners(tx: &Transaction<'_>, jobs: &[BatchJob]) -> Result<HashSet<UserId>, StoreError> {
    let joiners: Vec<&str> = jobs
        .iter()
        .flat_map(|j| &j.ops)
        .filter_map(|op| match op {
            WriteOp::Join(j) => Some(j.user.as_str()),
            _ => None,
        })
        .collect();
    if joiners.is_empty() {
        return Ok(HashSet::new());
    }
    let rows = tx.query_typed(LOOKUP_USERS, &[(&joiners, Type::TEXT_ARRAY)]).await?;
    Ok(rows.iter().filter_map(|r| UserId::parse(r.get(0)).ok()).collect())
}

/// Rows and changes accumulated while the ops of a batch are checked in order.
struct BatchBuilder {
    next_seq: i64,
    member_count: i32,
    membership_changes: i64,
    /// Request keys appended earlier in this batch: a second op with the same key is its replay.
    appended_keys: HashMap<RequestKey, SendAckWithHash>,
    events: Vec<Event>,
    member_changes: Vec<MemberChange>,
    now: DateTime<Utc>,
    conv: ConvId,
    dismissed: bool,
    mute_all: bool,
    join_mode: JoinMode,
    max_member: i32,
}

enum MemberChange {
    Open { user: UserId, seq: i64, role: Role },
    Close { user: UserId, seq: i64 },
}

impl BatchBuilder {
    fn new(conv: &ConvId, row: &ConvRow) -> Self {
        Self {
            next_seq: row.next_seq,
            member_count: row.member_count,
            membership_changes: 0,
            appended_keys: HashMap::new(),
            events: Vec::new(),
            member_changes: Vec::new(),
            now: row.now,
            conv: conv.clone(),
            dismissed: row.dismissed,
            mute_all: row.mute_all,
            join_mode: row.join_mode,
            max_member: row.max_member,
        }
    }

    fn append(&mut self, kind: EventKind) -> i64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.events.push(Event { conv_id: self.conv.clone(), seq, created_at: self.now, kind });
        seq
    }

    /// PROTOCOL §5 `send`: replay → tombstone → dismissed → member → mute → permission → append.
    fn send(&mut self, op: &SendOp, prior: &HashMap<RequestKey, Prior>, members: &MemberMap) -> WriteOutcome {
        let key = (self.conv.clone(), op.sender.clone(), op.client_msg_id.clone());
        let earlier = self.appended_keys.get(&key).or_else(|| prior.get(&key).and_then(|p| p.event.as_ref()));
        if let Some(earlier) = earlier {
            return if earlier.hash == op.body.fingerprint() {
                Ok(Written::Sent(SendAck { dup: true, ..earlier.ack.clone() }))
            } else {
                Err(Rejection::IdempotencyMismatch)
            };
        }
        if prior.get(&key).is_some_and(|p| p.tombstone) {
            return Err(Rejection::IdempotencyKeyExpired);
        }
        if self.dismissed {
            return Err(Rejection::ConvDismissed);
        }
        let Some(member) = members.get(&op.sender) else {
            return Err(Rejection::NotMember);
        };
        if (self.mute_all && member.role == Role::Member) || member.mute_until.is_some_and(|t| t > self.now) {
            return Err(Rejection::Muted);
        }
        if !member.role.can(self.join_mode, Permission::SendMsg) {
            return Err(Rejection::Forbidden("your role may not send messages"));
        }
        if op.body.mention_all() && !member.role.can(self.join_mode, Permission::AtAll) {
            return Err(Rejection::Forbidden("your role may not mention everyone"));
        }
        let message_id = Uuid::now_v7();
        let seq = self.append(EventKind::Msg {
            message_id,
            sender: op.sender.clone(),
            sender_device: op.device.clone(),
            client_msg_id: op.client_msg_id.clone(),
            body: Some(op.body.text().to_owned()),
            recalled: false,
        });
        let ack = SendAck { seq, message_id, dup: false, created_at: self.now };
        self.appended_keys.insert(key, SendAckWithHash { ack: ack.clone(), hash: op.body.fingerprint().to_vec() });
        Ok(Written::Sent(ack))
    }

    fn join(&mut self, op: &JoinOp, known_users: &HashSet<UserId>, members: &mut MemberMap) -> WriteOutcome {
        if self.dismissed {
            return Err(Rejection::ConvDismissed);
        }
        if !known_users.contains(&op.user) {
            return Err(Rejection::NotFound("user"));
        }
        if members.contains_key(&op.user) {
            return Err(Rejection::AlreadyMember);
        }
        if self.member_count >= self.max_member {
            return Err(Rejection::GroupFull);
        }
        let seq = self.append(EventKind::Join { subject: op.user.clone(), actor: op.actor.clone() });
        members.insert(op.user.clone(), MemberState { role: op.role, mute_until: None });
        self.member_count += 1;
        self.membership_changes += 1;
        self.member_changes.push(MemberChange::Open { user: op.user.clone(), seq, role: op.role });
        Ok(Written::Joined { seq })
    }

    fn leave(&mut self, op: &LeaveOp, members: &mut MemberMap) -> WriteOutcome {
        if !members.contains_key(&op.user) {
            return Err(Rejection::NotMember);
        }
        let seq =
            self.append(EventKind::Leave { subject: op.user.clone(), actor: op.actor.clone(), reason: op.reason });
        members.remove(&op.user);
        self.member_count -= 1;
        self.membership_changes += 1;
        self.member_changes.push(MemberChange::Close { user: op.user.clone(), seq });
        Ok(Written::Left { seq })
    }

    fn version_bump(&self) -> i64 {
        i64::from(self.membership_changes > 0)
    }
}

/// Column arrays of the events of a transaction, for one multi-row INSERT.
#[derive(Default)]
struct EventColumns<'a> {
    convs: Vec<&'a str>,
    seqs: Vec<i64>,
    kinds: Vec<&'static str>,
    message_ids: Vec<Option<Uuid>>,
    senders: Vec<Option<&'a str>>,
    devices: Vec<Option<&'a str>>,
    keys: Vec<Option<&'a str>>,
    hashes: Vec<Option<&'a [u8]>>,
    bodies: Vec<Option<&'a str>>,
    subjects: Vec<Option<&'a str>>,
    actors: Vec<Option<&'a str>>,
    reasons: Vec<Option<&'static str>>,
}

impl<'a> EventColumns<'a> {
    fn push(&mut self, b: &'a BatchBuilder, e: &'a Event) {
        self.convs.push(b.conv.as_str());
        self.seqs.push(e.seq);
        self.kinds.push(e.kind.name());
        let (mut mid, mut snd, mut dev, mut key, mut hash, mut body, mut subj, mut act, mut reason) =
            (None, None, None, None, None, None, None, None, None);
        match &e.kind {
            EventKind::Msg { message_id, sender, sender_device, client_msg_id, body: text, .. } => {
                mid = Some(*message_id);
                snd = Some(sender.as_str());
                dev = Some(sender_device.as_str());
                key = Some(client_msg_id.as_str());
                hash = b
                    .appended_keys
                    .get(&(b.conv.clone(), sender.clone(), client_msg_id.clone()))
                    .map(|a| a.hash.as_slice());
                body = text.as_deref();
            }
            EventKind::Join { subject, actor } => {
                subj = Some(subject.as_str());
                act = Some(actor.as_str());
            }
            EventKind::Leave { subject, actor, reason: r } => {
                subj = Some(subject.as_str());
                act = Some(actor.as_str());
                reason = Some(r.as_str());
            }
            EventKind::Recall { .. } | EventKind::Group { .. } => {}
        }
        self.message_ids.push(mid);
        self.senders.push(snd);
        self.devices.push(dev);
        self.keys.push(key);
        self.hashes.push(hash);
        self.bodies.push(body);
        self.subjects.push(subj);
        self.actors.push(act);
        self.reasons.push(reason);
    }
}

/// Writes every event the transaction's batches accumulated and moves each
/// conversation row on (`next_seq`, `member_version`, `member_count`), at once.
async fn append_events(tx: &Transaction<'_>, builders: &[(usize, BatchBuilder)]) -> Result<(), StoreError> {
    let mut cols = EventColumns::default();
    let (mut convs, mut next_seqs, mut bumps, mut counts) = (vec![], vec![], vec![], vec![]);
    let mut now = None;
    for (_, b) in builders.iter().filter(|(_, b)| !b.events.is_empty()) {
        for e in &b.events {
            cols.push(b, e);
        }
        convs.push(b.conv.as_str());
        next_seqs.push(b.next_seq);
        bumps.push(b.version_bump());
        counts.push(b.member_count);
        now = Some(b.now);
    }
    let Some(now) = now else { return Ok(()) };
    tx.execute_typed(
        APPEND_EVENTS,
        &[
            (&cols.convs, Type::TEXT_ARRAY),
            (&cols.seqs, Type::INT8_ARRAY),
            (&cols.kinds, Type::TEXT_ARRAY),
            (&cols.message_ids, Type::UUID_ARRAY),
            (&cols.senders, Type::TEXT_ARRAY),
            (&cols.devices, Type::TEXT_ARRAY),
            (&cols.keys, Type::TEXT_ARRAY),
            (&cols.hashes, Type::BYTEA_ARRAY),
            (&cols.bodies, Type::TEXT_ARRAY),
            (&cols.subjects, Type::TEXT_ARRAY),
            (&cols.actors, Type::TEXT_ARRAY),
            (&cols.reasons, Type::TEXT_ARRAY),
            (&now, Type::TIMESTAMPTZ),
            (&convs, Type::TEXT_ARRAY),
            (&next_seqs, Type::INT8_ARRAY),
            (&bumps, Type::INT8_ARRAY),
            (&counts, Type::INT4_ARRAY),
        ],
    )
    .await?;
    Ok(())
}

async fn write_member_changes(tx: &Transaction<'_>, conv: &ConvId, changes: &[MemberChange]) -> Result<(), StoreError> {
    let mut rest = changes;
    while let Some(first) = rest.first() {
        let opening = matches!(first, MemberChange::Open { .. });
        let run = rest.iter().take_while(|c| matches!(c, MemberChange::Open { .. }) == opening).count();
        let (users, seqs, roles): (Vec<&str>, Vec<i64>, Vec<&str>) = rest[..run]
            .iter()
            .map(|c| match c {
                MemberChange::Open { user, seq, role } => (user.as_str(), *seq, role.as_str()),
                MemberChange::Close { user, seq } => (user.as_str(), *seq, ""),
            })
            .fold((vec![], vec![], vec![]), |(mut u, mut s, mut r), (a, b, c)| {
                u.push(a);
                s.push(b);
                r.push(c);
                (u, s, r)
            });
        let conv = conv.as_str();
        if opening {
            tx.execute_typed(
                OPEN_PERIODS,
                &[
                    (&conv, Type::TEXT),
                    (&users, Type::TEXT_ARRAY),
                    (&seqs, Type::INT8_ARRAY),
                    (&roles, Type::TEXT_ARRAY),
                ],
            )
            .await?;
        } else {
            tx.execute_typed(
                CLOSE_PERIODS,
                &[(&conv, Type::TEXT), (&users, Type::TEXT_ARRAY), (&seqs, Type::INT8_ARRAY)],
            )
            .await?;
        }
        rest = &rest[run..];
    }
    Ok(())
}
