//! The commit stage's transaction: the batches of several conversations in
//! one transaction, and what became of each (ARCHITECTURE §3).
//!
//! Rows are taken with `SKIP LOCKED`: a conversation whose row another
//! transaction holds (a second node, an admin tool, an epoch bump) is left out
//! before any statement of its batch runs, and handed back to be committed on
//! its own, so it never makes the others wait. Whatever fails after that
//! fails the transaction as a whole; each job then learns whether nothing of
//! it took effect (a statement failed: the server refused it, or the
//! connection failed before COMMIT was sent) or its fate is unknown (COMMIT,
//! sent behind the INSERT, failed or may have run), which decides whether it
//! may run again.

use std::sync::Arc;

use super::lookup::{lock_and_read, lookup_request_keys, KeyLookup, LockMode};
use super::one_trip::key_taken;
use super::prepared::Conn;
use super::txn::WriteTx;
use super::{
    append_and_commit, apply_batches, in_one_trip, one_trip, BatchJob, ConvCache, Phase, Unfinished, WriteOp,
    WrittenBatch,
};
use crate::config::LargeGroupSettings;
use crate::store::{PooledClient, Store, StoreError};

/// What became of one job of a merged transaction.
#[derive(Debug)]
pub(in crate::store) enum Share {
    Committed(WrittenBatch, ConvCache),
    /// Its row was held by another transaction: none of its statements ran,
    /// so it can run again, alone.
    Locked(BatchJob),
    /// The transaction failed before COMMIT was sent and rolled back: nothing
    /// of the job took effect. Its cache is reset: it may describe
    /// membership changes the transaction never committed.
    RolledBack(BatchJob, Arc<StoreError>),
    /// COMMIT failed: the job may or may not have taken effect.
    Unknown(Arc<StoreError>),
}

impl Share {
    fn failure(&self) -> Option<&StoreError> {
        match self {
            Share::RolledBack(_, e) | Share::Unknown(e) => Some(e),
            Share::Committed(..) | Share::Locked(_) => None,
        }
    }
}

impl Store {
    /// Commits the batches of several conversations (distinct `conv`s) in one
    /// transaction: one lock statement (rows in `conv_id` order, `SKIP
    /// LOCKED`), one lookup of every request key, one INSERT of every event.
    /// Each conversation's ops keep their order and their own outcomes. One
    /// share per job, in the order of `jobs`.
    pub(in crate::store) async fn write_merged(&self, jobs: Vec<BatchJob>) -> Vec<Share> {
        let mut phase = Phase::start();
        let conn = match self.pool.get().await {
            Ok(conn) => conn,
            Err(e) => return rolled_back(jobs, e.into()),
        };
        let shares = merged_on(&conn, jobs, self.large_groups, &mut phase).await;
        if let Some(e) = shares.iter().find_map(Share::failure) {
            conn.note_failure(e);
        }
        shares
    }
}

/// [`Store::write_merged`] on the connection it checked out.
async fn merged_on(
    conn: &PooledClient,
    mut jobs: Vec<BatchJob>,
    large: LargeGroupSettings,
    phase: &mut Phase,
) -> Vec<Share> {
    let prepared = match conn.prepared().await {
        Ok(prepared) => prepared,
        Err(e) => return rolled_back(jobs, e.into()),
    };
    phase.end("pool");
    let conn = Conn { client: conn, prepared };
    // One round trip for a round of one batch (a hot conversation's), when
    // its cache decides it. Not for rounds of several: one guarded statement
    // for a whole round measured slower than the merged full path
    // (ARCHITECTURE §3; the figures are in benches/README.md).
    let mut keys = KeyLookup::ByInsert;
    if let [job] = &mut jobs[..] {
        if let Some(plan) = one_trip::plan(job) {
            match in_one_trip(conn, job, plan, LockMode::SkipLocked, large, phase).await {
                Ok(Some(written)) => return vec![Share::Committed(written, std::mem::take(&mut job.cache))],
                // Its key may be taken: the INSERT just refused it.
                Ok(None) => keys = KeyLookup::WithLock,
                Err(Unfinished::RolledBack(e)) => return rolled_back(jobs, e),
                Err(Unfinished::Unknown(e)) => return vec![Share::Unknown(Arc::new(e))],
            }
        }
    }
    // Several batches, or one the guard declined (changed elsewhere, or held).
    full_path(conn, jobs, large, phase, keys).await
}

/// The merged transaction of `jobs`: lock and reads, then append. Its request
/// keys are left to the INSERT's unique index (`ByInsert`, unless the one
/// round trip just met a taken key); a round that meets one already used, or
/// that refuses an op holding one (which a replay would have answered `dup`),
/// runs again reading them under the lock (ARCHITECTURE §3, "Request keys of
/// a merged round").
async fn full_path(
    conn: Conn<'_>,
    jobs: Vec<BatchJob>,
    large: LargeGroupSettings,
    phase: &mut Phase,
    keys: KeyLookup,
) -> Vec<Share> {
    match attempt(conn, jobs, large, phase, keys).await {
        Ok(shares) => shares,
        Err(jobs) => match attempt(conn, jobs, large, phase, KeyLookup::WithLock).await {
            Ok(shares) => shares,
            Err(jobs) => rolled_back(jobs, StoreError::Invariant("a merged round with its keys read asked for them")),
        },
    }
}

/// One run of the merged transaction. `Err` (only with `ByInsert`) gives the
/// jobs back, nothing of them written, their caches reset.
async fn attempt(
    conn: Conn<'_>,
    mut jobs: Vec<BatchJob>,
    large: LargeGroupSettings,
    phase: &mut Phase,
    keys: KeyLookup,
) -> Result<Vec<Share>, Vec<BatchJob>> {
    let tx = WriteTx::new(conn, &jobs);
    let mut reads = match lock_and_read(tx.conn(), tx.begin(), &mut jobs, LockMode::SkipLocked, keys).await {
        Ok(reads) => reads,
        Err(e) => return Ok(rolled_back(jobs, e)),
    };
    phase.end("lock");
    let held = std::mem::take(&mut reads.held);
    let left_out: Vec<bool> = jobs.iter().map(|j| held.contains(&j.conv)).collect();
    let (mut running, locked): (Vec<BatchJob>, Vec<BatchJob>) = jobs.into_iter().partition(|j| !held.contains(&j.conv));
    let by_insert = keys == KeyLookup::ByInsert;
    let known: Vec<bool> = running.iter().map(|j| reads.rows.contains_key(&j.conv)).collect();
    if by_insert && running.iter().any(|j| reads.rows.get(&j.conv).is_some_and(|r| r.purged)) {
        // A key used below `min_seq` survives only as a tombstone.
        match lookup_request_keys(tx.conn(), &running).await {
            Ok(prior) => reads.prior = prior,
            Err(e) => return Ok(rolled_back(again(&left_out, running, locked), e)),
        }
    }

    let ran = match apply_batches(tx.conn(), &mut running, reads, large, phase).await {
        Ok(applied) if by_insert && refused_a_key(&running, &known, &applied.written) => {
            drop(tx);
            return Err(again(&left_out, running, locked));
        }
        Ok(applied) => match append_and_commit(tx, applied, phase).await {
            Ok(written) => written.into_iter().zip(running).map(|(w, job)| Share::Committed(w, job.cache)).collect(),
            Err(Unfinished::RolledBack(StoreError::Db(e))) if by_insert && key_taken(&e) => {
                return Err(again(&left_out, running, locked))
            }
            Err(Unfinished::RolledBack(e)) => rolled_back(running, e),
            Err(Unfinished::Unknown(e)) => {
                let e = Arc::new(e);
                running.iter().map(|_| Share::Unknown(e.clone())).collect()
            }
        },
        // `tx` is dropped unfinished: it rolls back.
        Err(e) => rolled_back(running, e),
    };
    let (mut ran, mut locked) = (ran.into_iter(), locked.into_iter().map(Share::Locked));
    Ok(left_out.into_iter().filter_map(|out| if out { locked.next() } else { ran.next() }).collect())
}

/// Whether a job of an existing conversation refused a send or an edit: read
/// without its key, a replay of it would have been answered `dup`.
fn refused_a_key(jobs: &[BatchJob], known: &[bool], written: &[WrittenBatch]) -> bool {
    jobs.iter().zip(known).zip(written).any(|((job, known), w)| {
        *known
            && job
                .ops
                .iter()
                .zip(&w.outcomes)
                .any(|(op, outcome)| matches!(op, WriteOp::Send(_) | WriteOp::Edit(_)) && outcome.is_err())
    })
}

/// The jobs of a round that runs again, in their first order, their caches
/// reset (the round's membership changes never committed).
fn again(left_out: &[bool], running: Vec<BatchJob>, locked: Vec<BatchJob>) -> Vec<BatchJob> {
    let (mut running, mut locked) = (running.into_iter(), locked.into_iter());
    left_out
        .iter()
        .filter_map(|out| if *out { locked.next() } else { running.next() })
        .map(|job| BatchJob { cache: ConvCache::default(), ..job })
        .collect()
}

fn rolled_back(jobs: Vec<BatchJob>, e: StoreError) -> Vec<Share> {
    let e = Arc::new(e);
    jobs.into_iter().map(|job| Share::RolledBack(BatchJob { cache: ConvCache::default(), ..job }, e.clone())).collect()
}
