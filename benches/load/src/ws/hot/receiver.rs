//! One receiver device of the hot group: reads the group's pushes, checks
//! that seqs only increase by one (PROTOCOL §4), times each message end to
//! end, and stops once it has caught up with the last acked seq.

use std::time::Instant;

use imcore_client::Ws;
use serde::Deserialize;
use tokio::sync::watch;
use tokio::time::sleep_until;

use crate::ws::provision::now_us;

/// Where the receivers should get to: the last acked seq, by `give_up`.
#[derive(Debug, Clone, Copy)]
pub struct Target {
    pub head: i64,
    pub give_up: Instant,
}

#[derive(Default)]
pub struct ReceiverOut {
    pub e2e_ms: Vec<f64>,
    /// Message events received (push mode).
    pub events: u64,
    /// The highest seq seen: of an event (push mode) or a head push (pull mode).
    pub head: i64,
    /// Events whose seq jumped ahead of the last one seen plus one.
    pub gaps: u64,
    /// Events at or below a seq already seen.
    pub out_of_order: u64,
    pub last: Option<Instant>,
    /// The server closed the connection.
    pub closed: bool,
}

#[derive(Deserialize)]
struct PushIn {
    conv_id: Option<String>,
    head: Option<i64>,
    event: Option<EventIn>,
    events: Option<Vec<EventIn>>,
}

#[derive(Deserialize)]
struct EventIn {
    seq: i64,
    body: Option<BodyIn>,
}

#[derive(Deserialize)]
struct BodyIn {
    ts: Option<u64>,
}

pub async fn run(mut ws: Ws, mut target: watch::Receiver<Option<Target>>, conv: String, pull: bool) -> ReceiverOut {
    let mut out = ReceiverOut::default();
    let mut last_seq: Option<i64> = None;
    loop {
        let goal = *target.borrow();
        if goal.is_some_and(|g| out.head >= g.head) {
            return out;
        }
        let give_up = goal.map_or_else(Instant::now, |g| g.give_up);
        tokio::select! {
            frame = ws.next_text() => match frame {
                Ok(text) => {
                    let Ok(push) = serde_json::from_str::<PushIn>(&text) else { continue };
                    if push.conv_id.as_deref() != Some(conv.as_str()) {
                        continue;
                    }
                    out.record(push, &mut last_seq, pull);
                }
                Err(_) => {
                    out.closed = true;
                    return out;
                }
            },
            changed = target.changed() => if changed.is_err() {
                return out;
            },
            () = sleep_until(give_up.into()), if goal.is_some() => return out,
        }
    }
}

impl ReceiverOut {
    fn record(&mut self, push: PushIn, last_seq: &mut Option<i64>, pull: bool) {
        let now = now_us();
        if pull {
            self.head = self.head.max(push.head.unwrap_or(0));
        }
        for e in push.event.into_iter().chain(push.events.unwrap_or_default()) {
            match *last_seq {
                Some(l) if e.seq > l + 1 => self.gaps += 1,
                Some(l) if e.seq <= l => self.out_of_order += 1,
                _ => {}
            }
            *last_seq = Some(last_seq.map_or(e.seq, |l| l.max(e.seq)));
            self.head = self.head.max(e.seq);
            if let Some(ts) = e.body.and_then(|b| b.ts) {
                self.events += 1;
                self.e2e_ms.push(now.saturating_sub(ts) as f64 / 1000.0);
            }
        }
        self.last = Some(Instant::now());
    }
}
