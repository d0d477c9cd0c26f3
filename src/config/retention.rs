//! The retention purge's settings (P9, ARCHITECTURE §3 "Retention"): how
//! often it runs, how much one step purges, how much of the time it works,
//! and how long the tombstones of purged sends are kept.

use clap::Args;

/// The retention purge (P9): how often, how much per step, how much of the
/// time, and how long tombstones of purged sends are kept.
#[derive(Debug, Clone, Args)]
pub struct RetentionSettings {
    /// Ms between purge runs; 0: only on `POST /v1/admin/retention/run`.
    #[arg(
        long = "retention-interval-ms",
        value_name = "MS",
        env = "IMCORE_RETENTION_INTERVAL_MS",
        default_value_t = RetentionSettings::default().interval_ms
    )]
    pub interval_ms: u64,

    /// Events purged per step: one statement that deletes and buries them
    /// without the conversation's row lock (its `min_seq` moved past them
    /// first, one UPDATE under the lock).
    #[arg(
        long = "retention-chunk",
        value_name = "EVENTS",
        env = "IMCORE_RETENTION_CHUNK",
        default_value_t = RetentionSettings::default().chunk
    )]
    pub chunk: i64,

    /// Percent of the time a purge works: after each chunk it rests for the
    /// rest, leaving the database's CPU and WAL to the writers (100: never rests).
    #[arg(
        long = "retention-duty-pct",
        value_name = "PERCENT",
        env = "IMCORE_RETENTION_DUTY_PCT",
        default_value_t = RetentionSettings::default().duty_pct,
        value_parser = clap::value_parser!(u32).range(1..=100)
    )]
    pub duty_pct: u32,

    /// Ms a tombstone is kept after its send was purged; 0: forever. Past
    /// it, a retry of that send arriving even later would append it again.
    #[arg(
        long = "tombstone-horizon-ms",
        value_name = "MS",
        env = "IMCORE_TOMBSTONE_HORIZON_MS",
        default_value_t = RetentionSettings::default().tombstone_horizon_ms
    )]
    pub tombstone_horizon_ms: u64,
}

impl RetentionSettings {
    /// The horizon, `None` for forever.
    pub fn tombstone_horizon(&self) -> Option<i64> {
        (self.tombstone_horizon_ms > 0).then(|| self.tombstone_horizon_ms.min(i64::MAX as u64) as i64)
    }
}

impl Default for RetentionSettings {
    fn default() -> Self {
        Self { interval_ms: 60_000, chunk: 1_000, duty_pct: 25, tombstone_horizon_ms: 0 }
    }
}
