//! Failed admin authentications (PROTOCOL §3): each client address has a
//! budget of [`FAILURE_BURST`] failures refilling at [`FAILURES_PER_MINUTE`];
//! an address past it has every admin request refused `OVERLOADED` before its
//! token is compared, so guessing runs at that rate and no faster. Failures
//! and those refusals are logged at warn at most once per [`LOG_EVERY`], as
//! counts with the last address (never the token), so a flood cannot flood
//! the log.
//!
//! An address is the peer's IP, an IPv6 one by its /64 (what one host holds).
//! The map is bounded like `create_rate`'s: full buckets are pruned; when every
//! tracked address is still mid-bucket, a new one is refused too (admin
//! requests wait a minute, guesses stop).

use std::net::{IpAddr, Ipv6Addr};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use dashmap::DashMap;

/// Failures an address may make at once.
pub const FAILURE_BURST: f64 = 20.0;
/// Failures an address regains per minute.
pub const FAILURES_PER_MINUTE: f64 = 10.0;
/// At most one warn line per this long.
pub const LOG_EVERY: Duration = Duration::from_secs(10);
/// Addresses tracked at once.
pub const MAX_TRACKED: usize = 10_000;
const PRUNE_EVERY: Duration = Duration::from_secs(1);

#[derive(Default)]
pub struct AdminGuard {
    /// Failures left per address, as of an instant.
    left: DashMap<IpAddr, (f64, Instant)>,
    /// What happened since the last warn line.
    unlogged: Mutex<Unlogged>,
    last_prune: Mutex<Option<Instant>>,
}

#[derive(Default)]
struct Unlogged {
    /// When the last line was written.
    at: Option<Instant>,
    /// Wrong or missing tokens compared.
    failures: u64,
    /// Requests refused unchecked (their address had no failures left).
    refused: u64,
}

fn refilled((left, at): (f64, Instant), now: Instant) -> f64 {
    (left + now.saturating_duration_since(at).as_secs_f64() * FAILURES_PER_MINUTE / 60.0).min(FAILURE_BURST)
}

/// IPv4 as is; IPv6 by its /64.
fn address(peer: Option<IpAddr>) -> IpAddr {
    match peer {
        Some(IpAddr::V6(v6)) => {
            let s = v6.segments();
            IpAddr::V6(Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
        }
        Some(v4) => v4,
        None => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    }
}

impl AdminGuard {
    /// Whether `peer` spent its failures: then this request is refused
    /// unchecked (and counted for the log).
    pub fn blocked(&self, peer: Option<IpAddr>, now: Instant) -> bool {
        let key = address(peer);
        let blocked = match self.left.get(&key) {
            Some(entry) => refilled(*entry, now) < 1.0,
            None => self.left.len() >= MAX_TRACKED && !self.prune(now),
        };
        if blocked {
            self.note(key, now, |u| u.refused += 1);
        }
        blocked
    }

    /// Takes one failure from `peer`'s budget.
    pub fn failed(&self, peer: Option<IpAddr>, now: Instant) {
        let key = address(peer);
        let left = self.left.get(&key).map_or(FAILURE_BURST, |e| refilled(*e, now));
        self.left.insert(key, ((left - 1.0).max(0.0), now));
        self.note(key, now, |u| u.failures += 1);
    }

    /// Counts an event, and writes the line if the last is [`LOG_EVERY`] old.
    fn note(&self, key: IpAddr, now: Instant, count: impl FnOnce(&mut Unlogged)) {
        let mut u = self.unlogged.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        count(&mut u);
        if !u.at.is_some_and(|at| now.saturating_duration_since(at) < LOG_EVERY) {
            let (failures, refused) = (u.failures, u.refused);
            *u = Unlogged { at: Some(now), failures: 0, refused: 0 };
            tracing::warn!(failures, refused, last_peer = %key, "admin authentication failed");
        }
    }

    /// Drops the buckets that refilled (at most once per [`PRUNE_EVERY`]);
    /// whether there is room now.
    fn prune(&self, now: Instant) -> bool {
        {
            let mut last = self.last_prune.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            if last.is_some_and(|at| now.saturating_duration_since(at) < PRUNE_EVERY) {
                return false;
            }
            *last = Some(now);
        }
        self.left.retain(|_, entry| refilled(*entry, now) < FAILURE_BURST);
        self.left.len() < MAX_TRACKED
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_past_its_failures_is_blocked_until_they_refill_and_others_are_not() {
        let guard = AdminGuard::default();
        let (a, b) = (Some(IpAddr::from([10, 0, 0, 1])), Some(IpAddr::from([10, 0, 0, 2])));
        let t0 = Instant::now();
        for _ in 0..FAILURE_BURST as usize {
            assert!(!guard.blocked(a, t0));
            guard.failed(a, t0);
        }
        assert!(guard.blocked(a, t0), "the burst is spent");
        assert_eq!(guard.unlogged.lock().map(|u| (u.failures, u.refused)).ok(), Some((19, 1)), "one line so far");
        assert!(!guard.blocked(b, t0), "budgets are per address");
        let one = Duration::from_secs_f64(60.0 / FAILURES_PER_MINUTE);
        assert!(guard.blocked(a, t0 + one / 2));
        assert!(!guard.blocked(a, t0 + one), "one failure refilled");
        guard.failed(a, t0 + one);
        assert!(guard.blocked(a, t0 + one));
    }

    #[test]
    fn ipv6_peers_share_their_64() {
        let here: IpAddr = "2001:db8:1:2::1".parse().expect("ip");
        let same: IpAddr = "2001:db8:1:2:ffff::9".parse().expect("ip");
        let other: IpAddr = "2001:db8:1:3::1".parse().expect("ip");
        assert_eq!(address(Some(here)), address(Some(same)));
        assert_ne!(address(Some(here)), address(Some(other)));
    }

    #[test]
    fn a_full_map_refuses_new_addresses_until_buckets_refill() {
        let guard = AdminGuard::default();
        let t0 = Instant::now();
        for i in 0..MAX_TRACKED as u32 {
            guard.failed(Some(IpAddr::from(i.to_be_bytes())), t0);
        }
        let new = Some(IpAddr::from([192, 0, 2, 1]));
        assert!(guard.blocked(new, t0), "every tracked address is mid-bucket");
        assert!(!guard.blocked(new, t0 + Duration::from_secs(60)), "refilled buckets pruned");
        assert!(guard.left.is_empty());
    }
}
