//! The store as the port conversation actors write through.

use std::future::Future;

use imcore_actors::{BatchCommitted, ConvId, ConversationStore};

use super::write::{Appended, BatchJob, ConvCache, WriteOp, WriteOutcome};
use super::{Store, StoreError};

impl ConversationStore for Store {
    type Op = WriteOp;
    type Outcome = WriteOutcome;
    type Cache = ConvCache;
    type Committed = Appended;
    type Error = StoreError;

    fn commit_batch(
        &self,
        conv: ConvId,
        cache: ConvCache,
        ops: Vec<WriteOp>,
    ) -> impl Future<Output = Result<BatchCommitted<Self>, StoreError>> + Send + 'static {
        let store = self.clone();
        async move {
            let (written, cache) = match &store.commit_stage {
                Some(stage) => stage.commit(BatchJob { conv, cache, ops }).await?,
                None => store.write_job(BatchJob { conv, cache, ops }).await?,
            };
            // Before the acks: a caller that syncs after its ack finds its events.
            store.committed(&written.appended);
            crate::metrics::observe_batch(written.outcomes.len());
            let appended = written.appended.events.len();
            Ok(BatchCommitted { outcomes: written.outcomes, cache, committed: written.appended, appended })
        }
    }
}
