//! Configuration: flags and environment, one place, defaults that work.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use imcore_actors::conversation::ActorConfig;

use crate::domain::DEFAULT_MAX_BODY_BYTES;
use crate::store::SYNC_DEFAULT_MAX_BYTES;

/// How sends reach PostgreSQL.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum WritePath {
    /// Through the conversation's actor, batched (group commit).
    Actor,
    /// One transaction per op (seed 000): the baseline benchmarks compare against.
    Direct,
}

#[derive(Debug, Clone, Parser)]
#[command(name = "imcore", version, about = "imcore instant-messaging server")]
pub struct Config {
    /// PostgreSQL to use. Unset: run an embedded PostgreSQL in the data directory.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,

    /// Address to serve HTTP and WebSocket on.
    #[arg(long, env = "IMCORE_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,

    /// Holds the embedded PostgreSQL (`pg/`) and the generated admin token.
    #[arg(long, env = "IMCORE_DATA_DIR", default_value = "./var")]
    pub data_dir: PathBuf,

    /// Admin bearer token. Unset: generated once and kept in `<data_dir>/admin-token`.
    #[arg(long, env = "IMCORE_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,

    /// Database connections in the pool.
    #[arg(long, env = "IMCORE_POOL_SIZE", default_value_t = 16)]
    pub pool_size: u32,

    /// `actor` (batched, default) or `direct` (one transaction per op).
    #[arg(long, env = "IMCORE_WRITE_PATH", value_enum, default_value_t = WritePath::Actor)]
    pub write_path: WritePath,

    /// Largest message body, serialized compactly.
    #[arg(long, env = "IMCORE_MAX_BODY_BYTES", default_value_t = DEFAULT_MAX_BODY_BYTES)]
    pub max_body_bytes: usize,

    /// Most ops a conversation actor commits in one transaction.
    #[arg(long, env = "IMCORE_MAX_BATCH", default_value_t = 1024)]
    pub max_batch: usize,

    /// Ops queued per conversation behind the batch in flight; past it, `OVERLOADED`.
    #[arg(long, env = "IMCORE_MAX_QUEUE", default_value_t = 8192)]
    pub max_queue: usize,

    /// A conversation actor idle this long (ms) stops; the next write starts a new one.
    #[arg(long, env = "IMCORE_ACTOR_IDLE_MS", default_value_t = 60_000)]
    pub actor_idle_ms: u64,

    /// Workers of the commit stage, which merges the batches of several
    /// conversations into one transaction (0: one transaction per batch).
    #[arg(long, env = "IMCORE_COMMIT_WORKERS", default_value_t = 2)]
    pub commit_workers: usize,

    /// Most ops in one merged transaction of the commit stage.
    #[arg(long, env = "IMCORE_COMMIT_MAX_OPS", default_value_t = 4096)]
    pub commit_max_ops: usize,

    /// Threads conversation actors run on.
    #[arg(long, env = "IMCORE_ARBITERS", default_value_t = default_arbiters())]
    pub arbiters: usize,

    /// WebSocket: the server pings every this many ms.
    #[arg(long, env = "IMCORE_WS_PING_MS", default_value_t = 15_000)]
    pub ws_ping_ms: u64,

    /// WebSocket: a connection silent (no frame, no pong) this many ms is closed.
    /// Keep it a few ping intervals long.
    #[arg(long, env = "IMCORE_WS_TIMEOUT_MS", default_value_t = 45_000)]
    pub ws_timeout_ms: u64,

    /// WebSocket: a frame (or reassembled message) over this many bytes closes the connection (1009).
    #[arg(long, env = "IMCORE_WS_MAX_FRAME_BYTES", default_value_t = 64 * 1024)]
    pub ws_max_frame_bytes: usize,

    /// HTTP worker threads (0: one per core).
    #[arg(long, env = "IMCORE_WORKERS", default_value_t = 0)]
    pub workers: usize,

    /// Log filter (tracing `EnvFilter` syntax).
    #[arg(long, env = "IMCORE_LOG", default_value = "info")]
    pub log: String,

    // Load bounds of one connection.
    /// WebSocket: requests of one connection in flight at once; beyond it, `OVERLOADED`.
    #[arg(long, env = "IMCORE_WS_MAX_INFLIGHT", default_value_t = 64)]
    pub ws_max_inflight: usize,

    /// Bytes of event bodies in one `sync` reply; a page stops early at this
    /// budget (always at least one event) and says `has_more`.
    #[arg(long, env = "IMCORE_SYNC_MAX_BYTES", default_value_t = SYNC_DEFAULT_MAX_BYTES)]
    pub sync_max_bytes: usize,
}

impl Config {
    /// Defaults for embedding (tests, benchmarks): nothing read from the environment.
    pub fn for_database(url: String) -> Self {
        Self {
            database_url: Some(url),
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            data_dir: PathBuf::from("./var"),
            admin_token: None,
            pool_size: 16,
            write_path: WritePath::Actor,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            max_batch: 1024,
            max_queue: 8192,
            actor_idle_ms: 60_000,
            commit_workers: 2,
            commit_max_ops: 4096,
            arbiters: default_arbiters(),
            ws_ping_ms: 15_000,
            ws_timeout_ms: 45_000,
            ws_max_frame_bytes: 64 * 1024,
            workers: 0,
            log: "warn".into(),
            ws_max_inflight: 64,
            sync_max_bytes: SYNC_DEFAULT_MAX_BYTES,
        }
    }

    pub fn actor_config(&self) -> ActorConfig {
        ActorConfig {
            max_batch: self.max_batch,
            max_queue: self.max_queue,
            idle_timeout: Duration::from_millis(self.actor_idle_ms),
            ..ActorConfig::default()
        }
    }
}

impl Config {
    pub fn ws_ping(&self) -> Duration {
        Duration::from_millis(self.ws_ping_ms.max(1))
    }

    pub fn ws_timeout(&self) -> Duration {
        Duration::from_millis(self.ws_timeout_ms.max(1))
    }
}

fn default_arbiters() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// How long graceful shutdown waits for in-flight work.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
