//! Delivery after commit (ARCHITECTURE §5). A conversation's actor hands each
//! committed batch here once; the frames are encoded once and shared by every
//! receiving connection. Nothing here blocks or awaits on a connection: each
//! connection has a bounded mailbox, and one that overflows is told to close
//! (the client reconnects and syncs), so a slow device never slows the
//! conversation or the other devices. Every push frame queued for a
//! connection also holds its bytes of the global memory budget until the
//! session writes it (or drops it); a push that does not fit is treated like
//! an overflow.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::mem;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::{Arc, LazyLock, OnceLock, Weak};

use actix::dev::SendError;
use actix::{Message, Recipient};
use dashmap::mapref::entry::Entry;
use dashmap::DashMap;
use imcore_actors::registry::{ConnId, RouteRegistry};
use imcore_actors::{ConvId, DeviceId, Fanout, UserId};
use tokio::sync::oneshot;

use crate::budget::{MemoryBudget, Permit};
use crate::config::DeliverySettings;
use crate::domain::{DeliveryMode, Event, EventKind};
use crate::metrics::metrics;
use crate::protocol::{encode_event, push_encoded_events, push_head};
use crate::store::{Appended, MemberMap};

/// What a connection is sent from outside its own request handling.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub enum Push {
    /// A JSON text frame, encoded once for all its recipients, and its bytes
    /// of the memory budget, given back once the session wrote or dropped it.
    Frame(Arc<str>, Permit),
    /// The connection's mailbox overflowed: close it (1013), the client resyncs.
    Overflowed,
    /// Close the connection after telling it why (`kicked` push).
    Kick(KickReason),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KickReason {
    Replaced,
    TokenRevoked,
    Shutdown,
}

impl KickReason {
    pub fn as_str(self) -> &'static str {
        match self {
            KickReason::Replaced => "replaced",
            KickReason::TokenRevoked => "token_revoked",
            KickReason::Shutdown => "shutdown",
        }
    }
}

/// A live connection as the route registry holds it.
#[derive(Debug, Clone)]
pub struct Conn {
    /// Shared, not cloned per push: actix reports a full mailbox through
    /// `try_send` only to a sender that is already parked, and every clone of
    /// a `Recipient` starts unparked — the queue would never look full.
    pub push: Arc<Recipient<Push>>,
    overflow: Arc<Overflow>,
    budget: Arc<MemoryBudget>,
}

/// What an overflow must undo without the session's help.
///
/// A session whose client stops reading is not polled at all: actix-http
/// stops polling the response body (and with it the actor) while its write
/// buffer is full, so the session cannot close itself until the client reads
/// again or goes away. The route is therefore removed here, at the moment the
/// mailbox is found full, so fan-out stops considering the connection at once.
#[derive(Debug)]
struct Overflow {
    /// Set once the mailbox overflowed, so the close request is sent once.
    seen: AtomicBool,
    /// Weak: the registry holds this `Conn`.
    routes: Weak<Routes>,
    user: UserId,
    device: DeviceId,
    conn_id: ConnId,
}

impl Conn {
    /// The connection `conn_id` of `user`'s `device`, registered in `routes`;
    /// its queued pushes are paid from `budget`.
    pub fn new(
        push: Recipient<Push>,
        routes: &Arc<Routes>,
        budget: Arc<MemoryBudget>,
        user: UserId,
        device: DeviceId,
        conn_id: ConnId,
    ) -> Self {
        let overflow = Overflow { seen: AtomicBool::new(false), routes: Arc::downgrade(routes), user, device, conn_id };
        Self { push: Arc::new(push), overflow: Arc::new(overflow), budget }
    }

    /// Never waits. The frame's bytes are taken from the memory budget for
    /// this connection (a frame shared by many connections is paid by each:
    /// the budget bounds what the queues could hold, not what they share).
    /// A full mailbox or an exhausted budget drops this push, removes the
    /// route (compare-and-remove: a newer connection of the device keeps its
    /// own) and queues [`Push::Overflowed`] behind the pushes already queued,
    /// so the session closes with 1013 as soon as it runs again; the client
    /// reconnects and syncs (PROTOCOL §4).
    pub fn send(&self, frame: Arc<str>) {
        if self.overflow.seen.load(Ordering::Relaxed) {
            return;
        }
        let Some(permit) = self.budget.try_acquire(frame.len()) else {
            return self.overflowed("over_budget");
        };
        match self.push.try_send(Push::Frame(frame, permit)) {
            Ok(()) | Err(SendError::Closed(_)) => {}
            Err(SendError::Full(_)) => self.overflowed("overflowed"),
        }
    }

    fn overflowed(&self, reason: &'static str) {
        let o = &self.overflow;
        if !o.seen.swap(true, Ordering::Relaxed) {
            metrics().kicks.with_label_values(&[reason]).inc();
            if let Some(routes) = o.routes.upgrade() {
                routes.unregister(&o.user, &o.device, o.conn_id);
            }
            // One small message past the bound, once per connection.
            self.push.do_send(Push::Overflowed);
        }
    }
}

pub type Routes = RouteRegistry<Conn>;

/// Fan-out runs on a few delivery threads ("lanes", `DeliverySettings::lanes`),
/// never on a conversation actor's thread, so encoding and pushing a batch
/// never delays the next batch's commit. Every lane sees every batch, in
/// order, and serves the users that hash to it: a connection is always served
/// by one lane, so it gets one conversation's events in seq order, and a big
/// group's fan-out is spread over all lanes. Past a lane's backlog a batch's
/// pushes are dropped (counted and logged): clients notice the gap and sync,
/// the log is the truth.
pub struct Delivery {
    fan: Arc<FanOut>,
    lanes: Vec<SyncSender<Arc<Job>>>,
    /// Conversations being created whose id is known beforehand (a direct
    /// chat's, a group's chosen id): their batches wait here until the
    /// creation's own events are on the lanes. See [`Delivery::hold_creation`].
    held: DashMap<ConvId, Held>,
}

/// Batches of a conversation whose creation is in progress.
#[derive(Default)]
struct Held {
    /// Creations of this id in progress (two devices may create one direct chat at once).
    creations: usize,
    /// In the order they go to the lanes.
    jobs: Vec<Arc<Job>>,
}

/// A committed batch, shared by the lanes.
struct Job {
    appended: Appended,
    /// Every event as JSON, encoded once by whichever lane needs it first.
    encoded: OnceLock<Vec<String>>,
    /// Dropped with the job, once every lane has pushed it (or dropped it):
    /// tells a creator its conversation's first events are out.
    _pushed: Option<oneshot::Sender<()>>,
}

impl Job {
    fn new(appended: Appended) -> Self {
        Self { appended, encoded: OnceLock::new(), _pushed: None }
    }

    /// A job whose receiver resolves once every lane is done with it.
    fn announced(appended: Appended) -> (Self, oneshot::Receiver<()>) {
        let (pushed, done) = oneshot::channel();
        (Self { appended, encoded: OnceLock::new(), _pushed: Some(pushed) }, done)
    }
}

struct FanOut {
    routes: Arc<Routes>,
    lanes: usize,
}

impl Delivery {
    pub fn new(routes: Arc<Routes>, settings: &DeliverySettings) -> Self {
        let lanes = settings.lanes.max(1);
        let fan = Arc::new(FanOut { routes, lanes });
        let lanes = (0..lanes)
            .map(|lane| {
                let (sender, jobs) = sync_channel::<Arc<Job>>(settings.backlog);
                let fan = fan.clone();
                std::thread::Builder::new()
                    .name(format!("delivery-{lane}"))
                    .spawn(move || {
                        // Ends when the `Delivery` (every sender) is dropped.
                        for job in jobs {
                            fan.fan_out(&job, lane);
                        }
                    })
                    .map(|_| sender)
            })
            .collect::<Result<Vec<_>, _>>()
            .unwrap_or_else(|e| panic!("cannot start delivery threads: {e}"));
        Self { fan, lanes, held: DashMap::new() }
    }

    pub fn routes(&self) -> &Arc<Routes> {
        &self.fan.routes
    }

    /// Taken before the transaction that creates conversation `conv` (its id,
    /// when known beforehand), released with the events it appended once it
    /// committed: the creation's events reach the lanes before any batch of
    /// the conversation, so every connection gets its events in seq order
    /// even when a member who knew the id sends the moment the creation
    /// committed (pushing them on the request thread let that send overtake
    /// them). Dropped unreleased (the creation failed), it lets the held
    /// batches go.
    pub fn hold_creation(self: &Arc<Self>, conv: Option<ConvId>) -> CreationHold {
        if let Some(conv) = &conv {
            self.held.entry(conv.clone()).or_default().creations += 1;
        }
        CreationHold { delivery: self.clone(), conv }
    }

    /// Hands `job` to every lane (never waits: a full lane drops it, counted).
    fn to_lanes(&self, job: Arc<Job>) {
        for lane in &self.lanes {
            if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) = lane.try_send(job.clone()) {
                metrics().kicks.with_label_values(&["delivery_dropped"]).inc();
                tracing::warn!(conv_id = %job.appended.conv_id, "delivery lane full: pushes of a batch dropped");
            }
        }
    }

    /// Hands the creation's job over (with the held batches once no other
    /// creation of the id is in progress); resolves once it was pushed.
    fn release_creation(&self, conv: Option<&ConvId>, created: Option<Appended>) -> Option<oneshot::Receiver<()>> {
        let (creation, pushed) = match created.filter(|a| !a.events.is_empty()).map(Job::announced) {
            Some((job, pushed)) => (Some(Arc::new(job)), Some(pushed)),
            None => (None, None),
        };
        let Some(conv) = conv else {
            creation.into_iter().for_each(|job| self.to_lanes(job));
            return pushed;
        };
        let Entry::Occupied(mut entry) = self.held.entry(conv.clone()) else {
            return pushed;
        };
        let held = entry.get_mut();
        if let Some(job) = creation {
            // Its seqs come first: no batch can commit before the creation.
            held.jobs.insert(0, job);
        }
        held.creations -= 1;
        if held.creations == 0 {
            // Under the entry's lock: a batch delivered meanwhile waits for
            // `remove`, then goes to the lanes behind these.
            for job in mem::take(&mut held.jobs) {
                self.to_lanes(job);
            }
            entry.remove();
        }
        pushed
    }

    /// Sends `frame` to every live device of `user`.
    pub fn to_user(&self, user: &UserId, frame: &Arc<str>, except: Option<&DeviceId>) {
        self.fan.to_user(user, frame, except)
    }
}

impl FanOut {
    fn to_user(&self, user: &UserId, frame: &Arc<str>, except: Option<&DeviceId>) {
        for (device, route) in self.routes.routes_of(user) {
            if Some(&device) != except {
                route.recipient.send(frame.clone());
            }
        }
    }

    /// Pushes the events of `job` to the members `lane` serves.
    fn fan_out(&self, job: &Job, lane: usize) {
        let (a, before) = (&job.appended, &*job.appended.members_before);
        let mine = |user: &UserId| lane_of(user, self.lanes) == lane;
        let conv = a.conv_id.as_str();
        if a.delivery_mode == DeliveryMode::Pull {
            let frame: Arc<str> = push_head(conv, a.head).into();
            for user in members_after(a, before).iter().filter(|u| mine(u)) {
                self.to_user(user, &frame, None);
            }
            return;
        }
        let changes_membership =
            a.events.iter().any(|e| matches!(e.kind, EventKind::Join { .. } | EventKind::Leave { .. }));
        if !changes_membership {
            let all: Vec<usize> = (0..a.events.len()).collect();
            self.send_events(job, &all, before.keys().filter(|u| mine(u)));
            return;
        }
        // Who sees which event: replay the batch's joins and leaves (a joiner
        // sees from its join, a leaver up to and including its leave).
        let mut current: HashSet<&UserId> = before.keys().filter(|u| mine(u)).collect();
        let mut visible: HashMap<&UserId, Vec<usize>> = HashMap::new();
        for (i, e) in a.events.iter().enumerate() {
            if let EventKind::Join { subject, .. } = &e.kind {
                if mine(subject) {
                    current.insert(subject);
                }
            }
            for user in &current {
                visible.entry(user).or_default().push(i);
            }
            if let EventKind::Leave { subject, .. } = &e.kind {
                current.remove(subject);
            }
        }
        let mut groups: HashMap<Vec<usize>, Vec<&UserId>> = HashMap::new();
        for (user, indices) in visible {
            groups.entry(indices).or_default().push(user);
        }
        for (indices, users) in groups {
            self.send_events(job, &indices, users.into_iter());
        }
    }

    /// One frame for everyone, except that a device never gets its own
    /// messages pushed back (its ack answered it): its frame is spliced from
    /// the same encoded events, without its own.
    fn send_events<'a>(&self, job: &Job, indices: &[usize], users: impl Iterator<Item = &'a UserId>) {
        let (conv, events) = (job.appended.conv_id.as_str(), &job.appended.events);
        fn sent_by(e: &Event) -> Option<(&UserId, &DeviceId)> {
            match &e.kind {
                EventKind::Msg { sender, sender_device, .. } => Some((sender, sender_device)),
                _ => None,
            }
        }
        if indices.is_empty() {
            return;
        }
        let mut shared: Option<Arc<str>> = None;
        for user in users {
            for (device, route) in self.routes.routes_of(user) {
                let encoded = job.encoded.get_or_init(|| events.iter().map(encode_event).collect());
                let own = |i: usize| sent_by(&events[i]) == Some((user, &device));
                let frame = if indices.iter().any(|&i| own(i)) {
                    let rest: Vec<&str> = indices.iter().filter(|&&i| !own(i)).map(|&i| encoded[i].as_str()).collect();
                    if rest.is_empty() {
                        continue;
                    }
                    Arc::from(push_encoded_events(conv, &rest))
                } else {
                    shared
                        .get_or_insert_with(|| {
                            let all: Vec<&str> = indices.iter().map(|&i| encoded[i].as_str()).collect();
                            Arc::from(push_encoded_events(conv, &all))
                        })
                        .clone()
                };
                route.recipient.send(frame);
            }
        }
    }
}

/// Members once the batch's joins and leaves are applied.
fn members_after(a: &Appended, before: &MemberMap) -> Vec<UserId> {
    let mut users: HashSet<UserId> = before.keys().cloned().collect();
    for e in &a.events {
        match &e.kind {
            EventKind::Join { subject, .. } => {
                users.insert(subject.clone());
            }
            EventKind::Leave { subject, .. } => {
                users.remove(subject);
            }
            _ => {}
        }
    }
    users.into_iter().collect()
}

impl Fanout<Appended> for Delivery {
    /// Batches of one conversation must come in seq order (one caller at a
    /// time per conversation, as its actor is).
    fn deliver(&self, _conv: &ConvId, appended: Appended) {
        if appended.events.is_empty() {
            return;
        }
        let job = Arc::new(Job::new(appended));
        if let Some(mut held) = self.held.get_mut(&job.appended.conv_id) {
            held.jobs.push(job);
            return;
        }
        self.to_lanes(job);
    }
}

/// A creation in progress (see [`Delivery::hold_creation`]).
pub struct CreationHold {
    delivery: Arc<Delivery>,
    conv: Option<ConvId>,
}

impl CreationHold {
    /// The creation committed and appended `created` (nothing when it found
    /// the conversation existing). Resolves once those events were pushed to
    /// the members' connections, so the creator answers after that, as a
    /// device that connects after the answer gets them from `sync` instead.
    pub fn release(mut self, created: Option<Appended>) -> impl Future<Output = ()> {
        let conv = self.conv.take();
        let pushed = self.delivery.release_creation(conv.as_ref(), created);
        async move {
            if let Some(pushed) = pushed {
                // An error only says the sender was dropped: the job is done.
                let _ = pushed.await;
            }
        }
    }
}

impl Drop for CreationHold {
    fn drop(&mut self) {
        if let Some(conv) = self.conv.take() {
            self.delivery.release_creation(Some(&conv), None);
        }
    }
}

/// The lane of `lanes` that serves `user`'s connections.
fn lane_of(user: &UserId, lanes: usize) -> usize {
    use std::hash::{BuildHasher, RandomState};
    static SEED: LazyLock<RandomState> = LazyLock::new(RandomState::new);
    (SEED.hash_one(user) % lanes as u64) as usize
}
