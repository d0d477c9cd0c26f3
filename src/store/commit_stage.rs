//! The commit stage: conversation actors hand their batches here, and each
//! worker merges the batches waiting at the moment into one transaction
//! (`Store::write_merged`), so many quiet conversations share one commit. A
//! lone batch (none waiting, a round's slot free) is committed on its
//! caller's task as the round of one a worker would make of it.
//!
//! Invariant: one conversation never delays or fails another's callers. A
//! batch whose row is held elsewhere, or whose merged transaction failed
//! before COMMIT, is committed alone (in a task of its own, at most `workers`
//! at once); a worker that panics is replaced. At most `workers` rounds run
//! at once. Each conversation keeps its order (one batch in flight per actor).
//! Why, and what is never retried: ARCHITECTURE §3.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot, Mutex, Semaphore};

use super::write::{BatchJob, ConvCache, Share, WrittenBatch};
use super::{ErrorClass, Store, StoreError};

type Reply = oneshot::Sender<Result<(WrittenBatch, ConvCache), StoreError>>;
type Receiver = Arc<Mutex<mpsc::UnboundedReceiver<Pending>>>;

struct Pending {
    job: BatchJob,
    reply: Reply,
}

#[derive(Clone)]
pub struct CommitStage {
    /// Needs no bound of its own: it holds at most one batch per (bounded) live actor.
    sender: mpsc::UnboundedSender<Pending>,
    /// Batches sent to the workers and not yet taken by one.
    waiting: Arc<AtomicUsize>,
    rounds: Arc<Rounds>,
}

impl CommitStage {
    /// Starts `workers` merging workers on the current runtime; each merged
    /// transaction takes at most `max_ops` ops (a single batch may exceed it).
    pub fn start(store: Store, workers: usize, max_ops: usize) -> Self {
        let workers = workers.max(1);
        let (sender, receiver) = mpsc::unbounded_channel();
        let receiver = Arc::new(Mutex::new(receiver));
        let waiting = Arc::new(AtomicUsize::new(0));
        let alone = Alone { store: store.clone(), permits: Arc::new(Semaphore::new(workers)) };
        let rounds = Arc::new(Rounds { store, alone, slots: Arc::new(Semaphore::new(workers)) });
        for _ in 0..workers {
            let worker =
                Worker { rounds: rounds.clone(), receiver: receiver.clone(), waiting: waiting.clone(), max_ops };
            tokio::spawn(supervise(worker));
        }
        Self { sender, waiting, rounds }
    }

    pub async fn commit(&self, job: BatchJob) -> Result<(WrittenBatch, ConvCache), StoreError> {
        let (reply, answer) = oneshot::channel();
        let pending = Pending { job, reply };
        // Nothing to merge it with, and a worker would be free to take it
        // alone: the round is committed here, without a hop to the worker's
        // thread and back (a panic fails this task, which its actor reports).
        let lone = match self.waiting.load(SeqCst) {
            0 => self.rounds.slots.clone().try_acquire_owned().ok(),
            _ => None,
        };
        match lone {
            Some(_slot) => self.rounds.commit(vec![pending]).await,
            None => {
                self.waiting.fetch_add(1, SeqCst);
                // Workers run until every sender is gone, and this stage is one.
                if self.sender.send(pending).is_err() {
                    self.waiting.fetch_sub(1, SeqCst);
                    return Err(StoreError::Invariant("commit stage stopped"));
                }
            }
        }
        answer.await.map_err(|_| StoreError::Invariant("commit stage dropped a batch"))?
    }
}

/// Runs `worker`, and runs it again each time it ends by a panic; it ends for
/// good when the channel closes (or the runtime shuts down).
async fn supervise(worker: Worker) {
    loop {
        match tokio::spawn(worker.clone().work()).await {
            Err(e) if e.is_panic() => tracing::error!("a commit-stage worker panicked; starting another"),
            _ => return,
        }
    }
}

#[derive(Clone)]
struct Worker {
    rounds: Arc<Rounds>,
    receiver: Receiver,
    waiting: Arc<AtomicUsize>,
    max_ops: usize,
}

impl Worker {
    async fn work(self) {
        loop {
            let mut round = {
                // One worker gathers at a time; the others are committing meanwhile.
                let mut rx = self.receiver.lock().await;
                let Some(first) = rx.recv().await else { return };
                let mut ops = first.job.ops.len();
                let mut round = vec![first];
                while ops < self.max_ops {
                    let Ok(next) = rx.try_recv() else { break };
                    ops += next.job.ops.len();
                    round.push(next);
                }
                self.waiting.fetch_sub(round.len(), SeqCst);
                round
            };
            while !round.is_empty() {
                // Distinct conversations per transaction; a second batch of one
                // (never expected: one actor per conversation) waits for the next.
                let mut seen = HashSet::new();
                let (now, later): (Vec<Pending>, Vec<Pending>) =
                    round.into_iter().partition(|p| seen.insert(p.job.conv.clone()));
                round = later;
                // The semaphore is never closed.
                let Ok(_slot) = self.rounds.slots.acquire().await else { return };
                self.rounds.commit(now).await;
            }
        }
    }
}

/// What commits a round, on a worker or on a lone batch's caller's task.
struct Rounds {
    store: Store,
    alone: Alone,
    /// One per worker: held by every round while it commits.
    slots: Arc<Semaphore>,
}

impl Rounds {
    /// Commits one merged transaction and answers each batch of it, or hands
    /// it on to be committed alone (module docs). A failure is not logged
    /// here: each batch's caller gets it and the edge logs it.
    #[tracing::instrument(name = "merged_commit", skip_all, fields(batches = round.len(), ops, alone))]
    async fn commit(&self, round: Vec<Pending>) {
        let span = tracing::Span::current();
        span.record("ops", round.iter().map(|p| p.job.ops.len()).sum::<usize>());
        let (jobs, replies): (Vec<BatchJob>, Vec<Reply>) = round.into_iter().map(|p| (p.job, p.reply)).unzip();
        let shares = self.store.write_merged(jobs).await;
        let rolled_back = shares.iter().filter(|s| matches!(s, Share::RolledBack(..))).count();
        let mut alone = 0;
        for (reply, share) in replies.into_iter().zip(shares) {
            match share {
                Share::Committed(written, cache) => {
                    let _ = reply.send(Ok((written, cache)));
                }
                Share::Locked(job) => {
                    alone += 1;
                    self.alone.commit(Pending { job, reply });
                }
                Share::RolledBack(job, e) if rolled_back > 1 && e.class() != Some(ErrorClass::Unavailable) => {
                    alone += 1;
                    self.alone.commit(Pending { job, reply });
                }
                Share::RolledBack(_, e) | Share::Unknown(e) => {
                    let _ = reply.send(Err(StoreError::Merged(e)));
                }
            }
        }
        span.record("alone", alone);
    }
}

/// Commits batches one per transaction, each in a task of its own, at most
/// as many at once as there are permits.
#[derive(Clone)]
struct Alone {
    store: Store,
    permits: Arc<Semaphore>,
}

impl Alone {
    fn commit(&self, Pending { job, reply }: Pending) {
        let (store, permits) = (self.store.clone(), self.permits.clone());
        tokio::spawn(async move {
            // The semaphore is never closed; without a permit the reply drops
            // and the caller gets the failure.
            let Ok(_permit) = permits.acquire_owned().await else { return };
            let _ = reply.send(store.write_job(job).await);
        });
    }
}
