//! The `typing` throttle (PROTOCOL v1.2): at most one signal forwarded per
//! device and conversation per interval; the rest are answered and dropped.
//!
//! A map of the last forwarded time per (user, device, conversation),
//! bounded: past [`MAX_TRACKED`] keys, those older than the interval (which
//! say nothing a missing key would not) are pruned.

use std::time::{Duration, Instant};

use dashmap::mapref::entry::Entry;
use dashmap::DashMap;
use imcore_actors::{ConvId, DeviceId, UserId};

/// Keys tracked before a pruning pass.
const MAX_TRACKED: usize = 100_000;

type Key = (UserId, DeviceId, ConvId);

pub struct TypingRate {
    /// 0: no throttle.
    interval: Duration,
    last: DashMap<Key, Instant>,
}

impl TypingRate {
    pub fn new(interval: Duration) -> Self {
        Self { interval, last: DashMap::new() }
    }

    /// Whether a signal of this key was claimed within the interval (the
    /// new one is then dropped, unchecked).
    pub fn throttled(&self, key: &Key) -> bool {
        self.last.get(key).is_some_and(|at| at.elapsed() < self.interval)
    }

    /// Claims the interval for `key`: `false` if another signal did first.
    pub fn claim(&self, key: Key) -> bool {
        if self.interval.is_zero() {
            return true;
        }
        if self.last.len() >= MAX_TRACKED {
            self.last.retain(|_, at| at.elapsed() < self.interval);
        }
        let now = Instant::now();
        match self.last.entry(key) {
            Entry::Occupied(e) if now.saturating_duration_since(*e.get()) < self.interval => false,
            Entry::Occupied(mut e) => {
                e.insert(now);
                true
            }
            Entry::Vacant(e) => {
                e.insert(now);
                true
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(conv: &str) -> Key {
        (UserId::parse("ann").expect("id"), DeviceId::parse("d").expect("id"), ConvId::parse(conv).expect("id"))
    }

    #[test]
    fn one_claim_per_interval_and_key_and_none_without_an_interval() {
        let rate = TypingRate::new(Duration::from_secs(60));
        assert!(!rate.throttled(&key("c1")));
        assert!(rate.claim(key("c1")));
        assert!(rate.throttled(&key("c1")) && !rate.claim(key("c1")));
        assert!(rate.claim(key("c2")), "another conversation has its own interval");
        let free = TypingRate::new(Duration::ZERO);
        assert!(free.claim(key("c1")) && free.claim(key("c1")) && !free.throttled(&key("c1")));
    }
}
