//! What changed for a user since a token (PROTOCOL §7 `conversations?since=`):
//! a device back after a while pays for the conversations that changed, not
//! for all of them.
//!
//! Invariant: a delta misses no change made at or after its token (a change
//! may be reported twice). Changes are stamped with their transaction's start
//! time; the token is the start of the oldest transaction running when it was
//! taken (`pg_stat_activity`), read before the snapshot it goes with. Why that
//! suffices, and why not the clock: ARCHITECTURE §4.

use std::sync::LazyLock;

use chrono::{DateTime, TimeDelta, Utc};
use imcore_actors::{ConvId, UserId};
use tokio_postgres::types::Type;

use super::error::decoded;
use super::inbox::{inbox_item, inbox_items_sql, InboxItem, INBOX_MAX_LIMIT};
use super::since_token::{decode_token, since_token};
use super::{Store, StoreError};

/// Beyond this age a token answers `reset`: a full paging then costs less
/// than the delta would.
pub const SINCE_MAX_AGE: TimeDelta = TimeDelta::days(30);

/// How far ahead of this node's clock a token may be (another node's clock).
const SINCE_MAX_SKEW: TimeDelta = TimeDelta::minutes(1);

/// Most changed (or left) conversations one delta lists; more answer `reset`.
pub const SINCE_MAX_CHANGED: i64 = INBOX_MAX_LIMIT;

/// $1 user, $2 token time, $3 rows to fetch: the user's current
/// conversations (its open periods: a `members` row exists exactly while its
/// period is open) with a new event or a moved read cursor since $2.
static CHANGED: LazyLock<String> = LazyLock::new(|| {
    inbox_items_sql(
        "
  SELECT p.conv_id, p.from_seq
    FROM membership_periods p
    JOIN conversations c ON c.conv_id = p.conv_id
    LEFT JOIN read_cursors rc ON rc.user_id = p.user_id AND rc.conv_id = p.conv_id
   WHERE p.user_id = $1 AND p.to_seq IS NULL AND (c.last_event_at >= $2 OR rc.changed_at >= $2)
   ORDER BY c.last_event_at DESC, c.conv_id
   LIMIT $3",
    )
});

/// $1 user, $2 token time, $3 rows to fetch: conversations whose period of
/// the user ended since $2 and that the user is not back in.
const LEFT: &str = "
SELECT DISTINCT p.conv_id FROM membership_periods p
 WHERE p.user_id = $1 AND p.closed_at >= $2
   AND NOT EXISTS (SELECT 1 FROM membership_periods o
                    WHERE o.conv_id = p.conv_id AND o.user_id = $1 AND o.to_seq IS NULL)
 LIMIT $3";

/// The answer to `conversations?since=`.
#[derive(Debug, Clone)]
pub enum InboxDelta {
    Changed {
        /// Changed current conversations, as inbox items, most recent first.
        items: Vec<InboxItem>,
        /// Conversations the user left, was removed from, or that were dismissed.
        left: Vec<ConvId>,
        /// The token to keep for the next delta.
        since: String,
    },
    /// An unknown, too old or too fruitful token: page the whole inbox again.
    Reset,
}

impl Store {
    /// What changed for `user` since `token` (any string: one that is not a
    /// token of ours answers [`InboxDelta::Reset`]).
    pub async fn inbox_since(&self, user: &UserId, token: &str) -> Result<InboxDelta, StoreError> {
        let age = |at: &DateTime<Utc>| Utc::now() - *at;
        let Some(at) = decode_token(token).filter(|at| (-SINCE_MAX_SKEW..=SINCE_MAX_AGE).contains(&age(at))) else {
            return Ok(InboxDelta::Reset);
        };
        let fetch = SINCE_MAX_CHANGED + 1;
        let conn = self.pool.get().await?;
        let user = user.as_str();
        let params = [(&user as _, Type::TEXT), (&at as _, Type::TIMESTAMPTZ), (&fetch as _, Type::INT8)];
        // The new token first: its statement runs before the snapshots of the others.
        let (since, changed, left) = futures_util::join!(
            since_token(&conn),
            conn.query_prepared(&CHANGED, &params),
            conn.query_prepared(LEFT, &params)
        );
        let (since, changed, left) = (since?, changed?, left?);
        if changed.len() as i64 > SINCE_MAX_CHANGED || left.len() as i64 > SINCE_MAX_CHANGED {
            return Ok(InboxDelta::Reset);
        }
        Ok(InboxDelta::Changed {
            items: changed.iter().map(|r| inbox_item(r).map(|(item, _)| item)).collect::<Result<_, _>>()?,
            left: left.iter().map(|r| decoded(ConvId::parse(r.get(0)), "conv_id")).collect::<Result<_, _>>()?,
            since,
        })
    }
}
