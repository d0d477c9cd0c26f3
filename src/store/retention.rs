//! Retention (P9, PROTOCOL §6): events older than their conversation's
//! `retention_ms` are purged a chunk at a time: `min_seq` moves past the
//! chunk in one statement under the row lock (the events leave the log),
//! then a statement without the lock deletes them, their reactions, and
//! writes a tombstone of each purged send's request key (a late retry is
//! `IDEMPOTENCY_KEY_EXPIRED`).
//!
//! Invariant: the log stays gapless from `min_seq` (P1); an event is deleted
//! and buried by one statement, once; a purge cut short between the two
//! leaves its range below `min_seq` for the next run to sweep. Membership
//! periods are never purged. Why: ARCHITECTURE §3 "Retention".

use std::time::{Duration, Instant};

use imcore_actors::ConvId;
use tokio_postgres::types::{ToSql, Type};

use super::error::decoded;
use super::{PooledClient, Store, StoreError};
use crate::config::RetentionSettings;

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

/// How a purge goes: `chunk` events per step, working at most `duty_pct`
/// percent of the time (after each chunk it rests for the rest).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pace {
    pub chunk: i64,
    pub duty_pct: u32,
}

impl Pace {
    /// `chunk` events per step at the default duty.
    pub fn chunk(chunk: i64) -> Self {
        Self { chunk, duty_pct: RetentionSettings::default().duty_pct }
    }

    pub fn of(settings: &RetentionSettings) -> Self {
        Self { chunk: settings.chunk, duty_pct: settings.duty_pct }
    }

    /// The rest after a chunk that took `took`.
    fn rest_after(&self, took: Duration) -> Duration {
        let duty = self.duty_pct.clamp(1, 100);
        took * (100 - duty) / duty
    }
}

/// Conversations whose oldest kept event is past their retention, or that
/// hold events below `min_seq` (a sweep cut short: its range already left the log).
const DUE: &str = "
SELECT c.conv_id FROM conversations c
 WHERE (c.retention_ms IS NOT NULL AND c.min_seq < c.next_seq
        AND EXISTS (SELECT 1 FROM events e WHERE e.conv_id = c.conv_id AND e.seq = c.min_seq
                       AND e.created_at < now() - c.retention_ms * interval '1 millisecond'))
    OR (c.min_seq > 1 AND EXISTS (SELECT 1 FROM events e WHERE e.conv_id = c.conv_id AND e.seq < c.min_seq))
 ORDER BY c.conv_id";

/// The next range to purge, read without a lock: from `min_seq` to the first
/// seq of the range still inside the retention, else the range's end (capped
/// at the head). Events below the head this statement reads are committed
/// and never change `created_at`, so the bound holds until [`ADVANCE`]
/// finds the row as read here.
const CHUNK_END: &str = "
WITH c AS (SELECT min_seq, next_seq, retention_ms FROM conversations WHERE conv_id = $1 AND retention_ms IS NOT NULL)
SELECT c.min_seq,
       coalesce((SELECT min(e.seq) FROM events e
                  WHERE e.conv_id = $1 AND e.seq >= c.min_seq AND e.seq < c.min_seq + $2
                    AND e.created_at >= now() - c.retention_ms * interval '1 millisecond'),
                least(c.min_seq + $2, c.next_seq)),
       c.retention_ms
  FROM c";

/// Moves `min_seq` from `$2` to `$3`, one statement: the only moment a
/// purge holds the row lock. Nothing if another purge moved it, or the
/// retention changed, since [`CHUNK_END`] read them.
const ADVANCE: &str = "UPDATE conversations SET min_seq = $3 WHERE conv_id = $1 AND min_seq = $2 AND retention_ms = $4";

/// The events of `conv` left below `min_seq` by a sweep cut short: `(first, min_seq)`.
const LEFT_BELOW: &str = "
SELECT (SELECT min(e.seq) FROM events e WHERE e.conv_id = $1 AND e.seq < c.min_seq), c.min_seq
  FROM conversations c WHERE c.conv_id = $1";

/// Deletes `[$2, $3)`, below `min_seq` only, and the reactions on its
/// messages, and writes the tombstones of its sends and edits, all in one
/// statement (P9), without the row lock. A second sweep of the same range
/// deletes what the first did not: each event is purged, and buried, once.
const SWEEP: &str = "
WITH gone AS (
  DELETE FROM events WHERE conv_id = $1 AND seq >= $2 AND seq < $3
     AND seq < (SELECT min_seq FROM conversations WHERE conv_id = $1)
  RETURNING sender_user, client_msg_id, request_hash, seq),
unreacted AS (DELETE FROM reactions WHERE conv_id = $1 AND target_seq >= $2 AND target_seq < $3
                 AND target_seq < (SELECT min_seq FROM conversations WHERE conv_id = $1)),
uncounted AS (DELETE FROM reaction_counts WHERE conv_id = $1 AND target_seq >= $2 AND target_seq < $3
                 AND target_seq < (SELECT min_seq FROM conversations WHERE conv_id = $1)),
buried AS (
  INSERT INTO idem_tombstones (conv_id, sender_user, client_msg_id, request_hash, seq)
  SELECT $1, sender_user, client_msg_id, request_hash, seq FROM gone WHERE client_msg_id IS NOT NULL
  ON CONFLICT DO NOTHING
  RETURNING 1)
SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM buried)";

/// At most this many expired tombstones per statement.
const EXPIRE_TOMBSTONES: &str = "
DELETE FROM idem_tombstones WHERE ctid = ANY(ARRAY(
  SELECT ctid FROM idem_tombstones WHERE purged_at < now() - $1 * interval '1 millisecond' LIMIT 10000))";

impl Store {
    /// Purges every conversation that is due at `pace`, then drops tombstones older than `tombstone_horizon_ms`
    /// (`None`: kept forever).
    pub async fn purge_expired(
        &self,
        pace: Pace,
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
            let (events, tombstones) = self.purge_conversation(conv, pace).await?;
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
    /// Between chunks it rests (`pace`), leaving the database's CPU and WAL
    /// to the conversation's writers and everyone else's: what a purge costs
    /// them is that share, not its lock (ARCHITECTURE §3 "Retention").
    pub async fn purge_conversation(&self, conv: &ConvId, pace: Pace) -> Result<(u64, u64), StoreError> {
        let (mut events, mut tombstones) = (0, 0);
        self.purge_watched(conv, pace, |e, t, _| {
            events += e;
            tombstones += t;
            true
        })
        .await?;
        Ok((events, tombstones))
    }

    /// [`Store::purge_conversation`], telling `chunk_done` each chunk's
    /// events, tombstones and time (its advance and its sweep); it stops
    /// early when `chunk_done` answers false. True when nothing more was due.
    /// It first sweeps what an earlier purge cut short left below `min_seq`.
    pub async fn purge_watched(
        &self,
        conv: &ConvId,
        pace: Pace,
        mut chunk_done: impl FnMut(u64, u64, Duration) -> bool,
    ) -> Result<bool, StoreError> {
        let mut left = self.left_below(conv).await?;
        loop {
            let started = Instant::now();
            let range = match left.take() {
                Some((from, below)) => {
                    let to = below.min(from.saturating_add(pace.chunk));
                    left = (to < below).then_some((to, below));
                    (from, to)
                }
                None => match self.advance(conv, pace.chunk).await? {
                    Some(range) => range,
                    None => return Ok(true),
                },
            };
            let (events, tombstones) = self.sweep(conv, range).await?;
            let took = started.elapsed();
            if !chunk_done(events, tombstones, took) {
                return Ok(false);
            }
            tokio::time::sleep(pace.rest_after(took)).await;
        }
    }

    /// Moves `min_seq` of `conv` past its next expired range of at most
    /// `chunk` events: that range, or `None` when nothing is due (or `conv`
    /// is gone). Retried when another purge moved `min_seq` meanwhile.
    async fn advance(&self, conv: &ConvId, chunk: i64) -> Result<Option<(i64, i64)>, StoreError> {
        let c = self.pool.get().await?;
        loop {
            let params: [(&(dyn ToSql + Sync), Type); 2] = [(&conv.as_str(), Type::TEXT), (&chunk, Type::INT8)];
            let Some(row) = noted(&c, c.query_prepared_opt(CHUNK_END, &params).await)? else {
                return Ok(None);
            };
            let (from, to, retention): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
            if to <= from {
                return Ok(None);
            }
            let params: [(&(dyn ToSql + Sync), Type); 4] =
                [(&conv.as_str(), Type::TEXT), (&from, Type::INT8), (&to, Type::INT8), (&retention, Type::INT8)];
            let advanced = c.execute_prepared(ADVANCE, &params).await;
            // `min_seq` moved (or may have, when the answer was lost): the
            // tail must not serve the range any more.
            self.tail.forget(conv);
            if noted(&c, advanced)? == 1 {
                return Ok(Some((from, to)));
            }
        }
    }

    /// Where an earlier sweep of `conv` was cut short: `(first event below
    /// min_seq, min_seq)`, if any is left.
    async fn left_below(&self, conv: &ConvId) -> Result<Option<(i64, i64)>, StoreError> {
        let c = self.pool.get().await?;
        let row = noted(&c, c.query_prepared_opt(LEFT_BELOW, &[(&conv.as_str(), Type::TEXT)]).await)?;
        Ok(row.and_then(|r| r.get::<_, Option<i64>>(0).map(|first| (first, r.get(1)))))
    }

    /// Purges `[from, to)` of `conv`, already below its `min_seq`: `(events
    /// purged, tombstones written)`.
    async fn sweep(&self, conv: &ConvId, (from, to): (i64, i64)) -> Result<(u64, u64), StoreError> {
        let c = self.pool.get().await?;
        let params: [(&(dyn ToSql + Sync), Type); 3] =
            [(&conv.as_str(), Type::TEXT), (&from, Type::INT8), (&to, Type::INT8)];
        let swept = noted(&c, c.query_prepared(SWEEP, &params).await)?;
        Ok(swept.first().map_or((0, 0), |d| (d.get::<_, i64>(0) as u64, d.get::<_, i64>(1) as u64)))
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

/// `r`, its failure noted on the connection it ran on (a failed connection leaves the pool).
fn noted<T>(c: &PooledClient, r: Result<T, tokio_postgres::Error>) -> Result<T, StoreError> {
    r.map_err(|e| {
        let e = StoreError::from(e);
        c.note_failure(&e);
        e
    })
}
