//! The reads behind the live signals (PROTOCOL v1.2): whether a `typing` is
//! forwarded, who shares a conversation with a `presence` caller, whom a
//! presence change is announced to, and `last_seen`.
//! Nothing here is in a conversation's log or its write batches (ARCHITECTURE §5).

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};
use imcore_actors::{ConvId, UserId};
use tokio_postgres::types::{ToSql, Type};

use super::error::decoded;
use super::{Store, StoreError};
use crate::domain::{DeliveryMode, Rejection, Role, Standing};

/// The caller's standing in an active conversation it is a current member of.
const TYPIST: &str = "
SELECT c.delivery_mode, c.mute_all, m.role, m.role_until, m.mute_until, m.blocked, now()
  FROM conversations c JOIN members m ON m.conv_id = c.conv_id AND m.user_id = $2
 WHERE c.conv_id = $1 AND c.status = 'active'";

/// Of `$2`, the users who share an active conversation with `$1` (each
/// user's memberships by `members_by_user`, then the caller's row by key).
const SHARING: &str = "
SELECT u FROM unnest($2::text[]) AS u
 WHERE u = $1 OR EXISTS (
   SELECT 1 FROM members a
     JOIN members b ON b.conv_id = a.conv_id AND b.user_id = $1
     JOIN conversations c ON c.conv_id = a.conv_id AND c.status = 'active'
    WHERE a.user_id = u)";

/// The other members of `$1`'s direct conversations.
const DIRECT_PEERS: &str = "
SELECT b.user_id FROM members a
  JOIN conversations c ON c.conv_id = a.conv_id AND c.kind = 'direct'
  JOIN members b ON b.conv_id = a.conv_id AND b.user_id <> a.user_id
 WHERE a.user_id = $1";

const LAST_SEEN: &str = "SELECT user_id, last_seen FROM users WHERE user_id = ANY($1) AND last_seen IS NOT NULL";

const SET_LAST_SEEN: &str = "UPDATE users SET last_seen = $2 WHERE user_id = $1";

impl Store {
    /// Whether `user`'s `typing` in `conv` is forwarded: a `push`
    /// conversation, the caller neither muted nor blocked. `NOT_MEMBER` for
    /// a non-member (and an unknown or dismissed conversation).
    pub async fn typing_forwarded(&self, conv: &ConvId, user: &UserId) -> Result<bool, StoreError> {
        let conn = self.pool.get().await?;
        let row = conn
            .query_prepared_opt(TYPIST, &[(&conv.as_str(), Type::TEXT), (&user.as_str(), Type::TEXT)])
            .await?
            .ok_or(Rejection::NotMember)?;
        let push = row.get::<_, &str>(0).parse::<DeliveryMode>() == Ok(DeliveryMode::Push);
        let standing = Standing {
            role: decoded(row.get::<_, &str>(2).parse::<Role>(), "role")?,
            role_until: row.get(3),
            mute_until: row.get(4),
            blocked: row.get(5),
            ..Standing::new(Role::Member)
        };
        let now: DateTime<Utc> = row.get(6);
        Ok(push && !standing.blocked && !standing.muted(row.get(1), now))
    }

    /// Of `users`, those who share an active conversation with `caller` (and
    /// the caller itself).
    pub async fn sharing(&self, caller: &UserId, users: &[UserId]) -> Result<HashSet<UserId>, StoreError> {
        let conn = self.pool.get().await?;
        let ids: Vec<&str> = users.iter().map(UserId::as_str).collect();
        let params: [(&(dyn ToSql + Sync), Type); 2] = [(&caller.as_str(), Type::TEXT), (&ids, Type::TEXT_ARRAY)];
        let rows = conn.query_prepared(SHARING, &params).await?;
        rows.iter().map(|r| decoded(UserId::parse(r.get(0)), "user_id")).collect()
    }

    /// The users `user` shares a direct conversation with.
    pub async fn direct_peers(&self, user: &UserId) -> Result<Vec<UserId>, StoreError> {
        let conn = self.pool.get().await?;
        let rows = conn.query_prepared(DIRECT_PEERS, &[(&user.as_str(), Type::TEXT)]).await?;
        rows.iter().map(|r| decoded(UserId::parse(r.get(0)), "user_id")).collect()
    }

    /// When each of `users` was last seen, for those ever announced offline.
    pub async fn last_seen(&self, users: &[UserId]) -> Result<HashMap<UserId, DateTime<Utc>>, StoreError> {
        let conn = self.pool.get().await?;
        let ids: Vec<&str> = users.iter().map(UserId::as_str).collect();
        let rows = conn.query_prepared(LAST_SEEN, &[(&ids, Type::TEXT_ARRAY)]).await?;
        rows.iter().map(|r| Ok((decoded(UserId::parse(r.get(0)), "user_id")?, r.get(1)))).collect()
    }

    pub async fn set_last_seen(&self, user: &UserId, at: DateTime<Utc>) -> Result<(), StoreError> {
        let conn = self.pool.get().await?;
        conn.execute_prepared(SET_LAST_SEEN, &[(&user.as_str(), Type::TEXT), (&at, Type::TIMESTAMPTZ)]).await?;
        Ok(())
    }
}
