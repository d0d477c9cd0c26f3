//! The `direct` write path: one op, one transaction, no actor — the
//! baseline design, kept for the benchmarks to compare against.
//!
//! Concurrent transactions of one conversation commit in any order, and
//! their callers come back in any order; delivery takes a conversation's
//! batches in seq order only. So a batch reaches delivery only if it is newer
//! than every batch of its conversation handed over before; an older one is
//! not pushed (PROTOCOL §4: a client that notices the gap syncs).

use std::sync::Arc;

use dashmap::DashMap;
use imcore_actors::{ConvId, Fanout};

use super::WriteFailure;
use crate::delivery::Delivery;
use crate::domain::Rejection;
use crate::store::{Appended, ConvCache, Store, WriteOp, Written};

pub struct DirectWriter {
    store: Store,
    delivery: Arc<Delivery>,
    /// The head of the newest batch handed to delivery, per conversation.
    delivered: DashMap<ConvId, i64>,
}

impl DirectWriter {
    pub fn new(store: Store, delivery: Arc<Delivery>) -> Self {
        Self { store, delivery, delivered: DashMap::new() }
    }

    /// Commits `op` in a transaction of its own; the empty cache makes it
    /// load the member map under the row lock, which delivery needs.
    pub async fn write(&self, conv: ConvId, op: WriteOp) -> Result<Written, WriteFailure> {
        let (mut batch, _) = self.store.write_batch(&conv, ConvCache::default(), vec![op]).await?;
        let outcome = batch.outcomes.pop().unwrap_or(Err(Rejection::NotMember));
        self.deliver_in_order(batch.appended);
        Ok(outcome?)
    }

    fn deliver_in_order(&self, appended: Appended) {
        if appended.events.is_empty() {
            return;
        }
        // The entry stays locked while the batch is handed over (a
        // non-blocking queue push), so hand-overs keep their seq order.
        let mut newest = self.delivered.entry(appended.conv_id.clone()).or_insert(0);
        if appended.head > *newest {
            *newest = appended.head;
            self.delivery.deliver(&appended.conv_id.clone(), appended);
        }
    }
}
