//! What a node sends on the bus (ARCHITECTURE §7): the outbox's messages,
//! sealed, published in order, and kept until NATS confirms them (see
//! [`Publisher`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::{Client, RequestErrorKind};
use bytes::Bytes;
use imcore_actors::{DeviceId, UserId};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot, Notify};

use super::forward::{Forward, Forwarded, PendingWrites};
use super::node::NodeId;
use super::seal::Seal;
use crate::delivery::Live;
use crate::store::Appended;

pub(super) const BATCHES: &str = "imcore.batch";
pub(super) const ROUTES: &str = "imcore.route";
pub(super) const REVOKED: &str = "imcore.revoke";
pub(super) const LOST: &str = "imcore.lost";
/// Live signals (PROTOCOL v1.2): ephemeral, never published again.
pub(super) const LIVE: &str = "imcore.live";

/// Batches and claims waiting for the bus. Past it this node's batches are
/// lost to the others, and it says so (`imcore.lost`) once it can.
pub(super) const OUTBOX: usize = 16_384;
/// How long a confirmation round trip may take; past it the messages stay
/// unconfirmed (and are published again if the connection turns out lost).
/// Publishing waits meanwhile, so it is short.
const CONFIRM_WAIT: Duration = Duration::from_secs(1);

/// A route claim on the bus (`routing`).
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Claim {
    pub(super) user: UserId,
    pub(super) device: DeviceId,
    pub(super) conn: u64,
}

/// A device whose token was rotated.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Revoked {
    pub(super) user: UserId,
    pub(super) device: DeviceId,
}

/// What this node hands the bus thread to send.
pub(super) enum Outbound {
    Batch(Arc<Appended>),
    Claim(Claim),
    Revoked(Revoked),
    Live(Live),
    Forward(NodeId, Forward, oneshot::Sender<Forwarded>),
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
pub(super) struct Publisher {
    pub(super) client: Client,
    pub(super) outgoing: mpsc::Receiver<Outbound>,
    pub(super) lost: Arc<AtomicBool>,
    /// Signalled once reconnected, subscriptions confirmed.
    pub(super) reconnected: Arc<Notify>,
    /// Published and not yet confirmed, in order; unsealed (sealed again,
    /// with the time, when published again).
    pub(super) unconfirmed: Vec<(String, Bytes)>,
    pub(super) seal: Arc<Seal>,
    /// `imcore.confirm.<node>`: nobody subscribes to it.
    pub(super) confirm_subject: String,
    pub(super) pending: Arc<PendingWrites>,
}

impl Publisher {
    pub(super) async fn run(mut self) {
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
            if self.lost.swap(false, Ordering::Relaxed)
                && self.client.publish(LOST, self.seal.seal(LOST, None, &[])).await.is_err()
            {
                self.lost.store(true, Ordering::Relaxed);
            }
        }
    }

    async fn send(&mut self, message: Outbound) {
        let encoded = match message {
            Outbound::Batch(a) => serde_json::to_vec(&*a).map(|b| (format!("{BATCHES}.{}", a.conv_id), b)),
            Outbound::Claim(c) => serde_json::to_vec(&c).map(|b| (ROUTES.to_owned(), b)),
            Outbound::Revoked(r) => serde_json::to_vec(&r).map(|b| (REVOKED.to_owned(), b)),
            Outbound::Forward(home, forward, reply) => {
                return self.pending.publish(&self.client, &self.seal, home, forward, reply).await
            }
            // Ephemeral: a lost one is not sent again, nor does it make anyone resync.
            Outbound::Live(live) => {
                if let Ok(bytes) = serde_json::to_vec(&live) {
                    let _ = self.client.publish(LIVE, self.seal.seal(LIVE, None, &bytes)).await;
                }
                return;
            }
        };
        let Ok((subject, bytes)) = encoded else {
            return self.lost.store(true, Ordering::Relaxed);
        };
        let bytes = Bytes::from(bytes);
        if self.client.publish(subject.clone(), self.seal.seal(&subject, None, &bytes)).await.is_err() {
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
            if self.client.publish(subject.clone(), self.seal.seal(subject, None, bytes)).await.is_err() {
                self.lost.store(true, Ordering::Relaxed);
            }
        }
    }
}

/// Whether the server answered a request on `subject` (which nobody
/// subscribes to: it answers "no responders") within [`CONFIRM_WAIT`]. The
/// server handles a connection's messages in order, so an answer means it
/// has everything this connection sent before.
pub(super) async fn round_trip(client: &Client, subject: &str) -> bool {
    match tokio::time::timeout(CONFIRM_WAIT, client.request(subject.to_owned(), Bytes::new())).await {
        Ok(Ok(_)) => true,
        Ok(Err(e)) => e.kind() == RequestErrorKind::NoResponders,
        Err(_) => false,
    }
}
