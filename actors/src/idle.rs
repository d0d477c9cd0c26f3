//! Idle actors, idlest first: where the hub finds actors to evict when the
//! live actors reach the cap (ARCHITECTURE §3).
//!
//! An actor lists itself when it becomes idle and unlists itself when work
//! arrives or it retires, so the index holds at most one entry per live actor
//! and never a stale one for long. The hub takes the idlest without looking
//! at the actor table: no scan, only an ordered map's first entry under a
//! mutex that neither awaits nor sends.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// One listing of one actor; tickets grow with time, so the smallest listed
/// ticket is the actor idle the longest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Ticket(u64);

/// Idle actors by the time they became idle. `H` is how the hub reaches one.
pub(crate) struct IdleActors<H> {
    next: AtomicU64,
    by_ticket: Mutex<BTreeMap<Ticket, H>>,
}

impl<H> IdleActors<H> {
    pub(crate) fn new() -> Self {
        Self { next: AtomicU64::new(0), by_ticket: Mutex::new(BTreeMap::new()) }
    }

    /// Lists an actor that has just become idle, behind every actor listed
    /// before it.
    pub(crate) fn list(&self, actor: H) -> Ticket {
        let ticket = Ticket(self.next.fetch_add(1, Relaxed));
        self.lock().insert(ticket, actor);
        ticket
    }

    /// Work arrived, or the actor retires. A ticket already taken by the hub
    /// is gone: nothing to do.
    pub(crate) fn unlist(&self, ticket: Ticket) {
        self.lock().remove(&ticket);
    }

    /// Removes and returns the actor idle the longest.
    pub(crate) fn take_idlest(&self) -> Option<(Ticket, H)> {
        self.lock().pop_first()
    }

    /// Actors listed right now.
    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }

    /// Every critical section is a single map operation: a panic cannot
    /// leave the map half-updated, so a poisoned lock is still usable.
    fn lock(&self) -> MutexGuard<'_, BTreeMap<Ticket, H>> {
        self.by_ticket.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_idlest_is_the_one_listed_first_and_unlisting_takes_an_actor_out() {
        let idle = IdleActors::new();
        let a = idle.list("a");
        let b = idle.list("b");
        let c = idle.list("c");
        idle.unlist(a);
        assert_eq!(idle.take_idlest(), Some((b, "b")));
        idle.unlist(b);
        assert_eq!(idle.len(), 1, "unlisting a ticket the hub already took does nothing");
        assert_eq!(idle.take_idlest(), Some((c, "c")));
        assert_eq!(idle.take_idlest(), None);
    }
}
