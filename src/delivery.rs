//! Delivery after commit (ARCHITECTURE §5). A conversation's actor hands each
//! committed batch here once; the frames are encoded once and shared by every
//! receiving connection. Nothing here blocks or awaits on a connection: each
//! connection has a bounded mailbox, and one that overflows is told to close
//! (the client reconnects and syncs), so a slow device never slows the
//! conversation or the other devices.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::{Arc, Weak};

use actix::dev::SendError;
use actix::{Message, Recipient};
use imcore_actors::registry::{ConnId, RouteRegistry};
use imcore_actors::{ConvId, DeviceId, Fanout, UserId};

use crate::domain::{DeliveryMode, Event, EventKind};
use crate::metrics::metrics;
use crate::protocol::{encode_event, push_encoded_events, push_head};
use crate::store::{Appended, MemberMap, Store};

/// What a connection is sent from outside its own request handling.
#[derive(Debug, Clone, Message)]
#[rtype(result = "()")]
pub enum Push {
    /// A JSON text frame, encoded once for all its recipients.
    Frame(Arc<str>),
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
    /// The connection `conn_id` of `user`'s `device`, registered in `routes`.
    pub fn new(push: Recipient<Push>, routes: &Arc<Routes>, user: UserId, device: DeviceId, conn_id: ConnId) -> Self {
        let overflow = Overflow { seen: AtomicBool::new(false), routes: Arc::downgrade(routes), user, device, conn_id };
        Self { push: Arc::new(push), overflow: Arc::new(overflow) }
    }

    /// Never waits. A full mailbox drops this push, removes the route
    /// (compare-and-remove: a newer connection of the device keeps its own)
    /// and queues [`Push::Overflowed`] behind the pushes already queued, so
    /// the session closes with 1013 as soon as it runs again; the client
    /// reconnects and syncs (PROTOCOL §4).
    pub fn send(&self, push: Push) {
        match self.push.try_send(push) {
            Ok(()) | Err(SendError::Closed(_)) => {}
            Err(SendError::Full(_)) => {
                let o = &self.overflow;
                if !o.seen.swap(true, Ordering::Relaxed) {
                    metrics().kicks.with_label_values(&["overflowed"]).inc();
                    if let Some(routes) = o.routes.upgrade() {
                        routes.unregister(&o.user, &o.device, o.conn_id);
                    }
                    // One small message past the bound, once per connection.
                    self.push.do_send(Push::Overflowed);
                }
            }
        }
    }
}

pub type Routes = RouteRegistry<Conn>;

/// Fan-out runs on a few delivery threads ("lanes"), never on a conversation
/// actor's thread, so encoding and pushing a batch never delays the next
/// batch's commit. A conversation always maps to the same lane, which keeps
/// its batches in seq order per connection.
const LANES: usize = 2;
/// Batches waiting per lane; beyond it a batch's pushes are dropped (counted
/// and logged): clients notice the gap and sync, the log is the truth.
const LANE_CAPACITY: usize = 4096;

pub struct Delivery {
    fan: Arc<FanOut>,
    lanes: Vec<SyncSender<Job>>,
}

/// A committed batch and the members before it.
struct Job {
    appended: Appended,
    members: Arc<MemberMap>,
    /// Direct path: ops of one conversation reach their lane from concurrent
    /// tasks, so an older event may come after a newer one; it is dropped
    /// rather than pushed out of order (PROTOCOL §4), and clients sync.
    unordered: bool,
}

struct FanOut {
    routes: Arc<Routes>,
    store: Store,
}

impl Delivery {
    pub fn new(routes: Arc<Routes>, store: Store) -> Self {
        let fan = Arc::new(FanOut { routes, store });
        let lanes = (0..LANES)
            .map(|i| {
                let (lane, jobs) = sync_channel::<Job>(LANE_CAPACITY);
                let fan = fan.clone();
                std::thread::Builder::new()
                    .name(format!("delivery-{i}"))
                    .spawn(move || {
                        // The highest seq pushed per conversation of unordered jobs.
                        let mut pushed: HashMap<ConvId, i64> = HashMap::new();
                        // Ends when the `Delivery` (every sender) is dropped.
                        for mut job in jobs {
                            if job.unordered {
                                let last = pushed.entry(job.appended.conv_id.clone()).or_insert(0);
                                job.appended.events.retain(|e| e.seq > *last);
                                match job.appended.events.last() {
                                    Some(e) => *last = e.seq,
                                    None => continue,
                                }
                            }
                            fan.fan_out(&job.appended, &job.members);
                        }
                    })
                    .map(|_| lane)
            })
            .collect::<Result<Vec<_>, _>>()
            .unwrap_or_else(|e| panic!("cannot start delivery threads: {e}"));
        Self { fan, lanes }
    }

    pub fn routes(&self) -> &Arc<Routes> {
        &self.fan.routes
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
                route.recipient.send(Push::Frame(frame.clone()));
            }
        }
    }

    fn fan_out(&self, a: &Appended, before: &MemberMap) {
        let conv = a.conv_id.as_str();
        if a.delivery_mode == DeliveryMode::Pull {
            let frame: Arc<str> = push_head(conv, a.head).into();
            for user in members_after(a, before) {
                self.to_user(&user, &frame, None);
            }
            return;
        }
        let changes_membership =
            a.events.iter().any(|e| matches!(e.kind, EventKind::Join { .. } | EventKind::Leave { .. }));
        if !changes_membership {
            let all: Vec<usize> = (0..a.events.len()).collect();
            self.send_events(conv, &a.events, &all, before.keys());
            return;
        }
        // Who sees which event: replay the batch's joins and leaves (a joiner
        // sees from its join, a leaver up to and including its leave).
        let mut current: HashSet<&UserId> = before.keys().collect();
        let mut visible: HashMap<&UserId, Vec<usize>> = HashMap::new();
        for (i, e) in a.events.iter().enumerate() {
            if let EventKind::Join { subject, .. } = &e.kind {
                current.insert(subject);
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
            self.send_events(conv, &a.events, &indices, users.into_iter());
        }
    }

    /// One frame for everyone, except that a device never gets its own
    /// messages pushed back (its ack answered it): its frame is spliced from
    /// the same encoded events, without its own.
    fn send_events<'a>(
        &self,
        conv: &str,
        events: &[Event],
        indices: &[usize],
        users: impl Iterator<Item = &'a UserId>,
    ) {
        fn sent_by(e: &Event) -> Option<(&UserId, &DeviceId)> {
            match &e.kind {
                EventKind::Msg { sender, sender_device, .. } => Some((sender, sender_device)),
                _ => None,
            }
        }
        let mut encoded: Option<Vec<String>> = None;
        let mut shared: Option<Arc<str>> = None;
        for user in users {
            for (device, route) in self.routes.routes_of(user) {
                let encoded =
                    encoded.get_or_insert_with(|| indices.iter().map(|&i| encode_event(&events[i])).collect());
                let own = |k: usize| sent_by(&events[indices[k]]) == Some((user, &device));
                let frame = if (0..indices.len()).any(own) {
                    let rest: Vec<&str> =
                        (0..indices.len()).filter(|&k| !own(k)).map(|k| encoded[k].as_str()).collect();
                    if rest.is_empty() {
                        continue;
                    }
                    Arc::from(push_encoded_events(conv, &rest))
                } else {
                    shared
                        .get_or_insert_with(|| {
                            let all: Vec<&str> = encoded.iter().map(String::as_str).collect();
                            Arc::from(push_encoded_events(conv, &all))
                        })
                        .clone()
                };
                route.recipient.send(Push::Frame(frame));
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

impl Delivery {
    fn enqueue(&self, job: Job) {
        let conv = job.appended.conv_id.clone();
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) = self.lanes[lane_of(&conv)].try_send(job) {
            metrics().kicks.with_label_values(&["delivery_dropped"]).inc();
            tracing::warn!(conv_id = %conv, "delivery lane full: pushes of a batch dropped");
        }
    }
}

impl Fanout<Appended> for Delivery {
    fn deliver(&self, _conv: &ConvId, appended: Appended) {
        if appended.events.is_empty() {
            return;
        }
        match appended.members_before.clone() {
            Some(members) => self.enqueue(Job { appended, members, unordered: false }),
            // The direct path keeps no member map: look the members up after
            // commit, off the caller's path. A leaver of this very op misses
            // the push of its own leave; its sync has it.
            None => {
                let (fan, lanes) = (self.fan.clone(), self.lanes.clone());
                tokio::spawn(async move {
                    match fan.store.member_map(&appended.conv_id).await {
                        Ok(members) => Delivery { fan, lanes }.enqueue(Job {
                            appended,
                            members: Arc::new(members),
                            unordered: true,
                        }),
                        Err(e) => tracing::warn!(conv_id = %appended.conv_id, error = %e, "delivery skipped"),
                    }
                });
            }
        }
    }
}

fn lane_of(conv: &ConvId) -> usize {
    use std::hash::{BuildHasher, RandomState};
    static SEED: std::sync::LazyLock<RandomState> = std::sync::LazyLock::new(RandomState::new);
    (SEED.hash_one(conv) % LANES as u64) as usize
}
