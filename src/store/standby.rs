//! History reads from a hot standby (`IMCORE_STANDBY_URL`, ARCHITECTURE §6,
//! "History reads from a standby"): a `sync` page is read there when the
//! standby has replayed the conversation at least to the head this node
//! knows committed ([`Heads`](super::heads::Heads)) and to the caller's own
//! `after_seq`, so nobody reads less than it has already seen or been told
//! of; otherwise, and whenever the standby is down or refuses, the primary.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::connection::Pool;
use super::sync::{read_page, SyncPage, SyncRequest};
use super::{Store, StoreError};
use crate::metrics::metrics;

/// While the standby is unreachable, how often a request starts a new
/// attempt to connect (in the background: no request waits for it).
const RETRY: Duration = Duration::from_secs(1);

pub(super) struct Standby {
    pool: Pool,
    /// No attempt to reconnect starts before this.
    next_try: Mutex<Instant>,
}

impl Standby {
    pub(super) fn new(pool: Pool) -> Self {
        Self { pool, next_try: Mutex::new(Instant::now()) }
    }

    /// Whether to try the standby now: it was reachable at the last attempt.
    /// If not, a reconnect is started at most once per [`RETRY`].
    fn up(&self) -> bool {
        if self.pool.reachable() {
            return true;
        }
        let mut next = self.next_try.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if Instant::now() >= *next {
            *next = Instant::now() + RETRY;
            let pool = self.pool.clone();
            tokio::spawn(async move { pool.probe().await.is_some() });
        }
        false
    }
}

/// Why a `sync` read the primary, or that the standby served it.
#[derive(Clone, Copy)]
enum Served {
    Standby,
    /// No standby is configured.
    Primary,
    /// This node knows no committed head of the conversation.
    HeadUnknown,
    /// The standby had not replayed far enough, or refused (which may be lag:
    /// a join or an epoch not replayed yet).
    StandbyBehind,
    /// The standby is unreachable or the read failed.
    StandbyUnavailable,
}

impl Served {
    fn count(self) {
        let label = match self {
            Served::Standby => "standby",
            Served::Primary => "primary",
            Served::HeadUnknown => "primary_head_unknown",
            Served::StandbyBehind => "primary_standby_behind",
            Served::StandbyUnavailable => "primary_standby_unavailable",
        };
        metrics().sync_reads.with_label_values(&[label]).inc();
    }
}

impl Store {
    /// `req`'s page from the standby if it can answer it; `None`: read the
    /// primary (counted either way, `imcore_sync_reads_total`).
    pub(super) async fn sync_on_standby(&self, req: &SyncRequest) -> Option<SyncPage> {
        match self.try_standby(req).await {
            Ok(page) => {
                Served::Standby.count();
                Some(page)
            }
            Err(why) => {
                why.count();
                None
            }
        }
    }

    async fn try_standby(&self, req: &SyncRequest) -> Result<SyncPage, Served> {
        let standby = self.standby.as_ref().ok_or(Served::Primary)?;
        let known = self.heads.known(&req.conv).ok_or(Served::HeadUnknown)?;
        let needed = known.max(req.after_seq.unwrap_or(0));
        if !standby.up() {
            return Err(Served::StandbyUnavailable);
        }
        let conn = standby.pool.get().await.map_err(|_| Served::StandbyUnavailable)?;
        match read_page(conn, req).await {
            Ok((page, head)) if head >= needed => Ok(page),
            Ok(_) => Err(Served::StandbyBehind),
            Err(StoreError::Rejected(_)) => Err(Served::StandbyBehind),
            Err(e) => {
                tracing::debug!(error = %e, "sync on the standby failed; reading the primary");
                Err(Served::StandbyUnavailable)
            }
        }
    }
}
