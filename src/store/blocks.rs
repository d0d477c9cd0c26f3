//! Blocking (PROTOCOL v1.2): who blocked whom, and in the pair's direct
//! conversation the blocked member's standing (`members.blocked`), which the
//! send check reads under the conversation row lock (ARCHITECTURE §9).
//!
//! Invariant: a block and a write it forbids serialise. A block takes the
//! direct conversation's row lock (and bumps `member_version`, so no cached
//! standing survives it), then the blocker's `users` row; a creation or an
//! invite share-locks the `users` rows it names before it reads `blocks`.

use chrono::{DateTime, Utc};
use imcore_actors::UserId;
use tokio_postgres::types::Type;

use super::conversations::direct_conv_id;
use super::error::decoded;
use super::{Store, StoreError};
use crate::domain::Rejection;

/// The pair's direct conversation row, if it exists: locked first, as every
/// write of that conversation locks it before anything else.
const LOCK_DIRECT: &str = "SELECT 1 FROM conversations WHERE conv_id = $1 FOR NO KEY UPDATE";

/// `$1` blocker, `$2` blocked: which of them exist, the blocker's row locked
/// (creations and invites naming it share-lock it).
const LOCK_USERS: &str = "
SELECT user_id FROM users WHERE user_id IN ($1, $2) ORDER BY user_id FOR NO KEY UPDATE";

const COUNT: &str = "SELECT count(*) FROM blocks WHERE blocker = $1";

const INSERT: &str = "INSERT INTO blocks (blocker, blocked) VALUES ($1, $2) ON CONFLICT DO NOTHING";

const DELETE: &str = "DELETE FROM blocks WHERE blocker = $1 AND blocked = $2";

/// `$1` the direct conversation, `$2` the blocked member, `$3` the new flag:
/// sets it and, if it changed, bumps `member_version` (caches of the
/// standing are then stale, ARCHITECTURE §3).
const FLAG: &str = "
WITH flagged AS (
  UPDATE members SET blocked = $3 WHERE conv_id = $1 AND user_id = $2 AND blocked <> $3 RETURNING 1)
UPDATE conversations SET member_version = member_version + 1
 WHERE conv_id = $1 AND EXISTS (SELECT 1 FROM flagged)";

const LIST: &str = "SELECT blocked, created_at FROM blocks WHERE blocker = $1 ORDER BY blocked";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    pub user_id: UserId,
    pub created_at: DateTime<Utc>,
}

impl Store {
    /// `blocker` blocks `blocked` (again: no change). Oneself → `BAD_REQUEST`;
    /// an unknown user → `NOT_FOUND`; past `max_blocks` → `BAD_REQUEST`.
    pub async fn block(&self, blocker: &UserId, blocked: &UserId, max_blocks: i64) -> Result<(), StoreError> {
        self.set_block(blocker, blocked, Some(max_blocks)).await
    }

    /// `blocker` no longer blocks `blocked` (not blocked: no change).
    pub async fn unblock(&self, blocker: &UserId, blocked: &UserId) -> Result<(), StoreError> {
        self.set_block(blocker, blocked, None).await
    }

    /// `Some(cap)`: block; `None`: unblock.
    async fn set_block(&self, blocker: &UserId, blocked: &UserId, cap: Option<i64>) -> Result<(), StoreError> {
        if blocker == blocked {
            return Err(Rejection::BadRequest("one cannot block oneself".into()).into());
        }
        let direct = direct_conv_id(blocker, blocked)?;
        let (d, a, b) = (direct.as_str(), blocker.as_str(), blocked.as_str());
        let mut conn = self.pool.get().await?;
        let tx = conn.transaction().await?;
        tx.execute_typed(LOCK_DIRECT, &[(&d, Type::TEXT)]).await?;
        let found = tx.query_typed(LOCK_USERS, &[(&a, Type::TEXT), (&b, Type::TEXT)]).await?;
        if found.len() < 2 {
            return Err(Rejection::NotFound("user".into()).into());
        }
        match cap {
            Some(cap) => {
                let inserted = tx.execute_typed(INSERT, &[(&a, Type::TEXT), (&b, Type::TEXT)]).await?;
                let count: i64 = tx.query_typed_one(COUNT, &[(&a, Type::TEXT)]).await?.get(0);
                if inserted > 0 && count > cap {
                    return Err(Rejection::BadRequest(format!("at most {cap} users may be blocked")).into());
                }
            }
            None => {
                tx.execute_typed(DELETE, &[(&a, Type::TEXT), (&b, Type::TEXT)]).await?;
            }
        }
        // Read after the users lock: a direct conversation created meanwhile is seen.
        tx.execute_typed(FLAG, &[(&d, Type::TEXT), (&b, Type::TEXT), (&cap.is_some(), Type::BOOL)]).await?;
        tx.commit().await?;
        Ok(())
    }

    /// The users `blocker` blocks, by user id (at most the cap).
    pub async fn blocks(&self, blocker: &UserId) -> Result<Vec<Block>, StoreError> {
        let conn = self.pool.get().await?;
        let rows = conn.query_prepared(LIST, &[(&blocker.as_str(), Type::TEXT)]).await?;
        rows.iter()
            .map(|r| Ok(Block { user_id: decoded(UserId::parse(r.get(0)), "blocked user_id")?, created_at: r.get(1) }))
            .collect()
    }
}
