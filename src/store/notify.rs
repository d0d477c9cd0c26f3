//! The notifier's reads and writes (ARCHITECTURE §5 "Offline notifications"):
//! who is due for a batch, read in pages from `push_targets` (never a
//! roster); the push targets the batch's joins add; a user's unread total;
//! the durable progress rows, their leases, and the events recovery reads
//! back. None of it runs in a send's transaction.

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use imcore_actors::{ConvId, DeviceId, UserId};
use tokio_postgres::types::{Json, Type};

use super::error::decoded;
use super::inbox::unread_count;
use super::pushers::NotifyLevel;
use super::sync::event_from_row;
use super::{Store, StoreError, UNREAD_CAP};
use crate::domain::Event;

/// One pusher of a push target of a batch, with the member's period that
/// overlaps the batch's seqs (a member may have several).
#[derive(Debug, Clone)]
pub struct DueRow {
    pub user: UserId,
    pub device: DeviceId,
    pub app_id: String,
    pub pushkey: String,
    pub url: String,
    pub data: Option<serde_json::Value>,
    pub pushkey_at: DateTime<Utc>,
    pub from_seq: i64,
    pub to_seq: Option<i64>,
    pub level: Option<NotifyLevel>,
}

/// What a notification names of its conversation.
#[derive(Debug, Clone)]
pub struct ConvFacts {
    pub direct: bool,
    pub member_count: i32,
    pub name: Option<String>,
    pub head: i64,
}

/// A conversation whose notifications are behind and unleased.
#[derive(Debug, Clone)]
pub struct Behind {
    pub conv: ConvId,
    pub done: Option<i64>,
    pub head: i64,
}

/// $1 conv, $2 lowest seq, $3 highest seq, $4 after user, $5 users per page.
/// A page of targets first (by the primary key), then only their pushers and
/// periods: a user of the page without a row here still counts for paging.
const DUE_PAGE: &str = "
WITH page AS (SELECT user_id FROM push_targets WHERE conv_id = $1 AND user_id > $4 ORDER BY user_id LIMIT $5)
SELECT page.user_id, x.device_id, x.app_id, x.pushkey, x.url, x.data, x.created_at, x.from_seq, x.to_seq, nl.level
  FROM page
  LEFT JOIN LATERAL (
    SELECT p.device_id, p.app_id, p.pushkey, p.url, p.data, p.created_at, mp.from_seq, mp.to_seq
      FROM pushers p
      JOIN membership_periods mp ON mp.conv_id = $1 AND mp.user_id = p.user_id
                                AND mp.from_seq <= $3 AND coalesce(mp.to_seq, $3) >= $2
     WHERE p.user_id = page.user_id) x ON true
  LEFT JOIN notify_levels nl ON nl.user_id = page.user_id AND nl.conv_id = $1
 ORDER BY page.user_id";

/// Sum over the user's current conversations of the inbox's unread count
/// (the same bounded scan per conversation, `store::inbox`).
static UNREAD_TOTAL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "
SELECT coalesce(sum(u.unread), 0)::int8
  FROM membership_periods p
  JOIN conversations c ON c.conv_id = p.conv_id
  LEFT JOIN read_cursors rc ON rc.user_id = $1 AND rc.conv_id = p.conv_id
  CROSS JOIN LATERAL ({}) u
 WHERE p.user_id = $1 AND p.to_seq IS NULL",
        unread_count("p", "unread", "", UNREAD_CAP)
    )
});

/// Conversations with push targets, behind, not leased by a live node; one
/// never claimed only once its last event is `$2` old (the node that
/// committed it had time to claim it). `$1` give-up window start.
const BEHIND: &str = "
SELECT c.conv_id, np.done_seq, c.next_seq - 1
  FROM (SELECT DISTINCT conv_id FROM push_targets) t
  JOIN conversations c ON c.conv_id = t.conv_id
  LEFT JOIN notify_progress np ON np.conv_id = t.conv_id
 WHERE c.last_event_at >= $1
   AND c.next_seq - 1 > coalesce(np.done_seq, 0)
   AND (np.lease_until < now() OR np.conv_id IS NULL) AND c.last_event_at < $2
 LIMIT $3";

const EVENTS_AFTER: &str = concat!(
    "SELECT ",
    event_columns!(),
    "
  FROM events e
 WHERE e.conv_id = $1 AND e.seq > $2 AND e.seq <= $3 AND e.created_at >= $4
 ORDER BY e.seq"
);

impl Store {
    /// One page of the pushers due for seqs `lo..=hi` of `conv`, of the
    /// targets after `after` (`""` first); and the page's last target user,
    /// `None` when the page was the last.
    pub async fn due_page(
        &self,
        conv: &ConvId,
        (lo, hi): (i64, i64),
        after: &str,
        users: i64,
    ) -> Result<(Vec<DueRow>, Option<String>), StoreError> {
        let conn = self.pool.get().await?;
        let rows = conn
            .query_prepared(
                DUE_PAGE,
                &[
                    (&conv.as_str(), Type::TEXT),
                    (&lo, Type::INT8),
                    (&hi, Type::INT8),
                    (&after, Type::TEXT),
                    (&users, Type::INT8),
                ],
            )
            .await?;
        let mut due = Vec::new();
        let (mut seen, mut last): (i64, Option<String>) = (0, None);
        for r in &rows {
            let user: &str = r.get(0);
            if last.as_deref() != Some(user) {
                seen += 1;
                last = Some(user.to_owned());
            }
            let Some(device) = r.get::<_, Option<&str>>(1) else { continue };
            due.push(DueRow {
                user: decoded(UserId::parse(user), "user_id")?,
                device: decoded(DeviceId::parse(device), "device_id")?,
                app_id: r.get(2),
                pushkey: r.get(3),
                url: r.get(4),
                data: r.get::<_, Option<Json<serde_json::Value>>>(5).map(|j| j.0),
                pushkey_at: r.get(6),
                from_seq: r.get(7),
                to_seq: r.get(8),
                level: match r.get::<_, Option<&str>>(9) {
                    Some(l) => Some(NotifyLevel::parse(l).ok_or(StoreError::Undecodable("notify level"))?),
                    None => None,
                },
            });
        }
        Ok((due, (seen >= users).then_some(last).flatten()))
    }

    /// The conversation's kind, size, name and head, and the display names of `users`.
    pub async fn conv_facts(
        &self,
        conv: &ConvId,
        users: &[&str],
    ) -> Result<(Option<ConvFacts>, HashMap<String, String>), StoreError> {
        let conn = self.pool.get().await?;
        let facts = conn
            .query_prepared_opt(
                "SELECT kind = 'direct', member_count, name, next_seq - 1 FROM conversations WHERE conv_id = $1",
                &[(&conv.as_str(), Type::TEXT)],
            )
            .await?
            .map(|r| ConvFacts { direct: r.get(0), member_count: r.get(1), name: r.get(2), head: r.get(3) });
        let rows = conn
            .query_prepared(
                "SELECT user_id, display_name FROM users WHERE user_id = ANY($1) AND display_name IS NOT NULL",
                &[(&users, Type::TEXT_ARRAY)],
            )
            .await?;
        Ok((facts, rows.iter().map(|r| (r.get(0), r.get(1))).collect()))
    }

    /// `users` who joined `conv` become its push targets if they hold a pusher.
    pub async fn add_push_targets(&self, conv: &ConvId, users: &[&str]) -> Result<(), StoreError> {
        let conn = self.pool.get().await?;
        conn.execute_prepared(
            "INSERT INTO push_targets (conv_id, user_id)
             SELECT $1, u FROM unnest($2::text[]) u WHERE EXISTS (SELECT 1 FROM pushers p WHERE p.user_id = u)
             ON CONFLICT DO NOTHING",
            &[(&conv.as_str(), Type::TEXT), (&users, Type::TEXT_ARRAY)],
        )
        .await?;
        Ok(())
    }

    /// `users` who left `conv` stop being its push targets, unless back in it.
    pub async fn drop_push_targets(&self, conv: &ConvId, users: &[&str]) -> Result<(), StoreError> {
        let conn = self.pool.get().await?;
        conn.execute_prepared(
            "DELETE FROM push_targets t WHERE t.conv_id = $1 AND t.user_id = ANY($2)
               AND NOT EXISTS (SELECT 1 FROM membership_periods mp
                                WHERE mp.conv_id = $1 AND mp.user_id = t.user_id AND mp.to_seq IS NULL)",
            &[(&conv.as_str(), Type::TEXT), (&users, Type::TEXT_ARRAY)],
        )
        .await?;
        Ok(())
    }

    /// `user`'s unread messages over its conversations (each capped as the inbox's).
    pub async fn unread_total(&self, user: &UserId) -> Result<i64, StoreError> {
        let conn = self.pool.get().await?;
        Ok(conn.query_prepared_one(UNREAD_TOTAL.as_str(), &[(&user.as_str(), Type::TEXT)]).await?.get(0))
    }

    /// Records `node`'s progress and renews its lease on each conversation,
    /// where `node` holds the lease or it ran out. A lease taken over from
    /// another node keeps that node's progress. Returns the conversations
    /// `node` now holds, with their recorded progress.
    pub async fn flush_progress(
        &self,
        node: &str,
        progress: &[(ConvId, i64)],
        lease: Duration,
    ) -> Result<Vec<(String, i64)>, StoreError> {
        let conn = self.pool.get().await?;
        let convs: Vec<&str> = progress.iter().map(|(c, _)| c.as_str()).collect();
        let done: Vec<i64> = progress.iter().map(|(_, d)| *d).collect();
        let lease_ms = i64::try_from(lease.as_millis()).unwrap_or(i64::MAX);
        let rows = conn
            .query_prepared(
                "INSERT INTO notify_progress (conv_id, done_seq, node, lease_until)
                 SELECT c, d, $3, now() + make_interval(secs => $4::float8 / 1000)
                   FROM unnest($1::text[], $2::int8[]) AS x(c, d)
                 ON CONFLICT (conv_id) DO UPDATE
                    SET done_seq = CASE WHEN notify_progress.node = excluded.node
                                        THEN greatest(notify_progress.done_seq, excluded.done_seq)
                                        ELSE notify_progress.done_seq END,
                        node = excluded.node, lease_until = excluded.lease_until
                  WHERE notify_progress.node = excluded.node OR notify_progress.lease_until < now()
                 RETURNING conv_id, done_seq",
                &[(&convs, Type::TEXT_ARRAY), (&done, Type::INT8_ARRAY), (&node, Type::TEXT), (&lease_ms, Type::INT8)],
            )
            .await?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }

    /// Conversations behind whose lease ran out or was never taken, quiet
    /// for `settle` (so a live node taking a new batch in records it first),
    /// active within `window`; at most `limit`.
    pub async fn behind(&self, window: Duration, settle: Duration, limit: i64) -> Result<Vec<Behind>, StoreError> {
        let now = Utc::now();
        let ago = |d: Duration| now - chrono::Duration::from_std(d).unwrap_or(chrono::Duration::MAX);
        let (since, settled) = (ago(window), ago(settle));
        let conn = self.pool.get().await?;
        let rows = conn
            .query_prepared(BEHIND, &[(&since, Type::TIMESTAMPTZ), (&settled, Type::TIMESTAMPTZ), (&limit, Type::INT8)])
            .await?;
        rows.iter()
            .map(|r| Ok(Behind { conv: decoded(ConvId::parse(r.get(0)), "conv_id")?, done: r.get(1), head: r.get(2) }))
            .collect()
    }

    /// Takes `conv`'s lease for `node` if it ran out or was never taken
    /// (then starting at `done`); the progress to resume from, `None` if
    /// another node holds it.
    pub async fn claim_progress(
        &self,
        conv: &ConvId,
        node: &str,
        done: i64,
        lease: Duration,
    ) -> Result<Option<i64>, StoreError> {
        let conn = self.pool.get().await?;
        let lease_ms = i64::try_from(lease.as_millis()).unwrap_or(i64::MAX);
        let row = conn
            .query_prepared_opt(
                "INSERT INTO notify_progress (conv_id, done_seq, node, lease_until)
                 VALUES ($1, $2, $3, now() + make_interval(secs => $4::float8 / 1000))
                 ON CONFLICT (conv_id) DO UPDATE SET node = excluded.node, lease_until = excluded.lease_until
                  WHERE notify_progress.lease_until < now()
                 RETURNING done_seq",
                &[(&conv.as_str(), Type::TEXT), (&done, Type::INT8), (&node, Type::TEXT), (&lease_ms, Type::INT8)],
            )
            .await?;
        Ok(row.map(|r| r.get(0)))
    }

    /// `conv`'s events after `after` up to `upto`, committed at `since` or later.
    pub async fn events_after(
        &self,
        conv: &ConvId,
        after: i64,
        upto: i64,
        since: DateTime<Utc>,
    ) -> Result<Vec<Event>, StoreError> {
        let conn = self.pool.get().await?;
        let rows = conn
            .query_prepared(
                EVENTS_AFTER,
                &[(&conv.as_str(), Type::TEXT), (&after, Type::INT8), (&upto, Type::INT8), (&since, Type::TIMESTAMPTZ)],
            )
            .await?;
        rows.iter().map(|r| event_from_row(conv, r)).collect()
    }
}
