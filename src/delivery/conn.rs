//! A connection as delivery sees it: where its pushes go (its [`Outbox`];
//! control messages to its session), and how one that cannot keep up is
//! closed without its session's help.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use actix::{Message, Recipient};
use imcore_actors::registry::{ConnId, RouteRegistry};
use imcore_actors::{ConvId, DeviceId, UserId};

use super::outbox::{Out, Outbox, Refused};
use crate::metrics::metrics;

/// What a connection's session is told from outside its own request
/// handling (pushes go to its [`Outbox`] instead).
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub enum Push {
    /// The connection's outbox overflowed: close it (1013), the client resyncs.
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

/// Budget bytes of one queued `head` push (its frame is written later).
const HEAD_FRAME_BYTES: usize = 96;

/// A live connection as the route registry, its session and graceful
/// shutdown hold it: one allocation per connection, shared by all three.
#[derive(Debug, Clone)]
pub struct Conn(Arc<Link>);

#[derive(Debug)]
struct Link {
    /// The session, for control messages only (`do_send`: never dropped,
    /// at most one per cause).
    push: Recipient<Push>,
    /// Its pushes, drained by the connection's socket writer.
    outbox: Arc<Outbox>,
    overflow: Overflow,
}

/// What an overflow must undo without the session's help.
///
/// A session whose client stops reading is not polled at all: its socket
/// loop stops polling its output (and with it the actor) while a piece is
/// unwritten, so the session cannot close itself until the client reads
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
    pub fn new(
        (push, outbox): (Recipient<Push>, Arc<Outbox>),
        routes: &Arc<Routes>,
        (user, device, conn_id): (UserId, DeviceId, ConnId),
    ) -> Self {
        let overflow = Overflow { seen: AtomicBool::new(false), routes: Arc::downgrade(routes), user, device, conn_id };
        Self(Arc::new(Link { push, outbox, overflow }))
    }

    /// Never waits. The frame's bytes are taken from the memory budget for
    /// this connection (a frame shared by many connections is paid by each:
    /// the budget bounds what the queues could hold, not what they share).
    /// A full outbox or an exhausted budget drops this push, removes the
    /// route (compare-and-remove: a newer connection of the device keeps its
    /// own) and tells the session [`Push::Overflowed`]: once the socket
    /// takes bytes again, the writer writes the pushes already queued, then
    /// the session closes with 1013; the client reconnects and syncs
    /// (PROTOCOL §4).
    pub fn send(&self, frame: Arc<str>) {
        if self.0.overflow.seen.load(Ordering::Relaxed) {
            return;
        }
        let bytes = frame.len();
        self.queue(Out::Frame(frame), bytes);
    }

    /// Tells the connection that `pull`-mode `conv` is at `head`: queues a
    /// [`Out::Head`] unless one for `conv` is queued already, which then
    /// carries this head. Never waits; overflows like [`Conn::send`].
    pub fn send_head(&self, conv: &ConvId, head: i64) {
        if self.0.overflow.seen.load(Ordering::Relaxed) || !self.0.outbox.offer_head(conv, head) {
            return;
        }
        self.queue(Out::Head(conv.clone()), HEAD_FRAME_BYTES);
    }

    /// Closes the connection after telling it why: a control message, never
    /// dropped for a full mailbox.
    pub fn kick(&self, reason: KickReason) {
        self.0.push.do_send(Push::Kick(reason));
    }

    fn queue(&self, out: Out, bytes: usize) {
        match self.0.outbox.push(out, bytes) {
            Ok(()) => {}
            Err(Refused::Full) => self.overflowed("overflowed"),
            Err(Refused::OverBudget) => self.overflowed("over_budget"),
        }
    }

    /// Closes the connection the way an overflow does (1013, the client
    /// reconnects and syncs): its lane can no longer vouch for what it was
    /// pushed (ARCHITECTURE §5, gaps).
    pub(super) fn resync(&self) {
        self.overflowed("resync");
    }

    fn overflowed(&self, reason: &'static str) {
        let o = &self.0.overflow;
        if !o.seen.swap(true, Ordering::Relaxed) {
            metrics().kicks.with_label_values(&[reason]).inc();
            if let Some(routes) = o.routes.upgrade() {
                routes.unregister(&o.user, &o.device, o.conn_id);
            }
            // One small message past the bound, once per connection.
            self.0.push.do_send(Push::Overflowed);
        }
    }
}

pub type Routes = RouteRegistry<Conn>;
