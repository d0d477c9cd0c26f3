//! One actor per hot conversation: it serialises that conversation's writes
//! with its own queue and exactly one batch in flight (group commit without
//! timers; why not async handlers: ARCHITECTURE §3). A [`Submit`] only
//! queues; a batch takes everything queued (up to [`ActorConfig::max_batch`]):
//! commit → reply to every caller, in op order → [`Fanout::deliver`] → next.
//!
//! Invariant: an accelerator, not the guard (the store's row lock keeps P1,
//! P2); one submitter's ops keep their order, across an eviction too (P6,
//! `lifecycle`). Staying warm, retiring early, eviction at the cap:
//! ARCHITECTURE §3. A failed batch fails each caller with
//! [`WriteError::Internal`] (the source kept); the caller's edge logs it once,
//! this layer only at `debug` unless the store breaks its contract.

use std::collections::VecDeque;
use std::error::Error;
use std::sync::Arc;
use std::time::Duration;

use actix::{fut, Actor, ActorFutureExt, Addr, AsyncContext, Context, Handler, Message, Running, WeakAddr, WrapFuture};
use tokio::sync::oneshot;
use tokio::task::JoinError;
use tokio::time::Instant;
use tracing::Instrument;

use crate::idle::{IdleActors, Ticket};
use crate::lifecycle::Lease;
use crate::store::{BatchCommitted, ConversationStore, Fanout};

/// Why one op was not committed. The gateway maps these to PROTOCOL codes.
#[derive(Debug, Clone, thiserror::Error)]
pub enum WriteError {
    /// The conversation's queue is full (or the hub is shutting down): nothing
    /// was done; the client may retry later. Wire code `OVERLOADED`.
    #[error("conversation is overloaded, retry later")]
    Overloaded,
    /// The batch failed as a whole (store error, panic, actor gone): the op may
    /// or may not have been committed; a retry with the same request key is
    /// safe (it replays). Wire code `INTERNAL`.
    #[error("internal error, the write may or may not have been committed")]
    Internal(#[source] InternalError),
}

/// What went wrong behind a [`WriteError::Internal`], and the failure that
/// caused it when there is one. Cheap to clone: every caller of a failed
/// batch gets the same cause.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{reason}")]
pub struct InternalError {
    reason: &'static str,
    #[source]
    source: Option<Arc<dyn Error + Send + Sync>>,
}

impl InternalError {
    pub(crate) fn new(reason: &'static str) -> Self {
        Self { reason, source: None }
    }

    pub(crate) fn caused_by(reason: &'static str, source: impl Error + Send + Sync + 'static) -> Self {
        Self { reason, source: Some(Arc::new(source)) }
    }
}

impl From<InternalError> for WriteError {
    fn from(e: InternalError) -> Self {
        WriteError::Internal(e)
    }
}

/// What one op's caller gets back.
pub type WriteResult<S> = Result<<S as ConversationStore>::Outcome, WriteError>;

/// Capacities and timeouts of conversation actors, named in one place.
#[derive(Debug, Clone)]
pub struct ActorConfig {
    /// Most ops in one batch (one transaction). Default 1024.
    pub max_batch: usize,
    /// Most ops queued behind the batch in flight; one more is refused with
    /// [`WriteError::Overloaded`] at once. Default 8192.
    pub max_queue: usize,
    /// Capacity of the actix mailbox in front of the queue. The handler only
    /// moves messages into the queue, so the mailbox is a burst buffer while
    /// the actor's thread is busy; once full, `try_send` fails and the caller
    /// gets [`WriteError::Overloaded`] at once. Memory per conversation is
    /// bounded by `mailbox_capacity + max_queue` ops. Default 1024.
    pub mailbox_capacity: usize,
    /// An actor with nothing queued or in flight for this long stops and
    /// leaves the hub. Checked every `idle_timeout / 2`. Default 60 s.
    pub idle_timeout: Duration,
}

impl Default for ActorConfig {
    fn default() -> Self {
        Self { max_batch: 1024, max_queue: 8192, mailbox_capacity: 1024, idle_timeout: Duration::from_secs(60) }
    }
}

/// Queue one op on a conversation's actor. Handled without awaiting anything:
/// the op joins the queue (or is refused with `Overloaded`) and `reply`
/// receives its outcome once its batch is done. A `Submit` dropped unhandled
/// drops `reply`, which the hub reports as `Internal`.
pub struct Submit<S: ConversationStore> {
    pub op: S::Op,
    pub reply: oneshot::Sender<WriteResult<S>>,
}

// Hand-written: the derive would demand `S: Message`-friendly bounds on `S`.
impl<S: ConversationStore> Message for Submit<S> {
    type Result = ();
}

/// Stop once everything queued is committed and answered (hub shutdown).
/// The hub learns that the actor has stopped from its entry's `Exit`.
pub(crate) struct Drain;

impl Message for Drain {
    type Result = ();
}

/// Retire if still idle since the listing `Ticket` (the hub took it from the
/// idle index because live actors reached the cap).
pub(crate) struct Evict(pub(crate) Ticket);

impl Message for Evict {
    type Result = ();
}

struct Pending<S: ConversationStore> {
    op: S::Op,
    reply: oneshot::Sender<WriteResult<S>>,
}

/// The idle actors of one hub, as the hub reaches them.
pub(crate) type IdleIndex<S, F> = IdleActors<WeakAddr<ConversationActor<S, F>>>;

/// What every conversation actor of one hub is built from.
pub(crate) struct Shared<S: ConversationStore, F: Fanout<S::Committed>> {
    pub(crate) store: Arc<S>,
    pub(crate) fanout: Arc<F>,
    pub(crate) config: ActorConfig,
    pub(crate) idle: Arc<IdleIndex<S, F>>,
}

impl<S: ConversationStore, F: Fanout<S::Committed>> Clone for Shared<S, F> {
    fn clone(&self) -> Self {
        Self {
            store: Arc::clone(&self.store),
            fanout: Arc::clone(&self.fanout),
            config: self.config.clone(),
            idle: Arc::clone(&self.idle),
        }
    }
}

/// What this actor's committed batches have appended so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Appends {
    /// No batch has committed yet (a failed batch decides nothing: the
    /// actor carries on, as after any failure).
    Untried,
    /// Every committed batch appended nothing (each op refused or replayed):
    /// not worth keeping warm.
    Nothing,
    /// Some batch appended an event.
    Some,
}

/// The single owner of one conversation's write queue: everything else reaches it through messages.
pub struct ConversationActor<S: ConversationStore, F: Fanout<S::Committed>> {
    store: Arc<S>,
    fanout: Arc<F>,
    config: ActorConfig,
    /// The hub's idle index, and how it reaches this actor.
    idle: Arc<IdleIndex<S, F>>,
    /// This actor's listing in the idle index: `Some` exactly while the
    /// actor is idle, not retiring, and listed.
    idle_ticket: Option<Ticket>,
    appends: Appends,
    /// This actor's entry in the hub's table: its conversation, the gate it
    /// closes when retiring, and its predecessor's exit (see
    /// `lifecycle`).
    lease: Lease<Addr<Self>>,
    /// Ops waiting for the next batch, each with its caller's reply channel.
    queue: VecDeque<Pending<S>>,
    /// The store's per-conversation cache. `None` exactly while a batch owns
    /// it; after a failed batch it is reset to `Default` (it may be stale).
    cache: Option<S::Cache>,
    /// The one batch in flight. Every batch is started by `start_batch`,
    /// which does nothing while this is set.
    in_flight: bool,
    /// A batch start is already scheduled for the end of this mailbox poll.
    kick_scheduled: bool,
    /// Set while this actor's predecessor for the same conversation is still
    /// finishing; no batch starts before it has exited (keeps P6 across an
    /// eviction).
    blocked: bool,
    /// Last time an op arrived or a batch finished.
    last_activity: Instant,
    /// Stop once idle even before `idle_timeout` (hub shutdown).
    drain_requested: bool,
    /// The gate is closed: the hub no longer routes new ops here, and the
    /// actor stops as soon as its mailbox, queue and batch are empty.
    retiring: bool,
}

// actix needs `Actor: Unpin`. The store's types need not be `Unpin`, and
// nothing here is ever pinned in place: actix only takes `&mut` to the actor.
impl<S: ConversationStore, F: Fanout<S::Committed>> Unpin for ConversationActor<S, F> {}

impl<S: ConversationStore, F: Fanout<S::Committed>> ConversationActor<S, F> {
    pub(crate) fn new(shared: Shared<S, F>, lease: Lease<Addr<Self>>) -> Self {
        let Shared { store, fanout, config, idle } = shared;
        Self {
            store,
            fanout,
            config,
            idle,
            idle_ticket: None,
            appends: Appends::Untried,
            lease,
            queue: VecDeque::new(),
            cache: Some(S::Cache::default()),
            in_flight: false,
            kick_scheduled: false,
            // Set by `started`, which takes the predecessor from the lease.
            blocked: false,
            last_activity: Instant::now(),
            drain_requested: false,
            retiring: false,
        }
    }

    /// Starts a batch at the end of the current mailbox poll, so that a burst
    /// of messages already in the mailbox lands in one batch. Not a timer: the
    /// spawned item runs in the same poll of the actor's future.
    fn kick(&mut self, ctx: &mut Context<Self>) {
        if self.in_flight || self.blocked || self.kick_scheduled || self.queue.is_empty() {
            return;
        }
        self.kick_scheduled = true;
        ctx.spawn(fut::ready(()).map(|(), act: &mut Self, ctx| {
            act.kick_scheduled = false;
            act.start_batch(ctx);
        }));
    }

    fn start_batch(&mut self, ctx: &mut Context<Self>) {
        if self.in_flight || self.blocked || self.queue.is_empty() {
            return;
        }
        let n = self.queue.len().min(self.config.max_batch.max(1));
        let mut ops = Vec::with_capacity(n);
        let mut replies = Vec::with_capacity(n);
        for p in self.queue.drain(..n) {
            ops.push(p.op);
            replies.push(p.reply);
        }
        let cache = self.cache.take().unwrap_or_default();
        self.in_flight = true;
        let store = Arc::clone(&self.store);
        let conv = self.lease.conv().clone();
        // One span per batch, around the commit and the replies, so a send
        // can be followed from the queue to its transaction.
        let span = tracing::debug_span!("commit_batch", conv_id = %conv, ops = n);
        // The store call runs in its own task: a panic there (even in the
        // synchronous part of `commit_batch`) surfaces as a `JoinError`
        // instead of tearing down this actor.
        let task = actix::spawn(async move { store.commit_batch(conv, cache, ops).await }.instrument(span.clone()));
        ctx.spawn(task.into_actor(self).map(move |res, act, ctx| {
            // The next batch starts outside this span: it is not this
            // batch's child.
            span.in_scope(|| act.finish_batch(replies, res));
            act.start_batch(ctx);
            act.settle(ctx);
        }));
    }

    fn finish_batch(
        &mut self,
        replies: Vec<oneshot::Sender<WriteResult<S>>>,
        res: Result<Result<BatchCommitted<S>, S::Error>, JoinError>,
    ) {
        self.in_flight = false;
        self.last_activity = Instant::now();
        match res {
            Ok(Ok(committed)) => self.answer(replies, committed),
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "batch failed in the store");
                self.fail_all(replies, InternalError::caused_by("the store failed the batch", e));
            }
            Err(join) => {
                tracing::debug!(error = %join, "batch task failed");
                self.fail_all(replies, InternalError::caused_by("the batch was aborted", join));
            }
        }
    }

    /// Replies to every caller in op order, then fans out: an ack never trails a push of its own event.
    fn answer(&mut self, replies: Vec<oneshot::Sender<WriteResult<S>>>, batch: BatchCommitted<S>) {
        let BatchCommitted { outcomes, cache, committed, appended } = batch;
        self.cache = Some(cache);
        if appended > 0 {
            self.appends = Appends::Some;
        } else if self.appends == Appends::Untried {
            self.appends = Appends::Nothing;
        }
        if outcomes.len() != replies.len() {
            // Fields repeated from the span: this must show even where debug
            // spans are filtered out.
            tracing::error!(
                conv_id = %self.lease.conv(),
                ops = replies.len(),
                outcomes = outcomes.len(),
                "store broke its contract: one outcome per op"
            );
        }
        let mut outcomes = outcomes.into_iter();
        for reply in replies {
            let answer =
                outcomes.next().ok_or_else(|| InternalError::new("the store returned no outcome for this op").into());
            // A caller that gave up has dropped its receiver: nothing to do.
            let _ = reply.send(answer);
        }
        self.fanout.deliver(self.lease.conv(), committed);
    }

    fn fail_all(&mut self, replies: Vec<oneshot::Sender<WriteResult<S>>>, cause: InternalError) {
        // The cache may describe state the failed transaction never committed.
        self.cache = Some(S::Cache::default());
        for reply in replies {
            let _ = reply.send(Err(cause.clone().into()));
        }
    }

    fn idle(&self) -> bool {
        self.queue.is_empty() && !self.in_flight && !self.blocked
    }

    /// Called whenever the actor may have become idle. An idle actor retires
    /// when told to drain, when its batches appended nothing, or after
    /// `idle_timeout`; otherwise it lists itself as idle, for eviction at the
    /// hub's cap.
    fn settle(&mut self, ctx: &mut Context<Self>) {
        if !self.idle() {
            return;
        }
        if self.retiring {
            // Ops that slipped in before the gate closed are done: stop now.
            self.finish_retiring(ctx);
            return;
        }
        if self.drain_requested
            || self.appends == Appends::Nothing
            || self.last_activity.elapsed() >= self.config.idle_timeout
        {
            self.retire(ctx);
        } else if self.idle_ticket.is_none() {
            self.idle_ticket = Some(self.idle.list(ctx.address().downgrade()));
        }
    }

    /// Closes the gate so the hub routes no new op here (eviction step 2 in
    /// `lifecycle`), and stops once the ops already on their way are done.
    fn retire(&mut self, ctx: &mut Context<Self>) {
        tracing::debug!(conv_id = %self.lease.conv(), "conversation actor retiring");
        self.unlist();
        self.retiring = true;
        self.lease.close();
        self.finish_retiring(ctx);
    }

    /// Busy again, or going: the hub must not pick this actor as idle.
    fn unlist(&mut self) {
        if let Some(ticket) = self.idle_ticket.take() {
            self.idle.unlist(ticket);
        }
    }

    /// Waits until no hub caller is between reading this actor's address and
    /// pushing into its mailbox; from then on nothing new can arrive. The stop
    /// (the spawned item) runs after the next mailbox poll, which handles
    /// every message pushed so far; `stopping` refuses to stop if that poll
    /// queued ops, and the end of the batch comes back here.
    fn finish_retiring(&mut self, ctx: &mut Context<Self>) {
        if self.lease.senders_inside() {
            ctx.run_later(Duration::from_millis(1), |act, ctx| act.finish_retiring(ctx));
            return;
        }
        ctx.spawn(fut::ready(()).map(|(), _act: &mut Self, ctx: &mut Context<Self>| {
            use actix::ActorContext;
            ctx.stop();
        }));
    }
}

impl<S: ConversationStore, F: Fanout<S::Committed>> Actor for ConversationActor<S, F> {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        let tick = (self.config.idle_timeout / 2).max(Duration::from_millis(1));
        ctx.run_interval(tick, |act, ctx| act.settle(ctx));
        if let Some(predecessor) = self.lease.take_predecessor() {
            self.blocked = true;
            ctx.spawn(predecessor.wait().into_actor(self).map(|(), act, ctx| {
                act.blocked = false;
                act.last_activity = Instant::now();
                act.start_batch(ctx);
                // A drain may have arrived while blocked.
                act.settle(ctx);
            }));
        }
    }

    fn stopping(&mut self, _ctx: &mut Context<Self>) -> Running {
        if self.idle() {
            Running::Stop
        } else {
            // The last mailbox poll queued ops (or something asked us to stop
            // mid-batch): finish them first.
            Running::Continue
        }
    }

    fn stopped(&mut self, _ctx: &mut Context<Self>) {
        tracing::debug!(conv_id = %self.lease.conv(), "conversation actor stopped");
        self.unlist();
        self.lease.leave();
    }
}

impl<S: ConversationStore, F: Fanout<S::Committed>> Handler<Submit<S>> for ConversationActor<S, F> {
    type Result = ();

    fn handle(&mut self, msg: Submit<S>, ctx: &mut Context<Self>) {
        self.last_activity = Instant::now();
        self.unlist();
        if self.queue.len() >= self.config.max_queue {
            let _ = msg.reply.send(Err(WriteError::Overloaded));
            return;
        }
        self.queue.push_back(Pending { op: msg.op, reply: msg.reply });
        self.kick(ctx);
    }
}

impl<S: ConversationStore, F: Fanout<S::Committed>> Handler<Drain> for ConversationActor<S, F> {
    type Result = ();

    fn handle(&mut self, _msg: Drain, ctx: &mut Context<Self>) {
        self.drain_requested = true;
        self.settle(ctx);
    }
}

impl<S: ConversationStore, F: Fanout<S::Committed>> Handler<Evict> for ConversationActor<S, F> {
    type Result = ();

    fn handle(&mut self, Evict(ticket): Evict, ctx: &mut Context<Self>) {
        // Still listed under this ticket: no op has arrived since the hub took
        // it (an op unlists). Otherwise the actor is busy, or idle again and
        // listed anew, and stays.
        if self.idle_ticket == Some(ticket) {
            self.retire(ctx);
        }
    }
}
