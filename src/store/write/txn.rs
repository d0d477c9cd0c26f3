//! The write transaction's own BEGIN and COMMIT, so that each shares a round
//! trip with the statements next to it: tokio-postgres pipelines the
//! requests of futures polled together (each goes out when first polled,
//! without waiting for the replies before it), and the server runs them in
//! the order sent. A `tokio_postgres::Transaction` waits for BEGIN alone and
//! cannot send COMMIT behind a statement still in flight.

use futures_util::FutureExt;
use tokio_postgres::Error;

use super::prepared::Conn;

/// An open transaction on `client`; rolled back when dropped uncommitted
/// (an early return, a cancelled caller), like `tokio_postgres::Transaction`.
pub(super) struct WriteTx<'c> {
    conn: Conn<'c>,
    /// Neither COMMIT nor ROLLBACK has been sent.
    open: bool,
}

impl<'c> WriteTx<'c> {
    pub(super) fn new(conn: Conn<'c>) -> Self {
        Self { conn, open: true }
    }

    /// The connection, for the statements of the transaction.
    pub(super) fn conn(&self) -> Conn<'c> {
        self.conn
    }

    /// BEGIN: polled first in a `join!`, the statements polled after it go
    /// out behind it, in the same round trip.
    pub(super) async fn begin(&self) -> Result<(), Error> {
        self.conn.client.batch_execute("BEGIN").await
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
