//! Read cursors (PROTOCOL §5 `read`, P8): how far a user has read a
//! conversation. A cursor never moves back and never passes the head. The
//! members' cursors are paged like the roster (PROTOCOL v1.2 `reads`).
//!
//! One statement, no transaction: the upsert reads the conversation's head and
//! the caller's open period in the same snapshot, and `ON CONFLICT DO UPDATE`
//! takes the cursor row's lock, so concurrent marks serialise on that row and
//! `greatest` keeps the highest — whatever order they commit in.

use imcore_actors::{ConvId, UserId};
use tokio_postgres::types::Type;

use super::error::decoded;
use super::{Store, StoreError};
use crate::domain::Rejection;

/// $1 conv, $2 user, $3 seq (≥ 0): the cursor moved up to `$3`, and when it
/// moved in a direct conversation or a group of at most `$4` members, the
/// other current members (to push it to). No row back = not a current member
/// (or no such conversation). A cursor is only ever written capped at the
/// head of the moment, and heads only grow, so `greatest` of the stored value
/// and the capped request is itself ≤ head.
const MARK_READ_AND_TELL: &str = "
WITH cur AS (INSERT INTO read_cursors (user_id, conv_id, read_seq)
  SELECT $2, c.conv_id, least($3, c.next_seq - 1)
    FROM conversations c
   WHERE c.conv_id = $1
     AND EXISTS (SELECT 1 FROM membership_periods p
                  WHERE p.conv_id = c.conv_id AND p.user_id = $2 AND p.to_seq IS NULL)
      ON CONFLICT (user_id, conv_id)
      DO UPDATE SET read_seq = greatest(read_cursors.read_seq, excluded.read_seq),
                    changed_at = CASE WHEN excluded.read_seq > read_cursors.read_seq THEN now()
                                      ELSE read_cursors.changed_at END
  RETURNING read_seq, changed_at = now() AS moved)
SELECT cur.read_seq,
       CASE WHEN cur.moved AND (SELECT kind = 'direct' OR member_count <= $4 FROM conversations WHERE conv_id = $1)
            THEN ARRAY(SELECT user_id FROM members WHERE conv_id = $1 AND user_id <> $2) END
  FROM cur";

/// A page of the members' cursors, in join order: `$1` conversation, `$2`
/// after this `joined_seq`, `$3` rows.
const READS_PAGE: &str = "
SELECT m.user_id, m.joined_seq, coalesce(r.read_seq, 0)
  FROM members m LEFT JOIN read_cursors r ON r.user_id = m.user_id AND r.conv_id = m.conv_id
 WHERE m.conv_id = $1 AND m.joined_seq > $2
 ORDER BY m.joined_seq
 LIMIT $3";

/// The caller is a current member: its roster row (a dismissed group's stays).
const IS_MEMBER: &str = "SELECT 1 FROM members WHERE conv_id = $1 AND user_id = $2";

/// What a `read` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MarkedRead {
    pub read_seq: i64,
    /// The other members to tell (the cursor moved, and the conversation is
    /// direct or small enough); empty otherwise.
    pub tell: Vec<UserId>,
}

/// One member's cursor (PROTOCOL v1.2 `reads`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberRead {
    pub user_id: UserId,
    pub read_seq: i64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadsPage {
    pub reads: Vec<MemberRead>,
    /// `after` for the next page (a `joined_seq`); `None` at the end.
    pub next: Option<i64>,
}

/// $1 conv, $2 user. No row back = never a member (or no such conversation).
const READ_SEQ: &str = "
SELECT coalesce((SELECT r.read_seq FROM read_cursors r WHERE r.user_id = $2 AND r.conv_id = c.conv_id), 0)
  FROM conversations c
 WHERE c.conv_id = $1
   AND EXISTS (SELECT 1 FROM membership_periods p WHERE p.conv_id = c.conv_id AND p.user_id = $2)";

impl Store {
    /// Moves `user`'s read cursor in `conv` up to `seq` (capped at the head;
    /// never back) and returns the resulting `read_seq`. `NOT_MEMBER` unless
    /// `user` is a current member (also for a conversation that does not
    /// exist); `BAD_REQUEST` for a negative `seq`.
    pub async fn mark_read(&self, conv: &ConvId, user: &UserId, seq: i64) -> Result<i64, StoreError> {
        Ok(self.mark_read_telling(conv, user, seq, 0).await?.read_seq)
    }

    /// [`Store::mark_read`], and when the cursor moved in a direct
    /// conversation or a group of at most `tell_max_members` members, the
    /// other members to push it to (PROTOCOL v1.2).
    pub async fn mark_read_telling(
        &self,
        conv: &ConvId,
        user: &UserId,
        seq: i64,
        tell_max_members: i32,
    ) -> Result<MarkedRead, StoreError> {
        if seq < 0 {
            return Err(Rejection::BadRequest("seq must be >= 0".into()).into());
        }
        let conn = self.pool.get().await?;
        let row = conn
            .query_prepared_opt(
                MARK_READ_AND_TELL,
                &[
                    (&conv.as_str(), Type::TEXT),
                    (&user.as_str(), Type::TEXT),
                    (&seq, Type::INT8),
                    (&tell_max_members, Type::INT4),
                ],
            )
            .await?
            .ok_or(Rejection::NotMember)?;
        let tell: Option<Vec<&str>> = row.get(1);
        let tell = tell
            .unwrap_or_default()
            .into_iter()
            .map(|u| decoded(UserId::parse(u), "user_id"))
            .collect::<Result<_, _>>()?;
        Ok(MarkedRead { read_seq: row.get(0), tell })
    }

    /// A page of the members' read cursors, in join order (PROTOCOL v1.2
    /// `reads`): current members only (`NOT_MEMBER` otherwise, also for a
    /// conversation that does not exist).
    pub async fn reads(&self, conv: &ConvId, caller: &UserId, after: i64, limit: i64) -> Result<ReadsPage, StoreError> {
        let conn = self.pool.get().await?;
        let c = conv.as_str();
        conn.query_prepared_opt(IS_MEMBER, &[(&c, Type::TEXT), (&caller.as_str(), Type::TEXT)])
            .await?
            .ok_or(Rejection::NotMember)?;
        let rows =
            conn.query_prepared(READS_PAGE, &[(&c, Type::TEXT), (&after, Type::INT8), (&limit, Type::INT8)]).await?;
        let mut reads = Vec::with_capacity(rows.len());
        let mut last = None;
        for r in &rows {
            reads.push(MemberRead { user_id: decoded(UserId::parse(r.get(0)), "user_id")?, read_seq: r.get(2) });
            last = Some(r.get::<_, i64>(1));
        }
        let next = if rows.len() as i64 == limit { last } else { None };
        Ok(ReadsPage { reads, next })
    }

    /// `user`'s read cursor in `conv` (0 if never set). Readable by anyone who
    /// has ever been a member, like the history itself; `NOT_MEMBER` otherwise.
    pub async fn read_seq(&self, conv: &ConvId, user: &UserId) -> Result<i64, StoreError> {
        let conn = self.pool.get().await?;
        let row = conn
            .query_prepared_opt(READ_SEQ, &[(&conv.as_str(), Type::TEXT), (&user.as_str(), Type::TEXT)])
            .await?
            .ok_or(Rejection::NotMember)?;
        Ok(row.get(0))
    }
}
