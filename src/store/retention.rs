//! Retention (P9, PROTOCOL §6): events older than their conversation's
//! `retention_ms` are purged a chunk at a time, each chunk its own short
//! transaction under the conversation's row lock, and each purged send leaves
//! a tombstone of its request key (a late retry is `IDEMPOTENCY_KEY_EXPIRED`).
//!
//! Invariant: the log stays gapless from `min_seq` (P1) and no tombstone is
//! lost: a chunk deletes a prefix, writes its tombstones and moves `min_seq`
//! all or nothing, so a purge killed midway or racing another node leaves the
//! next chunk to whoever takes the lock next. Membership periods are never
//! purged. Why: ARCHITECTURE §3 "Retention".

use std::time::{Duration, Instant};

use imcore_actors::ConvId;
use tokio_postgres::types::Type;

use super::error::decoded;
use super::{PooledClient, Store, StoreError};

/// What one run did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PurgeReport {
    /// Conversations of which something was purged.
    pub conversations: u64,
    pub events_purged: u64,
    pub tombstones_written: u64,
    /// Tombstones dropped past the horizon.
    pub tombstones_expired: u64,
}

/// Conversations whose oldest kept event is past their retention.
const DUE: &str = "
SELECT c.conv_id FROM conversations c
 WHERE c.retention_ms IS NOT NULL AND c.min_seq < c.next_seq
   AND EXISTS (SELECT 1 FROM events e WHERE e.conv_id = c.conv_id AND e.seq = c.min_seq
                  AND e.created_at < now() - c.retention_ms * interval '1 millisecond')
 ORDER BY c.conv_id";

/// Takes the conversation's row lock, in a statement of its own: a statement
/// that waits for a row lock reads the row's new version but the rest of the
/// database as of its start, so a chunk bounded in the statement that waited
/// would miss the events a writer committed meanwhile and could purge them.
const LOCK_ROW: &str = "SELECT 1 FROM conversations WHERE conv_id = $1 FOR NO KEY UPDATE";

/// Where the chunk ends, under the row lock: the first seq of the chunk's
/// range still inside the retention, else the range's end (capped at the head).
const CHUNK_END: &str = "
WITH c AS (SELECT min_seq, next_seq, retention_ms FROM conversations WHERE conv_id = $1)
SELECT c.min_seq,
       CASE WHEN c.retention_ms IS NULL THEN c.min_seq
            ELSE coalesce((SELECT min(e.seq) FROM events e
                            WHERE e.conv_id = $1 AND e.seq >= c.min_seq AND e.seq < c.min_seq + $2
                              AND e.created_at >= now() - c.retention_ms * interval '1 millisecond'),
                          least(c.min_seq + $2, c.next_seq)) END
  FROM c";

/// Deletes `[$2, $3)` and the reactions on its messages, writes the
/// tombstones of its sends and edits, moves `min_seq` to `$3`.
const PURGE_CHUNK: &str = "
WITH gone AS (
  DELETE FROM events WHERE conv_id = $1 AND seq >= $2 AND seq < $3
  RETURNING sender_user, client_msg_id, request_hash, seq),
unreacted AS (DELETE FROM reactions WHERE conv_id = $1 AND target_seq >= $2 AND target_seq < $3),
uncounted AS (DELETE FROM reaction_counts WHERE conv_id = $1 AND target_seq >= $2 AND target_seq < $3),
buried AS (
  INSERT INTO idem_tombstones (conv_id, sender_user, client_msg_id, request_hash, seq)
  SELECT $1, sender_user, client_msg_id, request_hash, seq FROM gone WHERE client_msg_id IS NOT NULL
  ON CONFLICT DO NOTHING
  RETURNING 1),
moved AS (UPDATE conversations SET min_seq = $3 WHERE conv_id = $1)
SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM buried)";

/// At most this many expired tombstones per statement.
const EXPIRE_TOMBSTONES: &str = "
DELETE FROM idem_tombstones WHERE ctid = ANY(ARRAY(
  SELECT ctid FROM idem_tombstones WHERE purged_at < now() - $1 * interval '1 millisecond' LIMIT 10000))";

impl Store {
    /// Purges every conversation that is due, `chunk` events per
    /// transaction, then drops tombstones older than `tombstone_horizon_ms`
    /// (`None`: kept forever).
    pub async fn purge_expired(
        &self,
        chunk: i64,
        tombstone_horizon_ms: Option<i64>,
    ) -> Result<PurgeReport, StoreError> {
        let started = Instant::now();
        let due: Vec<ConvId> = {
            let c = self.pool.get().await?;
            let rows = c.query_prepared(DUE, &[]).await?;
            rows.iter().map(|r| decoded(ConvId::parse(r.get(0)), "conv_id")).collect::<Result<_, _>>()?
        };
        let mut report = PurgeReport::default();
        for conv in &due {
            let (events, tombstones) = self.purge_conversation(conv, chunk).await?;
            report.conversations += u64::from(events > 0);
            report.events_purged += events;
            report.tombstones_written += tombstones;
        }
        if let Some(horizon) = tombstone_horizon_ms {
            report.tombstones_expired = self.expire_tombstones(horizon).await?;
        }
        let (events, written, expired) = (report.events_purged, report.tombstones_written, report.tombstones_expired);
        crate::metrics::observe_purge(events, written, expired, started.elapsed());
        Ok(report)
    }

    /// Purges `conv` chunk by chunk until its oldest kept event is inside
    /// its retention; `(events purged, tombstones written)`.
    ///
    /// Between chunks it rests as long as the chunk took: the conversation's
    /// writers, which queued behind the chunk's lock (or, in the commit
    /// stage, were left out and retried alone), get the row before the next
    /// chunk takes it again — without the pause the purge would take it back
    /// first, chunk after chunk, and hold a busy conversation's sends for the
    /// whole purge.
    pub async fn purge_conversation(&self, conv: &ConvId, chunk: i64) -> Result<(u64, u64), StoreError> {
        let (mut events, mut tombstones) = (0, 0);
        self.purge_watched(conv, chunk, |e, t, _| {
            events += e;
            tombstones += t;
            true
        })
        .await?;
        Ok((events, tombstones))
    }

    /// [`Store::purge_conversation`], telling `chunk_done` each chunk's
    /// events, tombstones and transaction time; it stops early when
    /// `chunk_done` answers false. True when nothing more was due.
    pub async fn purge_watched(
        &self,
        conv: &ConvId,
        chunk: i64,
        mut chunk_done: impl FnMut(u64, u64, Duration) -> bool,
    ) -> Result<bool, StoreError> {
        loop {
            let started = Instant::now();
            let Some((events, tombstones)) = self.purge_chunk(conv, chunk).await? else {
                return Ok(true);
            };
            let took = started.elapsed();
            if !chunk_done(events, tombstones, took) {
                return Ok(false);
            }
            tokio::time::sleep(took).await;
        }
    }

    /// One chunk of [`Store::purge_conversation`], one transaction:
    /// `(events purged, tombstones written)`, or `None` when nothing of
    /// `conv` is due (or it is gone).
    async fn purge_chunk(&self, conv: &ConvId, chunk: i64) -> Result<Option<(u64, u64)>, StoreError> {
        let mut c = self.pool.get().await?;
        let purged = purge_chunk_on(&mut c, conv, chunk).await;
        if let Err(e) = &purged {
            c.note_failure(e);
        }
        // `min_seq` moved (or may have, when COMMIT's answer was lost).
        self.tail.forget(conv);
        purged
    }
    async fn expire_tombstones(&self, horizon_ms: i64) -> Result<u64, StoreError> {
        let c = self.pool.get().await?;
        let mut expired = 0;
        loop {
            let n = c.execute_prepared(EXPIRE_TOMBSTONES, &[(&horizon_ms, Type::INT8)]).await?;
            expired += n;
            if n == 0 {
                return Ok(expired);
            }
        }
    }
}

/// [`Store::purge_chunk`] on the connection it checked out.
async fn purge_chunk_on(c: &mut PooledClient, conv: &ConvId, chunk: i64) -> Result<Option<(u64, u64)>, StoreError> {
    let tx = c.transaction().await?;
    if tx.query_typed_opt(LOCK_ROW, &[(&conv.as_str(), Type::TEXT)]).await?.is_none() {
        return Ok(None); // gone meanwhile: nothing to purge
    }
    let Some(row) = tx.query_typed_opt(CHUNK_END, &[(&conv.as_str(), Type::TEXT), (&chunk, Type::INT8)]).await? else {
        return Ok(None);
    };
    let (from, to): (i64, i64) = (row.get(0), row.get(1));
    if to <= from {
        return Ok(None);
    }
    let done =
        tx.query_typed(PURGE_CHUNK, &[(&conv.as_str(), Type::TEXT), (&from, Type::INT8), (&to, Type::INT8)]).await?;
    tx.commit().await?;
    Ok(Some(done.first().map_or((0, 0), |d| (d.get::<_, i64>(0) as u64, d.get::<_, i64>(1) as u64))))
}
