//! A connection as delivery sees it: where its pushes go, and how one that
//! cannot keep up is closed without its session's help.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use actix::dev::SendError;
use actix::{Message, Recipient};
use imcore_actors::registry::{ConnId, RouteRegistry};
use imcore_actors::{ConvId, DeviceId, UserId};

use crate::budget::{MemoryBudget, Permit};
use crate::metrics::metrics;

/// What a connection is sent from outside its own request handling.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub enum Push {
    /// A JSON text frame, encoded once for all its recipients, and its bytes
    /// of the memory budget, given back once the session wrote or dropped it.
    Frame(Arc<str>, Permit),
    /// A `pull`-mode conversation advanced: write a `head` push with the
    /// newest head [`PendingHeads`] holds for it (and its budget bytes).
    Head(ConvId, Permit),
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

/// The heads of `pull`-mode conversations not yet written to a connection,
/// held in its [`Conn`] for delivery and the session. A burst of batches queues one
/// [`Push::Head`] per conversation, and the session writes the last head
/// when it gets to it: a connection behind on its queue is told once.
#[derive(Debug, Default)]
struct PendingHeads(Mutex<HashMap<ConvId, i64>>);

impl PendingHeads {
    /// Records `head`; `true` if no push for `conv` is queued (the caller queues one).
    fn offer(&self, conv: &ConvId, head: i64) -> bool {
        let mut pending = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match pending.get_mut(conv) {
            Some(newest) => {
                *newest = (*newest).max(head);
                false
            }
            None => {
                pending.insert(conv.clone(), head);
                true
            }
        }
    }

    /// The head to write for `conv` now.
    fn take(&self, conv: &ConvId) -> Option<i64> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).remove(conv)
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
    /// Shared, not cloned per push: actix reports a full mailbox through
    /// `try_send` only to a sender that is already parked, and every clone of
    /// a `Recipient` starts unparked — the queue would never look full.
    push: Recipient<Push>,
    overflow: Overflow,
    budget: Arc<MemoryBudget>,
    heads: PendingHeads,
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
        (user, device, conn_id): (UserId, DeviceId, ConnId),
    ) -> Self {
        let overflow = Overflow { seen: AtomicBool::new(false), routes: Arc::downgrade(routes), user, device, conn_id };
        Self(Arc::new(Link { push, overflow, budget, heads: PendingHeads::default() }))
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
        if self.0.overflow.seen.load(Ordering::Relaxed) {
            return;
        }
        let Some(permit) = self.0.budget.try_acquire(frame.len()) else {
            return self.overflowed("over_budget");
        };
        self.queue(Push::Frame(frame, permit));
    }

    /// Tells the connection that `pull`-mode `conv` is at `head`: queues a
    /// [`Push::Head`] unless one for `conv` is queued already, which then
    /// carries this head. Never waits; overflows like [`Conn::send`].
    pub fn send_head(&self, conv: &ConvId, head: i64) {
        if self.0.overflow.seen.load(Ordering::Relaxed) || !self.0.heads.offer(conv, head) {
            return;
        }
        let Some(permit) = self.0.budget.try_acquire(HEAD_FRAME_BYTES) else {
            return self.overflowed("over_budget");
        };
        self.queue(Push::Head(conv.clone(), permit));
    }

    /// The head to write for `conv` now (the session, on [`Push::Head`]).
    pub fn take_head(&self, conv: &ConvId) -> Option<i64> {
        self.0.heads.take(conv)
    }

    /// Closes the connection after telling it why: a control message, never
    /// dropped for a full mailbox.
    pub fn kick(&self, reason: KickReason) {
        self.0.push.do_send(Push::Kick(reason));
    }

    fn queue(&self, push: Push) {
        match self.0.push.try_send(push) {
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

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex, OnceLock};

    use actix::{Actor, Context, Handler, Message};
    use imcore_actors::registry::{ConnId, RouteRegistry};
    use imcore_actors::{ConvId, DeviceId, UserId};

    use super::{Conn, Push};
    use crate::budget::MemoryBudget;

    /// Writes a `head` push as the session does: the newest pending head.
    struct Session {
        conn: Arc<OnceLock<Conn>>,
        written: Arc<Mutex<Vec<(String, i64)>>>,
    }

    impl Actor for Session {
        type Context = Context<Self>;
    }

    impl Handler<Push> for Session {
        type Result = ();
        fn handle(&mut self, push: Push, _: &mut Context<Self>) {
            if let Push::Head(conv, _) = push {
                if let Some(head) = self.conn.get().and_then(|c| c.take_head(&conv)) {
                    self.written.lock().expect("written").push((conv.to_string(), head));
                }
            }
        }
    }

    /// Answered once every message queued before it has been handled.
    #[derive(Message)]
    #[rtype(result = "()")]
    struct Drained;

    impl Handler<Drained> for Session {
        type Result = ();
        fn handle(&mut self, _: Drained, _: &mut Context<Self>) {}
    }

    #[actix::test]
    async fn heads_queued_behind_a_busy_session_are_written_once_per_conversation_with_the_newest() {
        let (slot, written) = (Arc::new(OnceLock::new()), Arc::new(Mutex::new(vec![])));
        // Started but not yet run: every push below waits in its mailbox, as
        // behind a session busy with other work.
        let session = Session { conn: slot.clone(), written: written.clone() }.start();
        let routes = Arc::new(RouteRegistry::new());
        let ids =
            (UserId::parse("u").expect("id"), DeviceId::parse("d").expect("id"), ConnId::from_cluster_sequence(1));
        let conn = Conn::new(session.clone().recipient(), &routes, MemoryBudget::new(1 << 20), ids);
        slot.set(conn.clone()).expect("set once");
        let (a, b) = (ConvId::parse("a").expect("id"), ConvId::parse("b").expect("id"));
        for (conv, head) in [(&a, 5), (&b, 3), (&a, 7), (&a, 6), (&b, 4)] {
            conn.send_head(conv, head);
        }
        session.send(Drained).await.expect("drained");
        conn.send_head(&a, 8);
        session.send(Drained).await.expect("drained");
        let written = written.lock().expect("written").clone();
        assert_eq!(written, [("a".to_owned(), 7), ("b".to_owned(), 4), ("a".to_owned(), 8)]);
    }
}
