//! The pooled connection: a client with the write path's statements
//! prepared on it once, by its first write transaction (not when it
//! connects: the pool also serves the migrations that create the tables).
//!
//! A statement sent unprepared (`query_typed`) is parsed and planned by the
//! server every time; for the write transaction's statements that cost more
//! than a round trip (ARCHITECTURE §3, "Measured").

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};

use bb8_postgres::PostgresConnectionManager;
use tokio::sync::OnceCell;
use tokio_postgres::{Client, Error, NoTls};

use super::write::Prepared;
use super::{ErrorClass, StoreError};

/// A connection of the pool; derefs to its client.
pub struct PooledClient {
    client: Client,
    prepared: OnceCell<Prepared>,
    /// A statement on it failed because the connection did: it leaves the
    /// pool when returned, even if its task has not seen the close yet.
    failed: AtomicBool,
}

impl PooledClient {
    /// Notes how a statement on this connection failed (see `failed`).
    pub(super) fn note_failure(&self, e: &StoreError) {
        if e.class() == Some(ErrorClass::Unavailable) {
            self.failed.store(true, Ordering::Relaxed);
        }
    }

    /// The write path's statements, prepared on first use.
    pub(super) async fn prepared(&self) -> Result<&Prepared, Error> {
        self.prepared.get_or_try_init(|| Prepared::prepare(&self.client)).await
    }

    /// The client and its prepared statements, borrowed apart (a transaction
    /// borrows the client mutably while the statements are used beside it).
    pub(super) async fn split(&mut self) -> Result<(&mut Client, &Prepared), Error> {
        let prepared = self.prepared.get_or_try_init(|| Prepared::prepare(&self.client)).await?;
        Ok((&mut self.client, prepared))
    }
}

impl Deref for PooledClient {
    type Target = Client;

    fn deref(&self) -> &Client {
        &self.client
    }
}

impl DerefMut for PooledClient {
    fn deref_mut(&mut self) -> &mut Client {
        &mut self.client
    }
}

/// Connects like `bb8_postgres` and prepares the statements.
pub struct Manager {
    inner: PostgresConnectionManager<NoTls>,
}

impl Manager {
    pub fn new(config: tokio_postgres::Config) -> Self {
        Self { inner: PostgresConnectionManager::new(config, NoTls) }
    }
}

impl bb8::ManageConnection for Manager {
    type Connection = PooledClient;
    type Error = Error;

    async fn connect(&self) -> Result<PooledClient, Error> {
        Ok(PooledClient {
            client: self.inner.connect().await?,
            prepared: OnceCell::new(),
            failed: AtomicBool::new(false),
        })
    }

    /// No round trip: a connection known closed (its task saw the close, or
    /// a write transaction or purge saw it fail) is refused at checkout, so
    /// it does not fail the next transaction too. One that dies unseen fails
    /// the transaction that next uses it, before COMMIT is sent: nothing of it
    /// took effect, and the retry is safe (P2).
    async fn is_valid(&self, conn: &mut PooledClient) -> Result<(), Error> {
        // A connection marked `failed` never comes back to the pool.
        if conn.client.is_closed() {
            // Fails at once, without I/O: the error says the connection is closed.
            conn.client.simple_query("").await?;
        }
        Ok(())
    }

    fn has_broken(&self, conn: &mut PooledClient) -> bool {
        conn.client.is_closed() || conn.failed.load(Ordering::Relaxed)
    }
}
