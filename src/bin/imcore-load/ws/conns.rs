//! Issue 5 §3: connection scale. `N` idle authenticated connections (devices
//! share users: device i belongs to user i mod U), opened in stages; per
//! stage the connect rate, the server's RSS per connection, and that one
//! message to a group of every user still reaches every online device.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::{stream, SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::task::JoinSet;
use tokio_tungstenite::tungstenite::Message;

use super::client::{self, now_us, BoxError, Ws};
use super::server::{CpuWindow, Pg, Server};

pub struct Params {
    pub stages: Vec<usize>,
    pub devices_per_user: usize,
    pub source_addrs: usize,
    pub concurrency: usize,
}

#[derive(Default)]
struct Arrivals {
    count: AtomicU64,
    last_us: AtomicU64,
}

pub async fn run(server: &Server, pg: &Pg, p: &Params) -> Result<Vec<Value>, BoxError> {
    // The server and this process each hold one descriptor per connection:
    // stages past the open-file limit (which children inherit) are clamped.
    let nofile = super::server::raise_nofile(1 << 20);
    let cap = (nofile as usize).saturating_sub(400);
    let stages: Vec<usize> = p.stages.iter().map(|&n| n.min(cap)).collect();
    let max_n = stages.iter().copied().max().unwrap_or(0);
    let users_n = max_n.div_ceil(p.devices_per_user.max(1)).clamp(1, 1000);
    let users: Vec<String> = (0..users_n).map(|i| format!("cu{i}")).collect();
    let t = Instant::now();
    client::create_users(server.port, &server.admin, users.clone()).await?;
    let mut devices: Vec<(String, String)> =
        (0..max_n).map(|i| (users[i % users_n].clone(), format!("d{}", i / users_n))).collect();
    devices.push((users[0].clone(), "sender".to_owned()));
    let mut tokens = client::issue_tokens(server.port, &server.admin, devices).await?;
    let setup_s = t.elapsed().as_secs_f64();
    let sender_token = tokens.pop().ok_or("no sender token")?;
    eprintln!("connections: {users_n} users, {max_n} device tokens issued in {setup_s:.1} s");
    let conv = "conns-all";
    client::create_group(
        server.port,
        &tokens[0],
        json!({"kind": "group", "conv_id": conv, "name": conv, "members": users[1..], "max_member": users_n + 1}),
    )
    .await?;
    let mut sender = client::connect_retry(server.port, client::source_addr(0, 1), &sender_token).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let base_kib = server.rss_kib();

    let arrivals = Arc::new(Arrivals::default());
    let mut tasks = JoinSet::new();
    let mut online = 0usize;
    let mut runs = vec![];
    let mut seq_msg = 0u64;
    for (&n, &requested) in stages.iter().zip(&p.stages) {
        if n <= online {
            continue;
        }
        let cpu = CpuWindow::start(server, pg);
        let t = Instant::now();
        let (port, addrs) = (server.port, p.source_addrs);
        let mut opened = stream::iter(tokens[online..n].iter().enumerate().map(|(i, t)| (online + i, t)))
            .map(|(i, t)| client::connect_retry(port, client::source_addr(i, addrs), t))
            .buffer_unordered(p.concurrency);
        let mut failed = 0usize;
        let mut first_error = None;
        while let Some(r) = opened.next().await {
            match r {
                Ok(ws) => {
                    tasks.spawn(idle(ws, arrivals.clone()));
                }
                Err(e) => {
                    failed += 1;
                    first_error.get_or_insert_with(|| e.to_string());
                }
            }
        }
        drop(opened);
        let connect_s = t.elapsed().as_secs_f64();
        let cpu = cpu.end(server, pg);
        let opened_now = (n - online) - failed;
        online = n - failed;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let rss_kib = server.rss_kib();

        // One message to the group: every online device (all users' devices) should get it.
        arrivals.count.store(0, Ordering::Relaxed);
        seq_msg += 1;
        let sent_us = now_us();
        let frame = json!({"id": seq_msg, "op": "send", "conv_id": conv, "client_msg_id": format!("m{seq_msg}"),
                           "body": {"type": "text", "text": "hello, everyone", "ts": sent_us}});
        sender.send(Message::Text(frame.to_string())).await?;
        let mut acked = false;
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline && arrivals.count.load(Ordering::Relaxed) < online as u64 {
            tokio::select! {
                f = sender.next() => if let Some(Ok(Message::Text(t))) = f {
                    acked |= t.contains("\"ok\":true");
                },
                () = tokio::time::sleep(Duration::from_millis(10)) => {}
            }
        }
        let got = arrivals.count.load(Ordering::Relaxed);
        let last_ms = arrivals.last_us.load(Ordering::Relaxed).saturating_sub(sent_us) as f64 / 1000.0;
        let per_conn_kib = rss_kib.saturating_sub(base_kib) as f64 / online.max(1) as f64;
        let run = json!({
            "scenario": "connections",
            "write_path": "actor",
            "connections": online,
            "requested": requested,
            "limited_by": (n < requested).then(|| format!("RLIMIT_NOFILE {nofile} (hard limit; raising it needs CAP_SYS_RESOURCE)")),
            "failed": failed,
            "first_error": first_error,
            "users": users_n,
            "source_addrs": p.source_addrs,
            "connect_concurrency": p.concurrency,
            "connect_s": (connect_s * 100.0).round() / 100.0,
            "connects_per_s": (opened_now as f64 / connect_s.max(1e-9)).round(),
            "connect_cpu": cpu,
            "server_rss_mb": (rss_kib as f64 / 1024.0).round(),
            "server_rss_base_mb": (base_kib as f64 / 1024.0).round(),
            "server_rss_per_connection_kib": (per_conn_kib * 10.0).round() / 10.0,
            "server_vmhwm_mb": (server.hwm_kib() as f64 / 1024.0).round(),
            "message_acked": acked,
            "message_arrivals": got,
            "message_last_device_ms": (last_ms * 10.0).round() / 10.0,
            "verified": acked && got == online as u64 && failed == 0,
        });
        eprintln!(
            "connections N={online:<7} ({failed} failed) {:.0} connects/s  server RSS {} MB, {:.1} KiB/conn  \
             message reached {got}/{online} in {last_ms:.0} ms",
            run["connects_per_s"].as_f64().unwrap_or(0.0),
            run["server_rss_mb"],
            per_conn_kib
        );
        runs.push(run);
    }
    let _ = sender.close(None).await;
    tasks.abort_all();
    while tasks.join_next().await.is_some() {}
    Ok(runs)
}

/// An idle connection: reads (answering the server's pings) and counts the
/// events that arrive.
async fn idle(mut ws: Ws, arrivals: Arc<Arrivals>) {
    while let Some(Ok(msg)) = ws.next().await {
        if let Message::Text(t) = msg {
            if t.starts_with("{\"push\":\"event") && t.contains("hello, everyone") {
                arrivals.count.fetch_add(1, Ordering::Relaxed);
                arrivals.last_us.fetch_max(now_us(), Ordering::Relaxed);
            }
        }
    }
}
