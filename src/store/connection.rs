//! The pool and its connections: a client with the write path's statements
//! prepared on it once, by its first write transaction (not when it
//! connects: the pool also serves the migrations that create the tables),
//! and every other statement it runs outside a transaction prepared by its
//! first use.
//!
//! A statement sent unprepared (`query_typed`) is parsed and planned by the
//! server every time; for the write transaction's statements that cost more
//! than a round trip (ARCHITECTURE §3, "Measured"). While no primary answers
//! (a failover), a checkout waits one connect timeout, not the pool timeout
//! (ARCHITECTURE §6, "The database failing over").
//!
//! A pool's connections run their I/O on a thread of the pool's own
//! (`pg-io`), not on the runtime of whichever task first asked for one (the
//! System thread, an HTTP worker, a conversation actor's arbiter): an arbiter
//! that stopped took its connections with it, and whoever held one next got
//! `Closed`.

use std::collections::HashMap;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use std::{io, thread};

use bb8::{PooledConnection, RunError};
use bb8_postgres::PostgresConnectionManager;
use tokio::runtime::Handle;
use tokio::sync::{oneshot, watch, OnceCell};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, Error, NoTls, Row, Statement};

use super::write::Prepared;
use super::{ErrorClass, StoreError};

/// A statement's parameters with their types, as `query_typed` takes them.
type Params<'a> = [(&'a (dyn ToSql + Sync), Type)];

/// A connection of the pool; derefs to its client.
pub struct PooledClient {
    client: Client,
    prepared: OnceCell<Prepared>,
    /// The other statements, by their text: each `'static`, so the set is
    /// bounded by the program's statements.
    statements: Mutex<HashMap<&'static str, Statement>>,
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

    /// `sql` prepared on this connection with the parameters' types, by its
    /// first use here; and the parameters' values.
    async fn statement<'a>(
        &self,
        sql: &'static str,
        params: &Params<'a>,
    ) -> Result<(Statement, Vec<&'a (dyn ToSql + Sync)>), Error> {
        let values = params.iter().map(|(v, _)| *v).collect();
        let cached = self.statements.lock().unwrap_or_else(PoisonError::into_inner).get(sql).cloned();
        if let Some(statement) = cached {
            return Ok((statement, values));
        }
        let types: Vec<Type> = params.iter().map(|(_, t)| t.clone()).collect();
        let statement = self.client.prepare_typed(sql, &types).await?;
        self.statements.lock().unwrap_or_else(PoisonError::into_inner).insert(sql, statement.clone());
        Ok((statement, values))
    }

    /// `query_typed`, with the statement prepared once per connection.
    pub(super) async fn query_prepared(&self, sql: &'static str, params: &Params<'_>) -> Result<Vec<Row>, Error> {
        let (statement, values) = self.statement(sql, params).await?;
        self.client.query(&statement, &values).await
    }

    /// `query_typed_opt`, with the statement prepared once per connection.
    pub(super) async fn query_prepared_opt(
        &self,
        sql: &'static str,
        params: &Params<'_>,
    ) -> Result<Option<Row>, Error> {
        let (statement, values) = self.statement(sql, params).await?;
        self.client.query_opt(&statement, &values).await
    }

    /// `query_typed_one`, with the statement prepared once per connection.
    pub(super) async fn query_prepared_one(&self, sql: &'static str, params: &Params<'_>) -> Result<Row, Error> {
        let (statement, values) = self.statement(sql, params).await?;
        self.client.query_one(&statement, &values).await
    }

    /// `execute_typed`, with the statement prepared once per connection.
    pub(super) async fn execute_prepared(&self, sql: &'static str, params: &Params<'_>) -> Result<u64, Error> {
        let (statement, values) = self.statement(sql, params).await?;
        self.client.execute(&statement, &values).await
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

/// The connection pool: bb8's, with a shorter wait while the database is
/// known unreachable. Cheap to clone.
#[derive(Clone)]
pub struct Pool {
    inner: bb8::Pool<Manager>,
    /// Whether the latest connection attempt succeeded (set by the manager).
    reachable: Arc<watch::Sender<bool>>,
    /// The wait for a connection while `reachable` is false.
    unreachable_wait: Duration,
}

impl Pool {
    pub(super) async fn build(
        builder: bb8::Builder<Manager>,
        config: tokio_postgres::Config,
        unreachable_wait: Duration,
    ) -> Result<Self, Error> {
        let reachable = Arc::new(watch::Sender::new(true));
        // As the delivery lanes: a process that cannot start a thread cannot serve.
        let io = IoThread::start().unwrap_or_else(|e| panic!("cannot start the pool's I/O thread: {e}"));
        let manager =
            Manager { inner: PostgresConnectionManager::new(config, NoTls), reachable: reachable.clone(), io };
        Ok(Self { inner: builder.build(manager).await?, reachable, unreachable_wait })
    }

    /// A connection, waiting at most the pool timeout; once an attempt to
    /// connect finds no primary (now or during the wait), at most
    /// `unreachable_wait` more. A failure sent nothing, so the caller may
    /// answer `OVERLOADED`.
    pub async fn get(&self) -> Result<PooledConnection<'_, Manager>, RunError<Error>> {
        let mut reachable = self.reachable.subscribe();
        let get = self.inner.get();
        tokio::pin!(get);
        tokio::select! {
            biased;
            got = &mut get => return got,
            // The sender lives as long as the pool: an error never comes.
            _ = reachable.wait_for(|r| !*r) => {}
        }
        tokio::time::timeout(self.unreachable_wait, get).await.unwrap_or(Err(RunError::TimedOut))
    }

    /// A connection within `unreachable_wait` whatever the state (a probe
    /// must not wait the pool timeout), or `None`.
    pub async fn probe(&self) -> Option<PooledConnection<'_, Manager>> {
        tokio::time::timeout(self.unreachable_wait, self.inner.get()).await.ok()?.ok()
    }

    /// Whether the latest connection attempt reached a server it could use.
    pub fn reachable(&self) -> bool {
        *self.reachable.borrow()
    }

    pub fn state(&self) -> bb8::State {
        self.inner.state()
    }
}

/// Connects like `bb8_postgres` (to a primary, when `DATABASE_URL` names
/// several hosts with `target_session_attrs=read-write`) and prepares the
/// statements.
pub struct Manager {
    inner: PostgresConnectionManager<NoTls>,
    reachable: Arc<watch::Sender<bool>>,
    io: IoThread,
}

/// A thread running the pool's connections, for as long as the pool lives.
struct IoThread {
    handle: Handle,
    /// Dropped with the pool: the thread's runtime then ends, and with it
    /// every connection still open.
    _stop: oneshot::Sender<()>,
}

impl IoThread {
    fn start() -> io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = oneshot::channel::<()>();
        thread::Builder::new().name("pg-io".into()).spawn(move || {
            let _ = runtime.block_on(stopped);
        })?;
        Ok(Self { handle, _stop: stop })
    }
}

impl bb8::ManageConnection for Manager {
    type Connection = PooledClient;
    type Error = Error;

    async fn connect(&self) -> Result<PooledClient, Error> {
        // The connection's task is spawned where it is opened.
        let inner = self.inner.clone();
        let client = match self.io.handle.spawn(async move { inner.connect().await }).await {
            Ok(client) => client,
            // Not cancelled: the runtime lives as long as this manager.
            Err(e) => std::panic::resume_unwind(e.into_panic()),
        };
        self.reachable.send_if_modified(|r| std::mem::replace(r, client.is_ok()) != client.is_ok());
        Ok(PooledClient {
            client: client?,
            prepared: OnceCell::new(),
            statements: Mutex::default(),
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
