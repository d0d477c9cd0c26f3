//! Building and running the server. `Application::build` binds the listener
//! (port 0 works) and returns before serving, so tests boot the very same
//! server on an ephemeral port.

use std::fs;
use std::io::Write;
use std::net::TcpListener;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use actix_web::dev::Server;
use actix_web::web;
use rand::RngCore;
use tokio::sync::Notify;

use crate::cluster::{Bus, BusError};
use crate::config::{admin_token_path, Config, RetentionSettings, WritePath, MIN_ADMIN_TOKEN_CHARS, SHUTDOWN_GRACE};
use crate::gateway::{self, AppState};
use crate::pg::{EmbeddedPg, PgError, PgOptions, DATABASE};
use crate::store::{Pace, Store, StoreError};
use crate::writer::Engine;

#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    #[error("embedded PostgreSQL: {0}")]
    Pg(#[from] PgError),
    #[error("database: {0}")]
    Store(#[from] StoreError),
    #[error("{0}: {1}")]
    Io(&'static str, #[source] std::io::Error),
    #[error("cluster bus: {0}")]
    Bus(#[from] BusError),
    #[error(
        "the admin token (IMCORE_ADMIN_TOKEN, --admin-token or <data-dir>/admin-token) has {chars} characters; \
         it needs at least {MIN_ADMIN_TOKEN_CHARS} (e.g. `openssl rand -hex 32`)"
    )]
    WeakAdminToken { chars: usize },
    #[error("IMCORE_METRICS_TOKEN has {chars} characters; it needs at least {MIN_ADMIN_TOKEN_CHARS}")]
    WeakMetricsToken { chars: usize },
}

pub struct Application {
    port: u16,
    server: Server,
    state: web::Data<AppState>,
    trigger: ShutdownTrigger,
    /// Kept alive while serving; dropped (stopped) after the server stops.
    embedded_pg: Option<EmbeddedPg>,
}

impl Application {
    pub async fn build(config: Config) -> Result<Self, StartupError> {
        let admin_token = match &config.admin_token {
            Some(t) => t.clone(),
            None => admin_token_file(&config.data_dir)?,
        };
        let chars = admin_token.chars().count();
        if chars < MIN_ADMIN_TOKEN_CHARS {
            return Err(StartupError::WeakAdminToken { chars });
        }
        if let Some(chars) = config.metrics_token.as_ref().map(|t| t.chars().count()) {
            if chars < MIN_ADMIN_TOKEN_CHARS {
                return Err(StartupError::WeakMetricsToken { chars });
            }
        }
        let (database_url, embedded_pg) = match &config.database_url {
            Some(url) => (url.clone(), None),
            None => {
                let pg = EmbeddedPg::start(PgOptions::new(&config.data_dir)).await?;
                (pg.url(DATABASE), Some(pg))
            }
        };
        let store = Store::connect_with(&database_url, &config.store).await?;
        let applied = store.migrate().await?;
        tracing::info!(applied, "schema is current");
        let listener = TcpListener::bind(config.listen).map_err(|e| StartupError::Io("bind listener", e))?;
        set_tcp_user_timeout(&listener, config.ws.timeout_ms)
            .map_err(|e| StartupError::Io("set TCP_USER_TIMEOUT", e))?;
        let addr = listener.local_addr().map_err(|e| StartupError::Io("bind listener", e))?;
        let port = addr.port();
        let Engine { writer, delivery } = Engine::start(store.clone(), &config.engine);
        if config.notify.notify {
            crate::notify::start(database_url.clone(), config.notify.clone(), &delivery)
                .map_err(|e| StartupError::Io("start the notifier", e))?;
        }
        let bus = match &config.nats_url {
            Some(url) => {
                // Another node's epoch bump or purge would not reach this node's tail.
                store.tail().disable();
                let homes = config.home_node && writer.path() == WritePath::Actor;
                Some(Bus::join(url, &config.bus, config.max_body_bytes, &delivery, &writer, homes).await?)
            }
            None => None,
        };
        let workers = config.workers;
        let state = web::Data::new(AppState::new(store, writer, bus, delivery, admin_token, Arc::new(config)));
        let app_state = state.clone();
        let mut http = actix_server::Server::build()
            // Signals are ours: graceful shutdown is a protocol (`shutdown`), not just a stop.
            .disable_signals()
            .shutdown_timeout(SHUTDOWN_GRACE.as_secs());
        if workers > 0 {
            http = http.workers(workers);
        }
        let server = http
            .listen("imcore", listener, move || gateway::service(app_state.clone(), addr))
            .map_err(|e| StartupError::Io("listen", e))?
            .run();
        tracing::info!(port, "imcore is listening");
        Ok(Self { port, server, state, embedded_pg, trigger: ShutdownTrigger::default() })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The state every worker shares (tests reach the writer and delivery).
    pub fn state(&self) -> &web::Data<AppState> {
        &self.state
    }

    /// Starts graceful shutdown from inside the process (tests; same path as a signal).
    pub fn shutdown_trigger(&self) -> ShutdownTrigger {
        self.trigger.clone()
    }

    /// Serves until SIGINT/SIGTERM or the [`ShutdownTrigger`], then shuts down
    /// gracefully, outside in:
    /// 1. stop accepting connections (upgrades already accepted are refused);
    /// 2. every WebSocket session answers its in-flight requests, gets
    ///    `kicked: shutdown` and closes (at most [`SHUTDOWN_GRACE`]);
    /// 3. the writer commits and answers everything queued;
    /// 4. the HTTP server stops (in-flight HTTP requests get [`SHUTDOWN_GRACE`]);
    /// 5. the embedded PostgreSQL, if any, stops.
    pub async fn run_until_stopped(self) -> std::io::Result<()> {
        let Self { server, state, embedded_pg, trigger, .. } = self;
        let handle = server.handle();
        // Polled on its own task: the handle's commands are served by it.
        let mut running = actix_web::rt::spawn(server);
        let purging = actix_web::rt::spawn(purge_periodically(state.store.clone(), state.config.retention.clone()));
        let joined = |r: Result<std::io::Result<()>, tokio::task::JoinError>| {
            r.unwrap_or_else(|e| Err(std::io::Error::other(e)))
        };
        tokio::select! {
            result = &mut running => {
                drop(embedded_pg);
                return joined(result);
            }
            () = shutdown_requested(&trigger) => {}
        }
        tracing::info!("graceful shutdown: stop accepting, tell sessions");
        // A purge cut short loses nothing: each chunk is its own transaction.
        purging.abort();
        handle.pause().await;
        state.begin_shutdown();
        let deadline = tokio::time::Instant::now() + SHUTDOWN_GRACE;
        while !state.sessions.is_empty() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tracing::info!(left = state.sessions.len(), "graceful shutdown: draining the writer");
        state.writer.shutdown().await;
        handle.stop(true).await;
        let result = joined(running.await);
        drop(embedded_pg);
        tracing::info!("stopped");
        result
    }
}

/// Runs the retention purge every `interval_ms` (never with 0) until aborted.
async fn purge_periodically(store: Store, settings: RetentionSettings) {
    if settings.interval_ms == 0 {
        return;
    }
    let mut ticks = tokio::time::interval(Duration::from_millis(settings.interval_ms));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.tick().await; // the first tick is now: wait a whole interval first
    loop {
        ticks.tick().await;
        match store.purge_expired(Pace::of(&settings), settings.tombstone_horizon()).await {
            Ok(report) if report.events_purged > 0 || report.tombstones_expired > 0 => {
                tracing::info!(?report, "retention purge")
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %crate::store::Report(&e), "retention purge failed; retried next interval")
            }
        }
    }
}

/// Asks a running [`Application`] to shut down gracefully.
#[derive(Clone, Default)]
pub struct ShutdownTrigger(Arc<Notify>);

impl ShutdownTrigger {
    pub fn fire(&self) {
        self.0.notify_one();
    }
}

async fn shutdown_requested(trigger: &ShutdownTrigger) {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT"),
        () = terminate => tracing::info!("SIGTERM"),
        () = trigger.0.notified() => tracing::info!("shutdown requested"),
    }
}

/// The generated admin token, kept in `<data_dir>/admin-token` (mode 0600).
fn admin_token_file(data_dir: &Path) -> Result<String, StartupError> {
    let path = admin_token_path(data_dir);
    if let Ok(token) = fs::read_to_string(&path) {
        tracing::info!(path = %path.display(), "admin token is in this file");
        return Ok(token.trim().to_owned());
    }
    let mut raw = [0u8; 32];
    rand::thread_rng().fill_bytes(&mut raw);
    let token = hex::encode(raw);
    fs::create_dir_all(data_dir).map_err(|e| StartupError::Io("create data directory", e))?;
    fs::OpenOptions::new()
        .create_new(true)
        .write(true)
        .mode(0o600)
        .open(&path)
        .and_then(|mut f| f.write_all(token.as_bytes()))
        .map_err(|e| StartupError::Io("write admin token", e))?;
    tracing::info!(path = %path.display(), "generated an admin token; it is in this file");
    Ok(token)
}

/// Accepted sockets inherit `TCP_USER_TIMEOUT` from the listener: a peer that
/// stops reading (zero window) for this long has its connection dropped by
/// the kernel, so a session stalled behind a full write buffer — which also
/// stalls its own heartbeat — still ends.
fn set_tcp_user_timeout(listener: &TcpListener, timeout_ms: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let ms = libc::c_uint::try_from(timeout_ms).unwrap_or(libc::c_uint::MAX);
    // SAFETY: setsockopt on a socket we own, with a pointer to a live c_uint and its size.
    let rc = unsafe {
        libc::setsockopt(
            listener.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_USER_TIMEOUT,
            (&ms as *const libc::c_uint).cast(),
            std::mem::size_of::<libc::c_uint>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}
