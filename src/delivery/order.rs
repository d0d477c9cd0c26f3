//! Puts one conversation's batches back in seq order on a node of a cluster
//! (ARCHITECTURE §7): a node gets batches from its own actor and from the bus,
//! so `5..=6` may arrive before `3..=4`, and the lanes need them in order.
//!
//! Invariant: the lanes get a conversation's batches in seq order, or a gap
//! they resync on. A batch ahead of the next expected seq waits, at most
//! [`REORDER_WAIT`], for those before it; past the wait the waiting batches go
//! on anyway (the lanes' gap rule resyncs); a batch behind what already went
//! on is handed on as a `Missed` notice instead. A single node never uses it.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use dashmap::DashMap;
use imcore_actors::ConvId;

use super::lane::Job;

/// How long a batch waits for the batches before it. A batch in transit on
/// the bus takes a millisecond or two; past this, it is taken as lost.
pub const REORDER_WAIT: Duration = Duration::from_millis(250);
/// A conversation quiet this long is forgotten (its next batch goes on as it
/// comes), so the map holds only conversations written lately.
const FORGET_AFTER: Duration = Duration::from_secs(30);
/// How often quiet conversations are looked for (a pass over the whole map).
const SWEEP_EVERY: Duration = Duration::from_secs(5);

/// What goes on to the lanes.
pub(super) enum Admitted {
    /// In seq order.
    InOrder(Arc<Job>),
    /// Behind what already went on.
    Late(Arc<Job>),
}

/// Lock order: a `convs` entry, then `waiting`.
pub(super) struct Reorder {
    convs: DashMap<ConvId, Order>,
    /// Conversations with batches waiting, so that the periodic expiry
    /// visits only them, not every conversation written lately.
    waiting: Mutex<HashSet<ConvId>>,
    /// When quiet conversations were last forgotten.
    swept: Mutex<Instant>,
}

struct Order {
    /// The first seq of the batch that comes next.
    next: i64,
    /// Batches ahead of `next`, by first seq.
    waiting: BTreeMap<i64, Arc<Job>>,
    /// When the oldest waiting batch arrived.
    waiting_since: Option<Instant>,
    touched: Instant,
}

impl Order {
    fn advance_past(&mut self, job: &Job) {
        if let Some(last) = job.appended.events.last() {
            self.next = self.next.max(last.seq + 1);
        }
    }

    /// The waiting batches `next` has reached, in order.
    fn unblocked(&mut self, on: &mut impl FnMut(Admitted)) {
        while let Some(entry) = self.waiting.first_entry() {
            if *entry.key() > self.next {
                break;
            }
            let job = entry.remove();
            self.advance_past(&job);
            on(Admitted::InOrder(job));
        }
        if self.waiting.is_empty() {
            self.waiting_since = None;
        }
    }
}

impl Reorder {
    pub(super) fn new(now: Instant) -> Self {
        Self { convs: DashMap::new(), waiting: Mutex::new(HashSet::new()), swept: Mutex::new(now) }
    }

    fn waiting(&self) -> MutexGuard<'_, HashSet<ConvId>> {
        // Every update of the set is one call: a panic cannot leave it half-done.
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes `job` and calls `on` for whatever may go on now, in order. `on`
    /// runs under the conversation's entry lock, so two threads admitting
    /// batches of one conversation hand them on in seq order.
    pub(super) fn admit(&self, job: Arc<Job>, now: Instant, mut on: impl FnMut(Admitted)) {
        let Some(first) = job.appended.events.first().map(|e| e.seq) else { return };
        let mut order = self.convs.entry(job.appended.conv_id.clone()).or_insert_with(|| Order {
            next: first,
            waiting: BTreeMap::new(),
            waiting_since: None,
            touched: now,
        });
        order.touched = now;
        if first > order.next {
            if order.waiting.is_empty() {
                order.waiting_since = Some(now);
                self.waiting().insert(job.appended.conv_id.clone());
            }
            order.waiting.insert(first, job);
        } else if first == order.next {
            order.advance_past(&job);
            on(Admitted::InOrder(job));
            order.unblocked(&mut on);
        } else {
            on(Admitted::Late(job));
        }
    }

    /// Lets go of batches that waited [`REORDER_WAIT`] (their predecessors
    /// are taken as lost) and forgets quiet conversations. Called
    /// periodically.
    pub(super) fn expire(&self, now: Instant, mut on: impl FnMut(Admitted)) {
        let waiting: Vec<ConvId> = self.waiting().iter().cloned().collect();
        for conv in waiting {
            let Some(mut order) = self.convs.get_mut(&conv) else { continue };
            if order.waiting_since.is_some_and(|since| now.duration_since(since) >= REORDER_WAIT) {
                if let Some((&first, _)) = order.waiting.first_key_value() {
                    order.next = first;
                }
                order.unblocked(&mut on);
                // What still waits now waits for predecessors of its own.
                order.waiting_since = (!order.waiting.is_empty()).then_some(now);
            }
            if order.waiting.is_empty() {
                self.waiting().remove(&conv);
            }
        }
        let sweep = {
            let mut swept = self.swept.lock().unwrap_or_else(|p| p.into_inner());
            let due = now.duration_since(*swept) >= SWEEP_EVERY;
            if due {
                *swept = now;
            }
            due
        };
        if sweep {
            self.convs.retain(|_, order| !order.waiting.is_empty() || now.duration_since(order.touched) < FORGET_AFTER);
        }
    }
}

#[cfg(test)]
mod tests {
    use chrono::Utc;
    use imcore_actors::UserId;

    use super::*;
    use crate::domain::{DeliveryMode, Event, EventKind};
    use crate::store::Appended;

    fn job(seqs: std::ops::RangeInclusive<i64>) -> Arc<Job> {
        let conv = ConvId::parse("g-1").expect("conv id");
        let events = seqs
            .clone()
            .map(|seq| Event {
                conv_id: conv.clone(),
                seq,
                created_at: Utc::now(),
                kind: EventKind::Group { actor: UserId::parse("ann").ok(), change: "{}".into() },
            })
            .collect();
        let appended = Appended {
            conv_id: conv,
            events,
            head: *seqs.end(),
            delivery_mode: DeliveryMode::Push,
            members_summary: false,
        };
        Arc::new(Job::new(appended))
    }

    /// `(in order?, first seq)` of what went on.
    fn admit(r: &Reorder, seqs: std::ops::RangeInclusive<i64>, now: Instant) -> Vec<(bool, i64)> {
        let mut out = Vec::new();
        r.admit(job(seqs), now, |a| out.push(first_of(a)));
        out
    }

    fn first_of(a: Admitted) -> (bool, i64) {
        match a {
            Admitted::InOrder(j) => (true, j.appended.events[0].seq),
            Admitted::Late(j) => (false, j.appended.events[0].seq),
        }
    }

    #[test]
    fn a_batch_ahead_waits_for_the_ones_before_it_and_goes_on_with_them() {
        let t = Instant::now();
        let r = Reorder::new(t);
        assert_eq!(admit(&r, 1..=2, t), [(true, 1)]);
        assert_eq!(admit(&r, 5..=6, t), []);
        assert_eq!(admit(&r, 7..=7, t), []);
        assert_eq!(admit(&r, 3..=4, t), [(true, 3), (true, 5), (true, 7)]);
        assert_eq!(admit(&r, 8..=8, t), [(true, 8)]);
    }

    #[test]
    fn past_the_wait_the_waiting_batches_go_on_and_a_late_predecessor_is_a_missed_notice() {
        let t = Instant::now();
        let r = Reorder::new(t);
        assert_eq!(admit(&r, 1..=1, t), [(true, 1)]);
        assert_eq!(admit(&r, 3..=3, t), []);
        let mut out = Vec::new();
        r.expire(t + REORDER_WAIT / 2, |a| out.push(first_of(a)));
        assert_eq!(out, []);
        r.expire(t + REORDER_WAIT, |a| out.push(first_of(a)));
        assert_eq!(out, [(true, 3)]);
        assert_eq!(admit(&r, 2..=2, t), [(false, 2)]);
        assert_eq!(admit(&r, 4..=4, t), [(true, 4)]);
        // Past a second gap, what is left waits its own full wait.
        assert_eq!(admit(&r, 6..=6, t + REORDER_WAIT), []);
        assert_eq!(admit(&r, 9..=9, t + REORDER_WAIT), []);
        let mut out = Vec::new();
        r.expire(t + REORDER_WAIT * 2, |a| out.push(first_of(a)));
        assert_eq!(out, [(true, 6)]);
        r.expire(t + REORDER_WAIT * 3 - Duration::from_millis(1), |a| out.push(first_of(a)));
        assert_eq!(out, [(true, 6)]);
        r.expire(t + REORDER_WAIT * 3, |a| out.push(first_of(a)));
        assert_eq!(out, [(true, 6), (true, 9)]);
        assert!(r.waiting().is_empty());
    }

    #[test]
    fn a_quiet_conversation_is_forgotten_and_its_next_batch_goes_on_as_it_comes() {
        let t = Instant::now();
        let r = Reorder::new(t);
        assert_eq!(admit(&r, 1..=1, t), [(true, 1)]);
        r.expire(t + FORGET_AFTER, |_| {});
        assert!(r.convs.is_empty() && r.waiting().is_empty());
        assert_eq!(admit(&r, 9..=9, t), [(true, 9)]);
    }
}
