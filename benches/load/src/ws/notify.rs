//! `notify`: offline notifications (PROTOCOL v1.3) under a hot group. One
//! group of `--notify-members` offline members (one device and pusher each,
//! the pushers on a gateway of this process's own that answers after
//! `--notify-gateway-ms`) and `--notify-senders` sender connections in a
//! closed loop for `--seconds`; the same run without pushers, with pushers
//! (default coalescing), and with coalescing off (what the notifier sustains).
//! Notifications/s is what the gateway received over the span from its first
//! to its last request. Each run on its own server and database; log verified.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use imcore_client::Http;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;

use super::log_check::verify;
use super::provision::{self, BoxError};
use super::Ctx;

#[derive(Debug, Clone, clap::Args)]
pub struct NotifyArgs {
    /// Notify: offline members with a pusher each.
    #[arg(long, default_value_t = 1000)]
    pub notify_members: usize,
    /// Notify: sender connections (closed loop, one send in flight each).
    #[arg(long, default_value_t = 32)]
    pub notify_senders: usize,
    /// Notify: the test gateway's answer delay, ms.
    #[arg(long, default_value_t = 5)]
    pub notify_gateway_ms: u64,
    /// Notify: longest wait after the last ack for the gateway to go quiet, seconds.
    #[arg(long, default_value_t = 60.0)]
    pub notify_drain_s: f64,
}

/// Sender users (the senders' devices are theirs, round robin).
const SENDER_USERS: usize = 8;

pub async fn run(ctx: &Ctx) -> Result<Vec<String>, BoxError> {
    let a = &ctx.args.notify;
    let gw = Gateway::start(Duration::from_millis(a.notify_gateway_ms)).await?;
    let variants: [(&str, bool, &str); 3] =
        [("no-pushers", false, "5000"), ("pushers", true, "5000"), ("pushers-no-coalescing", true, "0")];
    let mut runs = vec![];
    for (name, pushers, coalesce_ms) in variants {
        // `all` for a group this size (the default level above 200 members is `mentions`).
        let env = [
            ("IMCORE_NOTIFY_ALL_MAX_MEMBERS".to_owned(), "100000".to_owned()),
            ("IMCORE_NOTIFY_COALESCE_MS".to_owned(), coalesce_ms.to_owned()),
        ];
        let db_label = format!("notify_{}", name.replace('-', "_"));
        let (nodes, db, db_name) = super::start_nodes(ctx, &db_label, "actor", 1, &env).await?;
        let result = one(ctx, nodes.first(), &db, &gw, name, pushers, coalesce_ms).await;
        super::stop_nodes(ctx, nodes, db, &db_name).await;
        runs.push(result.unwrap_or_else(|e| json!({"scenario": name, "verified": false, "error": e.to_string()})));
    }
    let extra = json!({
        "run_id": format!("notify-{}", chrono::Utc::now().format("%Y%m%dT%H%M%SZ")),
        "method": METHOD,
        "parameters": {"offline_members": a.notify_members, "senders": a.notify_senders,
                       "gateway_answer_ms": a.notify_gateway_ms, "seconds": ctx.args.seconds},
    });
    super::write_evidence(ctx, "notify.json", runs, extra)
}

const METHOD: &str = "One server (actor path) per run on a fresh database. Users over the admin API; the group is \
created by sender user ns0 with every member (push delivery), IMCORE_NOTIFY_ALL_MAX_MEMBERS raised so every member \
is at level all. Offline members have a device token and, in the pusher runs, one pusher each (HTTP, through \
POST /v1/pushers) on the load generator's gateway: a keep-alive HTTP/1.1 server on 127.0.0.1 that answers \
{\"rejected\":[]} after the configured delay. Senders: closed loop, one send in flight per connection, for \
--seconds. acked_per_s: acks over the sending time. Notifications: requests the gateway received from the first \
send until it was quiet for 2 s after the last ack (or the drain limit); notifications_per_s over the span from the \
gateway's first to its last request. The server's notifications_total counters are read from /metrics at the end.";

#[allow(clippy::too_many_arguments)]
async fn one(
    ctx: &Ctx,
    server: &super::server::Server,
    db: &imcore::store::Store,
    gw: &Gateway,
    name: &str,
    pushers: bool,
    coalesce_ms: &str,
) -> Result<Value, BoxError> {
    let a = &ctx.args.notify;
    let senders: Vec<String> = (0..SENDER_USERS).map(|i| format!("ns{i}")).collect();
    let offline: Vec<String> = (0..a.notify_members).map(|i| format!("no{i:05}")).collect();
    provision::create_users(server.port, &server.admin, senders.iter().chain(&offline).cloned().collect()).await?;
    let sender_tokens = provision::issue_tokens(
        server.port,
        &server.admin,
        (0..a.notify_senders).map(|i| (senders[i % SENDER_USERS].clone(), format!("d{i}"))).collect(),
    )
    .await?;
    let offline_tokens = provision::issue_tokens(
        server.port,
        &server.admin,
        offline.iter().map(|u| (u.clone(), "phone".to_owned())).collect(),
    )
    .await?;
    if pushers {
        let url = gw.url.clone();
        let items: Vec<(String, String)> = offline.iter().cloned().zip(offline_tokens).collect();
        provision::parallel(server.port, items, 16, move |mut http: Http, item| {
            let body = json!({"app_id": "bench", "pushkey": format!("pk-{}", item.0), "url": url});
            async move {
                let r = match http.call("POST", "/v1/pushers", Some(&item.1), Some(&body)).await {
                    Ok((200, _)) => Ok(()),
                    Ok((s, v)) => Err(format!("set_pusher: {s} {v}").into()),
                    Err(e) => Err(e.into()),
                };
                (http, r)
            }
        })
        .await?;
    }
    let conv = "hot".to_owned();
    let members: Vec<&String> = senders.iter().skip(1).chain(&offline).collect();
    let (first, rest) = members.split_at(members.len().min(999));
    let body = json!({"kind": "group", "conv_id": conv, "name": "hot", "members": first,
                      "max_member": members.len() + 1, "delivery_mode": "push"});
    provision::create_group(server.port, &sender_tokens[0], body).await?;
    let mut http = Http::new(server.port);
    for chunk in rest.chunks(500) {
        let (s, v) = http
            .call(
                "POST",
                &format!("/v1/conversations/{conv}/members"),
                Some(&sender_tokens[0]),
                Some(&json!({"user_ids": chunk})),
            )
            .await?;
        if s != 200 {
            return Err(format!("invite: {s} {v}").into());
        }
    }
    // The joins' notifications are not part of the measurement.
    gw.quiet(Duration::from_secs(2), Duration::from_secs_f64(a.notify_drain_s)).await;
    gw.reset();
    let acked = Arc::new(AtomicU64::new(0));
    let refused = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let until = started + Duration::from_secs_f64(ctx.args.seconds);
    let mut tasks = vec![];
    for (i, token) in sender_tokens.iter().enumerate() {
        let mut ws =
            provision::connect_retry(server.port, provision::source_addr(i, ctx.args.source_addrs), token).await?;
        let (acked, refused, conv) = (acked.clone(), refused.clone(), conv.clone());
        tasks.push(tokio::spawn(async move {
            let mut k = 0u64;
            while Instant::now() < until {
                k += 1;
                let f =
                    json!({"conv_id": conv, "client_msg_id": format!("m{i}-{k}"), "body": {"text": "notify bench"}});
                match ws.request("send", f).await {
                    Ok(r) if r["ok"] == true => acked.fetch_add(1, Ordering::Relaxed),
                    _ => refused.fetch_add(1, Ordering::Relaxed),
                };
            }
            ws.close().await;
        }));
    }
    for t in tasks {
        t.await?;
    }
    let send_s = started.elapsed().as_secs_f64();
    let drained = gw.quiet(Duration::from_secs(2), Duration::from_secs_f64(a.notify_drain_s)).await;
    let (received, span_s) = gw.count();
    // The log: gapless, no key twice, one row per ack (the head also counts the members' joins).
    let (_, detail) = verify(db, &conv, &[]).await?;
    let log_ok = detail["gapless"] == true
        && detail["duplicate_keys"] == 0
        && detail["stored_msgs"] == acked.load(Ordering::Relaxed);
    let metrics = notify_metrics(&mut http).await?;
    let acked = acked.load(Ordering::Relaxed);
    let run = json!({
        "scenario": name, "pushers": pushers, "coalesce_ms": coalesce_ms,
        "acked": acked, "refused": refused.load(Ordering::Relaxed), "send_s": round2(send_s),
        "acked_per_s": (acked as f64 / send_s).round(),
        "notifications_received": received, "gateway_span_s": round2(span_s),
        "notifications_per_s": if span_s > 0.0 { (received as f64 / span_s).round() } else { 0.0 },
        "drained": drained, "server_notifications": metrics,
        "verified": log_ok && refused.load(Ordering::Relaxed) == 0, "log": detail,
    });
    eprintln!("notify {name}: {run}");
    Ok(run)
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// The server's `imcore_notifications_total` by outcome, and the queue gauge.
async fn notify_metrics(http: &mut Http) -> Result<Value, BoxError> {
    let (_, text) = http.call("GET", "/metrics", None, None).await?;
    let mut out = serde_json::Map::new();
    for line in text
        .as_str()
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("imcore_notifications_total") || l.starts_with("imcore_notify_queue"))
    {
        if let Some((series, v)) = line.rsplit_once(' ') {
            out.insert(series.to_owned(), json!(v.parse::<f64>().unwrap_or(0.0)));
        }
    }
    Ok(Value::Object(out))
}

/// The gateway: counts requests, answers `{"rejected":[]}` after `delay`.
struct Gateway {
    url: String,
    /// Requests, and the first and last one's time since `epoch`.
    seen: Arc<Mutex<(u64, Option<Duration>, Duration)>>,
}

impl Gateway {
    async fn start(delay: Duration) -> Result<Self, BoxError> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://127.0.0.1:{}/_matrix/push/v1/notify", listener.local_addr()?.port());
        let seen = Arc::new(Mutex::new((0, None, Duration::ZERO)));
        let epoch = Instant::now();
        let counted = seen.clone();
        tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                tokio::spawn(serve(conn, delay, counted.clone(), epoch));
            }
        });
        Ok(Self { url, seen })
    }

    fn reset(&self) {
        *self.seen.lock().unwrap_or_else(|e| e.into_inner()) = (0, None, Duration::ZERO);
    }

    /// Requests since the reset, and the span from the first to the last.
    fn count(&self) -> (u64, f64) {
        let s = *self.seen.lock().unwrap_or_else(|e| e.into_inner());
        (s.0, s.1.map_or(0.0, |first| (s.2 - first).as_secs_f64()))
    }

    /// Waits until no request came for `gap` (true), or `limit` passed.
    async fn quiet(&self, gap: Duration, limit: Duration) -> bool {
        let until = Instant::now() + limit;
        let mut last = (u64::MAX, Instant::now());
        while Instant::now() < until {
            let n = self.seen.lock().unwrap_or_else(|e| e.into_inner()).0;
            if n != last.0 {
                last = (n, Instant::now());
            } else if last.1.elapsed() >= gap {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        false
    }
}

/// One keep-alive connection: reads each request (headers, Content-Length body), answers after `delay`.
async fn serve(
    conn: tokio::net::TcpStream,
    delay: Duration,
    seen: Arc<Mutex<(u64, Option<Duration>, Duration)>>,
    epoch: Instant,
) {
    let (read, mut write) = conn.into_split();
    let mut read = BufReader::new(read);
    loop {
        let mut length = 0usize;
        let mut line = String::new();
        loop {
            line.clear();
            match read.read_line(&mut line).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            if line == "\r\n" {
                break;
            }
            if let Some((k, v)) = line.split_once(':') {
                if k.eq_ignore_ascii_case("content-length") {
                    length = v.trim().parse().unwrap_or(0);
                }
            }
        }
        let mut body = vec![0u8; length];
        if read.read_exact(&mut body).await.is_err() {
            return;
        }
        {
            let mut s = seen.lock().unwrap_or_else(|e| e.into_inner());
            let at = epoch.elapsed();
            s.0 += 1;
            s.1.get_or_insert(at);
            s.2 = at;
        }
        tokio::time::sleep(delay).await;
        let answer =
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15\r\n\r\n{\"rejected\":[]}";
        if write.write_all(answer).await.is_err() {
            return;
        }
    }
}
