//! Read cursors (PROTOCOL §5 `read`, P8): how far a user has read a
//! conversation. A cursor never moves back and never passes the head.
//!
//! One statement, no transaction: the upsert reads the conversation's head and
//! the caller's open period in the same snapshot, and `ON CONFLICT DO UPDATE`
//! takes the cursor row's lock, so concurrent marks serialise on that row and
//! `greatest` keeps the highest — whatever order they commit in.

use imcore_actors::{ConvId, UserId};
use tokio_postgres::types::Type;

use super::{Store, StoreError};
use crate::domain::Rejection;

/// $1 conv, $2 user, $3 seq (≥ 0). No row back = not a current member (or no
/// such conversation). A cursor is only ever written capped at the head of
/// the moment, and heads only grow, so `greatest` of the stored value and the
/// capped request is itself ≤ head.
const MARK_READ: &str = "
INSERT INTO read_cursors (user_id, conv_id, read_seq)
SELECT $2, c.conv_id, least($3, c.next_seq - 1)
  FROM conversations c
 WHERE c.conv_id = $1
   AND EXISTS (SELECT 1 FROM membership_periods p
                WHERE p.conv_id = c.conv_id AND p.user_id = $2 AND p.to_seq IS NULL)
    ON CONFLICT (user_id, conv_id)
    DO UPDATE SET read_seq = greatest(read_cursors.read_seq, excluded.read_seq),
                  changed_at = CASE WHEN excluded.read_seq > read_cursors.read_seq THEN now()
                                    ELSE read_cursors.changed_at END
RETURNING read_seq";

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
        if seq < 0 {
            return Err(Rejection::BadRequest("seq must be >= 0".into()).into());
        }
        let conn = self.pool.get().await?;
        let row = conn
            .query_typed_opt(
                MARK_READ,
                &[(&conv.as_str(), Type::TEXT), (&user.as_str(), Type::TEXT), (&seq, Type::INT8)],
            )
            .await?
            .ok_or(Rejection::NotMember)?;
        Ok(row.get(0))
    }

    /// `user`'s read cursor in `conv` (0 if never set). Readable by anyone who
    /// has ever been a member, like the history itself; `NOT_MEMBER` otherwise.
    pub async fn read_seq(&self, conv: &ConvId, user: &UserId) -> Result<i64, StoreError> {
        let conn = self.pool.get().await?;
        let row = conn
            .query_typed_opt(READ_SEQ, &[(&conv.as_str(), Type::TEXT), (&user.as_str(), Type::TEXT)])
            .await?
            .ok_or(Rejection::NotMember)?;
        Ok(row.get(0))
    }
}
