//! The global memory budget: bytes the server holds for clients that it has
//! not finished with — message bodies queued on the writer, push frames queued
//! for connections. Everything else per client is bounded by count (requests
//! in flight, mailbox slots, queued ops); this bounds their sum in bytes, so
//! many clients at their per-client caps cannot exhaust memory together.
//!
//! Taking bytes never waits: a caller that cannot get them sheds load at once
//! (`OVERLOADED` for a write, a 1013 close for a push). A [`Permit`] gives its
//! bytes back when dropped, wherever the thing it pays for ends.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// One process-wide byte budget, shared through an `Arc`.
#[derive(Debug)]
pub struct MemoryBudget {
    limit: usize,
    used: AtomicUsize,
}

impl MemoryBudget {
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(Self { limit, used: AtomicUsize::new(0) })
    }

    /// `n` bytes, if the budget has them. One compare-and-swap when
    /// uncontended; `used` never exceeds `limit`, even transiently, so the
    /// gauge never reads over it.
    pub fn try_acquire(self: &Arc<Self>, n: usize) -> Option<Permit> {
        self.take(n).then(|| Permit { budget: self.clone(), bytes: n })
    }

    /// A permit of no bytes, to grow with what it pays for ([`Permit::try_grow`]).
    pub fn empty(self: &Arc<Self>) -> Permit {
        Permit { budget: self.clone(), bytes: 0 }
    }

    fn take(&self, n: usize) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(n).filter(|&after| after <= self.limit)
            })
            .is_ok()
    }

    /// Bytes held by live permits now.
    pub fn in_use(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }

    pub fn limit(&self) -> usize {
        self.limit
    }
}

/// Bytes taken from a [`MemoryBudget`]; given back on drop.
#[derive(Debug)]
pub struct Permit {
    budget: Arc<MemoryBudget>,
    bytes: usize,
}

impl Permit {
    /// `n` more bytes, if the budget has them.
    pub fn try_grow(&mut self, n: usize) -> bool {
        let taken = self.budget.take(n);
        if taken {
            self.bytes += n;
        }
        taken
    }

    /// The bytes it holds.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Gives `n` of its bytes back (at most all of them).
    pub fn shrink(&mut self, n: usize) {
        let n = n.min(self.bytes);
        self.bytes -= n;
        self.budget.used.fetch_sub(n, Ordering::AcqRel);
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permits_take_up_to_the_limit_and_give_back_on_drop() {
        let budget = MemoryBudget::new(100);
        let a = budget.try_acquire(60).expect("60 of 100");
        assert!(budget.try_acquire(41).is_none(), "over the limit is refused");
        let b = budget.try_acquire(40).expect("exactly to the limit");
        assert_eq!(budget.in_use(), 100);
        drop(a);
        assert_eq!(budget.in_use(), 40);
        drop(b);
        assert_eq!(budget.in_use(), 0);
        assert!(budget.try_acquire(usize::MAX).is_none(), "no overflow");
    }

    #[test]
    fn a_permit_grows_within_the_limit_and_shrinks() {
        let budget = MemoryBudget::new(100);
        let mut p = budget.empty();
        assert!(p.try_grow(70));
        assert!(!p.try_grow(31), "over the limit is refused and takes nothing");
        assert_eq!(budget.in_use(), 70);
        p.shrink(50);
        p.shrink(500);
        assert_eq!(budget.in_use(), 0, "never gives back more than it holds");
        assert!(p.try_grow(10));
        drop(p);
        assert_eq!(budget.in_use(), 0);
    }

    #[test]
    fn concurrent_takers_never_pass_the_limit() {
        let budget = MemoryBudget::new(1000);
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let budget = budget.clone();
                std::thread::spawn(move || {
                    for _ in 0..10_000 {
                        if let Some(p) = budget.try_acquire(300) {
                            assert!(budget.in_use() <= 1000);
                            drop(p);
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("thread");
        }
        assert_eq!(budget.in_use(), 0);
    }
}
