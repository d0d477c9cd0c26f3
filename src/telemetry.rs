//! Structured logs via tracing. Tests stay quiet unless `IMCORE_LOG` asks.
//!
//! Some libraries log what clients wrote below info: tokio-postgres prints
//! every statement's parameters at debug (message bodies, token hashes),
//! async-nats what crosses the bus. Their events above info are dropped
//! unless the filter names them, so `IMCORE_LOG=debug` shows this server's
//! debugging and no client's content.

use std::io::IsTerminal;

use tracing::{Level, Metadata};
use tracing_subscriber::filter::{filter_fn, FilterExt};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{fmt, EnvFilter, Layer};

/// Targets held at info unless the filter names them.
pub const QUIET_TARGETS: &[&str] = &["tokio_postgres", "postgres_protocol", "async_nats"];

/// Installs the global subscriber once; later calls are no-ops.
pub fn init(filter: &str) {
    let env = EnvFilter::try_new(filter).unwrap_or_else(|_| EnvFilter::new("info"));
    let quiet = Quiet::new(filter);
    // Colours only on a terminal, and never under `NO_COLOR`: a log file or
    // journal gets plain text.
    let ansi = std::io::stdout().is_terminal() && !matches!(std::env::var_os("NO_COLOR"), Some(v) if !v.is_empty());
    let layer =
        fmt::layer().with_target(false).with_ansi(ansi).with_filter(env.and(filter_fn(move |m| quiet.allows(m))));
    let _ = tracing_subscriber::registry().with(layer).try_init();
}

/// The [`QUIET_TARGETS`] a filter string does not name.
struct Quiet(Vec<&'static str>);

impl Quiet {
    fn new(filter: &str) -> Self {
        let named = |target: &str| filter.split(',').any(|d| d.trim().starts_with(target));
        Self(QUIET_TARGETS.iter().copied().filter(|t| !named(t)).collect())
    }

    fn allows(&self, meta: &Metadata<'_>) -> bool {
        self.allows_event(meta.target(), *meta.level())
    }

    /// Whether an event of `level` from `target` may pass (`Level`: more verbose is greater).
    fn allows_event(&self, target: &str, level: Level) -> bool {
        level <= Level::INFO || !self.0.iter().any(|t| target.starts_with(t))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libraries_that_log_client_content_stay_at_info_unless_named() {
        let debug = Quiet::new("debug");
        assert!(!debug.allows_event("tokio_postgres::query", Level::DEBUG), "statement parameters");
        assert!(!debug.allows_event("async_nats", Level::TRACE));
        assert!(debug.allows_event("tokio_postgres::connection", Level::INFO));
        assert!(debug.allows_event("imcore::gateway::session", Level::DEBUG), "ours still at debug");
        let named = Quiet::new("info, tokio_postgres::query=debug");
        assert!(named.allows_event("tokio_postgres::query", Level::DEBUG), "asked for by name");
        assert!(!named.allows_event("async_nats", Level::DEBUG));
    }
}
