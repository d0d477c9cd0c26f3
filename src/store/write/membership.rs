//! The rules of joins and leaves, and their membership rows.

use std::collections::HashSet;

use imcore_actors::{ConvId, UserId};
use tokio_postgres::types::Type;
use tokio_postgres::Transaction;

use super::batch::{BatchBuilder, MemberChange};
use super::{JoinOp, LeaveOp, MemberMap, MemberState, WriteOutcome, Written};
use crate::domain::{EventKind, Rejection};
use crate::store::StoreError;

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

impl BatchBuilder {
    pub(super) fn join(&mut self, op: &JoinOp, known_users: &HashSet<UserId>, members: &mut MemberMap) -> WriteOutcome {
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

    pub(super) fn leave(&mut self, op: &LeaveOp, members: &mut MemberMap) -> WriteOutcome {
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
}

pub(super) async fn write_member_changes(
    tx: &Transaction<'_>,
    conv: &ConvId,
    changes: &[MemberChange],
) -> Result<(), StoreError> {
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
