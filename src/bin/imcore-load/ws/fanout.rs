//! Issue 5 §2: fan-out. A group of `M` members, every member's device online,
//! one sender (a further device of member 0) at a steady rate. Per message:
//! the time until the last member device has it. `push` mode: the event
//! arrives in a push. `pull` mode: the device gets a coalesced `head` push and
//! calls `sync` (one in flight per device, again if the head moved meanwhile);
//! it has the event when the sync answer brings it. Both the `head` arrival
//! and the event arrival are reported for pull.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use futures_util::{stream, SinkExt, StreamExt};
use imcore::store::{CreateConversation, GroupSettings, Store};
use imcore_actors::{ConvId, UserId};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::task::JoinSet;
use tokio_tungstenite::tungstenite::Message;

use super::client::{self, now_us, BoxError, Percentiles, Ws};
use super::server::{CpuWindow, Pg, Server};

/// What the devices record into: the message currently measured.
struct Measure {
    conv: String,
    /// Group head before the first message: message n has seq h0 + 1 + n.
    h0: i64,
    sent_us: Vec<AtomicU64>,
    got: Vec<AtomicU32>,
    last_us: Vec<AtomicU64>,
    head_got: Vec<AtomicU32>,
    head_last_us: Vec<AtomicU64>,
    deliveries: AtomicU64,
    syncs: AtomicU64,
    pull: bool,
}

impl Measure {
    fn new(conv: String, h0: i64, n: usize, pull: bool) -> Self {
        let v64 = || (0..n).map(|_| AtomicU64::new(0)).collect::<Vec<_>>();
        let v32 = || (0..n).map(|_| AtomicU32::new(0)).collect::<Vec<_>>();
        Self {
            conv,
            h0,
            sent_us: v64(),
            got: v32(),
            last_us: v64(),
            head_got: v32(),
            head_last_us: v64(),
            deliveries: AtomicU64::new(0),
            syncs: AtomicU64::new(0),
            pull,
        }
    }

    fn arrived(&self, n: usize, at: u64) {
        if let (Some(g), Some(l)) = (self.got.get(n), self.last_us.get(n)) {
            g.fetch_add(1, Ordering::Relaxed);
            l.fetch_max(at, Ordering::Relaxed);
            self.deliveries.fetch_add(1, Ordering::Relaxed);
        }
    }
}

type Current = Arc<RwLock<Option<Arc<Measure>>>>;

/// Online member devices, kept across the runs of one server.
pub struct Devices {
    tasks: JoinSet<()>,
    current: Current,
    pub online: usize,
    tokens: Vec<String>,
    sender_token: String,
    users: Vec<String>,
    source_addrs: usize,
}

/// Users `f0..f{max_m}` with device `d0` each, and member 0's sending device.
pub async fn setup(server: &Server, max_m: usize, source_addrs: usize) -> Result<Devices, BoxError> {
    let users: Vec<String> = (0..max_m).map(|i| format!("f{i}")).collect();
    client::create_users(server.port, &server.admin, users.clone()).await?;
    let mut devices: Vec<(String, String)> = users.iter().map(|u| (u.clone(), "d0".to_owned())).collect();
    devices.push((users[0].clone(), "sender".to_owned()));
    let mut tokens = client::issue_tokens(server.port, &server.admin, devices).await?;
    let sender_token = tokens.pop().ok_or("no sender token")?;
    Ok(Devices { tasks: JoinSet::new(), current: Arc::default(), online: 0, tokens, sender_token, users, source_addrs })
}

impl Devices {
    /// Brings the devices of members `0..m` online.
    async fn online_up_to(&mut self, port: u16, m: usize) -> Result<(), BoxError> {
        let addrs = self.source_addrs;
        let from = self.online;
        let conns: Vec<Ws> = stream::iter(self.tokens[from..m].iter().enumerate())
            .map(|(i, t)| client::connect_retry(port, client::source_addr(from + i, addrs), t))
            .buffered(256)
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<Result<_, _>>()?;
        for ws in conns {
            self.tasks.spawn(device(ws, self.current.clone()));
        }
        self.online = m;
        Ok(())
    }

    pub fn close(mut self) {
        self.tasks.abort_all();
    }
}

pub struct Params<'a> {
    pub members: usize,
    pub mode: &'a str,
    pub rate: f64,
    pub messages: usize,
}

pub async fn run(server: &Server, pg: &Pg, db: &Store, devs: &mut Devices, p: &Params<'_>) -> Result<Value, BoxError> {
    let m = p.members.min(devs.users.len());
    let conv = format!("fan-{}-{m}", p.mode);
    // create_conversation takes at most 1,000 listed members and there is no
    // `invite` op yet: larger groups are created in the store directly.
    if m <= 1000 {
        client::create_group(
            server.port,
            &devs.tokens[0],
            json!({"kind": "group", "conv_id": conv, "name": conv, "members": devs.users[1..m],
                   "max_member": m + 1, "delivery_mode": p.mode}),
        )
        .await?;
    } else {
        let mut settings = GroupSettings { max_member: (m + 1) as i32, ..GroupSettings::default() };
        settings.delivery_mode = p.mode.parse().map_err(|()| "delivery mode")?;
        db.create_conversation(&CreateConversation::Group {
            creator: UserId::parse(&devs.users[0])?,
            conv_id: Some(ConvId::parse(&conv)?),
            name: conv.clone(),
            members: devs.users[1..m].iter().map(|u| UserId::parse(u)).collect::<Result<_, _>>()?,
            settings,
        })
        .await?;
    }
    let connect_started = Instant::now();
    devs.online_up_to(server.port, m).await?;
    let connect_s = connect_started.elapsed().as_secs_f64();
    let mut sender = client::connect_retry(server.port, client::source_addr(0, 1), &devs.sender_token).await?;
    // Let creation pushes drain before measuring.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let h0 = m as i64;
    let measure = Arc::new(Measure::new(conv.clone(), h0, p.messages, p.mode == "pull"));
    *devs.current.write().map_err(|_| "poisoned")? = Some(measure.clone());

    let cpu = CpuWindow::start(server, pg);
    let started = Instant::now();
    let interval = Duration::from_secs_f64(1.0 / p.rate.max(0.001));
    let mut acks: Vec<(i64, String)> = Vec::new();
    let mut pending: HashMap<u64, String> = HashMap::new();
    let mut errors = 0u64;
    let mut next = started;
    let mut n = 0usize;
    let send_deadline = started + interval.mul_f64(p.messages as f64) + Duration::from_secs(10);
    while (n < p.messages || !pending.is_empty()) && Instant::now() < send_deadline {
        tokio::select! {
            biased;
            frame = sender.next() => match frame {
                Some(Ok(Message::Text(t))) => {
                    if let Ok(r) = serde_json::from_str::<AckIn>(&t) {
                        if let (Some(id), Some(key)) = (r.id, r.id.and_then(|id| pending.remove(&id))) {
                            match r.seq {
                                Some(seq) if r.ok == Some(true) => acks.push((seq, key)),
                                _ => { errors += 1; let _ = id; }
                            }
                        }
                    }
                }
                Some(Ok(_)) => {}
                _ => return Err("the sender's connection closed".into()),
            },
            () = tokio::time::sleep_until(next.into()), if n < p.messages => {
                let key = format!("f{n}");
                let ts = now_us();
                measure.sent_us[n].store(ts, Ordering::Relaxed);
                let frame = json!({"id": n + 1, "op": "send", "conv_id": conv, "client_msg_id": key,
                                   "body": {"type": "text", "text": format!("fan-out message {n}"), "ts": ts, "n": n}});
                sender.send(Message::Text(frame.to_string())).await?;
                pending.insert(n as u64 + 1, key);
                n += 1;
                next += interval;
            }
        }
    }
    // Wait until every device has every message, or 20 s.
    let expected = m as u32;
    let wait_until = Instant::now() + Duration::from_secs(20);
    while Instant::now() < wait_until && measure.got.iter().any(|g| g.load(Ordering::Relaxed) < expected) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let cpu = cpu.end(server, pg);
    *devs.current.write().map_err(|_| "poisoned")? = None;
    let _ = sender.close(None).await;

    let lat = |got: &[AtomicU32], last: &[AtomicU64]| {
        let mut complete = 0;
        let ms: Vec<f64> = (0..n)
            .filter(|&i| got[i].load(Ordering::Relaxed) >= expected)
            .map(|i| {
                complete += 1;
                last[i].load(Ordering::Relaxed).saturating_sub(measure.sent_us[i].load(Ordering::Relaxed)) as f64
                    / 1000.0
            })
            .collect();
        (Percentiles::of(ms), complete)
    };
    let (last_device, complete) = lat(&measure.got, &measure.last_us);
    let first_sent = measure.sent_us.first().map_or(0, |a| a.load(Ordering::Relaxed));
    let last_arrival = measure.last_us.iter().map(|a| a.load(Ordering::Relaxed)).max().unwrap_or(first_sent);
    let deliveries = measure.deliveries.load(Ordering::Relaxed);
    let span_s = (last_arrival.saturating_sub(first_sent) as f64 / 1e6).max(1e-9);
    let (verified_log, detail) = super::hot::verify(db, &conv, &acks).await?;
    let verified = verified_log && complete == n && n == p.messages && errors == 0;
    let mut run = json!({
        "scenario": "fanout",
        "write_path": "actor",
        "delivery_mode": p.mode,
        "members": m,
        "online_devices": m,
        "rate_per_s": p.rate,
        "messages": n,
        "acked": acks.len(),
        "send_errors": errors,
        "complete_messages": complete,
        "last_device_ms": last_device.json(),
        "deliveries": deliveries,
        "deliveries_per_s": (deliveries as f64 / span_s).round(),
        "connect_s": (connect_s * 100.0).round() / 100.0,
        "cpu": cpu,
        "server_rss_mb": (server.rss_kib() as f64 / 1024.0).round(),
        "verified": verified,
        "verification": detail,
    });
    if measure.pull {
        let (head, head_complete) = lat(&measure.head_got, &measure.head_last_us);
        run["head_push_ms"] = head.json();
        run["head_complete_messages"] = json!(head_complete);
        run["syncs"] = json!(measure.syncs.load(Ordering::Relaxed));
    }
    eprintln!(
        "fanout {:<4} M={:<6} {:.0} msg/s x {}: last device p50 {:.1} p99 {:.1} max {:.1} ms  complete {}/{}  \
         {:.0} deliveries/s  cpu {}  verified {}",
        p.mode,
        m,
        p.rate,
        n,
        last_device.p50,
        last_device.p99,
        last_device.max,
        complete,
        n,
        run["deliveries_per_s"].as_f64().unwrap_or(0.0),
        run["cpu"],
        verified
    );
    Ok(run)
}

#[derive(Deserialize)]
struct AckIn {
    id: Option<u64>,
    ok: Option<bool>,
    seq: Option<i64>,
}

#[derive(Deserialize)]
struct FrameIn {
    id: Option<u64>,
    push: Option<String>,
    conv_id: Option<String>,
    head: Option<i64>,
    event: Option<EventIn>,
    events: Option<Vec<EventIn>>,
    next_after: Option<i64>,
    has_more: Option<bool>,
}

#[derive(Deserialize)]
struct EventIn {
    body: Option<BodyIn>,
}

#[derive(Deserialize)]
struct BodyIn {
    n: Option<usize>,
}

/// One member device: records event arrivals (push), or head arrivals and
/// then syncs (pull).
async fn device(mut ws: Ws, current: Current) {
    let mut synced: HashMap<String, i64> = HashMap::new();
    let mut head_seen: HashMap<String, i64> = HashMap::new();
    let mut syncing = false;
    let mut dirty = false;
    let mut next_id = 1u64;
    while let Some(Ok(msg)) = ws.next().await {
        let Message::Text(t) = msg else { continue };
        let Ok(f) = serde_json::from_str::<FrameIn>(&t) else { continue };
        let Some(m) = current.read().ok().and_then(|c| c.clone()) else { continue };
        let now = now_us();
        let events = f.event.into_iter().chain(f.events.unwrap_or_default());
        if f.id.is_some() {
            // A sync answer.
            syncing = false;
            for e in events {
                if let Some(n) = e.body.and_then(|b| b.n) {
                    m.arrived(n, now);
                }
            }
            let after = synced.entry(m.conv.clone()).or_insert(m.h0);
            if let Some(na) = f.next_after {
                *after = (*after).max(na);
            }
            if f.has_more == Some(true) || dirty {
                dirty = false;
                syncing = sync(&mut ws, &m, *after, &mut next_id).await;
            }
            continue;
        }
        if f.conv_id.as_deref() != Some(m.conv.as_str()) {
            continue;
        }
        match f.push.as_deref() {
            Some("event" | "events") => {
                for e in events {
                    if let Some(n) = e.body.and_then(|b| b.n) {
                        m.arrived(n, now);
                    }
                }
            }
            Some("head") if m.pull => {
                let Some(head) = f.head else { continue };
                let seen = head_seen.entry(m.conv.clone()).or_insert(m.h0);
                for s in (*seen + 1)..=head {
                    let n = (s - m.h0 - 1) as usize;
                    if let (Some(g), Some(l)) = (m.head_got.get(n), m.head_last_us.get(n)) {
                        g.fetch_add(1, Ordering::Relaxed);
                        l.fetch_max(now, Ordering::Relaxed);
                    }
                }
                *seen = (*seen).max(head);
                if syncing {
                    dirty = true;
                } else {
                    let after = *synced.entry(m.conv.clone()).or_insert(m.h0);
                    syncing = sync(&mut ws, &m, after, &mut next_id).await;
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
    ws.send(Message::Text(frame.to_string())).await.is_ok()
}
