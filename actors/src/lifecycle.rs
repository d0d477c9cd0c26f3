//! The life of a conversation's actor as seen from its table entry: at most
//! one entry per conversation, the eviction handshake, and compare-and-remove
//! on exit. The hub keeps the table ([`Slots`]); each actor holds the
//! [`Lease`] its entry was created with and never sees the hub.
//!
//! Invariant: no op is lost to a retiring actor, none overtakes another (P6).
//! A caller enters the entry's [`Gate`] before pushing; a retiring actor closes
//! it and waits until nobody is inside, removes its entry only if still its
//! own ([`Lease::leave`]), and its successor holds its first batch until the
//! predecessor's [`Exit`] resolves. Why: ARCHITECTURE §3. Guards live only in
//! [`Slots`]' methods, which neither await nor send; the `start` callback of
//! [`Slots::live_or_start`] runs under one, so it only hands the actor off.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, Weak};

use actix::{Actor, Addr};
use dashmap::mapref::entry::Entry;
use dashmap::DashMap;
use tokio::sync::oneshot;

use crate::ids::ConvId;

/// What an entry needs to know of its actor's address.
pub(crate) trait Mailbox {
    /// False once the actor is gone (stopped, or its thread died): its entry
    /// is dead and the next caller replaces it.
    fn is_open(&self) -> bool;
}

impl<A: Actor> Mailbox for Addr<A> {
    fn is_open(&self) -> bool {
        self.connected()
    }
}

type Table<A> = DashMap<ConvId, Slot<A>>;

/// `conv_id → its actor's entry`. At most one entry per conversation; an
/// entry is removed only by compare-and-remove against its identity.
pub(crate) struct Slots<A> {
    /// Shared with the actors' leases, weakly.
    table: Arc<Table<A>>,
}

impl<A: Mailbox> Slots<A> {
    pub(crate) fn new() -> Self {
        Self { table: Arc::new(DashMap::new()) }
    }

    /// The live entry for `conv`. If there is none, or its actor is retiring
    /// or gone, `start` gets the lease of a new entry, starts an actor with it
    /// and returns the actor's address; the new entry replaces the old one.
    pub(crate) fn live_or_start(&self, conv: &ConvId, start: impl FnOnce(Lease<A>) -> A) -> Slot<A> {
        if let Some(slot) = self.live(conv) {
            return slot;
        }
        match self.table.entry(conv.clone()) {
            Entry::Occupied(mut e) => {
                if e.get().is_live() {
                    return e.get().clone();
                }
                let predecessor = e.get().take_exit();
                let slot = self.new_slot(conv, predecessor, start);
                e.insert(slot.clone());
                slot
            }
            Entry::Vacant(e) => {
                let slot = self.new_slot(conv, None, start);
                e.insert(slot.clone());
                slot
            }
        }
    }

    /// The live entry for `conv`, if there is one.
    pub(crate) fn live(&self, conv: &ConvId) -> Option<Slot<A>> {
        let existing = self.table.get(conv).map(|s| s.clone());
        existing.filter(Slot::is_live)
    }

    fn new_slot(&self, conv: &ConvId, predecessor: Option<Exit>, start: impl FnOnce(Lease<A>) -> A) -> Slot<A> {
        let (done, exit) = oneshot::channel();
        let gate = Arc::new(Gate {
            closed: AtomicBool::new(false),
            inside: AtomicUsize::new(0),
            exit: Mutex::new(Some(Exit(exit))),
        });
        let lease = Lease {
            conv: conv.clone(),
            gate: Arc::clone(&gate),
            table: Arc::downgrade(&self.table),
            predecessor,
            _done: done,
        };
        Slot { addr: Arc::new(start(lease)), gate }
    }

    /// Removes `conv`'s entry only if it still is `slot` (a caller found its
    /// actor gone; a successor may have replaced it meanwhile).
    pub(crate) fn remove_if_same(&self, conv: &ConvId, slot: &Slot<A>) -> bool {
        remove_if_same(&self.table, conv, &slot.gate)
    }

    /// Conversations with an entry right now.
    pub(crate) fn len(&self) -> usize {
        self.table.len()
    }

    /// `conv`'s entry, live or not (tests of the handshake).
    #[cfg(test)]
    pub(crate) fn get(&self, conv: &ConvId) -> Option<Slot<A>> {
        self.table.get(conv).map(|s| s.clone())
    }

    /// Every entry right now; no guard outlives the call.
    pub(crate) fn snapshot(&self) -> Vec<Slot<A>> {
        self.table.iter().map(|e| e.value().clone()).collect()
    }
}

/// The gate identifies the entry: each entry gets its own.
fn remove_if_same<A>(table: &Table<A>, conv: &ConvId, gate: &Arc<Gate>) -> bool {
    table.remove_if(conv, |_, slot| Arc::ptr_eq(&slot.gate, gate)).is_some()
}

/// One table entry: an actor's address and the gate in front of it.
pub(crate) struct Slot<A> {
    /// One address shared by every caller: actix parks a *sender* once the
    /// mailbox is over capacity and refuses its sends until the actor catches
    /// up. A fresh `Addr` clone per send would never be parked, and
    /// `try_send` would never report a full mailbox.
    addr: Arc<A>,
    gate: Arc<Gate>,
}

impl<A> Clone for Slot<A> {
    fn clone(&self) -> Self {
        Self { addr: Arc::clone(&self.addr), gate: Arc::clone(&self.gate) }
    }
}

impl<A: Mailbox> Slot<A> {
    pub(crate) fn addr(&self) -> &A {
        &self.addr
    }

    /// Registers a caller about to push into this actor's mailbox; keep the
    /// guard until the push is done. `None`: the actor is retiring, and the
    /// next [`Slots::live_or_start`] replaces the entry.
    ///
    /// SeqCst on both sides (Dekker): either the caller sees the gate closed,
    /// or the retiring actor sees the caller inside and waits for its push.
    pub(crate) fn enter(&self) -> Option<Inside<'_>> {
        self.gate.inside.fetch_add(1, SeqCst);
        let inside = Inside(&self.gate);
        (!self.gate.closed.load(SeqCst)).then_some(inside)
    }

    /// The actor's exit, for a hub waiting at shutdown. `None` if a successor
    /// or an earlier shutdown already took it.
    pub(crate) fn take_exit(&self) -> Option<Exit> {
        self.gate.exit.lock().map_or(None, |mut e| e.take())
    }

    fn is_live(&self) -> bool {
        !self.gate.closed.load(SeqCst) && self.addr.is_open()
    }

    /// Retires the entry as its actor would (tests of the handshake).
    #[cfg(test)]
    pub(crate) fn close(&self) {
        self.gate.closed.store(true, SeqCst);
    }
}

/// Shared by an entry and its actor's lease: the eviction handshake.
struct Gate {
    closed: AtomicBool,
    /// Callers between "read the address" and "pushed into the mailbox".
    inside: AtomicUsize,
    /// Resolves when the actor is gone. Taken by a successor (which waits for
    /// it before its first batch) or by a hub waiting at shutdown.
    exit: Mutex<Option<Exit>>,
}

/// Leaves the gate on drop, also on unwind.
pub(crate) struct Inside<'a>(&'a Gate);

impl Drop for Inside<'_> {
    fn drop(&mut self) {
        self.0.inside.fetch_sub(1, SeqCst);
    }
}

/// Resolves once an actor (and with it its lease) is gone, however it ended.
pub(crate) struct Exit(oneshot::Receiver<()>);

impl Exit {
    pub(crate) async fn wait(self) {
        // The sender is never used: only its drop matters.
        let _ = self.0.await;
    }
}

/// An actor's membership in the table: everything its retirement needs, and
/// no reference to the hub.
pub(crate) struct Lease<A> {
    conv: ConvId,
    gate: Arc<Gate>,
    /// Weak: the table holds this actor's address; the hub owns the table
    /// and the threads actors run on.
    table: Weak<Table<A>>,
    predecessor: Option<Exit>,
    /// Dropped with the actor, however it ends: resolves its [`Exit`].
    _done: oneshot::Sender<()>,
}

impl<A> Lease<A> {
    pub(crate) fn conv(&self) -> &ConvId {
        &self.conv
    }

    /// The previous actor for this conversation, still finishing: no batch
    /// may start before it has exited (P6). Taken once, when the actor starts.
    pub(crate) fn take_predecessor(&mut self) -> Option<Exit> {
        self.predecessor.take()
    }

    /// Eviction, step 2: no new caller gets through the gate.
    pub(crate) fn close(&self) {
        self.gate.closed.store(true, SeqCst);
    }

    /// Eviction, step 2: callers that got through before the gate closed and
    /// have not pushed yet.
    pub(crate) fn senders_inside(&self) -> bool {
        self.gate.inside.load(SeqCst) != 0
    }

    /// Eviction, step 3, once the actor has stopped: closes the gate (also
    /// after a stop the actor did not choose) and removes the entry if it is
    /// still this lease's.
    ///
    /// Not done on drop: a lease is dropped under the table's guard when its
    /// actor could not be started, and removing there would deadlock.
    pub(crate) fn leave(&self) -> bool {
        self.close();
        self.table.upgrade().is_some_and(|table| remove_if_same(&table, &self.conv, &self.gate))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::cell::RefCell;

    use tokio::sync::oneshot::error::TryRecvError;

    use super::*;

    /// A mailbox that stays open: liveness here comes from the gate alone.
    struct Open;

    impl Mailbox for Open {
        fn is_open(&self) -> bool {
            true
        }
    }

    fn conv() -> ConvId {
        ConvId::parse("c-lifecycle").unwrap()
    }

    /// Starts "actors" by keeping their leases in `leases`.
    fn start(slots: &Slots<Open>, leases: &RefCell<Vec<Lease<Open>>>) -> Slot<Open> {
        slots.live_or_start(&conv(), |lease| {
            leases.borrow_mut().push(lease);
            Open
        })
    }

    fn exited(exit: &mut Exit) -> bool {
        matches!(exit.0.try_recv(), Err(TryRecvError::Closed))
    }

    #[test]
    fn a_live_entry_is_reused_and_a_closed_one_is_replaced_by_a_successor_that_waits_for_it() {
        let slots = Slots::new();
        let leases = RefCell::new(Vec::new());
        let first = start(&slots, &leases);
        assert!(Arc::ptr_eq(&start(&slots, &leases).gate, &first.gate), "a live entry is reused");
        assert_eq!(leases.borrow().len(), 1);

        leases.borrow()[0].close();
        assert!(first.enter().is_none(), "a retiring actor's gate turns callers away");
        let second = start(&slots, &leases);
        assert!(!Arc::ptr_eq(&second.gate, &first.gate));
        assert_eq!(slots.len(), 1);

        let mut predecessor = leases.borrow_mut()[1].take_predecessor().expect("the successor waits");
        assert!(!exited(&mut predecessor));
        let old = leases.borrow_mut().remove(0);
        drop(old);
        assert!(exited(&mut predecessor), "the old lease's drop resolves its exit");
    }

    #[test]
    fn an_old_actors_leave_never_removes_its_successors_entry() {
        let slots = Slots::new();
        let leases = RefCell::new(Vec::new());
        let first = start(&slots, &leases);
        leases.borrow()[0].close();
        let second = start(&slots, &leases);

        assert!(!slots.remove_if_same(&conv(), &first), "a stale entry removes nothing");
        assert!(!leases.borrow()[0].leave(), "the old actor's exit removes nothing");
        assert_eq!(slots.len(), 1);
        assert!(second.enter().is_some(), "the successor's entry is live");

        assert!(leases.borrow()[1].leave());
        assert_eq!(slots.len(), 0);
    }

    #[test]
    fn a_retiring_actor_sees_a_caller_that_got_in_before_the_gate_closed() {
        let slots = Slots::new();
        let leases = RefCell::new(Vec::new());
        let slot = start(&slots, &leases);
        let lease = &leases.borrow()[0];

        let inside = slot.enter().expect("the gate is open");
        lease.close();
        assert!(lease.senders_inside(), "the actor waits for this caller's push");
        drop(inside);
        assert!(!lease.senders_inside());
        assert!(slot.enter().is_none());
        assert!(!lease.senders_inside(), "a caller turned away does not stay inside");
    }
}
