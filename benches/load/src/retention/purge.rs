//! Purging a conversation chunk by chunk through `Store::purge_watched` (what
//! `purge_conversation` runs), timing each chunk (advance and sweep), and
//! checking what the purge left.

use std::time::Instant;

use imcore::store::{Pace, Store};
use imcore_actors::ConvId;
use serde_json::{json, Value};

use super::fill::Filled;
use crate::environment::BoxError;
use crate::percentiles::Percentiles;

/// What one purge did, and how long its chunks took.
pub struct Purged {
    pub pace: Pace,
    pub events: u64,
    pub tombstones: u64,
    pub seconds: f64,
    pub chunk_ms: Percentiles,
    /// Nothing more was due when it stopped (else the deadline stopped it).
    pub complete: bool,
}

/// Purges `conv` at `pace`, as the product does,
/// until nothing is due or `until` passes (checked between chunks).
pub async fn purge(store: &Store, conv: &ConvId, pace: Pace, until: Option<Instant>) -> Result<Purged, BoxError> {
    let started = Instant::now();
    let (mut events, mut tombstones, mut chunk_ms) = (0, 0, vec![]);
    let complete = store
        .purge_watched(conv, pace, |e, b, took| {
            chunk_ms.push(took.as_secs_f64() * 1000.0);
            events += e;
            tombstones += b;
            !until.is_some_and(|t| Instant::now() >= t)
        })
        .await?;
    let seconds = started.elapsed().as_secs_f64();
    Ok(Purged { pace, events, tombstones, seconds, chunk_ms: Percentiles::of(chunk_ms), complete })
}

impl Purged {
    pub fn json(&self) -> Value {
        json!({
            "chunk": self.pace.chunk,
            "duty_pct": self.pace.duty_pct,
            "events_purged": self.events,
            "tombstones_written": self.tombstones,
            "seconds": (self.seconds * 100.0).round() / 100.0,
            "events_per_s": (self.events as f64 / self.seconds).round(),
            "tombstones_per_s": (self.tombstones as f64 / self.seconds).round(),
            "chunks": self.chunk_ms.samples,
            "chunk_ms": self.chunk_ms.json(),
            "complete": self.complete,
        })
    }

    pub fn text(&self) -> String {
        format!(
            "chunk {:>6} duty {:>3}%: {:>8} events, {:>8} tombstones in {:.1} s = {:>7.0} events/s, {} chunks, chunk txn {}{}",
            self.pace.chunk,
            self.pace.duty_pct,
            self.events,
            self.tombstones,
            self.seconds,
            self.events as f64 / self.seconds,
            self.chunk_ms.samples,
            self.chunk_ms.text(),
            if self.complete { "" } else { " (stopped at the deadline)" }
        )
    }
}

/// What a purge of `filled` must leave: the log gapless from `min_seq` to
/// the head (P1); one tombstone per purged send, and none more (P9); every
/// filled send either still there or tombstoned; and, when the purge ran to
/// the end, nothing old left (`min_seq` at the first event a run appended).
pub async fn check(store: &Store, filled: &Filled, purged: &Purged) -> Result<bool, BoxError> {
    let conn = store.pool().get().await?;
    let conv = filled.conv.as_str();
    let r = conn
        .query_one(
            "SELECT c.min_seq, c.next_seq,
                    (SELECT count(*) FROM events e WHERE e.conv_id = $1),
                    (SELECT coalesce(min(seq), c.next_seq) FROM events e WHERE e.conv_id = $1),
                    (SELECT coalesce(max(seq), c.min_seq - 1) FROM events e WHERE e.conv_id = $1),
                    (SELECT count(*) FROM events e WHERE e.conv_id = $1 AND e.kind = 'msg' AND e.seq < $2),
                    (SELECT count(*) FROM idem_tombstones t WHERE t.conv_id = $1)
               FROM conversations c WHERE c.conv_id = $1",
            &[&conv, &filled.end_seq],
        )
        .await?;
    let (min_seq, next_seq, rows, first, last, old_left, buried): (i64, i64, i64, i64, i64, i64, i64) =
        (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4), r.get(5), r.get(6));
    let gapless = first == min_seq && last == next_seq - 1 && rows == next_seq - min_seq;
    let tombstoned = buried as u64 == purged.tombstones && old_left + buried == filled.events;
    let drained = !purged.complete || min_seq == filled.end_seq;
    let ok = gapless && tombstoned && drained;
    if !ok {
        eprintln!(
            "purge of {conv} failed its check: min_seq {min_seq}, next_seq {next_seq}, {rows} events ({first}..{last}), \
             {old_left} old sends left, {buried} tombstones for {} reported, {} filled",
            purged.tombstones, filled.events
        );
    }
    Ok(ok)
}
