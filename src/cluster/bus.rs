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
//! * `imcore.revoke` — `(user, device)` has a new token: whoever routes that
//!   device kicks it.
//! * `imcore.lost` — "this node's batches were lost before reaching the bus":
//!   whoever gets it resyncs every user online there.
//! * `imcore.confirm.<node>` — nobody subscribes: a request there is a round
//!   trip to the server (it answers "no responders").
//! * `imcore.node` — "this node takes homes" (see `home`), every heartbeat.
//! * `imcore.write.<node>` — a write forwarded to the conversation's home
//!   node, a request answered on the forwarding node's inbox.
//! * `imcore.live` — a live signal (PROTOCOL v1.2: typing, a read cursor or
//!   presence change for users' devices, a user online or not on the
//!   sender); ephemeral: never published again, its loss resyncs nobody.
//!
//! Every message is sealed by its sender and opened here before anything
//! reads it (`seal`); one that does not open is dropped and counted — it is
//! never taken for "the bus lost something" (ARCHITECTURE §7, the bus as a
//! trust boundary).
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
//! * this node reconnected to another server of a NATS cluster (the old one
//!   may have died with batches not yet routed on): likewise, `imcore.lost`.
//!
//! What this node published and NATS did not confirm before its connection
//! dropped is published again once reconnected (`publisher`); writes
//! forwarded to a home node travel as requests (`forward`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant, SystemTime};

use async_nats::{Client, ConnectOptions, Event, Message, StatusCode, Subscriber};
use futures_util::StreamExt;
use imcore_actors::registry::ConnId;
use imcore_actors::{ConvId, DeviceId, UserId};
use tokio::sync::{mpsc, oneshot, Notify};

use super::forward::{self, Forward, PendingWrites, Route, WRITES};
use super::home::{Homes, HEARTBEAT};
use super::node::NodeId;
use super::publisher::{round_trip, Claim, Outbound, Publisher, Revoked, BATCHES, LIVE, LOST, OUTBOX, REVOKED, ROUTES};
use super::routing::{settle, Settled};
use super::seal::{Opened, Refused, Seal, MIN_KEY_BYTES};
use crate::config::BusSettings;
use crate::delivery::{Delivery, KickReason, Live, Peers, REORDER_WAIT};
use crate::metrics::metrics;
use crate::store::{Appended, WriteOp};
use crate::writer::Writer;

const CONFIRM: &str = "imcore.confirm";
const NODES: &str = "imcore.node";
/// This node's request inboxes: under `imcore.>` like the rest, so one NATS
/// permission covers everything a node publishes and hears.
const INBOXES: &str = "imcore.inbox";

/// Messages waiting in this node's subscriptions; past it NATS drops them
/// and reports a slow consumer (every user here resyncs).
const INBOX: usize = 65_536;
/// The first connection to NATS must succeed within this.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest pause between two reconnect attempts.
const MAX_RECONNECT_DELAY: Duration = Duration::from_secs(1);
/// NATS is pinged this often; two pings unanswered count as a disconnect, so
/// a silent network cut is noticed within seconds (the client's default is
/// a minute).
const PING_EVERY: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum BusError {
    #[error("IMCORE_NATS_URL is not a comma-separated list of NATS URLs: {0:?}")]
    Url(String),
    #[error("cannot connect to NATS at {url}: {cause}")]
    Connect { url: String, cause: String },
    #[error("cannot start the bus thread: {0}")]
    Thread(#[source] std::io::Error),
    #[error("IMCORE_CLUSTER_KEY must be set, at least {MIN_KEY_BYTES} bytes, when IMCORE_NATS_URL is")]
    Key,
    #[error("cannot read the NATS credentials file {path}: {cause}")]
    Credentials { path: String, cause: std::io::Error },
}

/// Outbox slots forwarded writes never take (a quarter of it).
const FORWARD_RESERVE: usize = OUTBOX / 4;

/// This node's side of the bus, as delivery sees it ([`Peers`]).
pub struct Bus {
    node: NodeId,
    outbox: mpsc::Sender<Outbound>,
    /// Set when something of ours did not reach the bus; cleared by the
    /// `imcore.lost` notice that tells the other nodes.
    lost: Arc<AtomicBool>,
    /// The nodes taking homes; `None` when this node takes none (and so
    /// forwards nothing: every write is written here).
    homes: Option<Arc<Homes>>,
}

impl Peers for Bus {
    fn batch(&self, appended: Arc<Appended>) {
        self.send(Outbound::Batch(appended));
    }

    fn claim(&self, user: &UserId, device: &DeviceId, conn: ConnId) {
        self.send(Outbound::Claim(Claim { user: user.clone(), device: device.clone(), conn: conn.get() }));
    }

    fn revoke(&self, user: &UserId, device: &DeviceId) {
        self.send(Outbound::Revoked(Revoked { user: user.clone(), device: device.clone() }));
    }

    /// Dropped when the outbox is full: a live signal is not worth a resync.
    fn live(&self, live: Live) {
        let _ = self.outbox.try_send(Outbound::Live(live));
    }
}

impl Bus {
    /// Connects this node to one of the NATS servers `url` lists, authenticated as `settings`
    /// say, and joins `delivery` to the cluster. With `homes`, this node
    /// takes conversations' homes and writes what other nodes forward to it
    /// with `writer` (bodies up to `max_body` bytes), and forwards its own
    /// writes to their homes (`write_at_home`). Returns once the
    /// subscriptions are in place; the bus stops when `delivery` is dropped.
    pub async fn join(
        url: &str,
        settings: &BusSettings,
        max_body: usize,
        delivery: &Arc<Delivery>,
        writer: &Writer,
        homes: bool,
    ) -> Result<Arc<Bus>, BusError> {
        let servers =
            crate::config::nats_servers(url).ok_or_else(|| BusError::Url(crate::config::nats_servers_redacted(url)))?;
        let node = NodeId::random();
        let key = settings.cluster_key.as_deref().unwrap_or_default();
        let max_age = Duration::from_millis(settings.max_age_ms);
        let seal = Arc::new(Seal::new(key, node.clone(), max_age).ok_or(BusError::Key)?);
        let homes = homes.then(|| Arc::new(Homes::new(node.clone())));
        let serving = homes.as_ref().map(|homes| (writer.clone(), homes.clone()));
        let (events_in, events) = mpsc::unbounded_channel();
        let options = authenticated(ConnectOptions::new(), settings)
            .await?
            .name(node.as_str())
            .custom_inbox_prefix(INBOXES)
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
        let bus = Arc::new(Bus { node: node.clone(), outbox, lost: lost.clone(), homes });
        let (ready, started) = oneshot::channel();
        let (weak, answers) = (Arc::downgrade(delivery), bus.outbox.downgrade());
        let confirm_subject = format!("{CONFIRM}.{}", node.as_str());
        let node_name = node.as_str().to_owned();
        std::thread::Builder::new()
            .name("bus".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                    Ok(rt) => rt,
                    Err(e) => return drop(ready.send(Err(e.to_string()))),
                };
                runtime.block_on(async move {
                    let subscribed = async {
                        let client = options.connect(servers).await.map_err(|e| e.to_string())?;
                        let pending = Arc::new(PendingWrites::new(client.new_inbox()));
                        let serves = serving.is_some().then_some(node_name.as_str());
                        let subs = Subscriptions::open(&client, &confirm_subject, serves, &pending)
                            .await
                            .map_err(|e| e.to_string())?;
                        Ok::<_, String>((client, subs, pending))
                    };
                    match subscribed.await {
                        Ok((client, subs, pending)) => {
                            let _ = ready.send(Ok(()));
                            let reconnected = Arc::new(Notify::new());
                            let inbound = Inbound {
                                client: client.clone(),
                                seal: seal.clone(),
                                max_body,
                                delivery: weak,
                                answers,
                                reconnected: reconnected.clone(),
                                confirm_subject: confirm_subject.clone(),
                                server: client.server_info().server_id,
                                lost: lost.clone(),
                                down: false,
                                serving,
                                pending: pending.clone(),
                            };
                            tokio::spawn(inbound.run(subs, events));
                            let publisher = Publisher {
                                client,
                                outgoing,
                                lost,
                                reconnected,
                                unconfirmed: Vec::new(),
                                confirm_subject,
                                pending,
                                seal,
                            };
                            publisher.run().await;
                        }
                        Err(e) => drop(ready.send(Err(e))),
                    }
                });
            })
            .map_err(BusError::Thread)?;
        let shown = crate::config::nats_servers_redacted(url);
        let connect_error = |cause: String| BusError::Connect { url: shown.clone(), cause };
        started.await.map_err(|_| connect_error("the bus thread ended".into()))?.map_err(connect_error)?;
        delivery.join(bus.clone());
        tracing::info!(node = node.as_str(), url = shown, homes = bus.homes.is_some(), "joined the cluster bus");
        Ok(bus)
    }

    /// Hands `op` to the bus for `conv`'s home node, if that is another
    /// node. Else gives it back to be written here: the home is here, this
    /// node takes no homes, or the outbox is all but full. Forwards leave
    /// [`FORWARD_RESERVE`] of it to batches, claims and revocations, whose
    /// loss makes every node resync; a write made here instead is as correct
    /// (the row lock guards it), only not batched with the home's.
    pub fn forward(&self, conv: ConvId, op: WriteOp) -> Route {
        let Some(home) = self.homes.as_ref().and_then(|homes| homes.home_of(&conv)) else {
            return Route::Here(conv, op);
        };
        if self.outbox.capacity() <= FORWARD_RESERVE {
            return Route::Here(conv, op);
        }
        let Ok(slot) = self.outbox.try_reserve() else {
            return Route::Here(conv, op);
        };
        let (reply, answer) = oneshot::channel();
        slot.send(Outbound::Forward(home, Forward { conv, op }, reply));
        Route::Forwarded(answer)
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

/// `options` with the credentials and TLS `settings` name.
async fn authenticated(options: ConnectOptions, settings: &BusSettings) -> Result<ConnectOptions, BusError> {
    let mut options = match (&settings.nats_user, &settings.nats_password, &settings.nats_nkey, &settings.nats_creds) {
        (Some(user), Some(password), _, _) => options.user_and_password(user.clone(), password.clone()),
        (_, _, Some(seed), _) => options.nkey(seed.clone()),
        (_, _, _, Some(path)) => options
            .credentials_file(path)
            .await
            .map_err(|cause| BusError::Credentials { path: path.display().to_string(), cause })?,
        _ => options,
    };
    if let Some(ca) = &settings.nats_tls_ca {
        options = options.add_root_certificates(ca.clone()).require_tls(true);
    }
    if let (Some(cert), Some(key)) = (&settings.nats_tls_cert, &settings.nats_tls_key) {
        options = options.add_client_certificate(cert.clone(), key.clone()).require_tls(true);
    }
    Ok(options)
}

struct Subscriptions {
    batches: Subscriber,
    routes: Subscriber,
    revoked: Subscriber,
    lost: Subscriber,
    live: Subscriber,
    /// Those of a node taking homes.
    homes: Option<HomeSubscriptions>,
}

struct HomeSubscriptions {
    /// Heartbeats of the nodes taking homes.
    nodes: Subscriber,
    /// Writes forwarded to this node.
    writes: Subscriber,
    /// Answers to the writes this node forwarded.
    answers: Subscriber,
}

impl Subscriptions {
    /// Subscribes, then waits until the server has the subscriptions. With
    /// `homes` (this node's name), also to what a node taking homes hears.
    async fn open(
        client: &Client,
        confirm_subject: &str,
        homes: Option<&str>,
        pending: &PendingWrites,
    ) -> Result<Self, Box<dyn std::error::Error + Send + Sync>> {
        let homes = match homes {
            Some(node) => Some(HomeSubscriptions {
                nodes: client.subscribe(NODES).await?,
                writes: client.subscribe(format!("{WRITES}.{node}")).await?,
                answers: client.subscribe(pending.answers()).await?,
            }),
            None => None,
        };
        let subs = Self {
            batches: client.subscribe(format!("{BATCHES}.>")).await?,
            routes: client.subscribe(ROUTES).await?,
            revoked: client.subscribe(REVOKED).await?,
            lost: client.subscribe(LOST).await?,
            live: client.subscribe(LIVE).await?,
            homes,
        };
        if !round_trip(client, confirm_subject).await {
            return Err("NATS did not confirm the subscriptions".into());
        }
        Ok(subs)
    }
}

enum Input {
    Bus(Kind, Message),
    Event(Event),
    Tick,
    Heartbeat,
}

/// Which subscription a message came on.
enum Kind {
    Batch,
    Claim,
    Revoked,
    Lost,
    Live,
    Node,
    Write,
    Answer,
}

/// The next message of a subscription this node may not have.
async fn next(subscriber: Option<&mut Subscriber>) -> Option<Message> {
    match subscriber {
        Some(s) => s.next().await,
        None => std::future::pending().await,
    }
}

/// What comes in from the bus, handed to this node's delivery.
struct Inbound {
    client: Client,
    seal: Arc<Seal>,
    /// The body limit forwarded sends are held to.
    max_body: usize,
    delivery: Weak<Delivery>,
    /// For answering an older claim with ours; weak, so that the outbox
    /// closes with the delivery that owns it.
    answers: mpsc::WeakSender<Outbound>,
    /// Tells the publisher to send its unconfirmed messages again.
    reconnected: Arc<Notify>,
    confirm_subject: String,
    /// The id of the NATS server this node is connected to (or was, last).
    server: String,
    /// The publisher's flag: set, it tells the other nodes `imcore.lost`.
    lost: Arc<AtomicBool>,
    /// Disconnected from NATS since the last `Connected`.
    down: bool,
    /// A node taking homes: the writer for what is forwarded here, and the
    /// live nodes its heartbeats keep.
    serving: Option<(Writer, Arc<Homes>)>,
    pending: Arc<PendingWrites>,
}

impl Inbound {
    async fn run(mut self, mut subs: Subscriptions, mut events: mpsc::UnboundedReceiver<Event>) {
        let mut reorder_ticks = tokio::time::interval(REORDER_WAIT / 4);
        reorder_ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut heartbeats = tokio::time::interval(HEARTBEAT);
        heartbeats.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let takes_homes = subs.homes.is_some();
        loop {
            let homes = subs.homes.as_mut();
            let (nodes, writes, answers) = match homes {
                Some(h) => (Some(&mut h.nodes), Some(&mut h.writes), Some(&mut h.answers)),
                None => (None, None, None),
            };
            let input = tokio::select! {
                _ = reorder_ticks.tick() => Input::Tick,
                _ = heartbeats.tick(), if takes_homes => Input::Heartbeat,
                Some(m) = subs.batches.next() => Input::Bus(Kind::Batch, m),
                Some(m) = subs.routes.next() => Input::Bus(Kind::Claim, m),
                Some(m) = subs.revoked.next() => Input::Bus(Kind::Revoked, m),
                Some(m) = subs.lost.next() => Input::Bus(Kind::Lost, m),
                Some(m) = subs.live.next() => Input::Bus(Kind::Live, m),
                Some(m) = next(nodes) => Input::Bus(Kind::Node, m),
                Some(m) = next(writes) => Input::Bus(Kind::Write, m),
                Some(m) = next(answers) => Input::Bus(Kind::Answer, m),
                Some(event) = events.recv() => Input::Event(event),
                else => return,
            };
            // Not held while waiting: the bus must not keep delivery alive.
            let Some(delivery) = self.delivery.upgrade() else { return };
            match input {
                Input::Event(event) => self.event(&delivery, event).await,
                Input::Tick => delivery.expire_reordered(),
                Input::Heartbeat => self.heartbeat(&delivery).await,
                Input::Bus(Kind::Answer, m) if m.status == Some(StatusCode::NO_RESPONDERS) => {
                    self.pending.not_there(&m.subject)
                }
                Input::Bus(kind, m) => {
                    let Some(opened) = self.open(&m) else { continue };
                    self.heard_on(kind, &delivery, &m, opened);
                }
            }
        }
    }

    /// `m` opened, or counted and dropped.
    fn open(&self, m: &Message) -> Option<Opened> {
        let reply = m.reply.as_ref().map(|r| r.as_str());
        match self.seal.open(&m.subject, reply, &m.payload, SystemTime::now()) {
            Ok(opened) => Some(opened),
            Err(refused) => {
                refused.count(&m.subject);
                None
            }
        }
    }

    /// What another node said, signed.
    fn heard_on(&self, kind: Kind, delivery: &Delivery, m: &Message, opened: Opened) {
        let payload = &opened.payload[..];
        match kind {
            Kind::Batch => Self::batch(delivery, &m.subject, payload),
            Kind::Claim => self.claim(delivery, &m.subject, opened.sender.as_str(), payload),
            Kind::Revoked => match serde_json::from_slice::<Revoked>(payload) {
                Ok(r) => delivery.kick_revoked(&r.user, &r.device),
                Err(_) => Refused::Malformed.count(&m.subject),
            },
            Kind::Lost => {
                tracing::warn!(
                    node = opened.sender.as_str(),
                    "bus: another node lost batches: every user here resyncs"
                );
                delivery.resync_all();
            }
            Kind::Live => match serde_json::from_slice::<Live>(payload) {
                Ok(live) => delivery.from_peer_live(opened.sender.as_str(), live),
                Err(_) => Refused::Malformed.count(&m.subject),
            },
            Kind::Node => {
                if let Some((_, homes)) = &self.serving {
                    homes.heard(opened.sender, Instant::now());
                }
            }
            Kind::Write => match (&self.serving, &m.reply) {
                (Some((writer, _)), Some(reply)) => {
                    forward::serve(&self.client, &self.seal, writer, self.max_body, payload, reply.to_string())
                }
                _ => Refused::Malformed.count(&m.subject),
            },
            Kind::Answer => self.pending.answered(&m.subject, payload),
        }
    }

    /// A signed batch that does not decode was still a batch of a node of
    /// ours (another version?): lost to the users here, who resync.
    fn batch(delivery: &Delivery, subject: &str, payload: &[u8]) {
        match serde_json::from_slice::<Appended>(payload) {
            Ok(appended)
                if subject.strip_prefix(BATCHES).and_then(|c| c.strip_prefix('.'))
                    == Some(appended.conv_id.as_str()) =>
            {
                delivery.from_peer(appended)
            }
            Ok(_) => Refused::Malformed.count(subject),
            Err(e) => {
                Refused::Malformed.count(subject);
                tracing::warn!(subject, error = %e, "bus: a signed batch that does not decode: every user here resyncs");
                delivery.resync_all();
            }
        }
    }

    /// Connection ids come from a PostgreSQL `bigint` sequence: a claim past
    /// it is no claim.
    fn claim(&self, delivery: &Delivery, subject: &str, sender: &str, payload: &[u8]) {
        let claim = match serde_json::from_slice::<Claim>(payload) {
            Ok(c) if (1..=i64::MAX as u64).contains(&c.conn) => c,
            _ => return Refused::Malformed.count(subject),
        };
        let claimed = ConnId::from_cluster_sequence(claim.conn);
        delivery.routed_at(sender, &claim.user, &claim.device, claimed);
        match settle(delivery.routes(), &claim.user, &claim.device, claimed) {
            Settled::Nothing => {}
            Settled::Superseded(route) => {
                tracing::debug!(user = %claim.user, device = %claim.device, old = %route.conn_id, new = %claimed, "kicked by a newer connection on another node");
                route.recipient.kick(KickReason::Replaced);
            }
            Settled::Newer(mine) => {
                let answer = Claim { user: claim.user, device: claim.device, conn: mine.get() };
                if let Some(outbox) = self.answers.upgrade() {
                    let _ = outbox.try_send(Outbound::Claim(answer));
                }
            }
        }
    }

    /// Says this node is alive, and forgets the nodes that went silent (and
    /// the users they had online) and the forwarded writes whose callers
    /// stopped waiting.
    async fn heartbeat(&self, delivery: &Delivery) {
        let Some((_, homes)) = &self.serving else { return };
        // A silent node's users are no longer online there (PROTOCOL v1.2 presence).
        for node in homes.expire(Instant::now()) {
            delivery.node_gone(node.as_str());
        }
        self.pending.forget_abandoned();
        let _ = self.client.publish(NODES, self.seal.seal(NODES, None, &[])).await;
    }

    async fn event(&mut self, delivery: &Delivery, event: Event) {
        match event {
            Event::Disconnected => {
                tracing::warn!("bus: disconnected from NATS: every user here resyncs");
                self.down = true;
                delivery.resync_all();
                if let Some((_, homes)) = &self.serving {
                    homes.alone();
                }
                self.pending.lose_all();
            }
            Event::Connected if self.down => {
                // The subscriptions go out again before anything else on the
                // new connection; once a round trip is answered, the server has them.
                if !round_trip(&self.client, &self.confirm_subject).await {
                    tracing::warn!("bus: NATS did not confirm the subscriptions after reconnecting");
                }
                tracing::info!("bus: reconnected to NATS: users who connected meanwhile resync");
                // Another server of the NATS cluster: what the old one confirmed
                // may have died with it before crossing its routes to the others.
                let server = self.client.server_info().server_id;
                if server != std::mem::replace(&mut self.server, server.clone()) {
                    tracing::warn!(server, "bus: on another NATS server: every user on the other nodes resyncs");
                    self.lost.store(true, Ordering::Relaxed);
                }
                self.down = false;
                delivery.resync_all();
                self.reconnected.notify_one();
            }
            Event::SlowConsumer(_) => {
                tracing::warn!("bus: NATS dropped messages for this node (slow consumer): every user here resyncs");
                delivery.resync_all();
            }
            // A permission violation among them: NATS's configuration does
            // not give this node's user all of `imcore.>` (README recipe).
            Event::ServerError(e) => tracing::warn!(error = %e, "bus: NATS refused something this node did"),
            other => tracing::debug!(event = %other, "bus event"),
        }
    }
}
