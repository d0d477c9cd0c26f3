//! One delivery lane: a thread that sees every batch of every conversation in
//! seq order, keeps what its online users know ([`Presence`]) and pushes each
//! batch to the ones it concerns (ARCHITECTURE §5).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, OnceLock};

use imcore_actors::registry::{ConnId, Route};
use imcore_actors::{ConvId, DeviceId, UserId};
use tokio::sync::oneshot;

use super::presence::{Batch, Loaded, Presence, Step};
use super::{Conn, Routes};
use crate::domain::{DeliveryMode, Event, EventKind};
use crate::protocol::{encode_event, push_encoded_events, push_members_changed};
use crate::store::{Appended, Membership};

/// A committed batch, shared by the lanes.
pub(super) struct Job {
    /// Shared with the bus, which encodes it for the other nodes on a thread
    /// of its own (ARCHITECTURE §7).
    pub(super) appended: Arc<Appended>,
    /// Every event as JSON, encoded once by whichever lane needs it first.
    encoded: OnceLock<Vec<String>>,
    /// Dropped with the job, once every lane has pushed it (or dropped it):
    /// tells a creator its conversation's first events are out.
    _pushed: Option<oneshot::Sender<()>>,
}

impl Job {
    pub(super) fn new(appended: Appended) -> Self {
        Self { appended: Arc::new(appended), encoded: OnceLock::new(), _pushed: None }
    }

    /// A job whose receiver resolves once every lane is done with it.
    pub(super) fn announced(appended: Appended) -> (Self, oneshot::Receiver<()>) {
        let (pushed, done) = oneshot::channel();
        (Self { appended: Arc::new(appended), encoded: OnceLock::new(), _pushed: Some(pushed) }, done)
    }

    fn batch(&self) -> Batch<'_> {
        Batch { conv: &self.appended.conv_id, events: &self.appended.events }
    }
}

/// What a lane gets instead of a job past its backlog: enough to tell who
/// may have missed something.
pub(super) struct Missed {
    conv: ConvId,
    head: i64,
    /// Whose membership the batch changed (a join may concern a user that
    /// tracks nothing of the conversation yet).
    subjects: Vec<UserId>,
}

impl Missed {
    pub(super) fn of(job: &Job) -> Self {
        let a = &job.appended;
        let subjects = a
            .events
            .iter()
            .filter_map(|e| match &e.kind {
                EventKind::Join { subject, .. } | EventKind::Leave { subject, .. } => Some(subject.clone()),
                _ => None,
            })
            .collect();
        Self { conv: a.conv_id.clone(), head: a.head, subjects }
    }
}

/// What a lane works through, in the order it was handed over.
pub(super) enum LaneInput {
    Job(Arc<Job>),
    Missed(Arc<Missed>),
    /// A connection's route is registered; its snapshot is read after this.
    Subscribe {
        user: UserId,
        device: DeviceId,
        conn: ConnId,
    },
    Load {
        user: UserId,
        device: DeviceId,
        conn: ConnId,
        snapshot: Vec<Membership>,
    },
    Unsubscribe {
        user: UserId,
        conn: ConnId,
    },
    /// The lane may have missed batches it cannot name (the bus between nodes
    /// lost messages): every user it serves resyncs.
    ResyncAll,
    /// An ephemeral signal (`typing`) for the members of a conversation.
    Signal(Arc<Signal>),
}

/// An ephemeral frame for the current members of `conv` online in a lane,
/// but `from` (PROTOCOL v1.2 `typing`): never stored, never in a batch.
pub struct Signal {
    pub conv: ConvId,
    pub from: UserId,
    pub frame: Arc<str>,
}

/// What a user whose snapshot is loading saw meanwhile.
#[derive(Clone)]
enum Seen {
    Job(Arc<Job>),
    Missed(Arc<Missed>),
}

/// A lane's gauges, read from other threads.
#[derive(Default)]
pub(super) struct LaneCounts {
    /// Jobs handed to the lane and not yet taken (the backlog).
    pub(super) queued: AtomicUsize,
    pub(super) users: AtomicUsize,
    pub(super) periods: AtomicUsize,
}

pub(super) struct Lane {
    routes: Arc<Routes>,
    counts: Arc<LaneCounts>,
    presence: Presence<Seen>,
    /// One user's routes at a time, reused (no allocation per recipient).
    scratch: Vec<(DeviceId, Route<Conn>)>,
}

impl Lane {
    /// A user whose snapshot is loading keeps up to `backlog` batches.
    pub(super) fn new(routes: Arc<Routes>, counts: Arc<LaneCounts>, backlog: usize) -> Self {
        Self { routes, counts, presence: Presence::new(backlog), scratch: Vec::new() }
    }

    /// Ends when every sender is dropped.
    pub(super) fn run(mut self, inputs: Receiver<LaneInput>) {
        for input in inputs {
            self.handle(input);
            let (users, periods) = self.presence.size();
            self.counts.users.store(users, Ordering::Relaxed);
            self.counts.periods.store(periods, Ordering::Relaxed);
        }
    }

    fn handle(&mut self, input: LaneInput) {
        match input {
            LaneInput::Job(job) => {
                self.counts.queued.fetch_sub(1, Ordering::Relaxed);
                self.presence.buffer(&Seen::Job(job.clone()));
                let steps = self.presence.apply(&job.batch());
                self.push(&job, steps);
            }
            LaneInput::Missed(missed) => {
                self.presence.buffer(&Seen::Missed(missed.clone()));
                for user in self.presence.missed(&missed.conv, missed.head, &missed.subjects) {
                    self.close(&user);
                }
            }
            LaneInput::Subscribe { user, device, conn } => {
                if self.is_route(&user, &device, conn) {
                    self.presence.subscribe(&user, conn);
                }
            }
            LaneInput::Load { user, device, conn, snapshot } => {
                // A connection closed meanwhile leaves nothing behind.
                if !self.is_route(&user, &device, conn) {
                    return;
                }
                match self.presence.load(&user, conn, snapshot) {
                    Loaded::Ignored => {}
                    Loaded::Resync => self.close(&user),
                    Loaded::Replay(seen) => self.replay(&user, seen),
                }
            }
            LaneInput::Unsubscribe { user, conn } => self.presence.unsubscribe(&user, conn),
            LaneInput::Signal(signal) => {
                for user in self.presence.members_of(&signal.conv) {
                    if user != signal.from {
                        for (_, route) in self.routes.routes_of(&user) {
                            route.recipient.send(signal.frame.clone());
                        }
                    }
                }
            }
            LaneInput::ResyncAll => {
                for user in self.presence.clear() {
                    self.close(&user);
                }
            }
        }
    }

    fn is_route(&self, user: &UserId, device: &DeviceId, conn: ConnId) -> bool {
        self.routes.route(user, device).is_some_and(|r| r.conn_id == conn)
    }

    /// Applies what `user` missed while its snapshot loaded, in order.
    fn replay(&mut self, user: &UserId, seen: Vec<Seen>) {
        for s in seen {
            match s {
                Seen::Job(job) => {
                    let step = self.presence.apply_for(user, &job.batch());
                    self.push(&job, vec![(user.clone(), step)]);
                }
                Seen::Missed(m) => {
                    if self.presence.missed_for(user, &m.conv, m.head, &m.subjects) {
                        self.close(user);
                    }
                }
            }
            if !self.presence.is_live(user) {
                return;
            }
        }
    }

    /// Closes every connection of `user` (its state is already dropped):
    /// each reconnects and syncs (PROTOCOL §4).
    fn close(&self, user: &UserId) {
        tracing::debug!(%user, "delivery lost track of a user: its connections resync");
        for (_, route) in self.routes.routes_of(user) {
            route.recipient.resync();
        }
    }

    /// Pushes `job` as `steps` say: users to resync are closed, the others
    /// get the events they see (`pull`: one `head`).
    fn push(&mut self, job: &Job, steps: Vec<(UserId, Step)>) {
        let a = &job.appended;
        let mut groups: HashMap<Vec<usize>, Vec<UserId>> = HashMap::new();
        for (user, step) in steps {
            match step {
                Step::Resync => self.close(&user),
                Step::Visible(indices) if !indices.is_empty() => groups.entry(indices).or_default().push(user),
                Step::Visible(_) | Step::Nothing => {}
            }
        }
        if a.delivery_mode == DeliveryMode::Pull {
            for user in groups.into_values().flatten() {
                for (_, route) in self.routes.routes_of(&user) {
                    route.recipient.send_head(&a.conv_id, a.head);
                }
            }
            return;
        }
        for (indices, users) in groups {
            if a.members_summary {
                self.send_summary(job, &indices, &users);
            } else {
                self.send_events(job, &indices, &users);
            }
        }
    }

    /// [`Self::send_events`] for a `push` group past the summary size: the
    /// `join`s and `leave`s of others become two counts of one
    /// `members_changed` frame, which carries the rest as events (a user's
    /// own `join` or `leave` among them); `sync` still returns every one.
    /// Devices whose rest is the same share one frame.
    fn send_summary(&self, job: &Job, indices: &[usize], users: &[UserId]) {
        let (conv, events) = (job.appended.conv_id.as_str(), &job.appended.events);
        let (Some(&first), Some(&last)) = (indices.first(), indices.last()) else { return };
        let span = (events[first].seq, events[last].seq);
        let mut frames: HashMap<Vec<usize>, Arc<str>> = HashMap::new();
        for user in users {
            for (device, route) in self.routes.routes_of(user) {
                let (mut rest, mut counts) = (Vec::new(), (0, 0));
                for &i in indices {
                    match &events[i].kind {
                        EventKind::Join { subject, .. } if subject != user => counts.0 += 1,
                        EventKind::Leave { subject, .. } if subject != user => counts.1 += 1,
                        EventKind::Msg { sender, sender_device, .. } if sender == user && *sender_device == device => {}
                        _ => rest.push(i),
                    }
                }
                if counts == (0, 0) && rest.is_empty() {
                    continue;
                }
                let frame = frames.entry(rest).or_insert_with_key(|rest| {
                    let encoded = job.encoded.get_or_init(|| events.iter().map(encode_event).collect());
                    let rest: Vec<&str> = rest.iter().map(|&i| encoded[i].as_str()).collect();
                    match counts {
                        (0, 0) => Arc::from(push_encoded_events(conv, &rest)),
                        _ => Arc::from(push_members_changed(conv, span, counts, &rest)),
                    }
                });
                route.recipient.send(frame.clone());
            }
        }
    }

    /// One frame for everyone, except that a device never gets its own
    /// messages pushed back (its ack answered it): its frame is spliced from
    /// the same encoded events, without its own.
    fn send_events(&mut self, job: &Job, indices: &[usize], users: &[UserId]) {
        let (conv, events) = (job.appended.conv_id.as_str(), &job.appended.events);
        fn sent_by(e: &Event) -> Option<(&UserId, &DeviceId)> {
            match &e.kind {
                EventKind::Msg { sender, sender_device, .. } => Some((sender, sender_device)),
                _ => None,
            }
        }
        let senders: Vec<&UserId> = indices.iter().filter_map(|&i| sent_by(&events[i]).map(|(u, _)| u)).collect();
        let encoded = job.encoded.get_or_init(|| events.iter().map(encode_event).collect());
        let mut shared: Option<Arc<str>> = None;
        let mut routes = std::mem::take(&mut self.scratch);
        for user in users {
            self.routes.routes_of_into(user, &mut routes);
            let sends = senders.contains(&user);
            for (device, route) in routes.drain(..) {
                let own = |i: usize| sent_by(&events[i]) == Some((user, &device));
                let frame = if sends && indices.iter().any(|&i| own(i)) {
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
        self.scratch = routes;
    }
}
