//! One sender in the room: one groupchat message in flight, acked when the
//! room reflects it back to us (the room archives before it broadcasts);
//! the others' messages that reach us meanwhile are counted as deliveries.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use tokio::time::sleep_until;

use super::stream::{attr, Xmpp};

pub struct SenderCfg {
    /// The room's bare JID.
    pub room: String,
    pub start: Instant,
    /// No new sends after this.
    pub deadline: Instant,
    /// A message still unreflected at this point counts as `NO_ANSWER`.
    pub hard: Instant,
    /// Sends issued by all senders together, against `budget`.
    pub issued: AtomicU64,
    pub budget: u64,
}

#[derive(Default)]
pub struct SenderOut {
    /// The key (`c<sender>-<n>`, also in the body) of every acked message.
    pub acks: Vec<String>,
    pub ack_ms: Vec<f64>,
    /// `NO_ANSWER`, `CONNECTION_CLOSED`, or the type of an error stanza.
    pub errors: BTreeMap<String, u64>,
    /// Others' messages reflected to us (with a body: not the room's subject).
    pub deliveries: u64,
    pub last_ack: Option<Instant>,
    pub closed: bool,
}

/// Sends until the deadline or the shared budget, then waits for the
/// reflection still owed.
pub async fn run(idx: usize, nick: String, mut x: Xmpp, cfg: Arc<SenderCfg>) -> (Xmpp, SenderOut) {
    let mut out = SenderOut::default();
    let me = format!("{}/{nick}", cfg.room);
    let mut inflight: Option<(String, Instant)> = None;
    let mut n = 0u64;
    sleep_until(cfg.start.into()).await;
    loop {
        if inflight.is_none() {
            let budget_left = cfg.issued.fetch_add(1, Ordering::Relaxed) < cfg.budget;
            if !budget_left || Instant::now() >= cfg.deadline {
                return (x, out);
            }
            n += 1;
            let key = format!("c{idx}-{n}");
            let stanza = format!(
                "<message to='{}' type='groupchat' id='{key}'><body>load message {key} {}</body></message>",
                cfg.room,
                "x".repeat(64)
            );
            if x.send(stanza).await.is_err() {
                out.closed = true;
                return (x, out);
            }
            inflight = Some((key, Instant::now()));
        }
        tokio::select! {
            biased;
            stanza = x.next() => match stanza {
                Ok(s) if s.starts_with("<message") => {
                    let (id, kind, from) = (attr(&s, "id"), attr(&s, "type"), attr(&s, "from"));
                    let ours = inflight.as_ref().is_some_and(|(key, _)| id == Some(key.as_str()));
                    if ours && kind == Some("error") {
                        *out.errors.entry("error stanza".into()).or_default() += 1;
                        inflight = None;
                    } else if ours && from == Some(me.as_str()) {
                        if let Some((key, at)) = inflight.take() {
                            out.ack_ms.push(at.elapsed().as_secs_f64() * 1000.0);
                            out.last_ack = Some(Instant::now());
                            out.acks.push(key);
                        }
                    } else if kind == Some("groupchat") && from != Some(me.as_str()) && s.contains("<body") {
                        out.deliveries += 1;
                    }
                }
                Ok(_) => {}
                Err(_) => {
                    out.closed = true;
                    *out.errors.entry("CONNECTION_CLOSED".into()).or_default() += u64::from(inflight.is_some());
                    return (x, out);
                }
            },
            () = sleep_until(cfg.hard.into()) => {
                *out.errors.entry("NO_ANSWER".into()).or_default() += 1;
                return (x, out);
            }
        }
    }
}
