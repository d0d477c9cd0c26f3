//! The member devices of the fan-out scenario, online across the runs of one
//! server, and what they record into: the message currently measured. Push
//! mode: events arrive in pushes. Pull mode: a coalesced `head` push, then
//! `sync` (one in flight per device, again if the head moved meanwhile, and
//! after a short backoff if the server refused it).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use crate::ws::frame::FrameIn;
use imcore_client::Ws;
use serde_json::json;
use tokio::time::Instant;

use crate::ws::provision::now_us;

/// One run's records. Message n has seq `h0 + 1 + n`.
pub struct Measure {
    pub conv: String,
    /// Group head before the first message.
    pub h0: i64,
    pub pull: bool,
    pub sent_us: Vec<AtomicU64>,
    /// Per message: devices that got it, and the last arrival.
    pub got: Vec<AtomicU32>,
    pub last_us: Vec<AtomicU64>,
    /// Per message (pull mode): devices told of it by a `head` push, and the last such push.
    pub head_got: Vec<AtomicU32>,
    pub head_last_us: Vec<AtomicU64>,
    /// Per device: messages received in order (message 0, 1, 2, …, each once).
    pub in_order: Vec<AtomicU32>,
    /// Arrivals that were not the device's next message: gaps, repeats, reorderings.
    pub anomalies: AtomicU64,
    pub deliveries: AtomicU64,
    /// Pull mode: `head` pushes received, and the syncs they prompted.
    pub heads: AtomicU64,
    pub syncs: AtomicU64,
    /// Syncs the server refused (it sheds load with `OVERLOADED`), each retried.
    pub syncs_refused: AtomicU64,
}

impl Measure {
    pub fn new(conv: String, h0: i64, messages: usize, devices: usize, pull: bool) -> Self {
        let v64 = |n| (0..n).map(|_| AtomicU64::new(0)).collect::<Vec<_>>();
        let v32 = |n| (0..n).map(|_| AtomicU32::new(0)).collect::<Vec<_>>();
        Self {
            conv,
            h0,
            pull,
            sent_us: v64(messages),
            got: v32(messages),
            last_us: v64(messages),
            head_got: v32(messages),
            head_last_us: v64(messages),
            in_order: v32(devices),
            anomalies: AtomicU64::new(0),
            deliveries: AtomicU64::new(0),
            heads: AtomicU64::new(0),
            syncs: AtomicU64::new(0),
            syncs_refused: AtomicU64::new(0),
        }
    }

    /// Devices that have every one of `n` messages, in order.
    pub fn complete_devices(&self, n: usize) -> usize {
        self.in_order.iter().filter(|c| c.load(Ordering::Relaxed) as usize >= n).count()
    }

    fn arrived(&self, device: usize, next: &mut usize, n: usize, at: u64) {
        if n == *next {
            if let Some(c) = self.in_order.get(device) {
                c.fetch_add(1, Ordering::Relaxed);
            }
            *next += 1;
        } else {
            self.anomalies.fetch_add(1, Ordering::Relaxed);
            *next = (*next).max(n + 1);
        }
        if let (Some(g), Some(l)) = (self.got.get(n), self.last_us.get(n)) {
            g.fetch_add(1, Ordering::Relaxed);
            l.fetch_max(at, Ordering::Relaxed);
            self.deliveries.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn head_arrived(&self, seen: &mut i64, head: i64, at: u64) {
        for s in (*seen + 1)..=head {
            let n = (s - self.h0 - 1) as usize;
            if let (Some(g), Some(l)) = (self.head_got.get(n), self.head_last_us.get(n)) {
                g.fetch_add(1, Ordering::Relaxed);
                l.fetch_max(at, Ordering::Relaxed);
            }
        }
        *seen = (*seen).max(head);
    }
}

/// The run being measured, if any; devices ignore frames between runs.
pub type Current = Arc<RwLock<Option<Arc<Measure>>>>;

/// One device's view of the current run.
struct Run {
    measure: Arc<Measure>,
    /// The next message this device should get.
    next: usize,
    synced: i64,
    head_seen: i64,
    syncing: bool,
    /// The newest head a `head` push told while a sync was in flight: the
    /// device syncs again after the answer if that answer ended below it.
    dirty: Option<i64>,
}

/// How long a device waits before sending a refused sync again.
const SYNC_RETRY: Duration = Duration::from_millis(100);

/// Member device `index`: records arrivals until its connection ends; an
/// end it did not ask for is counted in `closed`.
pub async fn device(mut ws: Ws, index: usize, current: Current, closed: Arc<AtomicU64>) {
    let mut run: Option<Run> = None;
    let mut next_id = 1u64;
    // A refused sync is sent again at this time, as a client would after a backoff.
    let mut retry_at: Option<Instant> = None;
    loop {
        let received = match retry_at {
            Some(at) => tokio::time::timeout_at(at, ws.next_text()).await,
            None => Ok(ws.next_text().await),
        };
        let Ok(received) = received else {
            retry_at = None;
            if let Some(r) = &mut run {
                r.syncing = sync(&mut ws, &r.measure, r.synced, &mut next_id).await;
            }
            continue;
        };
        let Ok(text) = received else {
            closed.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let Ok(f) = serde_json::from_str::<FrameIn>(&text) else { continue };
        let Some(m) = current.read().ok().and_then(|c| c.clone()) else { continue };
        let r = match &mut run {
            Some(r) if Arc::ptr_eq(&r.measure, &m) => r,
            _ => run.insert(Run { next: 0, synced: m.h0, head_seen: m.h0, syncing: false, dirty: None, measure: m }),
        };
        let m = r.measure.clone();
        let now = now_us();
        let events = f.event.into_iter().chain(f.events.unwrap_or_default());
        if f.id.is_some() {
            // A sync answer.
            if f.ok == Some(false) {
                // Still syncing until the retry: a `head` push meanwhile must not
                // send a second sync from the same `after_seq` (its page would repeat).
                m.syncs_refused.fetch_add(1, Ordering::Relaxed);
                retry_at = Some(Instant::now() + SYNC_RETRY);
                continue;
            }
            r.syncing = false;
            for n in events.filter_map(|e| e.body.and_then(|b| b.n)) {
                m.arrived(index, &mut r.next, n, now);
            }
            r.synced = r.synced.max(f.next_after.unwrap_or(r.synced));
            let behind = r.dirty.take().is_some_and(|head| head > r.synced);
            if f.has_more == Some(true) || behind {
                r.syncing = sync(&mut ws, &m, r.synced, &mut next_id).await;
            }
            continue;
        }
        if f.conv_id.as_deref() != Some(m.conv.as_str()) {
            continue;
        }
        match f.push.as_deref() {
            Some("event" | "events") => {
                for n in events.filter_map(|e| e.body.and_then(|b| b.n)) {
                    m.arrived(index, &mut r.next, n, now);
                }
            }
            Some("head") if m.pull => {
                let Some(head) = f.head else { continue };
                m.heads.fetch_add(1, Ordering::Relaxed);
                m.head_arrived(&mut r.head_seen, head, now);
                // A head the device has synced past (its push was queued
                // before the answer that covered it) asks for nothing.
                if head <= r.synced {
                    continue;
                }
                if r.syncing {
                    r.dirty = r.dirty.max(Some(head));
                } else {
                    r.syncing = sync(&mut ws, &m, r.synced, &mut next_id).await;
                }
            }
            _ => {}
        }
    }
}

async fn sync(ws: &mut Ws, m: &Measure, after: i64, next_id: &mut u64) -> bool {
    *next_id += 1;
    m.syncs.fetch_add(1, Ordering::Relaxed);
    let frame = json!({"id": *next_id, "op": "sync", "conv_id": m.conv, "after_seq": after, "limit": 1000});
    ws.send_text(frame.to_string()).await.is_ok()
}
