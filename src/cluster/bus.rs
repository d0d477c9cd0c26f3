//! The NATS connection of a node (ARCHITECTURE §7). It runs on a thread of
//! its own (a current-thread Tokio runtime), so nothing here competes with the
//! HTTP workers or the conversation actors, and nothing they do waits for it:
//! they hand it batches and claims with `try_send`.
//!
//! Subjects:
//! * `imcore.batch.<conv_id>` — a committed batch, encoded once (JSON) for
//!   all the nodes; every node subscribes to `imcore.batch.>` and hands what
//!   it gets to its delivery lanes, which keep only what concerns the users
//!   online there.
//! * `imcore.route` — a route claim `(user, device, conn)` (see `routing`).
//! * `imcore.lost` — "this node's batches were lost before reaching the bus":
//!   whoever gets it resyncs every user online there.
//! * `imcore.confirm.<node>` — nobody subscribes: a request there is a round
//!   trip to the server (it answers "no responders").
//!
//! Core NATS delivers at most once, in publish order per publishing
//! connection. Whatever may have been lost makes the users concerned resync
//! (their connections close with 1013; the clients reconnect and sync,
//! PROTOCOL §4) rather than stay silently behind:
//! * this node disconnected from NATS (batches published meanwhile are gone):
//!   every user online here, at the disconnect and again once reconnected
//!   (for the connections made during the outage);
//! * NATS reported this node a slow consumer (it dropped messages): every user;
//! * a batch that does not follow on what a user knows of its conversation:
//!   that user (the lanes' gap rule, ARCHITECTURE §5);
//! * this node's outbox overflowed or a publish failed: every user on every
//!   other node, through `imcore.lost` once the bus takes messages again.
//!
//! What this node published and NATS did not confirm before its connection
//! dropped is published again once reconnected (see [`Publisher`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use async_nats::{Client, ConnectOptions, Event, Message, RequestErrorKind, Subscriber};
use bytes::Bytes;
use futures_util::StreamExt;
use imcore_actors::registry::ConnId;
use imcore_actors::{DeviceId, UserId};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot, Notify};

use super::routing::{settle, Settled};
use crate::delivery::{Delivery, KickReason, Peers, Push, REORDER_WAIT};
use crate::metrics::metrics;
use crate::store::Appended;

const BATCHES: &str = "imcore.batch";
const ROUTES: &str = "imcore.route";
const LOST: &str = "imcore.lost";
const CONFIRM: &str = "imcore.confirm";

/// Batches and claims waiting for the bus. Past it this node's batches are
/// lost to the others, and it says so (`imcore.lost`) once it can.
const OUTBOX: usize = 16_384;
/// Messages waiting in this node's subscriptions; past it NATS drops them
/// and reports a slow consumer (every user here resyncs).
const INBOX: usize = 65_536;
/// The first connection to NATS must succeed within this.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a confirmation round trip may take; past it the messages stay
/// unconfirmed (and are published again if the connection turns out lost).
/// Publishing waits meanwhile, so it is short.
const CONFIRM_WAIT: Duration = Duration::from_secs(1);
/// Longest pause between two reconnect attempts.
const MAX_RECONNECT_DELAY: Duration = Duration::from_secs(1);
/// NATS is pinged this often; two pings unanswered count as a disconnect, so
/// a silent network cut is noticed within seconds (the client's default is
/// a minute).
const PING_EVERY: Duration = Duration::from_secs(5);

/// This process's name in the cluster: random per start, so a restarted node
/// is a new one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeId(String);

impl NodeId {
    fn random() -> Self {
        Self(format!("imcore-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BusError {
    #[error("cannot connect to NATS at {url}: {cause}")]
    Connect { url: String, cause: String },
    #[error("cannot start the bus thread: {0}")]
    Thread(#[source] std::io::Error),
}

/// A route claim on the bus (`routing`).
#[derive(Debug, Serialize, Deserialize)]
struct Claim {
    user: UserId,
    device: DeviceId,
    conn: u64,
}

enum Outbound {
    Batch(Arc<Appended>),
    Claim(Claim),
}

/// This node's side of the bus, as delivery sees it ([`Peers`]).
pub struct Bus {
    node: NodeId,
    outbox: mpsc::Sender<Outbound>,
    /// Set when something of ours did not reach the bus; cleared by the
    /// `imcore.lost` notice that tells the other nodes.
    lost: Arc<AtomicBool>,
}

impl Peers for Bus {
    fn batch(&self, appended: Arc<Appended>) {
        self.send(Outbound::Batch(appended));
    }

    fn claim(&self, user: &UserId, device: &DeviceId, conn: ConnId) {
        self.send(Outbound::Claim(Claim { user: user.clone(), device: device.clone(), conn: conn.get() }));
    }
}

impl Bus {
    /// Connects this node to NATS at `url` and joins `delivery` to the
    /// cluster. Returns once the subscriptions are in place; the bus stops
    /// when `delivery` is dropped.
    pub async fn join(url: &str, delivery: &Arc<Delivery>) -> Result<NodeId, BusError> {
        let node = NodeId::random();
        let (events_in, events) = mpsc::unbounded_channel();
        let options = ConnectOptions::new()
            .name(node.as_str())
            // Our own batches and claims are not for us.
            .no_echo()
            .subscription_capacity(INBOX)
            .connection_timeout(CONNECT_TIMEOUT)
            .ping_interval(PING_EVERY)
            .max_reconnects(None)
            .reconnect_delay_callback(|attempts| {
                MAX_RECONNECT_DELAY.min(Duration::from_millis(100).saturating_mul(attempts as u32))
            })
            .event_callback(move |event| {
                let events_in = events_in.clone();
                async move {
                    let _ = events_in.send(event);
                }
            });
        let (outbox, outgoing) = mpsc::channel(OUTBOX);
        let lost = Arc::new(AtomicBool::new(false));
        let bus = Arc::new(Bus { node: node.clone(), outbox, lost: lost.clone() });
        let (ready, started) = oneshot::channel();
        let (url_owned, weak, answers) = (url.to_owned(), Arc::downgrade(delivery), bus.outbox.downgrade());
        let confirm_subject = format!("{CONFIRM}.{}", node.as_str());
        std::thread::Builder::new()
            .name("bus".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                    Ok(rt) => rt,
                    Err(e) => return drop(ready.send(Err(e.to_string()))),
                };
                runtime.block_on(async move {
                    let subscribed = async {
                        let client = options.connect(url_owned.as_str()).await.map_err(|e| e.to_string())?;
                        let subs = Subscriptions::open(&client, &confirm_subject).await.map_err(|e| e.to_string())?;
                        Ok::<_, String>((client, subs))
                    };
                    match subscribed.await {
                        Ok((client, subs)) => {
                            let _ = ready.send(Ok(()));
                            let reconnected = Arc::new(Notify::new());
                            let inbound = Inbound {
                                client: client.clone(),
                                delivery: weak,
                                answers,
                                reconnected: reconnected.clone(),
                                confirm_subject: confirm_subject.clone(),
                                down: false,
                            };
                            tokio::spawn(inbound.run(subs, events));
                            let publisher = Publisher {
                                client,
                                outgoing,
                                lost,
                                reconnected,
                                unconfirmed: Vec::new(),
                                confirm_subject,
                            };
                            publisher.run().await;
                        }
                        Err(e) => drop(ready.send(Err(e))),
                    }
                });
            })
            .map_err(BusError::Thread)?;
        let connect_error = |cause: String| BusError::Connect { url: url.to_owned(), cause };
        started.await.map_err(|_| connect_error("the bus thread ended".into()))?.map_err(connect_error)?;
        delivery.join(bus);
        tracing::info!(node = node.as_str(), url, "joined the cluster bus");
        Ok(node)
    }

    fn send(&self, message: Outbound) {
        if self.outbox.try_send(message).is_err() {
            self.lost_one("outbox_full");
        }
    }

    fn lost_one(&self, why: &'static str) {
        if !self.lost.swap(true, Ordering::Relaxed) {
            tracing::warn!(node = self.node.as_str(), why, "bus: a batch or claim did not reach the other nodes");
        }
        metrics().kicks.with_label_values(&["bus_outbox_lost"]).inc();
    }
}

/// Publishes the outbox in order until it closes (the node's delivery is
/// gone). Encoding happens here, once per batch, off the actors' threads.
///
/// Core NATS loses what was still in the socket when a connection drops, and
/// the other nodes cannot tell. So what was published stays here until a
/// round trip to the server on the same connection confirms it;
/// once reconnected, whatever is unconfirmed is published again, ahead of
/// anything newer. A node that already had a batch takes the copy as late
/// (its users already reflect it: nothing is pushed twice).
struct Publisher {
    client: Client,
    outgoing: mpsc::Receiver<Outbound>,
    lost: Arc<AtomicBool>,
    /// Signalled once reconnected, subscriptions confirmed.
    reconnected: Arc<Notify>,
    /// Published and not yet confirmed, in order.
    unconfirmed: Vec<(String, Bytes)>,
    /// `imcore.confirm.<node>`: nobody subscribes to it.
    confirm_subject: String,
}

impl Publisher {
    async fn run(mut self) {
        loop {
            tokio::select! {
                biased;
                () = self.reconnected.notified() => self.resend().await,
                message = self.outgoing.recv() => match message {
                    Some(m) => self.send(m).await,
                    None => return,
                },
            }
            if self.outgoing.is_empty() {
                self.confirm().await;
            }
            // Published after whatever it covers: a node that hears it has had
            // every batch of ours that made it.
            if self.lost.swap(false, Ordering::Relaxed) && self.client.publish(LOST, Bytes::new()).await.is_err() {
                self.lost.store(true, Ordering::Relaxed);
            }
        }
    }

    async fn send(&mut self, message: Outbound) {
        let encoded = match &message {
            Outbound::Batch(a) => serde_json::to_vec(&**a).map(|b| (format!("{BATCHES}.{}", a.conv_id), b)),
            Outbound::Claim(c) => serde_json::to_vec(c).map(|b| (ROUTES.to_owned(), b)),
        };
        let Ok((subject, bytes)) = encoded else {
            return self.lost.store(true, Ordering::Relaxed);
        };
        let bytes = Bytes::from(bytes);
        if self.client.publish(subject.clone(), bytes.clone()).await.is_err() {
            return self.lost.store(true, Ordering::Relaxed);
        }
        if self.unconfirmed.len() >= OUTBOX {
            // Too much to send again: say it is lost instead.
            self.unconfirmed.clear();
            self.lost.store(true, Ordering::Relaxed);
        }
        self.unconfirmed.push((subject, bytes));
    }

    /// Forgets what a round trip on the connection it went out on confirmed:
    /// a request nobody answers, which the server refuses (no responders)
    /// only after everything this connection sent before it. (The client's
    /// `flush` only empties the socket's buffer.)
    async fn confirm(&mut self) {
        if self.unconfirmed.is_empty() {
            return;
        }
        let (published, connects) = (self.unconfirmed.len(), self.connects());
        if round_trip(&self.client, &self.confirm_subject).await && self.connects() == connects {
            self.unconfirmed.drain(..published);
        }
    }

    /// Connections made so far: a round trip answered on a later one confirms
    /// nothing sent on an earlier one.
    fn connects(&self) -> u64 {
        self.client.statistics().connects.load(Ordering::Relaxed)
    }

    async fn resend(&mut self) {
        if !self.unconfirmed.is_empty() {
            tracing::info!(
                messages = self.unconfirmed.len(),
                "bus: publishing again what the lost connection may have dropped"
            );
        }
        for (subject, bytes) in &self.unconfirmed {
            if self.client.publish(subject.clone(), bytes.clone()).await.is_err() {
                self.lost.store(true, Ordering::Relaxed);
            }
        }
    }
}

/// Whether the server answered a request on `subject` (which nobody
/// subscribes to: it answers "no responders") within [`CONFIRM_WAIT`]. The
/// server handles a connection's messages in order, so an answer means it
/// has everything this connection sent before.
async fn round_trip(client: &Client, subject: &str) -> bool {
    match tokio::time::timeout(CONFIRM_WAIT, client.request(subject.to_owned(), Bytes::new())).await {
        Ok(Ok(_)) => true,
        Ok(Err(e)) => e.kind() == RequestErrorKind::NoResponders,
        Err(_) => false,
    }
}

struct Subscriptions {
    batches: Subscriber,
    routes: Subscriber,
    lost: Subscriber,
}

impl Subscriptions {
    /// Subscribes, then waits until the server has the subscriptions.
    async fn open(client: &Client, confirm_subject: &str) -> Result<Self, Box<dyn std::error::Error + Send + Sync>> {
        let subs = Self {
            batches: client.subscribe(format!("{BATCHES}.>")).await?,
            routes: client.subscribe(ROUTES).await?,
            lost: client.subscribe(LOST).await?,
        };
        if !round_trip(client, confirm_subject).await {
            return Err("NATS did not confirm the subscriptions".into());
        }
        Ok(subs)
    }
}

enum Input {
    Batch(Message),
    Claim(Message),
    Lost,
    Event(Event),
    Tick,
}

/// What comes in from the bus, handed to this node's delivery.
struct Inbound {
    client: Client,
    delivery: Weak<Delivery>,
    /// For answering an older claim with ours; weak, so that the outbox
    /// closes with the delivery that owns it.
    answers: mpsc::WeakSender<Outbound>,
    /// Tells the publisher to send its unconfirmed messages again.
    reconnected: Arc<Notify>,
    confirm_subject: String,
    /// Disconnected from NATS since the last `Connected`.
    down: bool,
}

impl Inbound {
    async fn run(mut self, mut subs: Subscriptions, mut events: mpsc::UnboundedReceiver<Event>) {
        let mut reorder_ticks = tokio::time::interval(REORDER_WAIT / 4);
        reorder_ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let input = tokio::select! {
                _ = reorder_ticks.tick() => Input::Tick,
                Some(m) = subs.batches.next() => Input::Batch(m),
                Some(m) = subs.routes.next() => Input::Claim(m),
                Some(_) = subs.lost.next() => Input::Lost,
                Some(event) = events.recv() => Input::Event(event),
                else => return,
            };
            // Not held while waiting: the bus must not keep delivery alive.
            let Some(delivery) = self.delivery.upgrade() else { return };
            match input {
                Input::Batch(m) => Self::batch(&delivery, &m),
                Input::Claim(m) => self.claim(&delivery, &m),
                Input::Lost => {
                    tracing::warn!("bus: another node lost batches: every user here resyncs");
                    delivery.resync_all();
                }
                Input::Event(event) => self.event(&delivery, event).await,
                Input::Tick => delivery.expire_reordered(),
            }
        }
    }

    fn batch(delivery: &Delivery, m: &Message) {
        match serde_json::from_slice::<Appended>(&m.payload) {
            Ok(appended) => delivery.from_peer(appended),
            Err(e) => {
                tracing::warn!(subject = %m.subject, error = %e, "bus: a batch that does not decode: every user here resyncs");
                delivery.resync_all();
            }
        }
    }

    fn claim(&self, delivery: &Delivery, m: &Message) {
        let claim = match serde_json::from_slice::<Claim>(&m.payload) {
            Ok(c) => c,
            Err(e) => return tracing::warn!(error = %e, "bus: a route claim that does not decode"),
        };
        let claimed = ConnId::from_cluster_sequence(claim.conn);
        match settle(delivery.routes(), &claim.user, &claim.device, claimed) {
            Settled::Nothing => {}
            Settled::Superseded(route) => {
                tracing::debug!(user = %claim.user, device = %claim.device, old = %route.conn_id, new = %claimed, "kicked by a newer connection on another node");
                route.recipient.push.do_send(Push::Kick(KickReason::Replaced));
            }
            Settled::Newer(mine) => {
                let answer = Claim { user: claim.user, device: claim.device, conn: mine.get() };
                if let Some(outbox) = self.answers.upgrade() {
                    let _ = outbox.try_send(Outbound::Claim(answer));
                }
            }
        }
    }

    async fn event(&mut self, delivery: &Delivery, event: Event) {
        match event {
            Event::Disconnected => {
                tracing::warn!("bus: disconnected from NATS: every user here resyncs");
                self.down = true;
                delivery.resync_all();
            }
            Event::Connected if self.down => {
                // The subscriptions go out again before anything else on the
                // new connection; once a round trip is answered, the server has them.
                if !round_trip(&self.client, &self.confirm_subject).await {
                    tracing::warn!("bus: NATS did not confirm the subscriptions after reconnecting");
                }
                tracing::info!("bus: reconnected to NATS: users who connected meanwhile resync");
                self.down = false;
                delivery.resync_all();
                self.reconnected.notify_one();
            }
            Event::SlowConsumer(_) => {
                tracing::warn!("bus: NATS dropped messages for this node (slow consumer): every user here resyncs");
                delivery.resync_all();
            }
            other => tracing::debug!(event = %other, "bus event"),
        }
    }
}
