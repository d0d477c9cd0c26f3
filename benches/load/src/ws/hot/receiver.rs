//! One receiver device of the hot group, a client as PROTOCOL §4 describes
//! one. Push mode: the group's events arrive in pushes. Pull mode: a `head`
//! push prompts a `sync`, one in flight at a time and one more if heads came
//! meanwhile, so a burst of heads costs one sync (plus its pages). Either
//! way the messages must come in increasing seq order; a seq beyond the next
//! one is a gap (the server may skip a push: the `direct` path drops one that
//! would arrive out of order), noted and filled by `sync` after the run, so
//! the recovery does not load the server while the run is measured. Each
//! live message is timed end to end; the receiver follows until it has the
//! last acked seq (or gives up), then recovers.

use std::time::{Duration, Instant};

use crate::ws::frame::{EventIn, FrameIn};
use imcore_client::{ClientError, Ws};
use serde_json::{json, Value};
use tokio::sync::watch;
use tokio::time::{sleep_until, timeout};

use crate::ws::provision::now_us;

/// How long one recovery `sync` page may take.
const SYNC_WAIT: Duration = Duration::from_secs(30);

/// Where the receivers should get to: the last acked seq, by `give_up`.
#[derive(Debug, Clone, Copy)]
pub struct Target {
    pub head: i64,
    pub give_up: Instant,
}

#[derive(Default)]
pub struct ReceiverOut {
    /// Per live message: ms end to end, and (with several nodes) whether it
    /// was sent on another node than this receiver's.
    pub e2e_ms: Vec<(f64, Option<bool>)>,
    /// Messages that arrived during the run: pushed (push mode), or in the
    /// answer of a sync a `head` push prompted (pull mode).
    pub live: u64,
    /// Seq ranges the live stream skipped, a missing tail included.
    pub gaps: u64,
    /// Messages the `sync` after the run fetched to fill the gaps.
    pub recovered: u64,
    /// Live messages at or below a seq already seen.
    pub out_of_order: u64,
    /// Syncs that failed, and gap seqs a recovery sync did not return exactly once.
    pub sync_faults: u64,
    /// Pull mode: `head` pushes received, and the syncs they prompted.
    pub heads: u64,
    pub syncs: u64,
    pub last: Option<Instant>,
    /// The server closed the connection.
    pub closed: bool,
}

/// The seqs that arrived live, in the order they came.
struct Live {
    /// The group head before the run: seqs up to it are not the run's.
    h0: i64,
    /// The highest seq received.
    last: i64,
    /// Gaps `(first, last)` seen so far, to be synced after the run.
    missing: Vec<(i64, i64)>,
}

#[derive(Debug, PartialEq)]
enum Arrival {
    /// The next seq, or one after a gap (now noted).
    New,
    /// At or below a seq of the run already received.
    OutOfOrder,
    /// From before the run.
    Earlier,
}

impl Live {
    fn new(h0: i64) -> Self {
        Self { h0, last: h0, missing: vec![] }
    }

    fn arrive(&mut self, seq: i64) -> Arrival {
        if seq <= self.h0 {
            return Arrival::Earlier;
        }
        if seq <= self.last {
            return Arrival::OutOfOrder;
        }
        if seq > self.last + 1 {
            self.missing.push((self.last + 1, seq - 1));
        }
        self.last = seq;
        Arrival::New
    }

    /// Notes seqs up to `head` that never arrived as a gap too.
    fn end_at(&mut self, head: i64) {
        if self.last < head {
            self.missing.push((self.last + 1, head));
            self.last = head;
        }
    }
}

struct Receiver {
    ws: Ws,
    /// This connection's node, when there are several.
    node: Option<usize>,
    conv: String,
    pull: bool,
    live: Live,
    /// Pull mode: the `next_after` of the last sync answer, the id of the
    /// sync in flight, and whether a head came while it was.
    synced: i64,
    in_flight: Option<u64>,
    dirty: bool,
    out: ReceiverOut,
}

/// Follows the group from seq `h0` on until the target, then fills the gaps.
pub async fn run(
    ws: Ws,
    node: Option<usize>,
    target: watch::Receiver<Option<Target>>,
    conv: String,
    h0: i64,
    pull: bool,
) -> ReceiverOut {
    let mut r = Receiver {
        ws,
        node,
        conv,
        pull,
        live: Live::new(h0),
        synced: h0,
        in_flight: None,
        dirty: false,
        out: ReceiverOut::default(),
    };
    let head = r.follow(target).await;
    if let Some(head) = head {
        r.live.end_at(head);
    }
    r.out.gaps = r.live.missing.len() as u64;
    if head.is_some() {
        r.recover().await;
    }
    r.out
}

impl Receiver {
    /// Reads the live stream until the target is reached or given up on;
    /// `None` when the connection or the run ended first.
    async fn follow(&mut self, mut target: watch::Receiver<Option<Target>>) -> Option<i64> {
        loop {
            let goal = *target.borrow();
            if let Some(g) = goal.filter(|g| self.live.last >= g.head || Instant::now() >= g.give_up) {
                return Some(g.head);
            }
            let give_up = goal.map_or_else(Instant::now, |g| g.give_up);
            tokio::select! {
                frame = self.ws.next_text() => {
                    let handled = match frame {
                        Ok(text) => self.on_frame(&text).await,
                        Err(e) => Err(e),
                    };
                    if handled.is_err() {
                        self.out.closed = true;
                        return None;
                    }
                },
                changed = target.changed() => if changed.is_err() {
                    return None;
                },
                () = sleep_until(give_up.into()), if goal.is_some() => {}
            }
        }
    }

    async fn on_frame(&mut self, text: &str) -> Result<(), ClientError> {
        let Ok(f) = serde_json::from_str::<FrameIn>(text) else { return Ok(()) };
        if f.id.is_some() && f.id == self.in_flight {
            return self.on_sync_answer(f).await;
        }
        if f.conv_id.as_deref() != Some(self.conv.as_str()) {
            return Ok(());
        }
        match f.push.as_deref() {
            Some("event" | "events") => self.on_events(f.into_events()),
            Some("head") if self.pull => {
                self.out.heads += 1;
                if self.in_flight.is_some() {
                    self.dirty = true;
                } else {
                    self.start_sync().await?;
                }
            }
            _ => {}
        }
        Ok(())
    }

    async fn on_sync_answer(&mut self, f: FrameIn) -> Result<(), ClientError> {
        self.in_flight = None;
        if f.ok != Some(true) {
            self.out.sync_faults += 1;
            return Ok(());
        }
        self.on_events(f.events.unwrap_or_default());
        self.synced = self.synced.max(f.next_after.unwrap_or(self.synced));
        if f.has_more == Some(true) || std::mem::take(&mut self.dirty) {
            self.start_sync().await?;
        }
        Ok(())
    }

    async fn start_sync(&mut self) -> Result<(), ClientError> {
        self.out.syncs += 1;
        let id = self.ws.start("sync", json!({"conv_id": self.conv, "after_seq": self.synced, "limit": 1000})).await?;
        self.in_flight = Some(id);
        Ok(())
    }

    fn on_events(&mut self, events: impl IntoIterator<Item = EventIn>) {
        let now = now_us();
        for e in events {
            let Some(seq) = e.seq else { continue };
            match self.live.arrive(seq) {
                Arrival::New => {}
                Arrival::OutOfOrder => {
                    self.out.out_of_order += 1;
                    continue;
                }
                Arrival::Earlier => continue,
            }
            self.out.live += 1;
            let Some(body) = e.body else { continue };
            if let Some(ts) = body.ts {
                let other = self.node.zip(body.node).map(|(mine, from)| mine != from);
                self.out.e2e_ms.push((now.saturating_sub(ts) as f64 / 1000.0, other));
            }
        }
        self.out.last = Some(Instant::now());
    }

    /// Syncs every gap noted.
    async fn recover(&mut self) {
        for (first, last) in std::mem::take(&mut self.live.missing) {
            let (fetched, faults) = self.fill(first, last).await;
            self.out.recovered += fetched;
            self.out.sync_faults += faults;
        }
    }

    /// Pages `sync` through seqs `first..=last`: how many came exactly once
    /// in order, and how many did not (repeated, skipped, never fetched).
    async fn fill(&mut self, first: i64, last: i64) -> (u64, u64) {
        let (mut after, mut expect, mut faults) = (first - 1, first, 0u64);
        while expect <= last {
            let req = json!({"conv_id": self.conv, "after_seq": after, "limit": (last - after).min(1000)});
            let page: Value = match timeout(SYNC_WAIT, self.ws.request("sync", req)).await {
                Ok(Ok(p)) if p["ok"] == true => p,
                _ => break,
            };
            for seq in page["events"].as_array().into_iter().flatten().filter_map(|e| e["seq"].as_i64()) {
                match seq {
                    s if s == expect => expect += 1,
                    s if s <= last => faults += 1,
                    _ => {}
                }
            }
            match page["next_after"].as_i64() {
                Some(next) if next > after && page["has_more"] == true => after = next,
                _ => break,
            }
        }
        let unfilled = (last - expect + 1).max(0) as u64;
        ((expect - first) as u64, faults + unfilled)
    }
}

#[cfg(test)]
mod tests {
    use super::{Arrival, Live};

    #[test]
    fn gaps_are_noted_and_a_lower_seq_is_out_of_order() {
        let mut live = Live::new(10);
        let arrivals: Vec<Arrival> = [3, 11, 12, 15, 14, 15, 16, 20].into_iter().map(|s| live.arrive(s)).collect();
        use Arrival::{Earlier, New, OutOfOrder};
        assert_eq!(arrivals, [Earlier, New, New, New, OutOfOrder, OutOfOrder, New, New]);
        live.end_at(22);
        assert_eq!(live.missing, [(13, 14), (17, 19), (21, 22)]);
    }

    #[test]
    fn a_stream_that_reached_the_head_has_no_tail_gap() {
        let mut live = Live::new(0);
        for s in 1..=5 {
            assert_eq!(live.arrive(s), Arrival::New);
        }
        live.end_at(5);
        assert!(live.missing.is_empty());
    }
}
