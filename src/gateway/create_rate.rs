//! The per-user limit on conversations created per minute: a token bucket per
//! user that holds `per_minute` creations and refills at `per_minute` a minute.
//! Every `create_conversation` request counts, including one that answers an
//! existing direct chat: the check comes before the database is asked, and
//! the request costs a transaction either way.
//!
//! The map is bounded: a bucket that has refilled completely says nothing a
//! missing one would not, so full buckets are pruned when the map reaches its
//! size; if every tracked user is still mid-bucket, a new user is refused until
//! some refill (at most one pruning pass per second, so that case stays cheap).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use dashmap::DashMap;
use imcore_actors::UserId;

/// Users tracked at once.
pub const MAX_TRACKED_USERS: usize = 100_000;
const PRUNE_EVERY: Duration = Duration::from_secs(1);

pub struct CreateRate {
    /// Bucket size and refill per minute; 0: no limit.
    per_minute: u32,
    buckets: DashMap<UserId, Bucket>,
    max_tracked: usize,
    last_prune: Mutex<Option<Instant>>,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn refilled(self, per_minute: f64, now: Instant) -> f64 {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        (self.tokens + elapsed * per_minute / 60.0).min(per_minute)
    }
}

impl CreateRate {
    pub fn new(per_minute: u32) -> Self {
        Self::bounded(per_minute, MAX_TRACKED_USERS)
    }

    fn bounded(per_minute: u32, max_tracked: usize) -> Self {
        Self { per_minute, buckets: DashMap::new(), max_tracked, last_prune: Mutex::new(None) }
    }

    /// Takes one creation from `user`'s bucket; false when it is empty.
    pub fn allow(&self, user: &UserId) -> bool {
        self.allow_at(user, Instant::now())
    }

    fn allow_at(&self, user: &UserId, now: Instant) -> bool {
        if self.per_minute == 0 {
            return true;
        }
        let per_minute = f64::from(self.per_minute);
        if let Some(mut bucket) = self.buckets.get_mut(user) {
            let tokens = bucket.refilled(per_minute, now);
            let allowed = tokens >= 1.0;
            *bucket = Bucket { tokens: if allowed { tokens - 1.0 } else { tokens }, at: now };
            return allowed;
        }
        if self.buckets.len() >= self.max_tracked && !self.prune(per_minute, now) {
            return false;
        }
        self.buckets.insert(user.clone(), Bucket { tokens: per_minute - 1.0, at: now });
        true
    }

    /// Drops the buckets that have refilled; whether there is room now.
    fn prune(&self, per_minute: f64, now: Instant) -> bool {
        {
            let mut last = self.last_prune.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            if last.is_some_and(|at| now.saturating_duration_since(at) < PRUNE_EVERY) {
                return false;
            }
            *last = Some(now);
        }
        self.buckets.retain(|_, b| b.refilled(per_minute, now) < per_minute);
        self.buckets.len() < self.max_tracked
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(s: &str) -> UserId {
        UserId::parse(s).expect("user id")
    }

    #[test]
    fn a_bucket_empties_then_refills_over_the_minute() {
        let rate = CreateRate::new(3);
        let (ana, t0) = (user("u-ana"), Instant::now());
        assert_eq!((0..4).map(|_| rate.allow_at(&ana, t0)).collect::<Vec<_>>(), [true, true, true, false]);
        assert!(rate.allow_at(&user("u-ben"), t0), "buckets are per user");
        assert!(!rate.allow_at(&ana, t0 + Duration::from_secs(19)), "one refills every 20 s");
        assert!(rate.allow_at(&ana, t0 + Duration::from_secs(20)));
        assert!(!rate.allow_at(&ana, t0 + Duration::from_secs(21)));
    }

    #[test]
    fn the_map_stays_bounded_and_prunes_refilled_buckets() {
        let rate = CreateRate::bounded(2, 2);
        let t0 = Instant::now();
        assert!(rate.allow_at(&user("a"), t0) && rate.allow_at(&user("b"), t0));
        assert!(!rate.allow_at(&user("c"), t0), "full of users mid-bucket");
        assert!(!rate.allow_at(&user("d"), t0 + Duration::from_millis(10)), "no second pass within a second");
        assert!(rate.allow_at(&user("c"), t0 + Duration::from_secs(30)), "a and b refilled and were pruned");
        assert!(rate.buckets.len() <= 2);
    }

    #[test]
    fn zero_means_no_limit() {
        let rate = CreateRate::new(0);
        assert!((0..1000).all(|_| rate.allow(&user("u-ana"))));
        assert!(rate.buckets.is_empty());
    }
}
