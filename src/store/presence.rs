//! What delivery needs when a user comes online (ARCHITECTURE §5): the user's
//! memberships and the heads they reflect, read in one statement so they are
//! one MVCC snapshot; and, with several nodes, the connection's cluster-wide
//! id (ARCHITECTURE §7).

use imcore_actors::{ConvId, UserId};
use tokio_postgres::types::Type;

use super::error::decoded;
use super::{Store, StoreError};

/// The latest membership period of every conversation the user was ever in,
/// and the conversation's head in the same snapshot (`DISTINCT ON` reads the
/// `membership_periods_by_user` index in order).
const MEMBERSHIPS_OF: &str = "
SELECT DISTINCT ON (p.conv_id) p.conv_id, p.from_seq, p.to_seq IS NULL AS open, c.next_seq - 1 AS head
  FROM membership_periods p
  JOIN conversations c ON c.conv_id = p.conv_id
 WHERE p.user_id = $1
 ORDER BY p.conv_id, p.from_seq DESC";

/// A user's membership of one conversation as of `head`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Membership {
    pub conv_id: ConvId,
    /// The seq its open period starts at; `None`: not a member at `head`.
    pub open_from: Option<i64>,
    /// The conversation's head this membership reflects.
    pub head: i64,
}

impl Store {
    /// The next connection id of the cluster (sequence `conn_ids`): every
    /// node draws from it, so a later connection of a device has a higher id
    /// wherever it lands (P7 across nodes).
    pub async fn next_cluster_conn_id(&self) -> Result<u64, StoreError> {
        let c = self.pool.get().await?;
        let n: i64 = c.query_prepared_one("SELECT nextval('conn_ids')", &[]).await?.get(0);
        // A sequence starts at 1 and never goes below it.
        Ok(n.unsigned_abs())
    }

    /// `user`'s memberships (one statement, one snapshot).
    pub async fn memberships_of(&self, user: &UserId) -> Result<Vec<Membership>, StoreError> {
        let c = self.pool.get().await?;
        let rows = c.query_prepared(MEMBERSHIPS_OF, &[(&user.as_str(), Type::TEXT)]).await?;
        rows.iter()
            .map(|row| {
                let conv_id = decoded(ConvId::parse(row.get(0)), "conv_id")?;
                let open: bool = row.get(2);
                Ok(Membership { conv_id, open_from: open.then(|| row.get(1)), head: row.get(3) })
            })
            .collect()
    }
}
