//! One sender connection of the hot group: keeps up to `window` sends in
//! flight (closed loop), or sends on its share of a fixed total rate (open
//! loop), until the shared message budget or the deadline is reached, then
//! waits for the answers still owed.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use imcore_client::{ClientError, Ws};
use serde::Deserialize;
use serde_json::json;
use tokio::time::sleep_until;

use crate::ws::provision::now_us;

pub struct SenderCfg {
    pub conv: String,
    pub window: usize,
    pub start: Instant,
    /// No new sends after this.
    pub deadline: Instant,
    /// Answers still owed at this point count as `NO_ANSWER`.
    pub hard: Instant,
    /// Sends issued by all senders together, against `budget`.
    pub issued: AtomicU64,
    pub budget: u64,
    /// Open loop: each sender's interval between sends.
    pub interval: Option<Duration>,
    pub senders: usize,
}

#[derive(Default)]
pub struct SenderOut {
    /// `(seq, client_msg_id)` of every acked send.
    pub acks: Vec<(i64, String)>,
    pub ack_ms: Vec<f64>,
    /// Rejections by error code, and sends left without an answer.
    pub errors: BTreeMap<String, u64>,
    /// Events pushed to this device (others' sends).
    pub pushed_events: u64,
    pub last_ack: Option<Instant>,
    /// The server closed the connection.
    pub closed: bool,
    /// Open-loop ticks skipped because the window was full.
    pub skipped: u64,
}

#[derive(Deserialize)]
struct ReplyIn {
    id: Option<u64>,
    ok: Option<bool>,
    seq: Option<i64>,
    error: Option<ErrorIn>,
}

#[derive(Deserialize)]
struct ErrorIn {
    code: String,
}

struct Sender {
    idx: usize,
    /// This connection's node, when there are several: sent in each body so
    /// receivers can tell deliveries that crossed nodes.
    node: Option<usize>,
    ws: Ws,
    cfg: Arc<SenderCfg>,
    /// `(id, sent at, client_msg_id)`.
    inflight: Vec<(u64, Instant, String)>,
    next_id: u64,
    exhausted: bool,
    out: SenderOut,
}

pub async fn run(idx: usize, node: Option<usize>, ws: Ws, cfg: Arc<SenderCfg>) -> SenderOut {
    let mut tick = cfg.interval.map(|i| cfg.start + i.mul_f64(idx as f64 / cfg.senders.max(1) as f64));
    let window = cfg.window;
    let mut s = Sender {
        idx,
        node,
        ws,
        cfg,
        inflight: Vec::with_capacity(window),
        next_id: 1,
        exhausted: false,
        out: SenderOut::default(),
    };
    sleep_until(s.cfg.start.into()).await;
    loop {
        let can_issue = !s.exhausted && Instant::now() < s.cfg.deadline;
        if s.cfg.interval.is_none() && can_issue && s.fill_window().await.is_err() {
            s.out.closed = true;
            return s.out;
        }
        if s.inflight.is_empty() && !can_issue {
            return s.out;
        }
        let (tick_at, hard) = (tick.unwrap_or(s.cfg.hard), s.cfg.hard);
        tokio::select! {
            biased;
            frame = s.ws.next_text() => match frame {
                Ok(text) => s.on_frame(&text),
                Err(_) => {
                    s.out.closed = true;
                    *s.out.errors.entry("CONNECTION_CLOSED".into()).or_default() += s.inflight.len() as u64;
                    return s.out;
                }
            },
            () = sleep_until(tick_at.into()), if tick.is_some() && can_issue => {
                tick = tick.map(|t| t + s.cfg.interval.unwrap_or_default());
                if s.inflight.len() >= s.cfg.window {
                    s.out.skipped += 1;
                } else if s.take_budget() && s.issue(true).await.is_err() {
                    s.out.closed = true;
                    return s.out;
                }
            }
            () = sleep_until(hard.into()) => {
                *s.out.errors.entry("NO_ANSWER".into()).or_default() += s.inflight.len() as u64;
                return s.out;
            }
        }
    }
}

impl Sender {
    /// One more send from the shared budget, if any is left.
    fn take_budget(&mut self) -> bool {
        self.exhausted |= self.cfg.issued.fetch_add(1, Ordering::Relaxed) >= self.cfg.budget;
        !self.exhausted
    }

    /// Closed loop: tops the window up, all new frames in one write.
    async fn fill_window(&mut self) -> Result<(), ClientError> {
        let mut fed = false;
        while self.inflight.len() < self.cfg.window && self.take_budget() {
            self.issue(false).await?;
            fed = true;
        }
        if fed {
            self.ws.flush().await?;
        }
        Ok(())
    }

    async fn issue(&mut self, flush: bool) -> Result<(), ClientError> {
        let (id, key) = (self.next_id, format!("c{}-{}", self.idx, self.next_id));
        let mut body = json!({"type": "text", "text": format!("load message {id:08} {}", "x".repeat(64)), "ts": now_us(), "n": id});
        if let Some(node) = self.node {
            body["node"] = json!(node);
        }
        let frame =
            json!({"id": id, "op": "send", "conv_id": self.cfg.conv, "client_msg_id": key, "body": body}).to_string();
        if flush {
            self.ws.send_text(frame).await?;
        } else {
            self.ws.feed_text(frame).await?;
        }
        self.inflight.push((id, Instant::now(), key));
        self.next_id += 1;
        Ok(())
    }

    fn on_frame(&mut self, text: &str) {
        if text.starts_with("{\"push\"") {
            self.out.pushed_events += text.matches("\"seq\":").count() as u64;
            return;
        }
        let Ok(reply) = serde_json::from_str::<ReplyIn>(text) else { return };
        let Some(pos) = reply.id.and_then(|id| self.inflight.iter().position(|f| f.0 == id)) else { return };
        let (_, at, key) = self.inflight.swap_remove(pos);
        match (reply.ok, reply.seq, reply.error) {
            (Some(true), Some(seq), _) => {
                self.out.ack_ms.push(at.elapsed().as_secs_f64() * 1000.0);
                self.out.acks.push((seq, key));
                self.out.last_ack = Some(Instant::now());
            }
            (_, _, Some(e)) => *self.out.errors.entry(e.code).or_default() += 1,
            _ => *self.out.errors.entry("UNPARSED".into()).or_default() += 1,
        }
    }
}
