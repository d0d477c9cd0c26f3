//! What a scenario wrote, checked in PostgreSQL afterwards: the log of one
//! conversation against the acks the clients got (P1, P2), and the batch
//! sizes the commits had.

use imcore::store::Store;
use serde_json::{json, Value};

use super::provision::BoxError;

/// P1 (gapless from 1, next_seq = max + 1), P2 (one row per request key),
/// every ack equals its stored row, and as many rows as acks.
pub async fn verify(db: &Store, conv: &str, acks: &[(i64, String)]) -> Result<(bool, Value), BoxError> {
    let conn = db.pool().get().await?;
    let row = conn
        .query_one(
            "SELECT count(e.seq), coalesce(min(e.seq), 0), coalesce(max(e.seq), 0), max(c.next_seq),
                    count(e.client_msg_id)
                      - count(DISTINCT (e.sender_user, e.client_msg_id)) FILTER (WHERE e.client_msg_id IS NOT NULL),
                    count(*) FILTER (WHERE e.kind = 'msg')
               FROM conversations c JOIN events e USING (conv_id) WHERE c.conv_id = $1",
            &[&conv],
        )
        .await?;
    let (count, min, max, next, dup_keys, msgs): (i64, i64, i64, i64, i64, i64) =
        (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4), row.get(5));
    let seqs: Vec<i64> = acks.iter().map(|a| a.0).collect();
    let keys: Vec<&str> = acks.iter().map(|a| a.1.as_str()).collect();
    let mismatched: i64 = conn
        .query_one(
            "SELECT count(*) FROM unnest($2::int8[], $3::text[]) AS a(seq, key)
              WHERE NOT EXISTS (SELECT 1 FROM events e WHERE e.conv_id = $1 AND e.seq = a.seq
                                                        AND e.client_msg_id = a.key AND e.kind = 'msg')",
            &[&conv, &seqs, &keys],
        )
        .await?
        .get(0);
    let gapless = min == 1 && count == max && next == max + 1;
    let ok = gapless && dup_keys == 0 && mismatched == 0 && msgs == acks.len() as i64;
    Ok((
        ok,
        json!({"gapless": gapless, "duplicate_keys": dup_keys, "acks_unlike_rows": mismatched,
               "stored_msgs": msgs, "acks": acks.len(), "head": max}),
    ))
}

/// Rows per inserting transaction (xmin), as PostgreSQL saw them.
pub async fn batch_sizes(db: &Store, conv: &str) -> Result<(f64, i64), BoxError> {
    let conn = db.pool().get().await?;
    let r = conn
        .query_one(
            "SELECT coalesce(avg(n)::float8, 0), coalesce(max(n), 0) FROM (
               SELECT count(*) AS n FROM events WHERE conv_id = $1 AND kind = 'msg' GROUP BY xmin::text) t",
            &[&conv],
        )
        .await?;
    Ok((r.get(0), r.get(1)))
}
