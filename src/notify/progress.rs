//! The notifier's durable progress (ARCHITECTURE §5 "Offline notifications"):
//! per conversation, the seq up to which every notification is handled,
//! written after the work under a lease this node renews while it owes
//! some. Recovery takes over conversations that are behind and whose lease
//! ran out (a crashed or dead node's), and reads their events back, bounded
//! by the give-up window: at least once, duplicates possible.

use std::collections::{HashMap, HashSet};

use chrono::Utc;
use imcore_actors::ConvId;

use super::runner::{take_lost, Runner};
use crate::metrics::count_notifications;
use crate::store::Report;

/// Conversations taken over per scan.
const RECOVER_PAGE: i64 = 100;
/// Most events read back for a conversation never claimed before.
const RECOVER_MAX_EVENTS: i64 = 1000;

impl Runner {
    /// Writes the progress of the conversations taken in since the last
    /// flush, renewing their leases; those owing nothing are then forgotten.
    pub(super) async fn flush(&mut self) {
        let lost = self.lost.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let progress: Vec<(ConvId, i64)> = self
            .dirty
            .iter()
            .filter_map(|conv| {
                let done = self.queue.done(conv)?;
                Some((conv.clone(), lost.get(conv).map_or(done, |first| done.min(first - 1))))
            })
            .collect();
        if progress.is_empty() {
            return;
        }
        let held = match self.store.flush_progress(&self.node, &progress, self.settings.lease()).await {
            Ok(held) => held,
            Err(e) => return tracing::warn!(error = %Report(&e), "notifier: progress not written; written next time"),
        };
        // Not recorded (another node's lease, or one just taken over): kept to flush again.
        let mut unrecorded: HashSet<&ConvId> = progress.iter().map(|(c, _)| c).collect();
        // A lapsed lease taken over from another node: the seqs before what this node took in
        // that the other did not record are read back (at least once; a dead node's lag).
        let mut behind = HashMap::new();
        for (conv, recorded) in held {
            let Some((conv, wanted)) = progress.iter().find(|(c, _)| c.as_str() == conv) else { continue };
            if recorded >= *wanted {
                unrecorded.remove(conv);
            } else if self.queue.first_taken(conv).is_some_and(|first| recorded + 1 < first) {
                tracing::info!(%conv, recorded, wanted, "notifier: took a lease over; reading its lag back");
                behind.insert(conv.clone(), recorded + 1);
            }
        }
        for (conv, _) in &progress {
            if !unrecorded.contains(conv) && !self.queue.owes(conv) && !lost.contains_key(conv) {
                self.queue.settle(conv);
                self.dirty.remove(conv);
            }
        }
        let mut lost = self.lost.lock().unwrap_or_else(|e| e.into_inner());
        for (conv, first) in behind {
            let at = lost.entry(conv).or_insert(first);
            *at = (*at).min(first);
        }
    }

    /// Reads back the batches that were not handed over or not resolved.
    pub(super) async fn reread_lost(&mut self) {
        for (conv, first) in take_lost(&self.lost) {
            if let Err(e) = self.read_back(&conv, first - 1, None).await {
                tracing::warn!(error = %Report(&e), %conv, "notifier: events not read back; retried");
                let mut lost = self.lost.lock().unwrap_or_else(|e| e.into_inner());
                lost.entry(conv).or_insert(first);
            }
        }
    }

    /// Takes over the conversations that are behind and unleased.
    pub(super) async fn recover(&mut self) {
        let (window, lease) = (self.settings.give_up(), self.settings.lease());
        let behind = match self.store.behind(window, lease, RECOVER_PAGE).await {
            Ok(b) => b,
            Err(e) => return tracing::warn!(error = %Report(&e), "notifier: lag not read; next scan"),
        };
        for b in behind {
            if self.dirty.contains(&b.conv) || self.queue.owes(&b.conv) {
                continue;
            }
            let start = b.done.unwrap_or((b.head - RECOVER_MAX_EVENTS).max(0));
            match self.store.claim_progress(&b.conv, &self.node, start, lease).await {
                Ok(Some(done)) => {
                    tracing::info!(conv = %b.conv, done, head = b.head, "notifier: taking over notifications");
                    if let Err(e) = self.read_back(&b.conv, done, Some(b.head)).await {
                        tracing::warn!(error = %Report(&e), conv = %b.conv, "notifier: takeover not read; next scan");
                    }
                }
                Ok(None) => {}
                Err(e) => tracing::warn!(error = %Report(&e), "notifier: lease not claimed; next scan"),
            }
        }
    }

    /// Takes in `conv`'s events after `after` up to `upto` (its head when
    /// `None`), those within the give-up window; its progress is then written.
    async fn read_back(
        &mut self,
        conv: &ConvId,
        after: i64,
        upto: Option<i64>,
    ) -> Result<(), crate::store::StoreError> {
        let upto = match upto {
            Some(u) => u,
            None => match self.store.conv_facts(conv, &[]).await?.0 {
                Some(facts) => facts.head,
                None => return Ok(()),
            },
        };
        let since = Utc::now() - chrono::Duration::from_std(self.settings.give_up()).unwrap_or(chrono::Duration::MAX);
        let events = self.store.events_after(conv, after, upto, since).await?;
        count_notifications("recovered", events.len() as u64);
        // Marks the range taken in, so its progress is written even if nothing was due.
        self.queue.taking(conv, after + 1, upto);
        self.take(conv, &events).await;
        self.queue.taken(conv, after + 1);
        self.dirty.insert(conv.clone());
        Ok(())
    }
}
