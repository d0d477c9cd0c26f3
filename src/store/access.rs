//! Whether a user may reach a conversation's writer at all (the gateway's
//! stranger gate, ARCHITECTURE §3 "Strangers never reach an actor"). One
//! probe of the `membership_periods` primary key, which costs the same for
//! a conversation that does not exist as for one the user is not in.

use imcore_actors::{ConvId, UserId};
use tokio_postgres::types::Type;

use super::{Store, StoreError};

/// Ever a member (periods are never deleted, so once true it stays true);
/// for a `join`, also whether the conversation is an active group anyone may
/// join or apply to, whose existence is no secret (one dismissed or banned
/// answers as a missing one: a stranger learns no status, PROTOCOL §2).
const ACCESS: &str = "
SELECT EXISTS (SELECT 1 FROM membership_periods WHERE conv_id = $1 AND user_id = $2),
       $3 AND EXISTS (SELECT 1 FROM conversations WHERE conv_id = $1 AND kind = 'group' AND join_mode <> 'invite'
                         AND status = 'active')";

/// What the gate learnt of a (conversation, user) pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Access {
    /// The user has (or had) a membership period: its writes may go on.
    pub ever_member: bool,
    /// Asked only for a `join`: the conversation is an active group open to joins.
    pub joinable: bool,
}

impl Store {
    /// Reads [`Access`] of `user` to `conv`; `joinable` only when `join`.
    pub async fn access(&self, conv: &ConvId, user: &UserId, join: bool) -> Result<Access, StoreError> {
        let c = self.pool.get().await?;
        let row = c
            .query_prepared_one(
                ACCESS,
                &[(&conv.as_str(), Type::TEXT), (&user.as_str(), Type::TEXT), (&join, Type::BOOL)],
            )
            .await?;
        Ok(Access { ever_member: row.get(0), joinable: row.get(1) })
    }
}
