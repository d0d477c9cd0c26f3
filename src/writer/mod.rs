//! The configurable write path: through the conversation's actor (batched,
//! the default) or `direct` (one transaction per op — the baseline
//! benchmarks compare against). Either hands delivery the same thing: each
//! conversation's committed batches, in seq order.

mod direct;

use std::error::Error;
use std::future::Future;
use std::sync::Arc;

use imcore_actors::conversation::WriteError;
use imcore_actors::hub::Hub;
use imcore_actors::ConvId;

use crate::config::{EngineSettings, WritePath, WriteSettings};
use crate::delivery::{Delivery, Routes};
use crate::domain::Rejection;
use crate::store::{Store, StoreError, WriteOp, Written};

pub use direct::DirectWriter;

/// Why a write did not append.
#[derive(Debug, Clone, thiserror::Error)]
pub enum WriteFailure {
    /// Refused by a rule; nothing changed.
    #[error(transparent)]
    Rejected(#[from] Rejection),
    /// Shed at once; nothing changed; safe to retry with the same key.
    #[error("the conversation is overloaded")]
    Overloaded,
    /// May or may not have taken effect; a retry with the same key is safe.
    /// Shared: one failed transaction fails every op of its batches.
    #[error("the write may or may not have taken effect")]
    Internal(#[source] Arc<dyn Error + Send + Sync>),
}

impl WriteFailure {
    pub fn internal(cause: impl Into<Box<dyn Error + Send + Sync>>) -> Self {
        WriteFailure::Internal(Arc::from(cause.into()))
    }
}

/// Not logged here: the caller's edge logs a failure once, with its context.
impl From<StoreError> for WriteFailure {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Rejected(r) => WriteFailure::Rejected(r),
            other => WriteFailure::Internal(Arc::new(other)),
        }
    }
}

impl From<WriteError> for WriteFailure {
    fn from(e: WriteError) -> Self {
        match e {
            WriteError::Overloaded => WriteFailure::Overloaded,
            WriteError::Internal(cause) => WriteFailure::internal(cause),
        }
    }
}

pub type ConversationHub = Hub<Store, Delivery>;

/// The write engine as the server runs it: the writer on the configured path
/// (with the commit stage unless `commit_workers` is 0) and the delivery
/// behind it. Tests and benchmarks build theirs here too, so they run what
/// production runs.
pub struct Engine {
    pub writer: Writer,
    /// Owns the route registry (`delivery.routes()`).
    pub delivery: Arc<Delivery>,
}

impl Engine {
    /// Starts the delivery lanes, the commit stage and the conversation
    /// actors' arbiters. Must run inside an actix `System`.
    pub fn start(store: Store, settings: &EngineSettings) -> Self {
        let delivery = Arc::new(Delivery::new(Arc::new(Routes::new()), store.heads().clone(), &settings.delivery));
        let writer = Writer::start(store, delivery.clone(), &settings.write);
        Self { writer, delivery }
    }
}

#[derive(Clone)]
pub enum Writer {
    Actor(Arc<ConversationHub>),
    Direct(Arc<DirectWriter>),
}

impl Writer {
    fn start(store: Store, delivery: Arc<Delivery>, settings: &WriteSettings) -> Self {
        match settings.path {
            WritePath::Actor => {
                let store = store.with_commit_stage(settings.commit_workers, settings.commit_max_ops);
                Writer::Actor(Hub::new(Arc::new(store), delivery, settings.hub_config()))
            }
            WritePath::Direct => Writer::Direct(Arc::new(DirectWriter::new(store, delivery))),
        }
    }

    pub fn path(&self) -> WritePath {
        match self {
            Writer::Actor(_) => WritePath::Actor,
            Writer::Direct(_) => WritePath::Direct,
        }
    }

    /// Queues `op` before returning, so ops written in order by one caller
    /// are committed in that order on the actor path (P6). The direct path
    /// runs each op in its own concurrent transaction and promises no order.
    pub fn write(&self, conv: ConvId, op: WriteOp) -> impl Future<Output = Result<Written, WriteFailure>> + 'static {
        let queued = match self {
            Writer::Actor(hub) => Queued::Actor(hub.enqueue(conv, op)),
            Writer::Direct(direct) => Queued::Direct { direct: direct.clone(), conv, op },
        };
        async move {
            match queued {
                Queued::Actor(reply) => Ok(reply.await??),
                // Boxed: a whole transaction's state (~10 KB) would otherwise
                // size, and be copied with, every actor-path send's future.
                Queued::Direct { direct, conv, op } => Box::pin(direct.write(conv, op)).await,
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
    Direct { direct: Arc<DirectWriter>, conv: ConvId, op: WriteOp },
}
