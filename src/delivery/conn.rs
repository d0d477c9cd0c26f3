//! A connection as delivery sees it: where its pushes go, and how one that
//! cannot keep up is closed without its session's help.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use actix::dev::SendError;
use actix::{Message, Recipient};
use imcore_actors::registry::{ConnId, RouteRegistry};
use imcore_actors::{DeviceId, UserId};

use crate::budget::{MemoryBudget, Permit};
use crate::metrics::metrics;

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

    /// Closes the connection the way an overflow does (1013, the client
    /// reconnects and syncs): its lane can no longer vouch for what it was
    /// pushed (ARCHITECTURE §5, gaps).
    pub(super) fn resync(&self) {
        self.overflowed("resync");
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
