//! The write transaction's own BEGIN and COMMIT, so that each shares a round
//! trip with the statements next to it: tokio-postgres pipelines the
//! requests of futures polled together (each goes out when first polled,
//! without waiting for the replies before it), and the server runs them in
//! the order sent. A `tokio_postgres::Transaction` waits for BEGIN alone and
//! cannot send COMMIT behind a statement still in flight.

use futures_util::FutureExt;
use tokio_postgres::Error;

use super::ops::WriteOp;
use super::prepared::Conn;
use super::BatchJob;

/// BEGIN, with the transaction's statements planned once per connection: a
/// custom plan per call cost 0.25 ms of planning at bind for the one-trip
/// statement, and 0.5 ms per merged round for the append. A generic plan is
/// made with the statistics of its first call, which on a young database say
/// the tables are all but empty; the statements it serves are probes by key
/// (the row by its key, `LATERAL … LIMIT 1`, scalar subqueries, key lists
/// joined to primary keys), and scans and hash or merge joins are priced
/// out, so that plan probes by key at any size (ARCHITECTURE §3).
pub(super) const BEGIN_PLANNED_ONCE: &str = "BEGIN; SET LOCAL plan_cache_mode = force_generic_plan; \
                                             SET LOCAL enable_seqscan = off; SET LOCAL enable_hashjoin = off; \
                                             SET LOCAL enable_mergejoin = off";

/// An open transaction on `client`; rolled back when dropped uncommitted
/// (an early return, a cancelled caller), like `tokio_postgres::Transaction`.
pub(super) struct WriteTx<'c> {
    conn: Conn<'c>,
    /// Begun with [`BEGIN_PLANNED_ONCE`].
    planned_once: bool,
    /// Neither COMMIT nor ROLLBACK has been sent.
    open: bool,
}

impl<'c> WriteTx<'c> {
    /// A transaction for `jobs`. One whose ops are all sends runs only the
    /// statements whose generic plans were checked to probe by key (the
    /// lock, the key, standing and target lookups, the append); any other
    /// plans each statement for its parameters.
    pub(super) fn new(conn: Conn<'c>, jobs: &[BatchJob]) -> Self {
        let planned_once = jobs.iter().flat_map(|j| &j.ops).all(|op| matches!(op, WriteOp::Send(_)));
        Self { conn, planned_once, open: true }
    }

    /// The connection, for the statements of the transaction.
    pub(super) fn conn(&self) -> Conn<'c> {
        self.conn
    }

    /// BEGIN: polled first in a `join!`, the statements polled after it go
    /// out behind it, in the same round trip.
    pub(super) async fn begin(&self) -> Result<(), Error> {
        self.conn.client.batch_execute(if self.planned_once { BEGIN_PLANNED_ONCE } else { "BEGIN" }).await
    }

    /// COMMIT, polled after the transaction's last statement so that it goes
    /// out behind it. If that statement failed, the transaction is aborted
    /// and the server answers COMMIT by rolling back.
    pub(super) async fn commit(mut self) -> Result<(), Error> {
        self.open = false;
        self.conn.client.batch_execute("COMMIT").await
    }
}

impl Drop for WriteTx<'_> {
    fn drop(&mut self) {
        if self.open {
            // One poll sends ROLLBACK ahead of whatever the connection's next
            // user sends; its reply is not awaited.
            let _ = self.conn.client.batch_execute("ROLLBACK").now_or_never();
        }
    }
}
