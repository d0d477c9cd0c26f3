//! The reads of a write transaction, under the conversation row locks.

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};
use imcore_actors::{ClientMsgId, ConvId, UserId};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Client;

use super::ops::{GroupChange, GroupOp, SendAck, WriteOp};
use super::prepared::Conn;
use super::{BatchJob, ConvCache, Roster, ROSTER_CACHE_USERS};
use crate::domain::{ConvStatus, DeliveryMode, DeliverySetting, Emoji, JoinMode, Role, Standing};
use crate::store::error::decoded;
use crate::store::StoreError;

/// The locked conversation row.
#[derive(Debug, Clone)]
pub(super) struct ConvRow {
    /// A group, not a direct conversation.
    pub(super) group: bool,
    pub(super) status: ConvStatus,
    pub(super) next_seq: i64,
    pub(super) member_version: i64,
    pub(super) member_count: i32,
    pub(super) max_member: i32,
    pub(super) mute_all: bool,
    pub(super) join_mode: JoinMode,
    /// What the group delivers in now (`push` or `pull`).
    pub(super) delivery_mode: DeliveryMode,
    /// What its admins chose (ARCHITECTURE §9 "Large groups").
    pub(super) delivery_setting: DeliverySetting,
    /// Transaction time, in ms: the `created_at` of everything the batch appends.
    pub(super) now: DateTime<Utc>,
    pub(super) recall_window_ms: i64,
    /// `None`: unlimited.
    pub(super) retention_ms: Option<i64>,
    pub(super) name: Option<String>,
    pub(super) owner: Option<UserId>,
    pub(super) edit_window_ms: i64,
    /// Retention purged the start of the log (`min_seq > 1`): some request
    /// keys live on only as tombstones, which no index of `events` holds.
    pub(super) purged: bool,
}

#[cfg(test)]
impl ConvRow {
    /// The rules' unit tests' row: an active push group, invite-only, with
    /// the default windows, as locked at `next_seq` with `member_count` members.
    pub(super) fn test_group(next_seq: i64, member_count: i32, max_member: i32) -> Self {
        Self {
            group: true,
            status: ConvStatus::Active,
            next_seq,
            member_version: 1,
            member_count,
            max_member,
            mute_all: false,
            join_mode: JoinMode::Invite,
            delivery_mode: DeliveryMode::Push,
            delivery_setting: DeliverySetting::Auto,
            now: Utc::now(),
            recall_window_ms: 120_000,
            retention_ms: None,
            name: None,
            owner: None,
            edit_window_ms: 86_400_000,
            purged: false,
        }
    }
}

/// Whether a write transaction reads its request keys under the lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum KeyLookup {
    /// Read with the lock: a retry is answered from the read.
    WithLock,
    /// Not read: the INSERT meets a key already in the log on
    /// `events_request_key`, and the caller runs the transaction again
    /// reading them (`merged`).
    ByInsert,
}

/// How a write transaction takes its conversation rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LockMode {
    /// Wait for a row another transaction holds (bounded by `lock_timeout`):
    /// a transaction of one conversation.
    Wait,
    /// Leave out a row another transaction holds: the merged transaction of
    /// the commit stage, which then runs without that conversation.
    SkipLocked,
}

const LOOKUP_APPLICATIONS: &str = "
SELECT a.conv_id, a.user_id FROM group_applications a
  JOIN unnest($1::text[], $2::text[]) AS k(conv, u) ON a.conv_id = k.conv AND a.user_id = k.u";

const LOCK_INVITEES: &str = "SELECT 1 FROM users WHERE user_id = ANY($1::text[]) ORDER BY user_id FOR SHARE";

const LOOKUP_BLOCKERS: &str = "
SELECT b.blocker, b.blocked FROM blocks b
  JOIN unnest($1::text[], $2::text[]) AS k(invitee, inviter) ON b.blocker = k.invitee AND b.blocked = k.inviter";

const LOOKUP_USERS: &str = "SELECT user_id FROM users WHERE user_id = ANY($1::text[])";

async fn lock_conversations(
    tx: Conn<'_>,
    jobs: &[BatchJob],
    mode: LockMode,
) -> Result<HashMap<ConvId, ConvRow>, StoreError> {
    let ids: Vec<&str> = jobs.iter().map(|j| j.conv.as_str()).collect();
    let statement = match mode {
        LockMode::Wait => &tx.prepared.lock,
        LockMode::SkipLocked => &tx.prepared.lock_skip_locked,
    };
    let rows = tx.client.query(statement, &[&ids]).await?;
    rows.iter()
        .map(|r| {
            let conv = decoded(ConvId::parse(r.get(0)), "conversations.conv_id")?;
            let row = ConvRow {
                status: decoded(r.get::<_, &str>(1).parse(), "conversations.status")?,
                next_seq: r.get(2),
                member_version: r.get(3),
                member_count: r.get(4),
                max_member: r.get(5),
                mute_all: r.get(6),
                join_mode: decoded(r.get::<_, &str>(7).parse(), "conversations.join_mode")?,
                delivery_mode: decoded(r.get::<_, &str>(8).parse(), "conversations.delivery_mode")?,
                now: r.get(9),
                group: r.get(10),
                recall_window_ms: r.get(11),
                retention_ms: r.get(12),
                name: r.get(13),
                owner: decoded(r.get::<_, Option<&str>>(14).map(UserId::parse).transpose(), "conversations.owner")?,
                edit_window_ms: r.get(15),
                delivery_setting: decoded(r.get::<_, &str>(16).parse(), "conversations.delivery_setting")?,
                purged: r.get::<_, i64>(17) > 1,
            };
            Ok((conv, row))
        })
        .collect()
}

/// Which conversations of `jobs` exist, read without locking (a row another
/// transaction holds is still read): those that exist but that a `SKIP
/// LOCKED` lock statement did not return are held elsewhere.
async fn existing_conversations(tx: Conn<'_>, jobs: &[BatchJob]) -> Result<HashSet<ConvId>, StoreError> {
    let ids: Vec<&str> = jobs.iter().map(|j| j.conv.as_str()).collect();
    let rows = tx.client.query(&tx.prepared.existing, &[&ids]).await?;
    Ok(rows.iter().filter_map(|r| ConvId::parse(r.get(0)).ok()).collect())
}

/// What a write transaction read: the rows it locked, and what the checks
/// of its ops need.
pub(super) struct Reads {
    pub(super) rows: HashMap<ConvId, ConvRow>,
    /// Conversations that exist but whose rows another transaction holds
    /// (`SKIP LOCKED` only): none of their statements' results count.
    pub(super) held: HashSet<ConvId>,
    pub(super) prior: HashMap<RequestKey, Prior>,
    pub(super) standings: Standings,
    pub(super) known_users: HashSet<UserId>,
    /// (blocker, blocked) among the invitees and their inviters.
    pub(super) blockers: HashSet<(UserId, UserId)>,
    pub(super) applications: HashMap<ConvId, HashSet<UserId>>,
    pub(super) targets: HashMap<ConvId, Targets>,
    pub(super) reactions: HashMap<ConvId, ReactionState>,
}

/// `begin`, the lock statement and every read under it in one round trip:
/// the reads go out behind the lock statement without waiting for its
/// result. The server runs them in order, so each read starts once the locks
/// are held and, under READ COMMITTED, sees every transaction committed
/// before (ARCHITECTURE §3). A failure is the first one in that order (a
/// failed statement aborts the transaction, which fails those behind it).
pub(super) async fn lock_and_read<B>(
    tx: Conn<'_>,
    begin: B,
    jobs: &mut [BatchJob],
    mode: LockMode,
    keys: KeyLookup,
) -> Result<Reads, StoreError>
where
    B: std::future::Future<Output = Result<(), tokio_postgres::Error>>,
{
    let pairs = standings_to_read(jobs);
    let jobs = &*jobs;
    let existing = async {
        match mode {
            LockMode::Wait => Ok(HashSet::new()),
            LockMode::SkipLocked => existing_conversations(tx, jobs).await,
        }
    };
    let prior = async {
        match keys {
            KeyLookup::WithLock => lookup_request_keys(tx, jobs).await,
            KeyLookup::ByInsert => Ok(HashMap::new()),
        }
    };
    let (begun, rows, existing, prior, standings, known_users, blockers, applications, targets, reactions) = futures_util::join!(
        begin,
        lock_conversations(tx, jobs, mode),
        existing,
        prior,
        read_standings(tx, pairs),
        lookup_joiners(tx.client, jobs),
        lookup_blockers(tx.client, jobs),
        lookup_applications(tx.client, jobs),
        lookup_targets(tx.client, jobs),
        lookup_reactions(tx.client, jobs),
    );
    begun?;
    let rows = rows?;
    let held = existing?.into_iter().filter(|c| !rows.contains_key(c)).collect();
    Ok(Reads {
        rows,
        held,
        prior: prior?,
        standings: standings?,
        known_users: known_users?,
        blockers: blockers?,
        applications: applications?,
        targets: targets?,
        reactions: reactions?,
    })
}

/// An earlier event or tombstone of a request key.
pub(super) struct Prior {
    pub(super) event: Option<SendAckWithHash>,
    /// The request hash of a purged send with this key (P9).
    pub(super) tombstone: Option<Vec<u8>>,
}

#[derive(Clone)]
pub(super) struct SendAckWithHash {
    pub(super) ack: SendAck,
    pub(super) hash: Vec<u8>,
}

pub(super) type RequestKey = (ConvId, UserId, ClientMsgId);

pub(super) async fn lookup_request_keys(
    tx: Conn<'_>,
    jobs: &[BatchJob],
) -> Result<HashMap<RequestKey, Prior>, StoreError> {
    let (mut convs, mut users, mut keys) = (vec![], vec![], vec![]);
    for job in jobs {
        for op in &job.ops {
            let (user, key) = match op {
                WriteOp::Send(s) => (&s.sender, &s.client_msg_id),
                WriteOp::Edit(e) => (&e.sender, &e.client_msg_id),
                _ => continue,
            };
            convs.push(job.conv.as_str());
            users.push(user.as_str());
            keys.push(key.as_str());
        }
    }
    if keys.is_empty() {
        return Ok(HashMap::new());
    }
    let rows = tx.client.query(&tx.prepared.request_keys, &[&convs, &users, &keys]).await?;
    let mut prior = HashMap::with_capacity(rows.len());
    for r in rows {
        let (Ok(conv), Ok(user), Ok(key)) =
            (ConvId::parse(r.get(0)), UserId::parse(r.get(1)), ClientMsgId::parse(r.get(2)))
        else {
            continue;
        };
        let event = r.get::<_, Option<i64>>(3).map(|seq| SendAckWithHash {
            // Only a `msg` has a message_id; an `edit`'s key answers with its
            // seq alone, and its fingerprint never matches a send's.
            ack: SendAck {
                seq,
                message_id: r.get::<_, Option<uuid::Uuid>>(4).unwrap_or_default(),
                dup: true,
                created_at: r.get(6),
            },
            hash: r.get(5),
        });
        prior.insert((conv, user, key), Prior { event, tombstone: r.get(7) });
    }
    Ok(prior)
}

/// The standings a transaction read: of the (conversation, user) pairs it
/// asked for, those that are members.
#[derive(Default)]
pub(super) struct Standings {
    asked: HashSet<(ConvId, UserId)>,
    found: HashMap<(ConvId, UserId), Standing>,
}

/// The pairs to read for `jobs`: the users their ops name that their caches
/// do not know, taking each cache as current (the row's `member_version` is
/// not known yet: the read goes out behind the lock statement). A roster
/// past [`ROSTER_CACHE_USERS`] starts again from the users of the batch.
fn standings_to_read(jobs: &mut [BatchJob]) -> Vec<(ConvId, UserId)> {
    let mut pairs = vec![];
    for job in jobs.iter_mut() {
        let named: HashSet<&UserId> = job.ops.iter().flat_map(WriteOp::users).collect();
        let roster = &mut job.cache.roster;
        if roster.len() + named.iter().filter(|u| !roster.knows(u)).count() > ROSTER_CACHE_USERS {
            *roster = Roster::default();
        }
        pairs.extend(named.into_iter().filter(|u| !roster.knows(u)).map(|u| (job.conv.clone(), u.clone())));
    }
    pairs
}

/// The standings of `pairs`, by primary key.
pub(super) async fn read_standings(tx: Conn<'_>, pairs: Vec<(ConvId, UserId)>) -> Result<Standings, StoreError> {
    if pairs.is_empty() {
        return Ok(Standings::default());
    }
    let convs: Vec<&str> = pairs.iter().map(|(c, _)| c.as_str()).collect();
    let users: Vec<&str> = pairs.iter().map(|(_, u)| u.as_str()).collect();
    let rows = tx.client.query(&tx.prepared.standings, &[&convs, &users]).await?;
    let mut found = HashMap::with_capacity(rows.len());
    for r in &rows {
        let (Ok(conv), Ok(user)) = (ConvId::parse(r.get(0)), UserId::parse(r.get(1))) else { continue };
        let standing = Standing {
            role: r.get::<_, &str>(2).parse().unwrap_or(Role::Member),
            mute_until: r.get(3),
            role_until: r.get(4),
            extra_perms: r.get::<_, i32>(5).max(0) as u32,
            blocked: r.get(6),
        };
        found.insert((conv, user), standing);
    }
    Ok(Standings { asked: pairs.into_iter().collect(), found })
}

/// Brings each job's roster up to the users its ops name, from `read`: a
/// cache whose `member_version` is not the locked row's starts empty. The
/// pairs `read` did not ask for (a cache that turned out stale) are
/// returned, to be read now, under the lock.
pub(super) fn settle_standings(
    jobs: &mut [BatchJob],
    rows: &HashMap<ConvId, ConvRow>,
    read: &Standings,
) -> Vec<(ConvId, UserId)> {
    let mut unread = vec![];
    for job in jobs.iter_mut() {
        let Some(row) = rows.get(&job.conv) else { continue };
        let cache = &mut job.cache;
        if cache.member_version != Some(row.member_version) {
            *cache = ConvCache { member_version: Some(row.member_version), ..ConvCache::default() };
        }
        let named: HashSet<&UserId> = job.ops.iter().flat_map(WriteOp::users).collect();
        for user in named {
            if cache.roster.knows(user) {
                continue;
            }
            let pair = (job.conv.clone(), user.clone());
            if !read.asked.contains(&pair) {
                unread.push(pair);
                continue;
            }
            match read.found.get(&pair) {
                Some(standing) => cache.roster.insert(pair.1, standing.clone()),
                None => cache.roster.remove(&pair.1),
            }
        }
    }
    unread
}

/// Which of the users that `ops` want to add exist (a join or invite of an
/// unknown user is `NOT_FOUND`).
async fn lookup_joiners(tx: &Client, jobs: &[BatchJob]) -> Result<HashSet<UserId>, StoreError> {
    let joiners: Vec<&str> = jobs
        .iter()
        .flat_map(|j| &j.ops)
        .flat_map(|op| match op {
            WriteOp::Join(j) => std::slice::from_ref(&j.user),
            WriteOp::Group(GroupOp { change: GroupChange::Invite(users), .. }) => users.as_slice(),
            _ => &[],
        })
        .map(UserId::as_str)
        .collect();
    if joiners.is_empty() {
        return Ok(HashSet::new());
    }
    let rows = tx.query_typed(LOOKUP_USERS, &[(&joiners, Type::TEXT_ARRAY)]).await?;
    Ok(rows.iter().filter_map(|r| UserId::parse(r.get(0)).ok()).collect())
}

/// Which invitees blocked their inviter: their `users` rows share-locked
/// first (a block locks its blocker's row, `store::blocks`), then `blocks`
/// read by a second statement, whose snapshot starts after those locks.
async fn lookup_blockers(tx: &Client, jobs: &[BatchJob]) -> Result<HashSet<(UserId, UserId)>, StoreError> {
    let (mut invitees, mut inviters) = (vec![], vec![]);
    for op in jobs.iter().flat_map(|j| &j.ops) {
        if let WriteOp::Group(GroupOp { actor, change: GroupChange::Invite(users) }) = op {
            invitees.extend(users.iter().map(UserId::as_str));
            inviters.extend(users.iter().map(|_| actor.as_str()));
        }
    }
    if invitees.is_empty() {
        return Ok(HashSet::new());
    }
    let lock_params: [(&(dyn ToSql + Sync), Type); 1] = [(&invitees, Type::TEXT_ARRAY)];
    let read_params: [(&(dyn ToSql + Sync), Type); 2] = [(&invitees, Type::TEXT_ARRAY), (&inviters, Type::TEXT_ARRAY)];
    let locked = tx.execute_typed(LOCK_INVITEES, &lock_params);
    let read = tx.query_typed(LOOKUP_BLOCKERS, &read_params);
    let (locked, rows) = futures_util::join!(locked, read);
    locked?;
    Ok(rows?.iter().filter_map(|r| Some((UserId::parse(r.get(0)).ok()?, UserId::parse(r.get(1)).ok()?))).collect())
}

/// The pending applications, per conversation, of the users whose
/// application an op of `jobs` may file, decide or supersede.
async fn lookup_applications(tx: &Client, jobs: &[BatchJob]) -> Result<HashMap<ConvId, HashSet<UserId>>, StoreError> {
    let (mut convs, mut users) = (vec![], vec![]);
    for job in jobs {
        for op in &job.ops {
            let WriteOp::Group(GroupOp { actor, change }) = op else { continue };
            let named = match change {
                GroupChange::Join => std::slice::from_ref(actor),
                GroupChange::Approve(u) | GroupChange::Reject(u) => std::slice::from_ref(u),
                GroupChange::Invite(us) => us.as_slice(),
                _ => &[],
            };
            for u in named {
                convs.push(job.conv.as_str());
                users.push(u.as_str());
            }
        }
    }
    if users.is_empty() {
        return Ok(HashMap::new());
    }
    let rows = tx.query_typed(LOOKUP_APPLICATIONS, &[(&convs, Type::TEXT_ARRAY), (&users, Type::TEXT_ARRAY)]).await?;
    let mut found: HashMap<ConvId, HashSet<UserId>> = HashMap::new();
    for r in rows {
        if let (Ok(conv), Ok(user)) = (ConvId::parse(r.get(0)), UserId::parse(r.get(1))) {
            found.entry(conv).or_default().insert(user);
        }
    }
    Ok(found)
}

/// For each op with a target (`recall`, `edit`, `react`, a `send`'s
/// `reply_to`): the target if it is a `msg` still in the log (from `min_seq`:
/// a purge's sweep deletes below it without the row lock), whether it lies
/// inside one of the caller's periods, and the recall that already erased
/// it, if any.
const LOOKUP_TARGETS: &str = "
SELECT k.conv, k.u, k.s, e.sender_user, e.created_at,
       EXISTS (SELECT 1 FROM membership_periods p
                WHERE p.conv_id = k.conv AND p.user_id = k.u AND p.from_seq <= k.s
                  AND (p.to_seq IS NULL OR p.to_seq >= k.s)),
       (SELECT min(r.seq) FROM events r WHERE r.conv_id = k.conv AND r.kind = 'recall' AND r.target_seq = k.s)
  FROM unnest($1::text[], $2::text[], $3::int8[]) AS k(conv, u, s)
  JOIN conversations c ON c.conv_id = k.conv AND k.s >= c.min_seq
  JOIN events e ON e.conv_id = k.conv AND e.seq = k.s AND e.kind = 'msg'";

/// A target as the transaction found it, for one caller.
#[derive(Debug, Clone)]
pub(super) struct Target {
    pub(super) sender: UserId,
    pub(super) created_at: DateTime<Utc>,
    /// The seq of the recall that already erased it.
    pub(super) recalled_by: Option<i64>,
    /// Inside one of the caller's membership periods.
    pub(super) visible: bool,
}

/// `(caller, target seq)` → the target, when it is a `msg` of the log.
pub(super) type Targets = HashMap<(UserId, i64), Target>;

/// The caller and the target seq of `op`, if it names a message.
fn target_of(op: &WriteOp) -> Option<(&UserId, i64)> {
    match op {
        WriteOp::Recall(r) => Some((&r.actor, r.target_seq)),
        WriteOp::Edit(e) => Some((&e.sender, e.target_seq)),
        WriteOp::React(r) => Some((&r.actor, r.target_seq)),
        WriteOp::Send(s) => s.reply_to.map(|seq| (&s.sender, seq)),
        _ => None,
    }
}

/// The targets of the ops of `jobs`, per conversation.
async fn lookup_targets(tx: &Client, jobs: &[BatchJob]) -> Result<HashMap<ConvId, Targets>, StoreError> {
    let (mut convs, mut users, mut seqs) = (vec![], vec![], vec![]);
    for job in jobs {
        for (user, seq) in job.ops.iter().filter_map(target_of) {
            convs.push(job.conv.as_str());
            users.push(user.as_str());
            seqs.push(seq);
        }
    }
    if seqs.is_empty() {
        return Ok(HashMap::new());
    }
    let rows = tx
        .query_typed(
            LOOKUP_TARGETS,
            &[(&convs, Type::TEXT_ARRAY), (&users, Type::TEXT_ARRAY), (&seqs, Type::INT8_ARRAY)],
        )
        .await?;
    let mut found: HashMap<ConvId, Targets> = HashMap::new();
    for r in rows {
        let (Ok(conv), Ok(user), Ok(sender)) =
            (ConvId::parse(r.get(0)), UserId::parse(r.get(1)), UserId::parse(r.get(3)))
        else {
            continue;
        };
        let target = Target { sender, created_at: r.get(4), visible: r.get(5), recalled_by: r.get(6) };
        found.entry(conv).or_default().insert((user, r.get(2)), target);
    }
    Ok(found)
}

/// The reactions that the `react`s of a conversation's batch read: per
/// target, how many users have each emoji on it now; per (user, target), the
/// user's own.
#[derive(Debug, Default)]
pub(super) struct ReactionState {
    pub(super) counts: HashMap<i64, HashMap<Emoji, i64>>,
    pub(super) own: HashSet<(UserId, i64, Emoji)>,
}

/// The emoji on each target (count above 0), by `reaction_counts`' key.
const LOOKUP_REACTION_COUNTS: &str = "
SELECT DISTINCT k.conv, k.s, r.emoji, r.count FROM unnest($1::text[], $2::int8[]) AS k(conv, s)
  JOIN reaction_counts r ON r.conv_id = k.conv AND r.target_seq = k.s AND r.count > 0";

/// Each caller's own reactions on its target, by `reactions`' key.
const LOOKUP_OWN_REACTIONS: &str = "
SELECT k.conv, k.s, k.u, r.emoji FROM unnest($1::text[], $2::int8[], $3::text[]) AS k(conv, s, u)
  JOIN reactions r ON r.conv_id = k.conv AND r.target_seq = k.s AND r.user_id = k.u";

async fn lookup_reactions(tx: &Client, jobs: &[BatchJob]) -> Result<HashMap<ConvId, ReactionState>, StoreError> {
    let (mut convs, mut seqs, mut users) = (vec![], vec![], vec![]);
    for job in jobs {
        for op in &job.ops {
            if let WriteOp::React(r) = op {
                convs.push(job.conv.as_str());
                seqs.push(r.target_seq);
                users.push(r.actor.as_str());
            }
        }
    }
    if seqs.is_empty() {
        return Ok(HashMap::new());
    }
    let by_target = [(&convs as &(dyn ToSql + Sync), Type::TEXT_ARRAY), (&seqs, Type::INT8_ARRAY)];
    let by_user = [by_target[0].clone(), by_target[1].clone(), (&users, Type::TEXT_ARRAY)];
    let (counts, own) = futures_util::join!(
        tx.query_typed(LOOKUP_REACTION_COUNTS, &by_target),
        tx.query_typed(LOOKUP_OWN_REACTIONS, &by_user),
    );
    let mut found: HashMap<ConvId, ReactionState> = HashMap::new();
    // Several ops on one target read its rows once each: a set takes them once.
    for r in counts? {
        let (Ok(conv), Ok(emoji)) = (ConvId::parse(r.get(0)), Emoji::parse(r.get(2))) else { continue };
        let count: i32 = r.get(3);
        found.entry(conv).or_default().counts.entry(r.get(1)).or_default().insert(emoji, count.into());
    }
    for r in own? {
        let (Ok(conv), Ok(user), Ok(emoji)) =
            (ConvId::parse(r.get(0)), UserId::parse(r.get(2)), Emoji::parse(r.get(3)))
        else {
            continue;
        };
        found.entry(conv).or_default().own.insert((user, r.get(1), emoji));
    }
    Ok(found)
}
