//! The coalescing queue (ARCHITECTURE §5 "Offline notifications"): one slot
//! per conversation and pusher, at most one request in flight per slot, the
//! next at least `coalesce` after the last, carrying the latest notice. What
//! each conversation still owes is held by seq, so its durable progress
//! ([`Queue::done`]) never passes a notification not yet handled.
//!
//! Invariant: a seq is held from the moment its batch is taken in until
//! every notification standing for it was delivered, given up or dropped;
//! a coalesced notice keeps the hold of the oldest one it stands for.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use imcore_actors::{ConvId, DeviceId, UserId};

use super::due::Notice;

/// Where a notification goes: one pusher of one device.
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    pub user: UserId,
    pub device: DeviceId,
    pub app_id: String,
    pub pushkey: String,
    pub url: String,
    pub data: Option<serde_json::Value>,
    /// When the pusher was registered, in seconds (the gateway's `pushkey_ts`).
    pub pushkey_ts: i64,
}

/// A slot's key: the conversation, the pusher's `(app_id, pushkey)`.
pub type Key = (ConvId, String, String);

/// A notification to send now.
#[derive(Debug, Clone)]
pub struct Outgoing {
    pub key: Key,
    pub target: Target,
    pub notice: Notice,
    pending: Pending,
}

#[derive(Debug, Clone)]
struct Pending {
    notice: Notice,
    /// The seq held for it: the oldest it stands for.
    hold: i64,
    /// Given up if not delivered by then.
    deadline: Instant,
    attempts: u32,
}

struct Slot {
    target: Target,
    waiting: Option<Pending>,
    in_flight: bool,
    /// Not sent before this (coalescing, backoff).
    not_before: Instant,
}

/// What became of an offered notice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Offer {
    Queued,
    /// Merged into one already waiting.
    Coalesced,
    /// Over a bound: never sent (counted).
    Dropped,
}

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Delivered,
    /// Worth trying again (5xx, 429, timeout, no connection).
    Retry,
    /// The gateway refused it for good (other 4xx), or rejected the pushkey.
    Failed,
}

/// What [`Queue::finished`] did with a request that did not deliver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    Done,
    Retrying,
    GivenUp,
}

pub struct Queue {
    slots: HashMap<Key, Slot>,
    holds: Holds,
    /// Per conversation: the lowest and the highest seq taken in since it was last settled.
    first: HashMap<ConvId, i64>,
    seen: HashMap<ConvId, i64>,
    /// Slots waiting or in flight, all together and per URL.
    busy: usize,
    busy_per_url: HashMap<String, usize>,
    max_busy: usize,
    max_busy_per_url: usize,
    coalesce: Duration,
}

impl Queue {
    pub fn new(max_busy: usize, max_busy_per_url: usize, coalesce: Duration) -> Self {
        Self {
            slots: HashMap::new(),
            holds: Holds::default(),
            first: HashMap::new(),
            seen: HashMap::new(),
            busy: 0,
            busy_per_url: HashMap::new(),
            max_busy,
            max_busy_per_url,
            coalesce,
        }
    }

    /// A batch of `conv` up to `last` is being resolved: `first` is held until [`Queue::taken`].
    pub fn taking(&mut self, conv: &ConvId, first: i64, last: i64) {
        self.holds.hold(conv, first);
        let from = self.first.entry(conv.clone()).or_insert(first);
        *from = (*from).min(first);
        let seen = self.seen.entry(conv.clone()).or_insert(last);
        *seen = (*seen).max(last);
    }

    /// The batch [`Queue::taking`] held at `first` was offered.
    pub fn taken(&mut self, conv: &ConvId, first: i64) {
        self.holds.release(conv, first);
    }

    /// Queues `notice` for `target`, or merges it into the one waiting there.
    pub fn offer(&mut self, conv: &ConvId, target: Target, notice: Notice, deadline: Instant, now: Instant) -> Offer {
        let key = (conv.clone(), target.app_id.clone(), target.pushkey.clone());
        let slot = self.slots.entry(key).or_insert_with(|| Slot {
            target: target.clone(),
            waiting: None,
            in_flight: false,
            not_before: now,
        });
        if let Some(waiting) = &mut slot.waiting {
            waiting.notice = Notice { high: waiting.notice.high || notice.high, ..notice };
            waiting.deadline = deadline;
            return Offer::Coalesced;
        }
        let url_busy = self.busy_per_url.get(&target.url).copied().unwrap_or(0);
        if !slot.in_flight && (self.busy >= self.max_busy || url_busy >= self.max_busy_per_url) {
            return Offer::Dropped;
        }
        if !slot.in_flight {
            self.busy += 1;
            *self.busy_per_url.entry(target.url.clone()).or_default() += 1;
        }
        slot.target = target;
        slot.waiting = Some(Pending { hold: notice.seq, notice, deadline, attempts: 0 });
        self.holds.hold(conv, slot.waiting.as_ref().map_or(0, |w| w.hold));
        Offer::Queued
    }

    /// Takes the notifications whose time has come (marked in flight); drops idle slots.
    pub fn due(&mut self, now: Instant) -> Vec<Outgoing> {
        let mut out = Vec::new();
        self.slots.retain(|key, slot| {
            if !slot.in_flight && slot.not_before <= now {
                match slot.waiting.take() {
                    Some(pending) => {
                        slot.in_flight = true;
                        out.push(Outgoing {
                            key: key.clone(),
                            target: slot.target.clone(),
                            notice: pending.notice.clone(),
                            pending,
                        });
                    }
                    None => return false,
                }
            }
            true
        });
        out
    }

    /// The earliest time a waiting notification may go.
    pub fn next_due(&self) -> Option<Instant> {
        self.slots.values().filter(|s| s.waiting.is_some() && !s.in_flight).map(|s| s.not_before).min()
    }

    /// `sent` ended with `outcome` at `now`; a retry waits `backoff`.
    pub fn finished(&mut self, sent: Outgoing, outcome: Outcome, backoff: Duration, now: Instant) -> Settled {
        let conv = sent.key.0.clone();
        let Some(slot) = self.slots.get_mut(&sent.key) else {
            self.holds.release(&conv, sent.pending.hold);
            return Settled::Done;
        };
        slot.in_flight = false;
        let settled = match outcome {
            Outcome::Retry if now < sent.pending.deadline => {
                let mut again = sent.pending;
                again.attempts += 1;
                match &mut slot.waiting {
                    // A newer notice came meanwhile: it goes instead, holding the older seq.
                    Some(newer) => {
                        let (keep, free) = (again.hold.min(newer.hold), again.hold.max(newer.hold));
                        newer.hold = keep;
                        newer.attempts = again.attempts;
                        newer.notice.high |= again.notice.high;
                        self.holds.release(&conv, free);
                    }
                    None => slot.waiting = Some(again),
                }
                slot.not_before = now + backoff;
                return Settled::Retrying;
            }
            Outcome::Retry => Settled::GivenUp,
            Outcome::Delivered => Settled::Done,
            Outcome::Failed => Settled::Done,
        };
        slot.not_before = now + self.coalesce;
        if slot.waiting.is_none() {
            self.unbusy(&sent.target.url);
        }
        self.holds.release(&conv, sent.pending.hold);
        settled
    }

    /// Attempts so far of `sent` (0 for a first try).
    pub fn attempts(sent: &Outgoing) -> u32 {
        sent.pending.attempts
    }

    /// The pusher is gone (rejected, removed): its waiting notifications go too.
    pub fn forget(&mut self, app_id: &str, pushkey: &str) {
        let gone: Vec<Key> =
            self.slots.keys().filter(|(_, a, p)| a == app_id && p == pushkey).cloned().collect::<Vec<_>>();
        for key in gone {
            if let Some(slot) = self.slots.get_mut(&key) {
                if let Some(w) = slot.waiting.take() {
                    if !slot.in_flight {
                        let url = slot.target.url.clone();
                        self.unbusy(&url);
                    }
                    self.holds.release(&key.0, w.hold);
                }
            }
        }
    }

    /// Every event of `conv` up to this is handled; `None` if none was taken in.
    pub fn done(&self, conv: &ConvId) -> Option<i64> {
        match self.holds.first(conv) {
            Some(first) => Some(first - 1),
            None => self.seen.get(conv).copied(),
        }
    }

    /// The lowest seq of `conv` taken in since it was last settled.
    pub fn first_taken(&self, conv: &ConvId) -> Option<i64> {
        self.first.get(conv).copied()
    }

    /// Whether `conv` still owes notifications (or is being resolved).
    pub fn owes(&self, conv: &ConvId) -> bool {
        self.holds.owes(conv)
    }

    /// Forgets `conv`'s progress once it owes nothing (after it was recorded).
    pub fn settle(&mut self, conv: &ConvId) {
        if !self.owes(conv) {
            self.first.remove(conv);
            self.seen.remove(conv);
        }
    }

    /// Slots waiting or in flight.
    pub fn depth(&self) -> usize {
        self.busy
    }

    fn unbusy(&mut self, url: &str) {
        self.busy = self.busy.saturating_sub(1);
        if let Some(n) = self.busy_per_url.get_mut(url) {
            *n -= 1;
            if *n == 0 {
                self.busy_per_url.remove(url);
            }
        }
    }
}

/// Per conversation: held seq → how many notifications hold it.
#[derive(Default)]
struct Holds(HashMap<ConvId, BTreeMap<i64, usize>>);

impl Holds {
    fn hold(&mut self, conv: &ConvId, seq: i64) {
        *self.0.entry(conv.clone()).or_default().entry(seq).or_default() += 1;
    }

    fn release(&mut self, conv: &ConvId, seq: i64) {
        let Some(holds) = self.0.get_mut(conv) else { return };
        if let Some(n) = holds.get_mut(&seq) {
            *n -= 1;
            if *n == 0 {
                holds.remove(&seq);
            }
        }
        if holds.is_empty() {
            self.0.remove(conv);
        }
    }

    fn first(&self, conv: &ConvId) -> Option<i64> {
        self.0.get(conv).and_then(|h| h.keys().next().copied())
    }

    fn owes(&self, conv: &ConvId) -> bool {
        self.0.contains_key(conv)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target() -> Target {
        Target {
            user: UserId::parse("ann").expect("user"),
            device: DeviceId::parse("phone").expect("device"),
            app_id: "app".into(),
            pushkey: "key".into(),
            url: "http://gw/notify".into(),
            data: None,
            pushkey_ts: 0,
        }
    }

    fn notice(seq: i64) -> Notice {
        Notice {
            seq,
            event_id: format!("g:{seq}"),
            kind: "msg",
            sender: UserId::parse("bob").expect("user"),
            high: false,
            room_name: None,
            sender_name: None,
        }
    }

    #[test]
    fn a_burst_coalesces_into_the_first_and_then_the_latest_and_progress_waits_for_both() {
        let conv = ConvId::parse("g").expect("conv");
        let (now, later) = (Instant::now(), Instant::now() + Duration::from_secs(600));
        let mut q = Queue::new(100, 100, Duration::from_secs(5));
        q.taking(&conv, 1, 1);
        assert_eq!(q.offer(&conv, target(), notice(1), later, now), Offer::Queued);
        q.taken(&conv, 1);
        let first = q.due(now);
        assert_eq!(first.len(), 1);
        for seq in 2..=500 {
            q.taking(&conv, seq, seq);
            let offered = q.offer(&conv, target(), notice(seq), later, now);
            assert_eq!(offered, if seq == 2 { Offer::Queued } else { Offer::Coalesced });
            q.taken(&conv, seq);
        }
        assert!(q.due(now).is_empty(), "one in flight per slot");
        assert_eq!(q.done(&conv), Some(0));
        q.finished(first.into_iter().next().expect("sent"), Outcome::Delivered, Duration::ZERO, now);
        assert_eq!(q.done(&conv), Some(1), "seq 2 onwards still owed");
        assert!(q.due(now).is_empty(), "the next waits out the coalescing interval");
        let second = q.due(now + Duration::from_secs(5));
        assert_eq!(second.iter().map(|o| o.notice.seq).collect::<Vec<_>>(), [500]);
        q.finished(second.into_iter().next().expect("sent"), Outcome::Delivered, Duration::ZERO, now);
        assert_eq!(q.done(&conv), Some(500));
        assert_eq!(q.depth(), 0);
    }

    #[test]
    fn a_retry_goes_again_after_its_backoff_and_gives_up_past_its_deadline() {
        let conv = ConvId::parse("g").expect("conv");
        let now = Instant::now();
        let mut q = Queue::new(100, 100, Duration::ZERO);
        q.offer(&conv, target(), notice(3), now + Duration::from_secs(10), now);
        let sent = q.due(now).pop().expect("due");
        assert_eq!(q.finished(sent, Outcome::Retry, Duration::from_secs(1), now), Settled::Retrying);
        assert!(q.due(now).is_empty());
        let again = q.due(now + Duration::from_secs(1)).pop().expect("retried");
        assert_eq!(Queue::attempts(&again), 1);
        let late = now + Duration::from_secs(11);
        assert_eq!(q.finished(again, Outcome::Retry, Duration::from_secs(1), late), Settled::GivenUp);
        assert_eq!(q.done(&conv), None);
        assert_eq!(q.depth(), 0);
    }

    #[test]
    fn a_full_url_drops_new_notices_but_others_urls_still_queue() {
        let now = Instant::now();
        let later = now + Duration::from_secs(10);
        let mut q = Queue::new(100, 1, Duration::ZERO);
        let conv = |c: &str| ConvId::parse(c).expect("conv");
        assert_eq!(q.offer(&conv("a"), target(), notice(1), later, now), Offer::Queued);
        assert_eq!(q.offer(&conv("b"), target(), notice(1), later, now), Offer::Dropped);
        let other = Target { url: "http://other/notify".into(), ..target() };
        assert_eq!(q.offer(&conv("b"), other, notice(1), later, now), Offer::Queued);
    }
}
