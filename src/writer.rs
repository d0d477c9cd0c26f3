//! The configurable write path: through the conversation's actor (batched,
//! the default) or `direct` (one transaction per op — seed 000's design, kept
//! as the baseline benchmarks compare against).

use std::future::Future;
use std::sync::Arc;

use imcore_actors::conversation::{ActorConfig, WriteError};
use imcore_actors::hub::{Hub, HubConfig};
use imcore_actors::{ConvId, Fanout};

use crate::config::WritePath;
use crate::delivery::Delivery;
use crate::domain::Rejection;
use crate::store::{Store, StoreError, WriteOp, Written};

/// Why a write did not append.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WriteFailure {
    /// Refused by a rule; nothing changed.
    #[error(transparent)]
    Rejected(#[from] Rejection),
    /// Shed at once; nothing changed; safe to retry with the same key.
    #[error("the conversation is overloaded")]
    Overloaded,
    /// May or may not have taken effect; a retry with the same key is safe.
    #[error("internal error")]
    Internal(String),
}

impl From<StoreError> for WriteFailure {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Rejected(r) => WriteFailure::Rejected(r),
            other => {
                tracing::warn!(error = ?other, "write failed");
                WriteFailure::Internal(other.to_string())
            }
        }
    }
}

/// `error: cause: cause…`: the edge's log line keeps the whole chain.
fn with_causes(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(cause) = next {
        out.push_str(": ");
        out.push_str(&cause.to_string());
        next = cause.source();
    }
    out
}

pub type ConversationHub = Hub<Store, Delivery>;

#[derive(Clone)]
pub enum Writer {
    Actor(Arc<ConversationHub>),
    Direct { store: Store, delivery: Arc<Delivery> },
}

impl Writer {
    /// Must run inside an actix `System` (the hub starts arbiters).
    pub fn new(path: WritePath, store: Store, delivery: Arc<Delivery>, actor: ActorConfig, arbiters: usize) -> Self {
        match path {
            WritePath::Actor => Writer::Actor(Hub::new(Arc::new(store), delivery, HubConfig { arbiters, actor })),
            WritePath::Direct => Writer::Direct { store, delivery },
        }
    }

    pub fn path(&self) -> WritePath {
        match self {
            Writer::Actor(_) => WritePath::Actor,
            Writer::Direct { .. } => WritePath::Direct,
        }
    }

    /// Queues `op` before returning, so ops written in order by one caller
    /// are committed in that order on the actor path (P6). The direct path
    /// runs each op in its own concurrent transaction and promises no order.
    pub fn write(&self, conv: ConvId, op: WriteOp) -> impl Future<Output = Result<Written, WriteFailure>> + 'static {
        let queued = match self {
            Writer::Actor(hub) => Queued::Actor(hub.enqueue(conv, op)),
            Writer::Direct { store, delivery } => {
                Queued::Direct { store: store.clone(), delivery: delivery.clone(), conv, op }
            }
        };
        async move {
            match queued {
                Queued::Actor(reply) => match reply.await {
                    Ok(outcome) => Ok(outcome?),
                    Err(WriteError::Overloaded) => Err(WriteFailure::Overloaded),
                    Err(e @ WriteError::Internal(_)) => Err(WriteFailure::Internal(with_causes(&e))),
                },
                Queued::Direct { store, delivery, conv, op } => {
                    let (written, batch) = store.write(&conv, op).await?;
                    delivery.deliver(&conv, batch.appended);
                    Ok(written)
                }
            }
        }
    }

    /// Graceful shutdown: every queued op is committed and answered.
    pub async fn shutdown(&self) {
        if let Writer::Actor(hub) = self {
            hub.shutdown().await;
        }
    }
}

enum Queued<F> {
    Actor(F),
    Direct { store: Store, delivery: Arc<Delivery>, conv: ConvId, op: WriteOp },
}
