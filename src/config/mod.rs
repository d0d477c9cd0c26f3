//! Configuration: flags and environment, one place, defaults that work.
//!
//! Settings are grouped by the part they size (store, write engine,
//! delivery, WebSocket). Each group has one `Default`, which is where its
//! numbers are written; the flags' defaults and [`Config::for_database`] read
//! them from there.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, Parser, ValueEnum};
use imcore_actors::conversation::ActorConfig;
use imcore_actors::hub::HubConfig;

use crate::domain::DEFAULT_MAX_BODY_BYTES;

mod bus;
mod groups;
mod notify;
mod retention;
pub use bus::{nats_servers, nats_servers_redacted, BusSettings};
pub use groups::LargeGroupSettings;
pub use notify::NotifySettings;
pub use retention::RetentionSettings;

/// How sends reach PostgreSQL.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum WritePath {
    /// Through the conversation's actor, batched (group commit).
    Actor,
    /// One transaction per op, no actor: the baseline benchmarks compare against.
    Direct,
}

#[derive(Debug, Clone, Parser)]
#[command(name = "imcore", version, about = "imcore instant-messaging server")]
pub struct Config {
    /// PostgreSQL to use. Unset: run an embedded PostgreSQL in the data directory.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,

    /// Address to serve HTTP and WebSocket on.
    #[arg(long, env = "IMCORE_LISTEN", default_value = "127.0.0.1:8080", global = true)]
    pub listen: SocketAddr,

    /// Holds the embedded PostgreSQL (`pg/`) and the generated admin token.
    #[arg(long, env = "IMCORE_DATA_DIR", default_value = DEFAULT_DATA_DIR, global = true)]
    pub data_dir: PathBuf,

    /// Admin bearer token, at least 32 characters (the server refuses to
    /// start with a shorter one). Unset: generated once and kept in
    /// `<data_dir>/admin-token`.
    #[arg(long, env = "IMCORE_ADMIN_TOKEN", hide_env_values = true, global = true)]
    pub admin_token: Option<String>,

    /// Bearer token `/metrics` asks for, at least 32 characters. Unset: only
    /// loopback peers may scrape it (the counts describe the service's load).
    #[arg(long, env = "IMCORE_METRICS_TOKEN", hide_env_values = true, global = true)]
    pub metrics_token: Option<String>,

    #[command(flatten)]
    pub store: StoreSettings,

    /// Largest message body, serialized compactly.
    #[arg(long, env = "IMCORE_MAX_BODY_BYTES", default_value_t = DEFAULT_MAX_BODY_BYTES)]
    pub max_body_bytes: usize,

    #[command(flatten)]
    pub engine: EngineSettings,

    #[command(flatten)]
    pub ws: WsSettings,

    #[command(flatten)]
    pub limits: LimitSettings,

    #[command(flatten)]
    pub retention: RetentionSettings,

    #[command(flatten)]
    pub live: LiveSettings,

    #[command(flatten)]
    pub notify: NotifySettings,

    /// HTTP worker threads (0: one per core).
    #[arg(long, env = "IMCORE_WORKERS", default_value_t = 0)]
    pub workers: usize,

    /// NATS server joining this node to others on the same PostgreSQL
    /// (ARCHITECTURE §7); several, comma-separated, for a NATS cluster (the
    /// node reconnects to another when its server goes). Unset: a single
    /// node, no bus.
    #[arg(long, env = "IMCORE_NATS_URL")]
    pub nats_url: Option<String>,

    #[command(flatten)]
    pub bus: BusSettings,

    /// With a bus and the actor write path: each conversation's writes go to
    /// one home node (ARCHITECTURE §7). Off: every node writes locally, under
    /// the row lock.
    #[arg(long, env = "IMCORE_HOME_NODE", default_value_t = true, action = clap::ArgAction::Set,
          value_parser = clap::builder::BoolishValueParser::new())]
    pub home_node: bool,

    /// Log filter (tracing `EnvFilter` syntax).
    #[arg(long, env = "IMCORE_LOG", default_value = "info")]
    pub log: String,

    /// Bytes of event bodies in one `sync` reply; a page stops early at this
    /// budget (always at least one event) and says `has_more`.
    #[arg(long, env = "IMCORE_SYNC_MAX_BYTES", default_value_t = SYNC_DEFAULT_MAX_BYTES)]
    pub sync_max_bytes: usize,
}

const DEFAULT_DATA_DIR: &str = "./var";

/// The `Retry-After` (seconds) of every HTTP `OVERLOADED` answer, the
/// WebSocket upgrade's included (PROTOCOL §2).
pub const OVERLOADED_RETRY_AFTER_SECS: u64 = 1;

/// Bytes of event bodies in one `sync` page, unless configured otherwise.
pub const SYNC_DEFAULT_MAX_BYTES: usize = 1024 * 1024;

/// The shortest admin token the server starts with: guessing it must stay
/// hopeless at any rate (the generated one has 64 hex characters).
pub const MIN_ADMIN_TOKEN_CHARS: usize = 32;

/// Where the generated admin token is kept (when none is configured).
pub fn admin_token_path(data_dir: &Path) -> PathBuf {
    data_dir.join("admin-token")
}

impl Config {
    /// Defaults for embedding (tests, benchmarks): nothing read from the
    /// environment, an ephemeral port, warnings only.
    pub fn for_database(url: String) -> Self {
        Self {
            database_url: Some(url),
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            data_dir: PathBuf::from(DEFAULT_DATA_DIR),
            admin_token: None,
            metrics_token: None,
            store: StoreSettings::default(),
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            engine: EngineSettings::default(),
            ws: WsSettings::default(),
            limits: LimitSettings::default(),
            retention: RetentionSettings::default(),
            live: LiveSettings::default(),
            notify: NotifySettings::default(),
            workers: 0,
            nats_url: None,
            bus: BusSettings::default(),
            home_node: true,
            log: "warn".into(),
            sync_max_bytes: SYNC_DEFAULT_MAX_BYTES,
        }
    }
}

/// The database connection pool, and the sizes the write transaction judges groups by.
#[derive(Debug, Clone, Args)]
pub struct StoreSettings {
    /// Database connections in the pool.
    #[arg(long, env = "IMCORE_POOL_SIZE", default_value_t = StoreSettings::default().pool_size)]
    pub pool_size: u32,

    /// A request waiting this many ms for a pooled connection fails.
    #[arg(long, env = "IMCORE_POOL_TIMEOUT_MS", default_value_t = StoreSettings::default().pool_timeout_ms)]
    pub pool_timeout_ms: u64,

    /// One connection attempt to one database host may take this many ms
    /// (unless `DATABASE_URL` sets `connect_timeout`); while the last attempt
    /// found no primary, a request waits at most this long for a connection
    /// before `OVERLOADED`, instead of the pool timeout (ARCHITECTURE §6).
    #[arg(long, env = "IMCORE_DB_CONNECT_TIMEOUT_MS", default_value_t = StoreSettings::default().connect_timeout_ms)]
    pub connect_timeout_ms: u64,

    /// Bytes of recently committed events (and their conversations' member
    /// periods) kept in memory to answer `sync` without PostgreSQL; one
    /// conversation holds at most a quarter, and at the cap the least recently
    /// read conversations go first. 0 turns the tail cache off.
    #[arg(long, env = "IMCORE_SYNC_TAIL_BYTES", default_value_t = StoreSettings::default().sync_tail_bytes)]
    pub sync_tail_bytes: usize,

    /// A hot standby (or several hosts) for `sync` pages it has replayed
    /// far enough; the pool has as many connections as the primary's. Unset:
    /// every read goes to the primary (ARCHITECTURE §6).
    #[arg(long, env = "IMCORE_STANDBY_URL", hide_env_values = true)]
    pub standby_url: Option<String>,

    #[command(flatten)]
    pub large_groups: LargeGroupSettings,
}

impl StoreSettings {
    /// The defaults with a pool of `pool_size` connections.
    pub fn pool(pool_size: u32) -> Self {
        Self { pool_size, ..Self::default() }
    }
}

impl Default for StoreSettings {
    fn default() -> Self {
        Self {
            pool_size: 16,
            pool_timeout_ms: 10_000,
            connect_timeout_ms: 2_000,
            sync_tail_bytes: 64 * 1024 * 1024,
            standby_url: None,
            large_groups: LargeGroupSettings::default(),
        }
    }
}

impl StoreSettings {
    pub fn pool_timeout(&self) -> Duration {
        Duration::from_millis(self.pool_timeout_ms.max(1))
    }

    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms.max(1))
    }
}

/// Everything [`crate::writer::Engine::start`] builds: the write path and
/// the delivery after it.
#[derive(Debug, Clone, Default, Args)]
pub struct EngineSettings {
    #[command(flatten)]
    pub write: WriteSettings,

    #[command(flatten)]
    pub delivery: DeliverySettings,
}

/// The write path: conversation actors and the commit stage behind them.
/// The actor numbers default to the actors crate's own ([`ActorConfig`],
/// [`HubConfig`]).
#[derive(Debug, Clone, Args)]
pub struct WriteSettings {
    /// `actor` (batched, default) or `direct` (one transaction per op).
    #[arg(long = "write-path", value_name = "WRITE_PATH", env = "IMCORE_WRITE_PATH", value_enum, default_value_t = WriteSettings::default().path)]
    pub path: WritePath,

    /// Most ops a conversation actor commits in one transaction.
    #[arg(long, env = "IMCORE_MAX_BATCH", default_value_t = WriteSettings::default().max_batch)]
    pub max_batch: usize,

    /// Ops queued per conversation behind the batch in flight; past it, `OVERLOADED`.
    #[arg(long, env = "IMCORE_MAX_QUEUE", default_value_t = WriteSettings::default().max_queue)]
    pub max_queue: usize,

    /// Ops a conversation actor's mailbox buffers while its thread is busy; past it, `OVERLOADED`.
    #[arg(long, env = "IMCORE_ACTOR_MAILBOX", default_value_t = WriteSettings::default().actor_mailbox)]
    pub actor_mailbox: usize,

    /// A conversation actor idle this long (ms) stops; the next write starts a new one.
    #[arg(long, env = "IMCORE_ACTOR_IDLE_MS", default_value_t = WriteSettings::default().actor_idle_ms)]
    pub actor_idle_ms: u64,

    /// Live conversation actors; past it a new one starts only by evicting
    /// the idlest idle actor, and with none idle the write gets `OVERLOADED`.
    #[arg(long, env = "IMCORE_MAX_ACTORS", default_value_t = WriteSettings::default().max_actors)]
    pub max_actors: usize,

    /// Workers of the commit stage, which merges the batches of several
    /// conversations into one transaction (0: one transaction per batch).
    #[arg(long, env = "IMCORE_COMMIT_WORKERS", default_value_t = WriteSettings::default().commit_workers)]
    pub commit_workers: usize,

    /// Most ops in one merged transaction of the commit stage.
    #[arg(long, env = "IMCORE_COMMIT_MAX_OPS", default_value_t = WriteSettings::default().commit_max_ops)]
    pub commit_max_ops: usize,

    /// Threads conversation actors run on (0: the thread that starts the engine).
    #[arg(long, env = "IMCORE_ARBITERS", default_value_t = WriteSettings::default().arbiters)]
    pub arbiters: usize,
}

impl Default for WriteSettings {
    fn default() -> Self {
        let actor = ActorConfig::default();
        let hub = HubConfig::default();
        Self {
            path: WritePath::Actor,
            max_batch: actor.max_batch,
            max_queue: actor.max_queue,
            actor_mailbox: actor.mailbox_capacity,
            actor_idle_ms: u64::try_from(actor.idle_timeout.as_millis()).unwrap_or(u64::MAX),
            max_actors: hub.max_actors,
            commit_workers: 2,
            commit_max_ops: 4096,
            arbiters: hub.arbiters,
        }
    }
}

impl WriteSettings {
    /// These settings on `path`.
    pub fn on(path: WritePath) -> Self {
        Self { path, ..Self::default() }
    }

    pub fn hub_config(&self) -> HubConfig {
        let actor = ActorConfig {
            max_batch: self.max_batch,
            max_queue: self.max_queue,
            mailbox_capacity: self.actor_mailbox,
            idle_timeout: Duration::from_millis(self.actor_idle_ms),
        };
        HubConfig { arbiters: self.arbiters, max_actors: self.max_actors, actor }
    }
}

/// Fan-out after commit.
#[derive(Debug, Clone, Args)]
pub struct DeliverySettings {
    /// Threads that fan committed events out to connections.
    #[arg(long = "delivery-lanes", value_name = "LANES", env = "IMCORE_DELIVERY_LANES", default_value_t = DeliverySettings::default().lanes)]
    pub lanes: usize,

    /// Committed batches waiting per delivery thread; past it a batch's pushes
    /// are dropped (counted; clients sync).
    #[arg(long = "delivery-backlog", value_name = "BATCHES", env = "IMCORE_DELIVERY_BACKLOG", default_value_t = DeliverySettings::default().backlog)]
    pub backlog: usize,
}

impl Default for DeliverySettings {
    fn default() -> Self {
        Self { lanes: 2, backlog: 4096 }
    }
}

/// WebSocket sessions.
#[derive(Debug, Clone, Args)]
pub struct WsSettings {
    /// WebSocket: the server pings every this many ms.
    #[arg(long = "ws-ping-ms", value_name = "WS_PING_MS", env = "IMCORE_WS_PING_MS", default_value_t = WsSettings::default().ping_ms)]
    pub ping_ms: u64,

    /// WebSocket: a connection silent (no frame, no pong) this many ms is closed.
    /// Keep it a few ping intervals long.
    #[arg(long = "ws-timeout-ms", value_name = "WS_TIMEOUT_MS", env = "IMCORE_WS_TIMEOUT_MS", default_value_t = WsSettings::default().timeout_ms)]
    pub timeout_ms: u64,

    /// WebSocket: a frame (or reassembled message) over this many bytes closes the connection (1009).
    #[arg(
        long = "ws-max-frame-bytes",
        value_name = "WS_MAX_FRAME_BYTES",
        env = "IMCORE_WS_MAX_FRAME_BYTES",
        default_value_t = WsSettings::default().max_frame_bytes
    )]
    pub max_frame_bytes: usize,

    /// WebSocket: pushes queued for one connection; past it the connection is
    /// closed (1013) and the client syncs.
    #[arg(long = "ws-mailbox", value_name = "WS_MAILBOX", env = "IMCORE_WS_MAILBOX", default_value_t = WsSettings::default().mailbox)]
    pub mailbox: usize,

    /// WebSocket: requests of one connection in flight at once; beyond it, `OVERLOADED`.
    #[arg(
        long = "ws-max-inflight",
        value_name = "WS_MAX_INFLIGHT",
        env = "IMCORE_WS_MAX_INFLIGHT",
        default_value_t = WsSettings::default().max_inflight
    )]
    pub max_inflight: usize,

    /// WebSocket: bytes of replies and frames one connection has waiting to be
    /// written to its socket; while over it, its requests that read the
    /// database answer `OVERLOADED` without running (a client that does not
    /// read cannot make the server hold its replies).
    #[arg(
        long = "ws-max-unwritten-bytes",
        value_name = "BYTES",
        env = "IMCORE_WS_MAX_UNWRITTEN_BYTES",
        default_value_t = WsSettings::default().max_unwritten_bytes
    )]
    pub max_unwritten_bytes: usize,

    /// WebSocket: requests of one connection doing database work at once
    /// (sends excepted); the rest of its in-flight requests wait their turn,
    /// so one connection holds at most this many pooled connections.
    #[arg(
        long = "ws-max-concurrent",
        value_name = "WS_MAX_CONCURRENT",
        env = "IMCORE_WS_MAX_CONCURRENT",
        default_value_t = WsSettings::default().max_concurrent
    )]
    pub max_concurrent: usize,
}

impl Default for WsSettings {
    fn default() -> Self {
        Self {
            ping_ms: 15_000,
            timeout_ms: 45_000,
            max_frame_bytes: 64 * 1024,
            mailbox: 256,
            max_inflight: 64,
            max_concurrent: 4,
            max_unwritten_bytes: 2 * 1024 * 1024,
        }
    }
}

impl WsSettings {
    pub fn ping(&self) -> Duration {
        Duration::from_millis(self.ping_ms.max(1))
    }

    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.max(1))
    }
}

/// Limits across connections: what all clients together, or one user over
/// time, may make the server hold or do.
#[derive(Debug, Clone, Args)]
pub struct LimitSettings {
    /// Bytes of message bodies queued on the writer plus push frames queued
    /// for connections, all clients together. Past it a write answers
    /// `OVERLOADED` and a connection whose push does not fit is closed (1013).
    #[arg(
        long = "memory-budget-bytes",
        value_name = "BYTES",
        env = "IMCORE_MEMORY_BUDGET_BYTES",
        default_value_t = LimitSettings::default().memory_budget_bytes
    )]
    pub memory_budget_bytes: usize,

    /// Conversations one user may create per minute (a token bucket that
    /// holds this many and refills over a minute); beyond it `OVERLOADED`.
    /// 0: no limit.
    #[arg(
        long = "create-per-minute",
        value_name = "COUNT",
        env = "IMCORE_CREATE_PER_MINUTE",
        default_value_t = LimitSettings::default().create_per_minute
    )]
    pub create_per_minute: u32,

    /// Ms to read an HTTP request body, from when its handler starts reading;
    /// past it `REQUEST_TIMEOUT` and the connection is closed. The head has
    /// actix-web's own 5 s. 0: no limit.
    #[arg(
        long = "body-timeout-ms",
        value_name = "MS",
        env = "IMCORE_BODY_TIMEOUT_MS",
        default_value_t = LimitSettings::default().body_timeout_ms
    )]
    pub body_timeout_ms: u64,

    /// TCP connections (HTTP and WebSocket) open at once from one IP address,
    /// loopback included; past it a new connection is answered
    /// `TOO_MANY_CONNECTIONS` and closed at once. 0: no limit (behind a
    /// proxy every client has the proxy's address: cap there instead).
    #[arg(
        long = "max-connections-per-ip",
        value_name = "COUNT",
        env = "IMCORE_MAX_CONNECTIONS_PER_IP",
        default_value_t = LimitSettings::default().max_connections_per_ip
    )]
    pub max_connections_per_ip: usize,

    /// Devices of one user with a WebSocket session at once; past it an
    /// upgrade of another device is refused `TOO_MANY_CONNECTIONS` (a device
    /// reconnecting replaces its own session and is always let in). 0: no limit.
    #[arg(
        long = "max-connections-per-user",
        value_name = "COUNT",
        env = "IMCORE_MAX_CONNECTIONS_PER_USER",
        default_value_t = LimitSettings::default().max_connections_per_user
    )]
    pub max_connections_per_user: usize,

    /// (conversation, user) pairs the stranger gate remembers as having been
    /// members, on this node (about 150 bytes each). A pair it does not
    /// remember costs one indexed query at its next write.
    #[arg(
        long = "gate-pairs",
        value_name = "COUNT",
        env = "IMCORE_GATE_PAIRS",
        default_value_t = LimitSettings::default().gate_pairs
    )]
    pub gate_pairs: usize,
}

impl Default for LimitSettings {
    fn default() -> Self {
        Self {
            memory_budget_bytes: 512 * 1024 * 1024,
            create_per_minute: 60,
            body_timeout_ms: 10_000,
            max_connections_per_ip: 1024,
            max_connections_per_user: 128,
            gate_pairs: 200_000,
        }
    }
}

impl LimitSettings {
    /// The body read timeout, `None` for none.
    pub fn body_timeout(&self) -> Option<Duration> {
        (self.body_timeout_ms > 0).then(|| Duration::from_millis(self.body_timeout_ms))
    }
}

/// Live signals and blocking (PROTOCOL v1.2): typing, presence, read
/// pushes to others, the block list.
#[derive(Debug, Clone, Args)]
pub struct LiveSettings {
    /// Ms during which one device's `typing` in one conversation is forwarded
    /// at most once (the rest are answered and dropped); 0: every one is.
    #[arg(long, env = "IMCORE_TYPING_INTERVAL_MS", default_value_t = LiveSettings::default().typing_interval_ms)]
    pub typing_interval_ms: u64,

    /// Ms a user's last device may stay away before it is announced offline
    /// (a reconnect within it announces nothing).
    #[arg(long, env = "IMCORE_PRESENCE_GRACE_MS", default_value_t = LiveSettings::default().presence_grace_ms)]
    pub presence_grace_ms: u64,

    /// Largest group whose members get each other's read cursors pushed
    /// (direct conversations always do); 0: groups never do.
    #[arg(long, env = "IMCORE_READ_PUSH_MAX_MEMBERS", default_value_t = LiveSettings::default().read_push_max_members)]
    pub read_push_max_members: i32,

    /// Most users one user may block.
    #[arg(long, env = "IMCORE_MAX_BLOCKS", default_value_t = LiveSettings::default().max_blocks)]
    pub max_blocks: i64,
}

impl Default for LiveSettings {
    fn default() -> Self {
        Self { typing_interval_ms: 1000, presence_grace_ms: 5000, read_push_max_members: 100, max_blocks: 1000 }
    }
}

impl LiveSettings {
    pub fn typing_interval(&self) -> Duration {
        Duration::from_millis(self.typing_interval_ms)
    }

    pub fn presence_grace(&self) -> Duration {
        Duration::from_millis(self.presence_grace_ms)
    }
}

/// How long graceful shutdown waits for in-flight work.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
