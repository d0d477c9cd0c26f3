//! The `direct` write path: one op, one transaction, no actor — the
//! baseline design, kept for the benchmarks to compare against.
//!
//! Invariant: delivery gets this node's batches of a conversation in seq
//! order. Callers of concurrent transactions come back in any order, so a
//! committed batch waits, up to [`HAND_OVER_WAIT`], until its predecessors
//! were handed over, and past that goes anyway (the lanes resync on the gap,
//! ARCHITECTURE §5). On a node of a cluster a batch goes at once: delivery's
//! reorder stage orders this node's batches and the others' (ARCHITECTURE §7).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use dashmap::DashMap;
use imcore_actors::{ConvId, Fanout};
use tokio::sync::Notify;
use tokio::time::{timeout_at, Instant};

use super::WriteFailure;
use crate::delivery::Delivery;
use crate::domain::Rejection;
use crate::store::{Appended, ConvCache, Store, WriteOp, Written};

/// How long a batch waits for its predecessors to be handed over.
const HAND_OVER_WAIT: Duration = Duration::from_secs(1);

pub struct DirectWriter {
    store: Store,
    delivery: Arc<Delivery>,
    order: DashMap<ConvId, Arc<HandOver>>,
}

/// Where a conversation's hand-overs stand.
struct HandOver {
    /// The head of the newest batch handed to delivery; locked while one is
    /// handed over (a non-blocking queue push), so hand-overs keep their order.
    handed: Mutex<i64>,
    /// Woken at every hand-over.
    handed_over: Notify,
}

impl DirectWriter {
    pub fn new(store: Store, delivery: Arc<Delivery>) -> Self {
        Self { store, delivery, order: DashMap::new() }
    }

    /// Commits `op` in a transaction of its own.
    pub async fn write(&self, conv: ConvId, op: WriteOp) -> Result<Written, WriteFailure> {
        let (mut batch, _) = self.store.write_batch(&conv, ConvCache::default(), vec![op]).await?;
        let outcome = batch.outcomes.pop().unwrap_or(Err(Rejection::NotMember));
        self.hand_over_in_order(batch.appended).await;
        Ok(outcome?)
    }

    async fn hand_over_in_order(&self, appended: Appended) {
        let Some(first) = appended.events.first().map(|e| e.seq) else { return };
        if self.delivery.clustered() {
            return self.delivery.deliver(&appended.conv_id.clone(), appended);
        }
        // The first batch seen of a conversation sets where it stands.
        let order = self
            .order
            .entry(appended.conv_id.clone())
            .or_insert_with(|| Arc::new(HandOver { handed: Mutex::new(first - 1), handed_over: Notify::new() }))
            .clone();
        let deadline = Instant::now() + HAND_OVER_WAIT;
        loop {
            let woken = order.handed_over.notified();
            tokio::pin!(woken);
            // Registered before the check, so a hand-over right after it still wakes us.
            woken.as_mut().enable();
            if *order.handed.lock().unwrap_or_else(PoisonError::into_inner) >= first - 1 {
                break;
            }
            if timeout_at(deadline, woken).await.is_err() {
                tracing::warn!(conv_id = %appended.conv_id, first, "a batch's predecessor was not handed over in time");
                break;
            }
        }
        let mut handed = order.handed.lock().unwrap_or_else(PoisonError::into_inner);
        *handed = (*handed).max(appended.head);
        self.delivery.deliver(&appended.conv_id.clone(), appended);
        drop(handed);
        order.handed_over.notify_waiters();
    }
}
