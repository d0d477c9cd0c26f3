//! `conv_id → conversation actor`, created on demand, spread over a few
//! arbiters; the table, the eviction handshake and compare-and-remove on exit
//! live in `lifecycle`. The hub routes ops through it, starts the actors, and
//! drives shutdown.
//!
//! Invariant: at most [`HubConfig::max_actors`] live actors, soft by the
//! retirements under way: at the cap an op for a new conversation asks the
//! idlest idle actor to retire (`Evict`) and starts its own; with none idle it
//! is refused with [`WriteError::Overloaded`]. Nothing scans the table: the
//! idle index (`idle`) keeps actors in the order they went idle (ARCHITECTURE §3).

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;

use actix::dev::SendError;
use actix::{Addr, Arbiter, ArbiterHandle, Context};
use tokio::sync::oneshot;

use crate::conversation::{
    ActorConfig, ConversationActor, Drain, Evict, InternalError, Shared, Submit, WriteError, WriteResult,
};
use crate::idle::IdleActors;
use crate::ids::ConvId;
use crate::lifecycle::{Lease, Slots};
use crate::store::{ConversationStore, Fanout};

/// How often one op may find its actor gone and move to a fresh one.
const MAX_ATTEMPTS: usize = 4;

/// Hub sizing.
#[derive(Debug, Clone)]
pub struct HubConfig {
    /// Arbiter threads actors are spread over, round-robin. `0` starts every
    /// actor on the arbiter that created the hub (handy for deterministic
    /// tests). Default: available parallelism.
    pub arbiters: usize,
    /// Live actors (table entries, retiring ones included) past which a new
    /// actor starts only by evicting the idlest idle one; with none idle, the
    /// op gets [`WriteError::Overloaded`]. What an actor costs: ARCHITECTURE
    /// §3, "Backpressure". Default 100,000.
    pub max_actors: usize,
    pub actor: ActorConfig,
}

impl Default for HubConfig {
    fn default() -> Self {
        Self {
            arbiters: std::thread::available_parallelism().map_or(1, |n| n.get()),
            max_actors: 100_000,
            actor: ActorConfig::default(),
        }
    }
}

type ActorAddr<S, F> = Addr<ConversationActor<S, F>>;

/// Routes ops to conversation actors. Shared as `Arc` across threads.
pub struct Hub<S: ConversationStore, F: Fanout<S::Committed>> {
    shared: Shared<S, F>,
    actors: Slots<ActorAddr<S, F>>,
    max_actors: usize,
    evicted: AtomicU64,
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
        Arc::new(Self {
            shared: Shared { store, fanout, config: config.actor, idle: Arc::new(IdleActors::new()) },
            actors: Slots::new(),
            max_actors: config.max_actors.max(1),
            evicted: AtomicU64::new(0),
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
    /// queue is full, when it has no actor and none can be evicted to make
    /// room under the cap, or when the hub is shutting down; `Internal` when
    /// no live actor could be reached after a few fresh ones.
    pub fn enqueue(&self, conv: ConvId, op: S::Op) -> impl Future<Output = WriteResult<S>> + Send + 'static {
        let queued = self.push(conv, op);
        async move {
            match queued {
                Ok(rx) => rx.await.unwrap_or_else(|_| Err(InternalError::new("the conversation actor stopped").into())),
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
            let slot = match self.actors.live(&conv) {
                Some(slot) => slot,
                None => {
                    self.make_room()?;
                    self.actors.live_or_start(&conv, |lease| self.start_actor(lease))
                }
            };
            let Some(inside) = slot.enter() else {
                // Retiring: the next `live_or_start` replaces it.
                continue;
            };
            let sent = slot.addr().try_send(Submit { op, reply });
            drop(inside);
            match sent {
                Ok(()) => return Ok(rx),
                Err(SendError::Full(_)) => return Err(WriteError::Overloaded),
                Err(SendError::Closed(back)) => {
                    tracing::debug!(conv_id = %conv, "conversation actor gone, retrying on a fresh one");
                    self.actors.remove_if_same(&conv, &slot);
                    op = back.op;
                    reply = back.reply;
                }
            }
        }
        Err(InternalError::new("no conversation actor could take the op").into())
    }

    /// Before a new actor starts: at the cap, asks the idlest idle actor to
    /// retire (see the module docs). Two callers racing here may evict two
    /// for one start; that only retires an idle actor early.
    fn make_room(&self) -> Result<(), WriteError> {
        if self.actors.len() < self.max_actors {
            return Ok(());
        }
        while let Some((ticket, actor)) = self.shared.idle.take_idlest() {
            // Gone already (its thread died): its listing was stale.
            if let Some(actor) = actor.upgrade() {
                // A control message, one per start over the cap: `do_send`,
                // an idle actor's mailbox is empty anyway.
                actor.do_send(Evict(ticket));
                self.evicted.fetch_add(1, SeqCst);
                return Ok(());
            }
        }
        tracing::debug!(live = self.actors.len(), cap = self.max_actors, "no idle conversation actor to evict");
        Err(WriteError::Overloaded)
    }

    /// Starts an actor for `lease` on the next arbiter. Runs under the
    /// table's entry guard: it only queues the actor on its arbiter.
    fn start_actor(&self, lease: Lease<ActorAddr<S, F>>) -> ActorAddr<S, F> {
        let i = self.next_arbiter.fetch_add(1, SeqCst) % self.handles.len();
        let conv = lease.conv().clone();
        // Like `Actor::start_in_arbiter`, but with the mailbox sized before
        // the address is handed out: a burst may arrive before `started`.
        let (tx, rx) = actix::dev::channel::channel(self.shared.config.mailbox_capacity.max(1));
        let addr = Addr::new(tx);
        let actor = ConversationActor::new(self.shared.clone(), lease);
        self.handles[i].spawn_fn(move || {
            let ctx = Context::with_receiver(rx);
            actix::spawn(ctx.into_future(actor));
        });
        self.started.fetch_add(1, SeqCst);
        tracing::debug!(conv_id = %conv, arbiter = i, "conversation actor started");
        addr
    }

    /// Conversations with an actor entry right now.
    pub fn live_actors(&self) -> usize {
        self.actors.len()
    }

    /// Live actors that are idle (nothing queued or in flight) and not
    /// retiring: the candidates for eviction at the cap.
    pub fn idle_actors(&self) -> usize {
        self.shared.idle.len()
    }

    /// Actors started since the hub was created (creations and replacements).
    pub fn actors_started(&self) -> u64 {
        self.started.load(SeqCst)
    }

    /// Idle actors asked to retire to make room under the cap, since the hub
    /// was created (an actor that got an op meanwhile stays).
    pub fn evictions(&self) -> u64 {
        self.evicted.load(SeqCst)
    }

    /// Stops accepting ops (new ones get `Overloaded`), lets every actor
    /// commit and answer what it has queued, and returns once all have stopped.
    pub async fn shutdown(&self) {
        self.closed.store(true, SeqCst);
        let slots = self.actors.snapshot();
        let mut exits = Vec::with_capacity(slots.len());
        for slot in slots {
            exits.extend(slot.take_exit());
            // A control message, one per actor, bounded by the actor count:
            // `do_send` so a full mailbox cannot make shutdown skip an actor.
            slot.addr().do_send(Drain);
        }
        for exit in exits {
            exit.wait().await;
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
    use crate::lifecycle::Slot;
    use crate::testing::{Appended, MemoryStore, RecordingFanout, SendOp};

    type TestHub = Hub<MemoryStore, RecordingFanout<Appended>>;

    fn op(key: &str) -> SendOp {
        SendOp { sender: UserId::parse("u1").unwrap(), key: ClientMsgId::parse(key).unwrap(), payload: String::new() }
    }

    fn current(hub: &TestHub, conv: &ConvId) -> Slot<ActorAddr<MemoryStore, RecordingFanout<Appended>>> {
        hub.actors.get(conv).expect("an entry")
    }

    #[actix::test]
    async fn an_old_actors_exit_never_removes_its_successors_entry() {
        let store = Arc::new(MemoryStore::new());
        store.set_latency(Duration::from_millis(20));
        let hub: Arc<TestHub> = Hub::new(
            Arc::clone(&store),
            Arc::new(RecordingFanout::default()),
            HubConfig { arbiters: 1, ..HubConfig::default() },
        );
        let conv = ConvId::parse("c-successor").unwrap();

        // The old actor is busy with a batch when it is told to retire.
        let first = hub.enqueue(conv.clone(), op("k1"));
        let old = current(&hub, &conv);
        old.close();

        // A caller finds the gate closed and installs a successor, which holds
        // its first batch until the old actor is gone.
        let second = hub.enqueue(conv.clone(), op("k2"));
        let new = current(&hub, &conv);
        assert!(new.addr() != old.addr());
        assert!(!hub.actors.remove_if_same(&conv, &old), "a stale entry removes nothing");

        old.addr().do_send(Drain);
        assert_eq!(first.await.unwrap().seq, 1);
        assert_eq!(second.await.unwrap().seq, 2, "the successor waited for its predecessor");

        // The old actor has stopped and run its compare-and-remove by now.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
        while old.addr().connected() {
            assert!(tokio::time::Instant::now() < deadline, "old actor stopped");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_eq!(hub.live_actors(), 1);
        assert!(current(&hub, &conv).addr() == new.addr(), "the successor's entry survived");
        assert_eq!(hub.submit(conv.clone(), op("k3")).await.unwrap().seq, 3);
        assert_eq!(hub.actors_started(), 2);
    }

    async fn listed_idle(hub: &TestHub) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
        while hub.idle_actors() == 0 {
            assert!(tokio::time::Instant::now() < deadline, "the actor lists itself idle");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    #[actix::test]
    async fn an_eviction_request_is_declined_by_an_actor_that_got_an_op_since_it_was_listed() {
        let hub: Arc<TestHub> = Hub::new(
            Arc::new(MemoryStore::new()),
            Arc::new(RecordingFanout::default()),
            HubConfig { arbiters: 1, ..HubConfig::default() },
        );
        let conv = ConvId::parse("c-evict").unwrap();
        assert_eq!(hub.submit(conv.clone(), op("k1")).await.unwrap().seq, 1);
        listed_idle(&hub).await;
        let (stale, actor) = hub.shared.idle.take_idlest().expect("listed");

        // An op since the listing: the request with the old ticket is stale.
        assert_eq!(hub.submit(conv.clone(), op("k2")).await.unwrap().seq, 2);
        actor.upgrade().expect("alive").do_send(Evict(stale));
        // Handled after the request (one mailbox, in order): the gate would
        // be closed by now had the actor retired.
        assert_eq!(hub.submit(conv.clone(), op("k3")).await.unwrap().seq, 3);
        assert!(hub.actors.live(&conv).is_some(), "the actor declined");
        assert_eq!(hub.actors_started(), 1);

        // Idle and still listed under the ticket the hub takes: it retires.
        listed_idle(&hub).await;
        let (current, actor) = hub.shared.idle.take_idlest().expect("listed again");
        actor.upgrade().expect("alive").do_send(Evict(current));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
        while hub.live_actors() != 0 {
            assert!(tokio::time::Instant::now() < deadline, "the evicted actor leaves");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}
