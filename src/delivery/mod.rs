//! Delivery after commit (ARCHITECTURE §5): a conversation's actor hands each
//! committed batch here once; frames are encoded once and shared by every
//! receiving connection. With several nodes ([`Peers`], ARCHITECTURE §7) a
//! batch committed here also goes to the others, and theirs come in through
//! [`Delivery::from_peer`] to the same lanes.
//!
//! Invariant: nothing here blocks or awaits on a connection (bounded mailbox;
//! an overflow or a push over the memory budget closes it, the client syncs).
//! Recipients come from what each lane keeps of its online users, never from
//! a member list. `conn`: a connection's pushes and close; `outbox`: its
//! queue to the socket writer; `presence`: a lane's online users (pure);
//! `lane`: a lane's thread; `order`: seq order.

mod conn;
mod lane;
mod order;
mod outbox;
mod presence;

use std::collections::HashSet;
use std::future::Future;
use std::mem;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, LazyLock, OnceLock};
use std::time::Instant;

use dashmap::mapref::entry::Entry;
use dashmap::DashMap;
use imcore_actors::registry::ConnId;
use imcore_actors::{ConvId, DeviceId, Fanout, UserId};
use tokio::sync::oneshot;

use crate::config::DeliverySettings;
use crate::metrics::metrics;
use crate::store::{Appended, Heads, Membership};
pub use conn::{Conn, KickReason, Push, Routes};
pub use lane::Signal;
use lane::{Job, Lane, LaneCounts, LaneInput, Missed};
pub use order::REORDER_WAIT;
use order::{Admitted, Reorder};
pub use outbox::{Out, Outbox, Queued};

/// Fan-out runs on a few delivery threads ("lanes", `DeliverySettings::lanes`),
/// never on a conversation actor's thread, so encoding and pushing a batch
/// never delays the next batch's commit. Every lane sees every batch, in
/// order, and serves the users that hash to it: a connection is always served
/// by one lane, so it gets one conversation's events in seq order, and a big
/// group's fan-out is spread over all lanes. A lane's input is unbounded, but
/// past `backlog` queued batches a lane gets a small [`Missed`] notice
/// instead of the batch (counted and logged): the users it concerns resync.
pub struct Delivery {
    routes: Arc<Routes>,
    lanes: Vec<LaneHandle>,
    backlog: usize,
    /// Conversations being created whose id is known beforehand (a direct
    /// chat's, a group's chosen id): their batches wait here until the
    /// creation's own events are on the lanes. See [`Delivery::hold_creation`].
    held: DashMap<ConvId, Held>,
    /// The other nodes, once this one joined a cluster; unset on a single
    /// node, which then pays one load of this cell per batch.
    peers: OnceLock<Arc<dyn Peers>>,
    /// Noted before a peer's batch is delivered: a device that then syncs
    /// reads a standby only once it has that batch (ARCHITECTURE §6).
    heads: Arc<Heads>,
    /// Tokens revoked on this node ([`Delivery::revocations`]).
    revocations: AtomicU64,
    /// With peers: batches of one conversation from here and from the bus,
    /// back in seq order.
    reorder: Reorder,
    /// Users other nodes said they have online, and which nodes (`Live::Online`).
    online_elsewhere: DashMap<UserId, HashSet<String>>,
    /// Devices routed on another node: the node and connection its claim
    /// named, until that node says the connection ended (`Live::Unrouted`)
    /// or goes silent.
    routed_elsewhere: DashMap<(UserId, DeviceId), (String, u64)>,
    /// What follows this node's committed batches besides the lanes (the
    /// notifier, ARCHITECTURE §5); unset: nothing does.
    follower: OnceLock<Arc<dyn Follower>>,
}

/// Follows the batches committed on this node, in each conversation's seq
/// order. Never waits.
pub trait Follower: Send + Sync {
    fn committed(&self, appended: &Arc<Appended>);
}

/// The other nodes of a cluster, as delivery sees them (ARCHITECTURE §7).
/// Neither call waits.
pub trait Peers: Send + Sync {
    /// A batch committed on this node, for the devices on the others. Called
    /// in the order the batches go to this node's lanes.
    fn batch(&self, appended: Arc<Appended>);
    /// Connection `conn` (a cluster-wide id) is now the route of `user`'s
    /// `device` here: a node holding an older connection of it kicks that one.
    fn claim(&self, user: &UserId, device: &DeviceId, conn: ConnId);
    /// `user`'s `device` has a new token: a node routing it kicks that connection.
    fn revoke(&self, user: &UserId, device: &DeviceId);
    /// An ephemeral signal for the other nodes (PROTOCOL v1.2); may be lost.
    fn live(&self, live: Live);
}

/// What the live signals (PROTOCOL v1.2) tell the other nodes: never stored,
/// never in a conversation's batches; a lost one is not made up for.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub enum Live {
    /// For the current members of `conv` online there, but `from` (`typing`).
    Signal { conv: ConvId, from: UserId, frame: String },
    /// For every device of `users` there (a read cursor, a presence change).
    ToUsers { users: Vec<UserId>, frame: String },
    /// Whether the sending node has `user` online (a device, or its grace).
    Online { user: UserId, online: bool },
    /// The sending node's connection `conn` of `user`'s `device` ended.
    Unrouted { user: UserId, device: DeviceId, conn: u64 },
}

struct LaneHandle {
    input: Sender<LaneInput>,
    counts: Arc<LaneCounts>,
}

/// Batches of a conversation whose creation is in progress.
#[derive(Default)]
struct Held {
    /// Creations of this id in progress (two devices may create one direct chat at once).
    creations: usize,
    /// In the order they go to the lanes.
    jobs: Vec<Arc<Job>>,
}

/// What the lanes keep about online users, all lanes together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tracked {
    /// Online users (subscribed connections' users).
    pub users: usize,
    /// (online user, conversation) pairs.
    pub periods: usize,
}

impl Delivery {
    pub fn new(routes: Arc<Routes>, heads: Arc<Heads>, settings: &DeliverySettings) -> Self {
        let lanes = (0..settings.lanes.max(1))
            .map(|lane| {
                let (input, inputs) = channel::<LaneInput>();
                let counts = Arc::new(LaneCounts::default());
                let worker = Lane::new(routes.clone(), counts.clone(), settings.backlog);
                std::thread::Builder::new()
                    .name(format!("delivery-{lane}"))
                    // Ends when the `Delivery` (every sender) is dropped.
                    .spawn(move || worker.run(inputs))
                    .map(|_| LaneHandle { input, counts })
            })
            .collect::<Result<Vec<_>, _>>()
            .unwrap_or_else(|e| panic!("cannot start delivery threads: {e}"));
        Self {
            routes,
            lanes,
            backlog: settings.backlog,
            held: DashMap::new(),
            peers: OnceLock::new(),
            heads,
            revocations: AtomicU64::new(0),
            reorder: Reorder::new(Instant::now()),
            online_elsewhere: DashMap::new(),
            routed_elsewhere: DashMap::new(),
            follower: OnceLock::new(),
        }
    }

    /// From now on `follower` gets every batch committed here. Once per
    /// process; a second call is ignored.
    pub fn follow(&self, follower: Arc<dyn Follower>) {
        let _ = self.follower.set(follower);
    }

    /// Whether `user`'s `device` has a connection on this node or another.
    pub fn device_connected(&self, user: &UserId, device: &DeviceId) -> bool {
        self.routes.route(user, device).is_some() || self.routed_elsewhere.contains_key(&(user.clone(), device.clone()))
    }

    /// Node `node` claimed `conn` as the route of `user`'s `device`.
    pub fn routed_at(&self, node: &str, user: &UserId, device: &DeviceId, conn: ConnId) {
        let key = (user.clone(), device.clone());
        match self.routed_elsewhere.entry(key) {
            Entry::Occupied(mut e) if e.get().1 < conn.get() => {
                e.insert((node.to_owned(), conn.get()));
            }
            Entry::Occupied(_) => {}
            Entry::Vacant(e) => {
                e.insert((node.to_owned(), conn.get()));
            }
        }
    }

    /// This node's connection `conn` of `user`'s `device` ended: the others hear of it.
    pub fn unrouted(&self, user: &UserId, device: &DeviceId, conn: ConnId) {
        self.live(Live::Unrouted { user: user.clone(), device: device.clone(), conn: conn.get() });
    }

    /// Joins a cluster: from now on this node's batches and routes go to
    /// `peers` too. Once per process; a second call is ignored.
    pub fn join(&self, peers: Arc<dyn Peers>) {
        let _ = self.peers.set(peers);
    }

    /// Hands `live` to the other nodes, if any.
    pub fn live(&self, live: Live) {
        if let Some(peers) = self.peers.get() {
            peers.live(live);
        }
    }

    /// A live signal from node `node`: to this node's devices, or (`Online`)
    /// into what this node knows of users online elsewhere.
    pub fn from_peer_live(&self, node: &str, live: Live) {
        match live {
            Live::Signal { conv, from, frame } => self.signal(Signal { conv, from, frame: frame.into() }),
            Live::ToUsers { users, frame } => {
                let frame: Arc<str> = frame.into();
                for user in &users {
                    self.to_user(user, &frame, None);
                }
            }
            Live::Online { user, online } => match self.online_elsewhere.entry(user) {
                Entry::Occupied(mut e) => {
                    if online {
                        e.get_mut().insert(node.to_owned());
                    } else {
                        e.get_mut().remove(node);
                        if e.get().is_empty() {
                            e.remove();
                        }
                    }
                }
                Entry::Vacant(e) => {
                    if online {
                        e.insert(HashSet::from([node.to_owned()]));
                    }
                }
            },
            Live::Unrouted { user, device, conn } => {
                self.routed_elsewhere.remove_if(&(user, device), |_, (n, c)| n == node && *c == conn);
            }
        }
    }

    /// Node `node` went silent: the users only it had online are not online.
    pub fn node_gone(&self, node: &str) {
        self.online_elsewhere.retain(|_, nodes| {
            nodes.remove(node);
            !nodes.is_empty()
        });
        self.routed_elsewhere.retain(|_, (n, _)| n != node);
    }

    /// Whether another node said it has `user` online.
    pub fn online_elsewhere(&self, user: &UserId) -> bool {
        self.online_elsewhere.contains_key(user)
    }

    /// Whether this node is one of several (connection ids then come from the
    /// cluster-wide sequence).
    pub fn clustered(&self) -> bool {
        self.peers.get().is_some()
    }

    /// Tells the other nodes that `conn` routes `user`'s `device` here.
    pub fn claim(&self, user: &UserId, device: &DeviceId, conn: ConnId) {
        if let Some(peers) = self.peers.get() {
            peers.claim(user, device, conn);
        }
    }

    /// `user`'s `device` has a new token: its connection, on this node or
    /// another, is kicked (`token_revoked`).
    pub fn revoke(&self, user: &UserId, device: &DeviceId) {
        self.kick_revoked(user, device);
        if let Some(peers) = self.peers.get() {
            peers.revoke(user, device);
        }
    }

    /// Tokens revoked here so far, from this node or another (a connection
    /// that registers after a lookup re-reads its token only if this moved).
    pub fn revocations(&self) -> u64 {
        self.revocations.load(Ordering::SeqCst)
    }

    /// Kicks this node's connection of `user`'s `device`, if any, for a new token.
    pub fn kick_revoked(&self, user: &UserId, device: &DeviceId) {
        // Counted before the route is looked up: a connection registering
        // meanwhile sees the count move and re-reads its token.
        self.revocations.fetch_add(1, Ordering::SeqCst);
        if let Some(route) = self.routes.route(user, device) {
            route.recipient.kick(KickReason::TokenRevoked);
        }
    }

    /// A batch another node committed: to the lanes like one of ours.
    pub fn from_peer(&self, appended: Appended) {
        self.heads.saw(&appended.conv_id, appended.head);
        if !appended.events.is_empty() {
            self.admit(Arc::new(Job::new(appended)));
        }
    }

    /// Lets go of batches that waited too long for their predecessors (see
    /// [`REORDER_WAIT`]); the bus calls it periodically.
    pub fn expire_reordered(&self) {
        self.reorder.expire(Instant::now(), |a| self.admitted(a));
    }

    /// Batches from other nodes may have been lost without trace (the bus
    /// was disconnected or dropped messages): every user online here resyncs
    /// (its connections close with 1013; the clients reconnect and sync).
    pub fn resync_all(&self) {
        metrics().kicks.with_label_values(&["bus_lost"]).inc();
        for lane in &self.lanes {
            let _ = lane.input.send(LaneInput::ResyncAll);
        }
    }

    pub fn routes(&self) -> &Arc<Routes> {
        &self.routes
    }

    /// What the lanes keep now (an instant's sum, for gauges and tests).
    pub fn tracked(&self) -> Tracked {
        let sum = |f: fn(&LaneCounts) -> usize| self.lanes.iter().map(|l| f(&l.counts)).sum();
        Tracked { users: sum(|c| c.users.load(Ordering::Relaxed)), periods: sum(|c| c.periods.load(Ordering::Relaxed)) }
    }

    /// Connection `conn` of `user`'s `device` is routed: its lane starts
    /// tracking the user. Call before reading the snapshot for
    /// [`Delivery::load`], so that every batch the snapshot does not reflect
    /// reaches the lane after this (ARCHITECTURE §5).
    pub fn subscribe(&self, user: &UserId, device: &DeviceId, conn: ConnId) {
        let input = LaneInput::Subscribe { user: user.clone(), device: device.clone(), conn };
        self.to_lane_of(user, input);
    }

    /// `user`'s memberships, read after [`Delivery::subscribe`] for `conn`.
    pub fn load(&self, user: &UserId, device: &DeviceId, conn: ConnId, snapshot: Vec<Membership>) {
        let input = LaneInput::Load { user: user.clone(), device: device.clone(), conn, snapshot };
        self.to_lane_of(user, input);
    }

    /// Connection `conn` of `user` is gone.
    pub fn unsubscribe(&self, user: &UserId, conn: ConnId) {
        self.to_lane_of(user, LaneInput::Unsubscribe { user: user.clone(), conn });
    }

    /// Sends `frame` to every live device of `user`.
    pub fn to_user(&self, user: &UserId, frame: &Arc<str>, except: Option<&DeviceId>) {
        for (device, route) in self.routes.routes_of(user) {
            if Some(&device) != except {
                route.recipient.send(frame.clone());
            }
        }
    }

    /// Sends `signal` to the current members of its conversation online on
    /// this node (every lane looks among its own users); never waits.
    pub fn signal(&self, signal: Signal) {
        let signal = Arc::new(signal);
        for lane in &self.lanes {
            let _ = lane.input.send(LaneInput::Signal(signal.clone()));
        }
    }

    fn to_lane_of(&self, user: &UserId, input: LaneInput) {
        // Fails only once the lane thread is gone (shutdown): nothing to track then.
        let _ = self.lanes[lane_of(user, self.lanes.len())].input.send(input);
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

    /// A batch committed on this node: to the other nodes, then to the lanes.
    fn dispatch(&self, job: Arc<Job>) {
        if let Some(follower) = self.follower.get() {
            follower.committed(&job.appended);
        }
        let Some(peers) = self.peers.get() else {
            return self.to_lanes(job);
        };
        peers.batch(job.appended.clone());
        self.admit(job);
    }

    /// With peers, batches reach the lanes through the reorder stage.
    fn admit(&self, job: Arc<Job>) {
        self.reorder.admit(job, Instant::now(), |a| self.admitted(a));
    }

    fn admitted(&self, admitted: Admitted) {
        match admitted {
            Admitted::InOrder(job) => self.to_lanes(job),
            Admitted::Late(job) => {
                metrics().kicks.with_label_values(&["delivery_late"]).inc();
                let missed = Arc::new(Missed::of(&job));
                for lane in &self.lanes {
                    let _ = lane.input.send(LaneInput::Missed(missed.clone()));
                }
            }
        }
    }

    /// Hands `job` to every lane, in order; never waits. A lane `backlog`
    /// jobs behind gets a [`Missed`] notice instead (counted).
    fn to_lanes(&self, job: Arc<Job>) {
        let mut missed: Option<Arc<Missed>> = None;
        for lane in &self.lanes {
            let input = if lane.counts.queued.fetch_add(1, Ordering::Relaxed) < self.backlog {
                LaneInput::Job(job.clone())
            } else {
                lane.counts.queued.fetch_sub(1, Ordering::Relaxed);
                metrics().kicks.with_label_values(&["delivery_dropped"]).inc();
                tracing::warn!(conv_id = %job.appended.conv_id, "delivery lane full: a batch's pushes dropped");
                LaneInput::Missed(missed.get_or_insert_with(|| Arc::new(Missed::of(&job))).clone())
            };
            if lane.input.send(input).is_err() {
                lane.counts.queued.fetch_sub(1, Ordering::Relaxed);
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
            creation.into_iter().for_each(|job| self.dispatch(job));
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
                self.dispatch(job);
            }
            entry.remove();
        }
        pushed
    }
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
        self.dispatch(job);
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
