//! Batches in one round trip, when their conversations' caches already know
//! the outcome: BEGIN, one guarded statement and COMMIT, sent together (a
//! batch in a transaction of its own, or a commit-stage round of one batch).
//! Rounds of several take the merged full path: one guarded statement for a
//! whole round measured slower (benches/README.md, latency).
//!
//! Invariant: every check holds under the row lock. The statement appends only
//! if the locked row, the request keys, the assumed standings and the time
//! bounds are what the checks in Rust read; otherwise it writes nothing and
//! the batch takes the full path on the same connection. The guard, and why
//! it is exact under the statement's snapshot: ARCHITECTURE §3.

use std::borrow::Cow;
use std::collections::HashMap;

use chrono::{DateTime, DurationRound, TimeDelta, Utc};
use imcore_actors::UserId;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;

use super::append::EventColumns;
use super::batch::BatchBuilder;
use super::lookup::{ConvRow, LockMode};
use super::ops::{WriteOp, WriteOutcome, Written};
use super::prepared::Conn;
use super::txn::BEGIN_PLANNED_ONCE;
use super::{Appended, BatchJob, Unfinished, WrittenBatch, ROSTER_CACHE_USERS};
use crate::domain::{Role, Standing};

/// A batch checked against its cache: what it appends if the guard holds.
pub(super) struct Plan {
    builder: BatchBuilder,
    outcomes: Vec<WriteOutcome>,
    member_version: i64,
    /// Senders the roster did not know, taken to be plain members (no mute,
    /// no extra bits), as the guard then checks: most senders are.
    pub(super) assumed: Vec<UserId>,
    /// The transaction's time must be at or after this…
    not_before: Option<DateTime<Utc>>,
    /// …and before this, for the checks to answer as they did.
    not_after: Option<DateTime<Utc>>,
}

impl Plan {
    /// The batch as committed at the transaction's time `now` (the checks
    /// ran at the local time; the events carry the transaction's).
    fn written(self, now: DateTime<Utc>) -> WrittenBatch {
        let Plan { mut builder, mut outcomes, .. } = self;
        for e in &mut builder.events {
            e.created_at = now;
        }
        for outcome in &mut outcomes {
            if let Ok(Written::Sent(ack)) = outcome {
                ack.created_at = now;
            }
        }
        let appended = Appended {
            conv_id: builder.conv.clone(),
            head: builder.next_seq - 1,
            events: builder.events,
            delivery_mode: builder.delivery_mode,
            members_summary: false,
        };
        WrittenBatch { outcomes, appended }
    }
}

/// Checks `job` against its cache alone: a plan when the cache remembers the
/// row and every op is a plain send that appends (no `reply_to`, `mentions`
/// or `mention_all`: their columns are the full append's; a sender the roster
/// does not know taken to be a plain member).
pub(super) fn plan(job: &BatchJob) -> Option<Plan> {
    let cache = &job.cache;
    let row = cache.row.as_ref().filter(|r| cache.member_version == Some(r.member_version))?;
    let now = Utc::now().duration_trunc(TimeDelta::milliseconds(1)).ok()?;
    let mut builder = BatchBuilder::new(&job.conv, &ConvRow { now, ..row.clone() });
    let (mut not_before, mut not_after) = (None::<DateTime<Utc>>, None::<DateTime<Utc>>);
    let mut outcomes = Vec::with_capacity(job.ops.len());
    let (no_prior, no_targets) = (HashMap::new(), HashMap::new());
    let mut roster = Cow::Borrowed(&cache.roster);
    let mut assumed = vec![];
    for op in &job.ops {
        let WriteOp::Send(send) = op else { return None };
        if send.reply_to.is_some() || !send.mentions.is_empty() || send.body.mention_all() {
            return None;
        }
        if !roster.knows(&send.sender) {
            if roster.len() >= ROSTER_CACHE_USERS {
                return None;
            }
            roster.to_mut().insert(send.sender.clone(), Standing::new(Role::Member));
            assumed.push(send.sender.clone());
        }
        let standing = roster.get(&send.sender)?;
        let outcome = builder.send(send, &no_prior, &roster, &no_targets);
        if !matches!(outcome, Ok(Written::Sent(_))) {
            return None;
        }
        for bound in [standing.mute_until, standing.role_until].into_iter().flatten() {
            if bound <= now {
                not_before = not_before.max(Some(bound));
            } else {
                not_after = Some(not_after.map_or(bound, |t| t.min(bound)));
            }
        }
        outcomes.push(outcome);
    }
    Some(Plan { builder, outcomes, member_version: row.member_version, assumed, not_before, not_after })
}

/// Runs `plan` in one round trip: `None` when its row was not as remembered
/// (or, with `SkipLocked`, held elsewhere) and nothing was written.
pub(super) async fn commit_plan(
    conn: Conn<'_>,
    plan: Plan,
    mode: LockMode,
    activity_ms: i64,
) -> Result<Option<WrittenBatch>, Unfinished> {
    let statement = match mode {
        LockMode::Wait => &conn.prepared.append_if_unchanged,
        LockMode::SkipLocked => &conn.prepared.append_if_unchanged_skip_locked,
    };
    let appended = async {
        let mut cols = EventColumns::default();
        cols.push_all(&plan.builder);
        let b = &plan.builder;
        let assumed: Vec<&str> = plan.assumed.iter().map(UserId::as_str).collect();
        let expected: [&(dyn ToSql + Sync); 11] = [
            &b.conv.as_str(),
            &b.first_seq,
            &b.next_seq,
            &plan.member_version,
            &b.mute_all,
            &b.join_mode.as_str(),
            &b.delivery_mode.as_str(),
            &plan.not_before,
            &plan.not_after,
            &assumed,
            &activity_ms,
        ];
        conn.client.query_opt(statement, &[&cols.params()[..], &expected].concat()).await
    };
    let (begun, appended, committed) = futures_util::join!(
        conn.client.batch_execute(BEGIN_PLANNED_ONCE),
        appended,
        conn.client.batch_execute("COMMIT")
    );
    let now: DateTime<Utc> = match (begun, appended) {
        (Err(e), _) => return Err(Unfinished::Unknown(e.into())),
        // A retry of an event already in the log: nothing was written, and
        // the full path answers it (`dup`) from the lookup under the lock.
        (Ok(()), Err(e)) if key_taken(&e) => return Ok(None),
        (Ok(()), Err(e)) if e.as_db_error().is_some() => return Err(Unfinished::RolledBack(e.into())),
        (Ok(()), Err(e)) => return Err(Unfinished::Unknown(e.into())),
        (Ok(()), Ok(None)) => return Ok(None),
        (Ok(()), Ok(Some(row))) => row.get(0),
    };
    committed.map_err(|e| Unfinished::Unknown(e.into()))?;
    Ok(Some(plan.written(now)))
}

/// The INSERT met an event holding one of its request keys.
pub(super) fn key_taken(e: &tokio_postgres::Error) -> bool {
    e.as_db_error()
        .is_some_and(|d| *d.code() == SqlState::UNIQUE_VIOLATION && d.constraint() == Some("events_request_key"))
}

/// Which batches the cache decides, and the time window it decides them for.
#[cfg(test)]
mod tests {
    use chrono::{Duration, Utc};
    use imcore_actors::{ClientMsgId, ConvId, DeviceId, UserId};
    use serde_json::json;

    use super::super::lookup::ConvRow;
    use super::super::ops::{LeaveOp, SendOp, WriteOp};
    use super::super::{BatchJob, ConvCache, Roster};
    use super::plan;
    use crate::domain::{Body, LeaveReason, Role, Standing};

    fn uid(s: &str) -> UserId {
        UserId::parse(s).expect("id")
    }

    fn send(user: &str, key: &str) -> WriteOp {
        WriteOp::Send(SendOp::plain(
            uid(user),
            DeviceId::parse("d").expect("id"),
            ClientMsgId::parse(key).expect("id"),
            Body::parse(&json!({"type": "text", "text": "hi"}), 1024).expect("body"),
        ))
    }

    /// A warm cache: the row as of seq 9, and the standings of `roster`.
    fn job(mute_all: bool, roster: &[(&str, Standing)], ops: Vec<WriteOp>) -> BatchJob {
        let row = ConvRow { mute_all, member_version: 3, ..ConvRow::test_group(10, 3, 100) };
        let mut known = Roster::default();
        for (u, standing) in roster {
            known.insert(uid(u), standing.clone());
        }
        let cache = ConvCache { member_version: Some(3), roster: known, row: Some(row) };
        BatchJob { conv: ConvId::parse("g").expect("id"), cache, ops }
    }

    #[test]
    fn sends_of_known_members_are_planned_at_the_next_seqs_with_their_replay_inside_the_batch() {
        let member = Standing::new(Role::Member);
        let j = job(
            false,
            &[("m", member.clone()), ("n", member)],
            vec![send("m", "k1"), send("n", "k1"), send("m", "k1")],
        );
        let p = plan(&j).expect("a plan");
        let seqs: Vec<i64> = p.builder.events.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, [10, 11], "the repeated key answers from the batch, appending nothing");
        assert_eq!((p.builder.next_seq, p.outcomes.len()), (12, 3));
        assert_eq!((p.member_version, p.not_before, p.not_after), (3, None, None));
    }

    #[test]
    fn a_cold_or_stale_cache_a_non_member_a_refusal_or_another_op_takes_the_full_path() {
        let member = Standing::new(Role::Member);
        let mut cold = job(false, &[("m", member.clone())], vec![send("m", "k")]);
        cold.cache.row = None;
        assert!(plan(&cold).is_none(), "no remembered row");
        let mut stale = job(false, &[("m", member.clone())], vec![send("m", "k")]);
        stale.cache.member_version = Some(4);
        assert!(plan(&stale).is_none(), "the roster is of another member_version than the row");
        let mut left = job(false, &[("m", member.clone())], vec![send("x", "k")]);
        left.cache.roster.remove(&uid("x"));
        assert!(plan(&left).is_none(), "a sender known not to be a member");
        assert!(plan(&job(true, &[("m", member.clone())], vec![send("m", "k")])).is_none(), "muted group");
        let leave = WriteOp::Leave(LeaveOp { user: uid("m"), actor: uid("m"), reason: LeaveReason::Left });
        assert!(plan(&job(false, &[("m", member)], vec![send("m", "k"), leave])).is_none(), "not only sends");
    }

    #[test]
    fn a_sender_the_roster_does_not_know_is_taken_for_a_plain_member_for_the_guard_to_check() {
        let j =
            job(false, &[("m", Standing::new(Role::Member))], vec![send("x", "k1"), send("m", "k2"), send("x", "k3")]);
        let p = plan(&j).expect("a plan");
        assert_eq!((p.assumed.clone(), p.builder.events.len()), (vec![uid("x")], 3));
        let everyone = WriteOp::Send(SendOp {
            body: Body::parse(&json!({"type": "text", "text": "hi", "mention_all": true}), 1024).expect("body"),
            ..match send("x", "k") {
                WriteOp::Send(s) => s,
                _ => unreachable!(),
            }
        });
        assert!(plan(&job(false, &[], vec![everyone])).is_none(), "a plain member may not mention everyone");
    }

    #[test]
    fn every_time_a_check_compared_with_bounds_the_transaction_time_on_its_side() {
        let now = Utc::now();
        let (ended, ends) = (now - Duration::minutes(5), now + Duration::minutes(5));
        let was_muted = Standing { mute_until: Some(ended), ..Standing::new(Role::Member) };
        let temporary = Standing { role_until: Some(ends), ..Standing::new(Role::Admin) };
        let ops = vec![send("m", "k1"), send("a", "k2")];
        let p = plan(&job(true, &[("m", Standing::new(Role::Owner)), ("a", temporary.clone())], ops)).expect("plan");
        assert_eq!((p.not_before, p.not_after), (None, Some(ends)), "the admin may send under mute_all until then");
        let p = plan(&job(false, &[("m", was_muted), ("a", temporary)], vec![send("m", "k1"), send("a", "k2")]))
            .expect("plan");
        assert_eq!((p.not_before, p.not_after), (Some(ended), Some(ends)));
        let muted = Standing { mute_until: Some(ends), ..Standing::new(Role::Admin) };
        assert!(plan(&job(false, &[("m", muted)], vec![send("m", "k")])).is_none(), "a refused send is not planned");
    }
}
