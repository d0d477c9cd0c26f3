//! An in-memory [`ConversationStore`]: per-conversation logs with gapless
//! seqs and request-key replay, plus knobs for latency, failure and panic
//! injection, conversations that do not exist, and a record of batch sizes.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::ids::{ClientMsgId, ConvId, UserId};
use crate::store::{BatchCommitted, ConversationStore};

/// A send-like op: `key` is the request key (one event per key, P2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendOp {
    pub sender: UserId,
    pub key: ClientMsgId,
    pub payload: String,
}

/// One op's result: its seq, and whether it replayed an earlier op; or
/// `refused` (seq 0): the conversation does not exist
/// ([`MemoryStore::set_missing`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendOutcome {
    pub seq: u64,
    pub duplicate: bool,
    pub refused: bool,
}

/// A logged event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub seq: u64,
    pub sender: UserId,
    pub key: ClientMsgId,
    pub payload: String,
}

/// What one batch appended (handed to the fanout; duplicates excluded).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Appended {
    pub events: Vec<Event>,
}

/// The actor-held cache: the next seq as last seen. Revalidated on every
/// batch, like the real store's cache; a mismatch counts as a reload.
#[derive(Debug, Clone, Default)]
pub struct MemoryCache {
    pub next_seq: Option<u64>,
}

/// An injected batch failure.
#[derive(Debug, Clone, thiserror::Error)]
#[error("memory store: {0}")]
pub struct MemoryStoreError(pub String);

#[derive(Default)]
struct Log {
    events: Vec<Event>,
    by_key: HashMap<ClientMsgId, u64>,
}

#[derive(Default)]
struct Inner {
    /// Stands in for the row lock: a batch applies atomically.
    logs: Mutex<HashMap<ConvId, Log>>,
    missing: Mutex<HashSet<ConvId>>,
    latency_us: AtomicU64,
    fail_next: AtomicUsize,
    panic_next: AtomicUsize,
    batch_sizes: Mutex<Vec<usize>>,
    cache_reloads: AtomicU64,
}

/// In-memory store for actor tests. Cheap to clone (shared state).
#[derive(Clone, Default)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }

    /// Every batch sleeps this long before applying (a transaction's latency).
    pub fn set_latency(&self, latency: Duration) {
        let us = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
        self.inner.latency_us.store(us, SeqCst);
    }

    /// The next `n` batches fail with an error; nothing of them is applied.
    pub fn fail_next_batches(&self, n: usize) {
        self.inner.fail_next.store(n, SeqCst);
    }

    /// The next `n` batches panic; nothing of them is applied.
    pub fn panic_next_batches(&self, n: usize) {
        self.inner.panic_next.store(n, SeqCst);
    }

    /// Ops on `conv` are refused from now on, as if it did not exist.
    pub fn set_missing(&self, conv: &ConvId) {
        if let Ok(mut missing) = self.inner.missing.lock() {
            missing.insert(conv.clone());
        }
    }

    /// Sizes of the batches committed so far (failed ones excluded), in order.
    pub fn batch_sizes(&self) -> Vec<usize> {
        self.inner.batch_sizes.lock().map(|b| b.clone()).unwrap_or_default()
    }

    /// Batches whose cache did not match the log.
    pub fn cache_reloads(&self) -> u64 {
        self.inner.cache_reloads.load(SeqCst)
    }

    /// `conv`'s log, in seq order.
    pub fn log(&self, conv: &ConvId) -> Vec<Event> {
        self.inner.logs.lock().ok().and_then(|logs| logs.get(conv).map(|l| l.events.clone())).unwrap_or_default()
    }
}

fn take_one(counter: &AtomicUsize) -> bool {
    counter.fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1)).is_ok()
}

impl Inner {
    fn apply(
        &self,
        conv: ConvId,
        cache: MemoryCache,
        ops: Vec<SendOp>,
    ) -> Result<BatchCommitted<MemoryStore>, MemoryStoreError> {
        let missing = self.missing.lock().map_err(|_| MemoryStoreError("poisoned".into()))?.contains(&conv);
        let mut logs = self.logs.lock().map_err(|_| MemoryStoreError("poisoned".into()))?;
        let log = logs.entry(conv).or_default();
        let next = log.events.len() as u64 + 1;
        if cache.next_seq != Some(next) {
            self.cache_reloads.fetch_add(1, SeqCst);
        }
        let mut outcomes = Vec::with_capacity(ops.len());
        let mut appended = Vec::new();
        for op in ops {
            if missing {
                outcomes.push(SendOutcome { seq: 0, duplicate: false, refused: true });
                continue;
            }
            if let Some(&seq) = log.by_key.get(&op.key) {
                outcomes.push(SendOutcome { seq, duplicate: true, refused: false });
                continue;
            }
            let seq = log.events.len() as u64 + 1;
            let event = Event { seq, sender: op.sender, key: op.key, payload: op.payload };
            log.by_key.insert(event.key.clone(), seq);
            log.events.push(event.clone());
            appended.push(event);
            outcomes.push(SendOutcome { seq, duplicate: false, refused: false });
        }
        if let Ok(mut sizes) = self.batch_sizes.lock() {
            sizes.push(outcomes.len());
        }
        Ok(BatchCommitted {
            outcomes,
            cache: MemoryCache { next_seq: Some(log.events.len() as u64 + 1) },
            appended: appended.len(),
            committed: Appended { events: appended },
        })
    }
}

impl ConversationStore for MemoryStore {
    type Op = SendOp;
    type Outcome = SendOutcome;
    type Cache = MemoryCache;
    type Committed = Appended;
    type Error = MemoryStoreError;

    fn commit_batch(
        &self,
        conv: ConvId,
        cache: MemoryCache,
        ops: Vec<SendOp>,
    ) -> impl Future<Output = Result<BatchCommitted<Self>, MemoryStoreError>> + Send + 'static {
        let inner = Arc::clone(&self.inner);
        async move {
            let latency = inner.latency_us.load(SeqCst);
            if latency > 0 {
                tokio::time::sleep(Duration::from_micros(latency)).await;
            }
            if take_one(&inner.fail_next) {
                return Err(MemoryStoreError("injected failure".into()));
            }
            if take_one(&inner.panic_next) {
                panic!("injected panic in commit_batch");
            }
            inner.apply(conv, cache, ops)
        }
    }
}
