//! Prometheus metrics (PROTOCOL §6 `/metrics`): requests, errors by code, send
//! latency, batch sizes, live connections, live conversation actors, pool state,
//! the memory budget.
//!
//! Counters and histograms live in one process-wide registry, so the store can
//! record batch sizes without a handle. Gauges that mirror state owned
//! elsewhere (routes, actors, pool) are sampled when `/metrics` is scraped,
//! never kept in step by hand.

use std::sync::LazyLock;
use std::time::Duration;

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
    TextEncoder,
};

pub struct Metrics {
    registry: Registry,
    /// `op`, `transport` (`ws` | `http`).
    pub requests: IntCounterVec,
    /// `code`: PROTOCOL §2 code of every error answer.
    pub errors: IntCounterVec,
    /// Seconds from a parsed `send` to its answer (queue + batch + commit).
    pub send_latency: Histogram,
    /// Ops per committed write transaction.
    pub batch_size: Histogram,
    /// Seconds per phase of a write transaction: `pool` (waiting for a
    /// connection), `begin`, `lock`, `lookup` (request keys, members), `append`
    /// (INSERT + UPDATE), `commit` (includes the WAL flush).
    pub write_phase: HistogramVec,
    /// WebSocket sessions accepted since start.
    pub ws_accepted: IntCounter,
    /// Pushes of the kinds a session sends itself (`kicked`, `read`, …) by reason.
    pub kicks: IntCounterVec,
    /// Sampled at scrape: routed connections, open sessions.
    pub connections: IntGaugeVec,
    /// Sampled at scrape: conversation actors alive (actor write path).
    pub live_actors: IntGauge,
    /// Sampled at scrape (actor write path): `idle` actors (candidates for
    /// eviction at the cap), `started_total`, `evicted_total` (asked to
    /// retire to make room under the cap).
    pub actors: IntGaugeVec,
    /// Sampled at scrape from the pool's own state: see [`sample_pool`].
    pub pool: IntGaugeVec,
    /// Sampled at scrape: the memory budget's bytes `in_use` and its `limit`.
    pub memory_budget: IntGaugeVec,
    /// Requests whose work is running now (both transports); held by a
    /// [`Running`] guard, so a finished or dropped request always leaves it.
    pub requests_running: IntGauge,
    /// `what`: `events_purged`, `tombstones_written`, `tombstones_expired` by retention.
    pub retention: IntCounterVec,
    /// Seconds per retention run.
    pub retention_run: Histogram,
    /// Writes forwarded to their conversation's home node, by `outcome`:
    /// `answered`, `not_there` (written here instead), `lost`, `unanswered`;
    /// and `served`: writes other nodes forwarded here.
    pub forwarded_writes: IntCounterVec,
    /// Nodes taking homes, this one included, as this node knows them.
    pub cluster_nodes: IntGauge,
    /// Messages from the bus dropped unread (ARCHITECTURE §7), by `reason`:
    /// `unsigned`, `bad_signature`, `stale`, `replayed`, `malformed` (signed, does not
    /// decode or is out of range), `refused_op` (a forwarded op no client sends).
    pub bus_rejected: IntCounterVec,
    /// Offline notifications (PROTOCOL v1.3) by `outcome`: see [`NOTIFY_OUTCOMES`].
    pub notifications: IntCounterVec,
    /// Notifications waiting (coalescing, backing off, queued for their URL) or in flight.
    pub notify_queue: IntGauge,
    /// Seconds per push gateway request, whatever its answer.
    pub notify_gateway: Histogram,
    /// The tail in memory (ARCHITECTURE §4), sampled per scrape: see [`sample_tail`].
    pub sync_tail: IntGaugeVec,
    /// `sync` pages read from PostgreSQL, by `from`: `standby`, or the
    /// primary and why (ARCHITECTURE §6, "History reads from a standby").
    pub sync_reads: IntCounterVec,
}

/// `sent` (delivered), `failed` (refused for good), `rejected` (pushkey
/// rejected: the pusher is removed), `coalesced` (merged into a waiting one),
/// `retried`, `given_up` (past the give-up window), `dropped` (over a queue
/// bound), `recovered` (events read back after a crash or takeover),
/// `backlog_lost` (batches read back because the notifier was behind).
pub const NOTIFY_OUTCOMES: [&str; 9] =
    ["sent", "failed", "rejected", "coalesced", "retried", "given_up", "dropped", "recovered", "backlog_lost"];

fn build() -> Result<Metrics, prometheus::Error> {
    let registry = Registry::new_custom(Some("imcore".into()), None)?;
    let requests =
        IntCounterVec::new(Opts::new("requests_total", "Requests handled, by op and transport"), &["op", "transport"])?;
    let errors = IntCounterVec::new(Opts::new("errors_total", "Error answers, by PROTOCOL code"), &["code"])?;
    let send_latency = Histogram::with_opts(
        HistogramOpts::new("send_latency_seconds", "Time from a parsed send to its answer")
            .buckets(vec![0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0]),
    )?;
    let batch_size = Histogram::with_opts(
        HistogramOpts::new("write_batch_ops", "Ops per committed write transaction")
            .buckets(vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0]),
    )?;
    let write_phase = HistogramVec::new(
        HistogramOpts::new("write_phase_seconds", "Time per phase of a write transaction")
            .buckets(vec![0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5]),
        &["phase"],
    )?;
    let ws_accepted = IntCounter::new("ws_accepted_total", "WebSocket sessions accepted")?;
    let kicks =
        IntCounterVec::new(Opts::new("ws_closed_total", "Sessions closed by the server, by reason"), &["reason"])?;
    let connections = IntGaugeVec::new(
        Opts::new("connections", "Live connections: kind=routed (route registry), kind=sessions (open sockets)"),
        &["kind"],
    )?;
    let live_actors = IntGauge::new("live_conversation_actors", "Conversation actors alive")?;
    let actors = IntGaugeVec::new(
        Opts::new("conversation_actors", "Conversation actors: state=idle|started_total|evicted_total"),
        &["state"],
    )?;
    let pool = IntGaugeVec::new(
        Opts::new(
            "db_pool",
            "Database pool: state=connections|idle|in_use|waited_gets_total|timed_out_gets_total|wait_ms_total",
        ),
        &["state"],
    )?;
    registry.register(Box::new(requests.clone()))?;
    registry.register(Box::new(errors.clone()))?;
    registry.register(Box::new(send_latency.clone()))?;
    registry.register(Box::new(batch_size.clone()))?;
    registry.register(Box::new(write_phase.clone()))?;
    registry.register(Box::new(ws_accepted.clone()))?;
    registry.register(Box::new(kicks.clone()))?;
    registry.register(Box::new(connections.clone()))?;
    registry.register(Box::new(live_actors.clone()))?;
    let requests_running =
        IntGauge::new("requests_running", "Requests whose work is running (answers not yet produced)")?;
    registry.register(Box::new(actors.clone()))?;
    registry.register(Box::new(pool.clone()))?;
    let memory_budget = IntGaugeVec::new(
        Opts::new("memory_budget_bytes", "Bytes of queued message bodies and queued push frames: state=in_use|limit"),
        &["state"],
    )?;
    registry.register(Box::new(memory_budget.clone()))?;
    registry.register(Box::new(requests_running.clone()))?;
    let retention = IntCounterVec::new(
        Opts::new("retention_total", "Retention: what=events_purged|tombstones_written|tombstones_expired"),
        &["what"],
    )?;
    let retention_run = Histogram::with_opts(
        HistogramOpts::new("retention_run_seconds", "Time per retention run")
            .buckets(vec![0.01, 0.1, 0.5, 1.0, 5.0, 30.0, 120.0, 600.0]),
    )?;
    registry.register(Box::new(retention.clone()))?;
    registry.register(Box::new(retention_run.clone()))?;
    let forwarded_writes = IntCounterVec::new(
        Opts::new(
            "forwarded_writes_total",
            "Writes forwarded to their home node: outcome=answered|not_there|lost|unanswered; served: forwarded here",
        ),
        &["outcome"],
    )?;
    let cluster_nodes = IntGauge::new("cluster_nodes", "Nodes taking conversations' homes, this one included")?;
    registry.register(Box::new(forwarded_writes.clone()))?;
    registry.register(Box::new(cluster_nodes.clone()))?;
    let bus_rejected = IntCounterVec::new(
        Opts::new(
            "bus_rejected_total",
            "Bus messages dropped: reason=unsigned|bad_signature|stale|replayed|malformed|refused_op",
        ),
        &["reason"],
    )?;
    registry.register(Box::new(bus_rejected.clone()))?;
    let notifications = IntCounterVec::new(
        Opts::new(
            "notifications_total",
            "Offline notifications: outcome=sent|failed|rejected|coalesced|retried|given_up|dropped|recovered|backlog_lost",
        ),
        &["outcome"],
    )?;
    let notify_queue = IntGauge::new("notify_queue", "Offline notifications waiting or in flight")?;
    let notify_gateway = Histogram::with_opts(
        HistogramOpts::new("notify_gateway_seconds", "Time per push gateway request")
            .buckets(vec![0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0]),
    )?;
    registry.register(Box::new(notifications.clone()))?;
    registry.register(Box::new(notify_queue.clone()))?;
    registry.register(Box::new(notify_gateway.clone()))?;
    let sync_tail = IntGaugeVec::new(
        Opts::new(
            "sync_tail",
            "The tail in memory: state=bytes|cap|hits_total|loads_total|coalesced_total|evicted_total",
        ),
        &["state"],
    )?;
    registry.register(Box::new(sync_tail.clone()))?;
    let sync_reads = IntCounterVec::new(
        Opts::new(
            "sync_reads_total",
            "sync pages read from PostgreSQL: from=standby|primary|primary_head_unknown|primary_standby_behind|\
             primary_standby_unavailable",
        ),
        &["from"],
    )?;
    registry.register(Box::new(sync_reads.clone()))?;
    Ok(Metrics {
        registry,
        requests,
        errors,
        send_latency,
        batch_size,
        write_phase,
        ws_accepted,
        kicks,
        connections,
        live_actors,
        actors,
        pool,
        memory_budget,
        requests_running,
        retention,
        retention_run,
        forwarded_writes,
        cluster_nodes,
        bus_rejected,
        notifications,
        notify_queue,
        notify_gateway,
        sync_tail,
        sync_reads,
    })
}

static METRICS: LazyLock<Metrics> =
    LazyLock::new(|| build().unwrap_or_else(|e| unreachable!("metric definitions are static and valid: {e}")));

pub fn metrics() -> &'static Metrics {
    &METRICS
}

/// Called by the store once per committed write transaction.
pub fn observe_batch(ops: usize) {
    METRICS.batch_size.observe(ops as f64);
}

pub fn observe_write_phase(phase: &'static str, elapsed: Duration) {
    METRICS.write_phase.with_label_values(&[phase]).observe(elapsed.as_secs_f64());
}

/// The write-transaction phases, in order: a transaction runs `one_trip`
/// (BEGIN, guarded append and COMMIT at once), or `lock`, `apply` and
/// `commit`, after a `declined` one-trip attempt or without one.
pub const WRITE_PHASES: [&str; 6] = ["pool", "one_trip", "declined", "lock", "apply", "commit"];

/// `(total seconds, transactions)` per phase so far, in [`WRITE_PHASES`]
/// order; two readings give the mean per transaction in between.
pub fn write_phase_totals() -> Vec<(f64, u64)> {
    WRITE_PHASES
        .into_iter()
        .map(|phase| {
            let h = METRICS.write_phase.with_label_values(&[phase]);
            (h.get_sample_sum(), h.get_sample_count())
        })
        .collect()
}

/// Sets the pool gauges from the pool's state as it is now: `connections`,
/// `idle`, `in_use` (checked out), and bb8's running totals of gets that
/// waited, timed out, and their wait. bb8's `pending_gets` is left out: it is
/// gets started minus gets finished, so every get dropped while waiting (a
/// request cancelled) would count as pending forever.
pub fn sample_pool(state: bb8::State) {
    let set = |name: &str, n: u64| METRICS.pool.with_label_values(&[name]).set(i64::try_from(n).unwrap_or(i64::MAX));
    set("connections", state.connections.into());
    set("idle", state.idle_connections.into());
    set("in_use", state.connections.saturating_sub(state.idle_connections).into());
    let stats = &state.statistics;
    set("waited_gets_total", stats.get_waited);
    set("timed_out_gets_total", stats.get_timed_out);
    set("wait_ms_total", u64::try_from(stats.get_wait_time.as_millis()).unwrap_or(u64::MAX));
}

/// Sets the tail gauges to `state`, what the tail reports of itself now
/// (`store::Tail::sample`).
pub fn sample_tail(state: &[(&str, u64)]) {
    for (name, n) in state {
        METRICS.sync_tail.with_label_values(&[name]).set(i64::try_from(*n).unwrap_or(i64::MAX));
    }
}

/// Counts one request in [`Metrics::requests_running`] while it lives.
pub struct Running(());

impl Running {
    pub fn start() -> Self {
        METRICS.requests_running.inc();
        Self(())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        METRICS.requests_running.dec();
    }
}

pub fn observe_purge(events_purged: u64, tombstones_written: u64, tombstones_expired: u64, elapsed: Duration) {
    let m = &METRICS.retention;
    m.with_label_values(&["events_purged"]).inc_by(events_purged);
    m.with_label_values(&["tombstones_written"]).inc_by(tombstones_written);
    m.with_label_values(&["tombstones_expired"]).inc_by(tombstones_expired);
    METRICS.retention_run.observe(elapsed.as_secs_f64());
}

/// Counts `n` notifications with `outcome` (one of [`NOTIFY_OUTCOMES`]).
pub fn count_notifications(outcome: &'static str, n: u64) {
    METRICS.notifications.with_label_values(&[outcome]).inc_by(n);
}

pub fn observe_send(elapsed: Duration) {
    METRICS.send_latency.observe(elapsed.as_secs_f64());
}

impl Metrics {
    /// The text exposition format.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut out) {
            tracing::warn!(error = %e, "metrics encoding failed");
        }
        String::from_utf8(out).unwrap_or_default()
    }
}
