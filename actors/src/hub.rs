//! `conv_id → conversation actor`, created on demand, spread over a few
//! arbiters, removed compare-and-remove on exit.
//!
//! # Eviction handshake (why [`Gate`] exists)
//! A caller reads an actor's address from the map and then pushes into its
//! mailbox; an idle actor may decide to stop in between. actix would accept
//! the push into a mailbox whose actor is about to stop and drop it unhandled,
//! and the op would be lost (its caller could only be told `INTERNAL`). So
//! each map entry carries a [`Gate`]: a caller registers inside it before
//! checking that it is open and pushing; a retiring actor closes it and waits
//! until nobody is inside, after which every op that will ever reach it is
//! already in its mailbox, and it handles them all before stopping. A caller
//! that finds the gate closed (or the mailbox closed, e.g. after a crash)
//! replaces the entry with a fresh actor and retries, a bounded number of
//! times. The fresh actor holds its first batch until its predecessor is gone,
//! so one submitter's ops stay in issue order (P6) across an eviction.
//!
//! # Locking
//! Never hold a dashmap guard across `.await` or while sending to an actor
//! (STYLE 9): guards live only inside [`Hub::slot_for`] and
//! [`Hub::remove_if_same`], which neither await nor send (starting an actor in
//! an arbiter only queues a closure on the arbiter's unbounded channel).

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, Weak};

use actix::dev::SendError;
use actix::{Addr, Arbiter, ArbiterHandle, Context};
use dashmap::mapref::entry::Entry;
use dashmap::DashMap;
use tokio::sync::oneshot;

use crate::conversation::{ActorConfig, ConversationActor, Drain, Submit, WriteError, WriteResult};
use crate::ids::ConvId;
use crate::store::{ConversationStore, Fanout};

/// How often one op may find its actor gone and move to a fresh one.
const MAX_ATTEMPTS: usize = 4;

/// Hub sizing (STYLE 11).
#[derive(Debug, Clone)]
pub struct HubConfig {
    /// Arbiter threads actors are spread over, round-robin. `0` starts every
    /// actor on the arbiter that created the hub (handy for deterministic
    /// tests). Default: available parallelism.
    pub arbiters: usize,
    pub actor: ActorConfig,
}

impl Default for HubConfig {
    fn default() -> Self {
        Self { arbiters: std::thread::available_parallelism().map_or(1, |n| n.get()), actor: ActorConfig::default() }
    }
}

/// Shared by a map entry and its actor: the eviction handshake (module docs).
#[derive(Default)]
pub(crate) struct Gate {
    closed: AtomicBool,
    /// Callers between "read the address" and "pushed into the mailbox".
    inside: AtomicUsize,
    /// Resolves when the actor is gone. Taken by a successor (which waits for
    /// it before its first batch) or by [`Hub::shutdown`].
    done: Mutex<Option<oneshot::Receiver<()>>>,
}

impl Gate {
    /// SeqCst on both sides (Dekker): either the caller sees `closed`, or the
    /// actor sees the caller inside and waits for its push.
    fn enter(&self) -> Option<Inside<'_>> {
        self.inside.fetch_add(1, SeqCst);
        let inside = Inside(self);
        (!self.closed.load(SeqCst)).then_some(inside)
    }

    pub(crate) fn close(&self) {
        self.closed.store(true, SeqCst);
    }

    pub(crate) fn senders_inside(&self) -> bool {
        self.inside.load(SeqCst) != 0
    }

    fn is_closed(&self) -> bool {
        self.closed.load(SeqCst)
    }

    fn take_done(&self) -> Option<oneshot::Receiver<()>> {
        self.done.lock().map_or(None, |mut d| d.take())
    }
}

/// Leaves the gate on drop, also on unwind.
struct Inside<'a>(&'a Gate);

impl Drop for Inside<'_> {
    fn drop(&mut self) {
        self.0.inside.fetch_sub(1, SeqCst);
    }
}

type ActorOf<S, F> = ConversationActor<S, F>;

struct Slot<S: ConversationStore, F: Fanout<S::Committed>> {
    /// One `Addr` (one actix sender) shared by every caller: actix parks a
    /// *sender* once the mailbox is over capacity and refuses its sends until
    /// the actor catches up. A fresh `Addr` clone per send would never be
    /// parked, and `try_send` would never report a full mailbox.
    addr: Arc<Addr<ActorOf<S, F>>>,
    gate: Arc<Gate>,
}

impl<S: ConversationStore, F: Fanout<S::Committed>> Clone for Slot<S, F> {
    fn clone(&self) -> Self {
        Self { addr: Arc::clone(&self.addr), gate: Arc::clone(&self.gate) }
    }
}

/// Routes ops to conversation actors. Shared as `Arc` across threads.
pub struct Hub<S: ConversationStore, F: Fanout<S::Committed>> {
    me: Weak<Self>,
    store: Arc<S>,
    fanout: Arc<F>,
    config: ActorConfig,
    /// At most one entry per conversation; an entry is removed only by
    /// compare-and-remove against its address.
    actors: DashMap<ConvId, Slot<S, F>>,
    /// Owned arbiters, stopped when the hub is dropped.
    arbiters: Vec<Arbiter>,
    handles: Vec<ArbiterHandle>,
    next_arbiter: AtomicUsize,
    started: AtomicU64,
    closed: AtomicBool,
}

impl<S: ConversationStore, F: Fanout<S::Committed>> Hub<S, F> {
    /// Creates the hub and its arbiters.
    ///
    /// # Panics
    /// Must be called on a thread running an actix `System` (arbiters are
    /// registered with it); panics otherwise.
    pub fn new(store: Arc<S>, fanout: Arc<F>, config: HubConfig) -> Arc<Self> {
        let arbiters: Vec<Arbiter> = (0..config.arbiters).map(|_| Arbiter::new()).collect();
        let handles =
            if arbiters.is_empty() { vec![Arbiter::current()] } else { arbiters.iter().map(Arbiter::handle).collect() };
        Arc::new_cyclic(|me| Self {
            me: me.clone(),
            store,
            fanout,
            config: config.actor,
            actors: DashMap::new(),
            arbiters,
            handles,
            next_arbiter: AtomicUsize::new(0),
            started: AtomicU64::new(0),
            closed: AtomicBool::new(false),
        })
    }

    /// Commits `op` through `conv`'s actor and returns its outcome.
    ///
    /// The op is queued when this future is first polled; to fix the order of
    /// several ops without awaiting each, use [`Hub::enqueue`].
    pub async fn submit(&self, conv: ConvId, op: S::Op) -> Result<S::Outcome, WriteError> {
        self.enqueue(conv, op).await
    }

    /// Queues `op` now, before returning, and gives back a future of its
    /// outcome. Ops of one caller enqueued one after another are committed in
    /// that order (P6), whether or not their futures are awaited in between.
    ///
    /// Refusals are immediate: `Overloaded` when the conversation's mailbox or
    /// queue is full or the hub is shutting down; `Internal` when no live
    /// actor could be reached after a few fresh ones.
    pub fn enqueue(&self, conv: ConvId, op: S::Op) -> impl Future<Output = WriteResult<S>> + Send + 'static {
        let queued = self.push(conv, op);
        async move {
            match queued {
                Ok(rx) => rx.await.unwrap_or_else(|_| Err(WriteError::Internal("conversation actor stopped".into()))),
                Err(e) => Err(e),
            }
        }
    }

    fn push(&self, conv: ConvId, mut op: S::Op) -> Result<oneshot::Receiver<WriteResult<S>>, WriteError> {
        if self.closed.load(SeqCst) {
            return Err(WriteError::Overloaded);
        }
        let (tx, rx) = oneshot::channel();
        let mut reply = tx;
        for _ in 0..MAX_ATTEMPTS {
            let slot = self.slot_for(&conv);
            let Some(inside) = slot.gate.enter() else {
                // Retiring: the next `slot_for` replaces it.
                continue;
            };
            let sent = slot.addr.try_send(Submit { op, reply });
            drop(inside);
            match sent {
                Ok(()) => return Ok(rx),
                Err(SendError::Full(_)) => return Err(WriteError::Overloaded),
                Err(SendError::Closed(back)) => {
                    tracing::debug!(conv_id = %conv, "conversation actor gone, retrying on a fresh one");
                    self.remove_if_same(&conv, &slot.addr);
                    op = back.op;
                    reply = back.reply;
                }
            }
        }
        Err(WriteError::Internal("no conversation actor could take the op".into()))
    }

    /// The live entry for `conv`, creating (or replacing a retired/dead) one.
    fn slot_for(&self, conv: &ConvId) -> Slot<S, F> {
        let existing = self.actors.get(conv).map(|s| s.clone());
        if let Some(slot) = existing {
            if !slot.gate.is_closed() && slot.addr.connected() {
                return slot;
            }
        }
        match self.actors.entry(conv.clone()) {
            Entry::Occupied(mut e) => {
                let current = e.get();
                if !current.gate.is_closed() && current.addr.connected() {
                    return current.clone();
                }
                let predecessor = current.gate.take_done();
                let slot = self.start_actor(conv, predecessor);
                e.insert(slot.clone());
                slot
            }
            Entry::Vacant(e) => {
                let slot = self.start_actor(conv, None);
                e.insert(slot.clone());
                slot
            }
        }
    }

    fn start_actor(&self, conv: &ConvId, predecessor: Option<oneshot::Receiver<()>>) -> Slot<S, F> {
        let i = self.next_arbiter.fetch_add(1, SeqCst) % self.handles.len();
        let gate = Arc::new(Gate::default());
        let (done_tx, done_rx) = oneshot::channel();
        if let Ok(mut d) = gate.done.lock() {
            *d = Some(done_rx);
        }
        let actor = ConversationActor::new(
            conv.clone(),
            Arc::clone(&self.store),
            Arc::clone(&self.fanout),
            self.me.clone(),
            self.config.clone(),
            Arc::clone(&gate),
            done_tx,
            predecessor,
        );
        // Like `Actor::start_in_arbiter`, but with the mailbox sized before
        // the address is handed out: a burst may arrive before `started`.
        let (tx, rx) = actix::dev::channel::channel(self.config.mailbox_capacity.max(1));
        self.handles[i].spawn_fn(move || {
            let ctx = Context::with_receiver(rx);
            actix::spawn(ctx.into_future(actor));
        });
        let addr = Arc::new(Addr::new(tx));
        self.started.fetch_add(1, SeqCst);
        tracing::debug!(conv_id = %conv, arbiter = i, "conversation actor started");
        Slot { addr, gate }
    }

    /// Removes `conv`'s entry only if it still points at `addr`: an old
    /// actor's exit never removes its successor.
    pub fn remove_if_same(&self, conv: &ConvId, addr: &Addr<ConversationActor<S, F>>) -> bool {
        self.actors.remove_if(conv, |_, slot| *slot.addr == *addr).is_some()
    }

    /// Conversations with an actor entry right now.
    pub fn live_actors(&self) -> usize {
        self.actors.len()
    }

    /// Actors started since the hub was created (creations and replacements).
    pub fn actors_started(&self) -> u64 {
        self.started.load(SeqCst)
    }

    /// Stops accepting ops (new ones get `Overloaded`), lets every actor
    /// commit and answer what it has queued, and returns once all have stopped.
    pub async fn shutdown(&self) {
        self.closed.store(true, SeqCst);
        let slots: Vec<Slot<S, F>> = self.actors.iter().map(|e| e.value().clone()).collect();
        let mut waits = Vec::with_capacity(slots.len());
        for slot in slots {
            if let Some(done) = slot.gate.take_done() {
                waits.push(done);
            }
            // A control message, one per actor, bounded by the actor count:
            // `do_send` so a full mailbox cannot make shutdown skip an actor.
            slot.addr.do_send(Drain);
        }
        for done in waits {
            let _ = done.await;
        }
    }
}

/// Stops the hub's arbiters and with them every actor; callers still waiting
/// get `Internal`. Call [`Hub::shutdown`] first to drain.
impl<S: ConversationStore, F: Fanout<S::Committed>> Drop for Hub<S, F> {
    fn drop(&mut self) {
        for arbiter in &self.arbiters {
            arbiter.stop();
        }
    }
}

#[cfg(all(test, feature = "test-util"))]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::time::Duration;

    use super::*;
    use crate::ids::{ClientMsgId, UserId};
    use crate::testing::{Appended, MemoryStore, RecordingFanout, SendOp};

    type TestHub = Hub<MemoryStore, RecordingFanout<Appended>>;

    fn op(key: &str) -> SendOp {
        SendOp { sender: UserId::parse("u1").unwrap(), key: ClientMsgId::parse(key).unwrap(), payload: String::new() }
    }

    fn current(hub: &TestHub, conv: &ConvId) -> Slot<MemoryStore, RecordingFanout<Appended>> {
        hub.actors.get(conv).map(|s| s.clone()).expect("an entry")
    }

    #[actix::test]
    async fn an_old_actors_exit_never_removes_its_successors_entry() {
        let store = Arc::new(MemoryStore::new());
        store.set_latency(Duration::from_millis(20));
        let hub: Arc<TestHub> = Hub::new(
            Arc::clone(&store),
            Arc::new(RecordingFanout::default()),
            HubConfig { arbiters: 1, actor: ActorConfig::default() },
        );
        let conv = ConvId::parse("c-successor").unwrap();

        // The old actor is busy with a batch when it is told to retire.
        let first = hub.enqueue(conv.clone(), op("k1"));
        let old = current(&hub, &conv);
        old.gate.close();

        // A caller finds the gate closed and installs a successor, which holds
        // its first batch until the old actor is gone.
        let second = hub.enqueue(conv.clone(), op("k2"));
        let new = current(&hub, &conv);
        assert!(new.addr != old.addr);
        assert!(!hub.remove_if_same(&conv, &*old.addr), "stale address removes nothing");

        old.addr.do_send(Drain);
        assert_eq!(first.await.unwrap().seq, 1);
        assert_eq!(second.await.unwrap().seq, 2, "the successor waited for its predecessor");

        // The old actor has stopped and run its compare-and-remove by now.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
        while old.addr.connected() {
            assert!(tokio::time::Instant::now() < deadline, "old actor stopped");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_eq!(hub.live_actors(), 1);
        assert!(current(&hub, &conv).addr == new.addr, "the successor's entry survived");
        assert_eq!(hub.submit(conv.clone(), op("k3")).await.unwrap().seq, 3);
        assert_eq!(hub.actors_started(), 2);
    }
}
