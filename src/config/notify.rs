//! The notifier's settings (PROTOCOL v1.3, ARCHITECTURE §5 "Offline
//! notifications"): where it may POST, how it coalesces, retries and gives
//! up, and the bounds on its queues.

use std::time::Duration;

use clap::Args;

/// Offline notifications through push gateways.
#[derive(Debug, Clone, Args)]
pub struct NotifySettings {
    /// Off: no notifier runs (pushers are still kept).
    #[arg(long, env = "IMCORE_NOTIFY", default_value_t = true, action = clap::ArgAction::Set,
          value_parser = clap::builder::BoolishValueParser::new())]
    pub notify: bool,

    /// Comma-separated URL prefixes a pusher's `url` must start with; empty:
    /// any http(s) URL. The server POSTs to URLs that clients chose.
    #[arg(long, env = "IMCORE_PUSH_URL_PREFIXES", value_delimiter = ',', default_value = "")]
    pub push_url_prefixes: Vec<String>,

    /// Most pushers one device may hold.
    #[arg(long, env = "IMCORE_MAX_PUSHERS_PER_DEVICE", default_value_t = NotifySettings::default().max_pushers_per_device)]
    pub max_pushers_per_device: i64,

    /// Groups up to this many members notify `all` by default; above, `mentions`.
    #[arg(long = "notify-all-max-members", id = "notify_all_max_members", env = "IMCORE_NOTIFY_ALL_MAX_MEMBERS", default_value_t = NotifySettings::default().all_max_members)]
    pub all_max_members: i32,

    /// Ms between two notifications of one conversation to one pusher; what
    /// comes meanwhile is coalesced into the next (the latest event, current counts).
    #[arg(long = "notify-coalesce-ms", id = "notify_coalesce_ms", env = "IMCORE_NOTIFY_COALESCE_MS", default_value_t = NotifySettings::default().coalesce_ms)]
    pub coalesce_ms: u64,

    /// Ms a gateway request may take before it counts as failed (and is retried).
    #[arg(long = "notify-timeout-ms", id = "notify_timeout_ms", env = "IMCORE_NOTIFY_TIMEOUT_MS", default_value_t = NotifySettings::default().timeout_ms)]
    pub timeout_ms: u64,

    /// First retry delay in ms after a 5xx, 429 or timeout; doubles per attempt, at most 60 s.
    #[arg(long = "notify-backoff-ms", id = "notify_backoff_ms", env = "IMCORE_NOTIFY_BACKOFF_MS", default_value_t = NotifySettings::default().backoff_ms)]
    pub backoff_ms: u64,

    /// Ms after an event's commit past which its notification is given up
    /// (counted); also how far back recovery looks.
    #[arg(long = "notify-give-up-ms", id = "notify_give_up_ms", env = "IMCORE_NOTIFY_GIVE_UP_MS", default_value_t = NotifySettings::default().give_up_ms)]
    pub give_up_ms: u64,

    /// Requests in flight to one gateway URL at once.
    #[arg(long = "notify-per-url", id = "notify_per_url", env = "IMCORE_NOTIFY_PER_URL", default_value_t = NotifySettings::default().per_url)]
    pub per_url: usize,

    /// Notifications waiting (coalescing, backing off or queued for their URL);
    /// past it new ones are dropped (counted).
    #[arg(long = "notify-max-pending", id = "notify_max_pending", env = "IMCORE_NOTIFY_MAX_PENDING", default_value_t = NotifySettings::default().max_pending)]
    pub max_pending: usize,

    /// Committed batches waiting for the notifier; past it a conversation's
    /// batches are read back from the database instead (counted).
    #[arg(long = "notify-backlog", id = "notify_backlog", env = "IMCORE_NOTIFY_BACKLOG", default_value_t = NotifySettings::default().backlog)]
    pub backlog: usize,

    /// Ms a node's claim on a conversation's notifications lasts unrenewed;
    /// a dead node's pending ones are taken over after it.
    #[arg(long = "notify-lease-ms", id = "notify_lease_ms", env = "IMCORE_NOTIFY_LEASE_MS", default_value_t = NotifySettings::default().lease_ms)]
    pub lease_ms: u64,

    /// Ms between writes of the notifier's progress (what a crash redoes at most).
    #[arg(long = "notify-flush-ms", id = "notify_flush_ms", env = "IMCORE_NOTIFY_FLUSH_MS", default_value_t = NotifySettings::default().flush_ms)]
    pub flush_ms: u64,

    /// Database connections of the notifier's own pool (never the writers').
    #[arg(long = "notify-pool-size", id = "notify_pool_size", env = "IMCORE_NOTIFY_POOL_SIZE", default_value_t = NotifySettings::default().pool_size)]
    pub pool_size: u32,
}

impl Default for NotifySettings {
    fn default() -> Self {
        Self {
            notify: true,
            push_url_prefixes: Vec::new(),
            max_pushers_per_device: 5,
            all_max_members: 200,
            coalesce_ms: 5_000,
            timeout_ms: 10_000,
            backoff_ms: 1_000,
            give_up_ms: 600_000,
            per_url: 16,
            max_pending: 100_000,
            backlog: 10_000,
            lease_ms: 30_000,
            flush_ms: 1_000,
            pool_size: 4,
        }
    }
}

impl NotifySettings {
    pub fn coalesce(&self) -> Duration {
        Duration::from_millis(self.coalesce_ms)
    }

    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.max(1))
    }

    pub fn give_up(&self) -> Duration {
        Duration::from_millis(self.give_up_ms)
    }

    pub fn lease(&self) -> Duration {
        Duration::from_millis(self.lease_ms.max(1))
    }

    pub fn flush(&self) -> Duration {
        Duration::from_millis(self.flush_ms.max(1))
    }

    /// The delay before retry `attempt` (1 = the first).
    pub fn backoff(&self, attempt: u32) -> Duration {
        let ms = self.backoff_ms.saturating_mul(1 << attempt.saturating_sub(1).min(16));
        Duration::from_millis(ms.min(60_000))
    }

    /// Whether the operator's allow-list lets the server POST to `url`.
    pub fn url_allowed(&self, url: &str) -> bool {
        let prefixes: Vec<&String> = self.push_url_prefixes.iter().filter(|p| !p.is_empty()).collect();
        prefixes.is_empty() || prefixes.iter().any(|p| url.starts_with(p.as_str()))
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn the_notifier_flags_fit_among_the_others() {
        super::super::Config::command().debug_assert();
    }
}
