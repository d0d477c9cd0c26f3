//! A connection's pushes on their way to its socket writer, which drains
//! them itself: a push costs a lock, a queue slot and, when the writer is
//! idle, one wakeup — no message to the session actor (ARCHITECTURE §5, the
//! write path of a push). Bounded: a full outbox is the connection's overflow.

use std::collections::{HashMap, VecDeque};
use std::mem;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Waker;

use imcore_actors::ConvId;

use crate::budget::{MemoryBudget, Permit};

/// What a connection is pushed.
#[derive(Debug)]
pub enum Out {
    /// A JSON text frame, encoded once for all its recipients.
    Frame(Arc<str>),
    /// A `pull`-mode conversation advanced: the writer writes a `head` push
    /// with the newest head [`Outbox::take_head`] holds for it then.
    Head(ConvId),
}

/// A push and its bytes of the memory budget.
pub type Queued = (Out, usize);

#[derive(Debug)]
pub struct Outbox {
    cap: usize,
    state: Mutex<State>,
    heads: PendingHeads,
}

#[derive(Debug)]
struct State {
    frames: VecDeque<Queued>,
    /// The budget's bytes of the queued pushes (one permit for all: a push
    /// costs no reference count of the budget), given back as they are taken.
    charge: Permit,
    /// The writer waiting for a frame; taken by the push that wakes it, so
    /// a burst of pushes before the writer runs wakes it once.
    waker: Option<Waker>,
    /// The connection is closing: no frame may follow its close frame.
    closed: bool,
}

/// Why a push was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The outbox holds `cap` pushes already.
    Full,
    /// The memory budget cannot hold its bytes.
    OverBudget,
}

impl Outbox {
    /// Holds at most `cap` pushes (`ws.mailbox`), paid from `budget`.
    pub fn new(cap: usize, budget: &Arc<MemoryBudget>) -> Arc<Self> {
        let state = State { frames: VecDeque::new(), charge: budget.empty(), waker: None, closed: false };
        Arc::new(Self { cap: cap.max(1), state: Mutex::new(state), heads: PendingHeads::default() })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `out`, its `bytes` taken from the memory budget, and wakes the
    /// writer if it waits; a closed outbox drops it (the connection is going
    /// away). Never waits on the writer.
    pub(super) fn push(&self, out: Out, bytes: usize) -> Result<(), Refused> {
        let waker = {
            let mut state = self.lock();
            if state.closed {
                return Ok(());
            }
            if state.frames.len() >= self.cap {
                return Err(Refused::Full);
            }
            if !state.charge.try_grow(bytes) {
                return Err(Refused::OverBudget);
            }
            state.frames.push_back((out, bytes));
            state.waker.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
        Ok(())
    }

    /// The writer's side: every queued push, swapped into `into` (empty, its
    /// allocation reused), in order, their budget bytes given back (the
    /// writer copies them at once); `waker` is woken by the next push.
    pub fn take(&self, waker: &Waker, into: &mut VecDeque<Queued>) {
        let mut state = self.lock();
        if state.closed {
            return;
        }
        mem::swap(&mut state.frames, into);
        let bytes = into.iter().map(|(_, n)| n).sum();
        state.charge.shrink(bytes);
        match &mut state.waker {
            Some(w) if w.will_wake(waker) => {}
            slot => *slot = Some(waker.clone()),
        }
    }

    /// Records `head` for `conv`; `true` if no [`Out::Head`] of it is
    /// queued (the caller queues one, which will carry the newest head).
    pub(super) fn offer_head(&self, conv: &ConvId, head: i64) -> bool {
        self.heads.offer(conv, head)
    }

    /// The head to write for `conv` now (the writer, on [`Out::Head`]).
    pub fn take_head(&self, conv: &ConvId) -> Option<i64> {
        self.heads.take(conv)
    }

    /// From now on pushes are dropped (their budget bytes given back): the
    /// session stopped, and its close frame is the last one written.
    pub fn close(&self) {
        let frames = {
            let mut state = self.lock();
            state.closed = true;
            state.waker = None;
            let bytes = state.charge.bytes();
            state.charge.shrink(bytes);
            mem::take(&mut state.frames)
        };
        drop(frames);
    }
}

/// The heads of `pull`-mode conversations not yet written. A burst of
/// batches queues one [`Out::Head`] per conversation, and the writer writes
/// the last head when it gets to it: a connection behind on its queue is
/// told once.
#[derive(Debug, Default)]
struct PendingHeads(Mutex<HashMap<ConvId, i64>>);

impl PendingHeads {
    /// Records `head`; `true` if no push for `conv` is queued (the caller queues one).
    fn offer(&self, conv: &ConvId, head: i64) -> bool {
        let mut pending = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match pending.get_mut(conv) {
            Some(newest) => {
                *newest = (*newest).max(head);
                false
            }
            None => {
                pending.insert(conv.clone(), head);
                true
            }
        }
    }

    fn take(&self, conv: &ConvId) -> Option<i64> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).remove(conv)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Wake;

    use super::*;
    use crate::budget::MemoryBudget;

    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn a_burst_wakes_the_writer_once_and_a_full_or_closed_outbox_takes_nothing() {
        let budget = MemoryBudget::new(1 << 20);
        let (outbox, wakes) = (Outbox::new(2, &budget), Arc::new(Count(AtomicUsize::new(0))));
        let push = |s: &str| outbox.push(Out::Frame(s.into()), s.len());
        let waker = Waker::from(wakes.clone());
        let mut taken = VecDeque::new();
        outbox.take(&waker, &mut taken);
        push("a").expect("room");
        push("bb").expect("room");
        assert_eq!(budget.in_use(), 3);
        assert_eq!(push("c"), Err(Refused::Full), "full at 2");
        assert_eq!(wakes.0.load(Ordering::Relaxed), 1, "one wake for the burst");
        outbox.take(&waker, &mut taken);
        let texts: Vec<&str> = taken.iter().map(|(o, _)| if let Out::Frame(f) = o { &**f } else { "?" }).collect();
        assert_eq!(texts, ["a", "bb"]);
        taken.clear();
        assert_eq!(budget.in_use(), 0, "taken frames give their bytes back");
        assert_eq!(push(&"x".repeat(2 << 20)), Err(Refused::OverBudget));
        push("d").expect("room");
        outbox.close();
        assert_eq!(budget.in_use(), 0, "closing drops what was queued");
        push("e").expect("dropped, not refused");
        outbox.take(&waker, &mut taken);
        assert!(taken.is_empty() && budget.in_use() == 0);
        assert_eq!(wakes.0.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn heads_queued_behind_a_busy_writer_are_written_once_per_conversation_with_the_newest() {
        let budget = MemoryBudget::new(1 << 20);
        let (outbox, waker) = (Outbox::new(16, &budget), Waker::from(Arc::new(Count(AtomicUsize::new(0)))));
        let (a, b) = (ConvId::parse("a").expect("id"), ConvId::parse("b").expect("id"));
        let offer = |conv: &ConvId, head| {
            if outbox.offer_head(conv, head) {
                outbox.push(Out::Head(conv.clone()), 96).expect("room");
            }
        };
        // What a writer writes from what it takes now.
        let write = || {
            let mut taken = VecDeque::new();
            outbox.take(&waker, &mut taken);
            let heads = taken.iter().filter_map(|(o, _)| match o {
                Out::Head(conv) => outbox.take_head(conv).map(|h| (conv.to_string(), h)),
                Out::Frame(_) => None,
            });
            heads.collect::<Vec<_>>()
        };
        for (conv, head) in [(&a, 5), (&b, 3), (&a, 7), (&a, 6), (&b, 4)] {
            offer(conv, head);
        }
        assert_eq!(write(), [("a".to_owned(), 7), ("b".to_owned(), 4)]);
        offer(&a, 8);
        assert_eq!(write(), [("a".to_owned(), 8)]);
    }
}
