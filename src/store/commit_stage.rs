//! The commit stage: conversation actors hand their batches here, and each
//! worker merges the batches waiting at the moment into one transaction
//! (`Store::write_batches`: rows locked in `conv_id` order, one INSERT for
//! all). Many quiet conversations then share one commit instead of paying one
//! each, while each conversation keeps its order (its actor has at most one
//! batch in flight) and its row lock stays the guard.
//!
//! The channel needs no bound of its own: it holds at most one batch per live
//! conversation actor, and those queues are bounded.

use std::sync::Arc;

use tokio::sync::{mpsc, oneshot, Mutex};

use super::write::{BatchJob, ConvCache, WrittenBatch};
use super::{Store, StoreError};

type Reply = oneshot::Sender<Result<(WrittenBatch, ConvCache), StoreError>>;

struct Pending {
    job: BatchJob,
    reply: Reply,
}

#[derive(Clone)]
pub struct CommitStage {
    sender: mpsc::UnboundedSender<Pending>,
}

impl CommitStage {
    /// Starts `workers` merging workers on the current runtime; each merged
    /// transaction takes at most `max_ops` ops (a single batch may exceed it).
    pub fn start(store: Store, workers: usize, max_ops: usize) -> Self {
        let (sender, receiver) = mpsc::unbounded_channel();
        let receiver = Arc::new(Mutex::new(receiver));
        for _ in 0..workers.max(1) {
            tokio::spawn(work(store.clone(), receiver.clone(), max_ops));
        }
        Self { sender }
    }

    pub async fn commit(&self, job: BatchJob) -> Result<(WrittenBatch, ConvCache), StoreError> {
        let (reply, answer) = oneshot::channel();
        // Workers run until every sender is gone, and this stage is one.
        self.sender.send(Pending { job, reply }).map_err(|_| StoreError::Invariant("commit stage stopped"))?;
        answer.await.map_err(|_| StoreError::Invariant("commit stage dropped a batch"))?
    }
}

async fn work(store: Store, receiver: Arc<Mutex<mpsc::UnboundedReceiver<Pending>>>, max_ops: usize) {
    loop {
        let mut round = {
            // One worker gathers at a time; the others are committing meanwhile.
            let mut rx = receiver.lock().await;
            let Some(first) = rx.recv().await else { return };
            let mut ops = first.job.ops.len();
            let mut round = vec![first];
            while ops < max_ops {
                let Ok(next) = rx.try_recv() else { break };
                ops += next.job.ops.len();
                round.push(next);
            }
            round
        };
        while !round.is_empty() {
            // Distinct conversations per transaction; a second batch of one
            // (never expected: one actor per conversation) waits for the next.
            let mut seen = std::collections::HashSet::new();
            let (now, later): (Vec<Pending>, Vec<Pending>) =
                round.into_iter().partition(|p| seen.insert(p.job.conv.clone()));
            round = later;
            commit_round(&store, now).await;
        }
    }
}

/// Commits one merged transaction and answers each batch of it. A failure is
/// not logged here: each batch's caller gets it (shared) and the edge logs it.
#[tracing::instrument(name = "merged_commit", skip_all, fields(batches = round.len(), ops))]
async fn commit_round(store: &Store, round: Vec<Pending>) {
    tracing::Span::current().record("ops", round.iter().map(|p| p.job.ops.len()).sum::<usize>());
    let (jobs, replies): (Vec<BatchJob>, Vec<Reply>) = round.into_iter().map(|p| (p.job, p.reply)).unzip();
    match store.write_batches(jobs).await {
        Ok(done) => {
            for (reply, result) in replies.into_iter().zip(done) {
                let _ = reply.send(Ok(result));
            }
        }
        Err(e) => {
            let shared = Arc::new(e);
            for reply in replies {
                let _ = reply.send(Err(StoreError::Merged(shared.clone())));
            }
        }
    }
}
