//! The conversations the retention benchmark starts from, made over SQL in
//! one statement each rather than through the write path: a million old
//! sends, a million tombstones. Only the starting state bypasses the API;
//! what is measured (purges and sends) goes through the store and the writer.

use imcore::store::{GroupSettings, Store};
use imcore_actors::{ConvId, UserId};

use crate::environment::BoxError;
use crate::senders::{body, group};

/// Retention of the benchmark's conversations: the filled events (a day
/// old) are all due, what the runs send is not.
pub const RETENTION_MS: i64 = 3_600_000;

/// A day back: older than [`RETENTION_MS`].
const AGE: &str = "now() - interval '1 day'";

/// A conversation holding `events` old sends, the last at `end_seq - 1`.
pub struct Filled {
    pub conv: ConvId,
    pub events: i64,
    /// `next_seq` after the fill: what a run appends starts here.
    pub end_seq: i64,
}

/// A group of `users` with [`RETENTION_MS`], its creation events aged.
pub async fn old_group(store: &Store, users: &[UserId], id: &str) -> Result<ConvId, BoxError> {
    let conv =
        group(store, users, id, GroupSettings { retention_ms: Some(RETENTION_MS), ..GroupSettings::default() }).await?;
    let conn = store.pool().get().await?;
    conn.execute(&format!("UPDATE events SET created_at = {AGE} WHERE conv_id = $1"), &[&conv.as_str()]).await?;
    Ok(conv)
}

/// [`old_group`] with `events` sends appended a day back: distinct
/// client_msg_ids (`old-N`), 32-byte request hashes, the members in turn as
/// senders, `next_seq` moved past them.
pub async fn filled_group(store: &Store, users: &[UserId], id: &str, events: i64) -> Result<Filled, BoxError> {
    let conv = old_group(store, users, id).await?;
    let names: Vec<&str> = users.iter().map(|u| u.as_str()).collect();
    let mut conn = store.pool().get().await?;
    let tx = conn.transaction().await?;
    tx.batch_execute("SET LOCAL statement_timeout = 0").await?;
    let from: i64 = tx
        .query_one("SELECT next_seq FROM conversations WHERE conv_id = $1 FOR NO KEY UPDATE", &[&conv.as_str()])
        .await?
        .get(0);
    tx.execute(
        &format!(
            "INSERT INTO events (conv_id, seq, kind, message_id, sender_user, sender_device, client_msg_id,
                                 request_hash, body, created_at)
             SELECT $1, $2::int8 + i, 'msg', gen_random_uuid(), ($3::text[])[1 + i % cardinality($3::text[])],
                    'bulk', 'old-' || i, sha256(i::text::bytea), $4, {AGE}
               FROM generate_series(0, $5::int8 - 1) i"
        ),
        &[&conv.as_str(), &from, &names, &body(0).text(), &events],
    )
    .await?;
    tx.execute("UPDATE conversations SET next_seq = $2 WHERE conv_id = $1", &[&conv.as_str(), &(from + events)])
        .await?;
    tx.commit().await?;
    Ok(Filled { conv, events, end_seq: from + events })
}

/// `n` tombstones of `conv`'s members under keys no run sends (`old-N`),
/// as retention would have left them (their seqs are placeholders: a send's
/// lookup reads only the key and the hash).
pub async fn tombstones(store: &Store, conv: &ConvId, users: &[UserId], n: i64) -> Result<(), BoxError> {
    let names: Vec<&str> = users.iter().map(|u| u.as_str()).collect();
    let mut conn = store.pool().get().await?;
    let tx = conn.transaction().await?;
    tx.batch_execute("SET LOCAL statement_timeout = 0").await?;
    tx.execute(
        "INSERT INTO idem_tombstones (conv_id, sender_user, client_msg_id, request_hash, seq)
         SELECT $1, ($2::text[])[1 + i % cardinality($2::text[])], 'old-' || i, sha256(i::text::bytea), i
           FROM generate_series(1, $3::int8) i",
        &[&conv.as_str(), &names, &n],
    )
    .await?;
    tx.commit().await?;
    Ok(())
}

/// Rows in `idem_tombstones`, all conversations.
pub async fn tombstone_rows(store: &Store) -> Result<i64, BoxError> {
    let conn = store.pool().get().await?;
    Ok(conn.query_one("SELECT count(*) FROM idem_tombstones", &[]).await?.get(0))
}
