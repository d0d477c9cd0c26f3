//! Writes forwarded to their conversation's home node over the bus
//! (ARCHITECTURE §7): what crosses (`imcore.write.<node>`, a request answered
//! on the forwarding node's inbox), the forwarding node's table of writes
//! waiting for their answers, and the home node's side that writes them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use async_nats::{Client, Message, StatusCode};
use bytes::Bytes;
use imcore_actors::ConvId;
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use super::NodeId;
use crate::domain::Rejection;
use crate::metrics::metrics;
use crate::store::{WriteOp, Written};
use crate::writer::{WriteFailure, Writer};

/// `imcore.write.<node>`: the writes forwarded to that node.
pub(super) const WRITES: &str = "imcore.write";

/// A write on its way to its conversation's home node.
#[derive(Serialize, Deserialize)]
pub(super) struct Forward {
    pub(super) conv: ConvId,
    pub(super) op: WriteOp,
}

/// The home node's answer to a [`Forward`].
#[derive(Serialize, Deserialize)]
enum Answer {
    Written(Written),
    Rejected(Rejection),
    Overloaded,
    Failed(String),
}

impl From<Result<Written, WriteFailure>> for Answer {
    fn from(result: Result<Written, WriteFailure>) -> Self {
        match result {
            Ok(written) => Answer::Written(written),
            Err(WriteFailure::Rejected(r)) => Answer::Rejected(r),
            Err(WriteFailure::Overloaded) => Answer::Overloaded,
            Err(WriteFailure::Internal(cause)) => Answer::Failed(cause.to_string()),
        }
    }
}

impl From<Answer> for Result<Written, WriteFailure> {
    fn from(answer: Answer) -> Self {
        match answer {
            Answer::Written(written) => Ok(written),
            Answer::Rejected(r) => Err(WriteFailure::Rejected(r)),
            Answer::Overloaded => Err(WriteFailure::Overloaded),
            Answer::Failed(cause) => Err(WriteFailure::internal(format!("at the home node: {cause}"))),
        }
    }
}

/// Where a write goes.
pub enum Route {
    /// To its home node; the answer comes here.
    Forwarded(oneshot::Receiver<Forwarded>),
    Here(ConvId, WriteOp),
}

/// What became of a forwarded write.
pub enum Forwarded {
    /// The home node wrote it (or refused it).
    Answered(Result<Written, WriteFailure>),
    /// No node listens at the home (it died or left): nothing was written
    /// there; the op comes back to be written here.
    NotThere(ConvId, WriteOp),
    /// This node lost its bus connection with the write in flight: it may or
    /// may not have been written.
    Lost,
}

/// A forwarded write waiting for its answer.
struct Pending {
    reply: oneshot::Sender<Forwarded>,
    /// Kept for [`Forwarded::NotThere`].
    forward: Forward,
}

impl Pending {
    fn not_there(self) {
        let _ = self.reply.send(Forwarded::NotThere(self.forward.conv, self.forward.op));
    }
}

/// This node's forwarded writes waiting for their answers, by reply token.
pub(super) struct PendingWrites {
    /// Where the answers come (`<inbox>.<token>`).
    inbox: String,
    next_token: AtomicU64,
    by_token: Mutex<HashMap<u64, Pending>>,
}

impl PendingWrites {
    pub(super) fn new(inbox: String) -> Self {
        Self { inbox, next_token: AtomicU64::new(0), by_token: Mutex::new(HashMap::new()) }
    }

    /// The subject the answers come on.
    pub(super) fn answers(&self) -> String {
        format!("{}.*", self.inbox)
    }

    fn table(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Pending>> {
        self.by_token.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Publishes `forward` for `home`, its answer due to `reply`. Not kept for
    /// publishing again: a lost request is answered `Lost` (the caller's retry
    /// with the same key is safe), not repeated.
    pub(super) async fn publish(
        &self,
        client: &Client,
        home: NodeId,
        forward: Forward,
        reply: oneshot::Sender<Forwarded>,
    ) {
        let pending = Pending { reply, forward };
        let bytes = match serde_json::to_vec(&pending.forward) {
            Ok(b) => Bytes::from(b),
            Err(e) => {
                tracing::error!(error = %e, "bus: a write that does not encode is written here");
                return pending.not_there();
            }
        };
        let token = self.next_token.fetch_add(1, Ordering::Relaxed);
        self.table().insert(token, pending);
        let subject = format!("{WRITES}.{}", home.as_str());
        if client.publish_with_reply(subject, format!("{}.{token}", self.inbox), bytes).await.is_err() {
            // Never queued on the connection: nothing went out, so it is written here.
            let pending = self.table().remove(&token);
            if let Some(pending) = pending {
                pending.not_there();
            }
        }
    }

    /// Hands the answer `m` (or NATS's "no responders") to its caller.
    pub(super) fn answered(&self, m: &Message) {
        let token = m.subject.rsplit('.').next().and_then(|t| t.parse::<u64>().ok());
        let Some(pending) = token.and_then(|t| self.table().remove(&t)) else { return };
        if m.status == Some(StatusCode::NO_RESPONDERS) {
            return pending.not_there();
        }
        let result = match serde_json::from_slice::<Answer>(&m.payload) {
            Ok(answer) => answer.into(),
            Err(e) => Err(WriteFailure::internal(format!("an answer that does not decode: {e}"))),
        };
        let _ = pending.reply.send(Forwarded::Answered(result));
    }

    /// Forgets the writes whose callers stopped waiting.
    pub(super) fn forget_abandoned(&self) {
        self.table().retain(|_, p| !p.reply.is_closed());
    }

    /// The connection they went out on dropped: every write in flight is `Lost`.
    pub(super) fn lose_all(&self) {
        for (_, pending) in self.table().drain() {
            let _ = pending.reply.send(Forwarded::Lost);
        }
    }
}

/// Writes what another node forwarded here with `writer`, and answers it on
/// `client`. Called in the order the requests came: each op is queued before
/// this returns.
pub(super) fn serve(client: &Client, writer: &Writer, m: Message) {
    let Some(reply_to) = m.reply else { return };
    metrics().forwarded_writes.with_label_values(&["served"]).inc();
    let written = serde_json::from_slice::<Forward>(&m.payload).map(|f| writer.write(f.conv, f.op));
    let client = client.clone();
    tokio::spawn(async move {
        let answer = match written {
            Ok(written) => Answer::from(written.await),
            Err(e) => Answer::Failed(format!("the forwarded write does not decode: {e}")),
        };
        match serde_json::to_vec(&answer) {
            Ok(bytes) => drop(client.publish(reply_to, Bytes::from(bytes)).await),
            Err(e) => tracing::error!(error = %e, "bus: an answer that does not encode"),
        }
    });
}
