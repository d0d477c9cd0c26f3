//! `imcore-load failover`: the `imcore` binary on a pg_auto_failover
//! formation (monitor, primary, synchronous standby, from Debian's packages)
//! under load over WebSocket — a hot group and 1,000 direct conversations,
//! one send in flight per connection, every failed send retried with its key.
//! In one run: the throughput on a single PostgreSQL, then on the formation;
//! a planned switchover; the primary SIGKILLed. Every ack is checked on the
//! last primary (lost, duplicated); `evidence/bench/failover.json`.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use imcore::pg_formation::{self, Formation, Timers};
use serde_json::json;

use super::provision::{self, BoxError};
use super::server::{self, Pg, Server};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Direct conversations, each with one sender connection.
    #[arg(long, default_value_t = 1000)]
    conversations: usize,
    /// Sender connections of the hot group.
    #[arg(long, default_value_t = 32)]
    hot_senders: usize,
    /// Length of each throughput window, seconds.
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// The monitor's short test timers instead of pg_auto_failover's defaults.
    #[arg(long)]
    fast_timers: bool,
    #[arg(long, default_value = "./var/failover-bench")]
    data_dir: PathBuf,
    /// The server binary. Default: `imcore` next to this binary, else target/release/imcore.
    #[arg(long)]
    server_bin: Option<PathBuf>,
    #[arg(long, default_value = "evidence/bench")]
    out_dir: PathBuf,
}

/// One acked send, or one error answer, at µs since the run's start.
struct Ack {
    conv: String,
    user: String,
    key: String,
    seq: i64,
    at: u64,
}

#[derive(Default)]
struct Log {
    acks: Vec<Ack>,
    errors: Vec<(u64, String)>,
}

struct Load {
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

pub fn main(args: Args) -> std::process::ExitCode {
    imcore::telemetry::init("warn");
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("imcore-load failover: runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(args)) {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("imcore-load failover: the run did not verify (see the evidence file)");
            std::process::ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("imcore-load failover: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<bool, BoxError> {
    if let Some(reason) = pg_formation::missing() {
        return Err(reason.into());
    }
    server::raise_nofile(1 << 16);
    let bin = server::server_binary(args.server_bin.as_deref())?;
    let started = Instant::now();
    let us = move || started.elapsed().as_micros() as u64;
    std::fs::create_dir_all(&args.data_dir)?;

    // The price of the standby: the same load on a single PostgreSQL first.
    let pg = Pg::start(None, &args.data_dir.join("single")).await?;
    let url = pg.create_db("failover_single").await?;
    let mut single = Server::start(&bin, "actor", &url, &args.data_dir.join("single.log"), &[]).await?;
    let log = Arc::new(Mutex::new(Log::default()));
    let load = start_load(&single, &args, log.clone(), us).await?;
    let single_rate = window_rate(&log, args.seconds, us).await;
    load.stop().await;
    single.stop();
    pg.stop();

    let timers = if args.fast_timers { Timers::fast() } else { Timers::default() };
    let mut formation = Formation::start(&args.data_dir.join("formation"), timers).await?;
    let env = [("IMCORE_DB_CONNECT_TIMEOUT_MS".to_owned(), "1000".to_owned())];
    let mut ha = Server::start(&bin, "actor", &formation.url(), &args.data_dir.join("formation.log"), &env).await?;
    let log = Arc::new(Mutex::new(Log::default()));
    let load = start_load(&ha, &args, log.clone(), us).await?;
    let sync_rate = window_rate(&log, args.seconds, us).await;

    let switch_from = us();
    let f = &formation;
    let switched = tokio::task::block_in_place(|| f.switchover());
    let switch_to = us();
    tokio::time::sleep(Duration::from_secs(5)).await;

    let primary = formation.primary().await.ok_or("no primary after the switchover")?;
    let killed = us();
    formation.kill(primary);
    let resumed = wait_resumed(&log, killed, us).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    load.stop().await;
    let new_primary = formation.primary().await;
    ha.stop();

    let log = std::mem::take(&mut *log.lock().map_err(|_| "log poisoned")?);
    let (lost, duplicated, stored) = verify(&formation.url(), &log.acks).await?;
    drop(formation);

    let switch_gap = longest_gap(&log.acks, switch_from, switch_to + 5_000_000);
    let kill_gap = longest_gap(&log.acks, killed.saturating_sub(1_000_000), resumed.unwrap_or(killed) + 1_000_000);
    let pass = lost == 0 && duplicated == 0 && resumed.is_some() && switched.is_ok();
    let doc = json!({
        "scenario": "failover",
        "command": "imcore-load failover",
        "machine": {"cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0)},
        "load": {"direct_conversations": args.conversations, "hot_group_senders": args.hot_senders,
                 "in_flight_per_connection": 1, "window_s": args.seconds},
        "timers": if args.fast_timers { "fast (Timers::fast)" } else { "pg_auto_failover defaults" },
        "acked": log.acks.len(),
        "stored_sends_checked": stored,
        "lost": lost,
        "duplicated": duplicated,
        "sends_per_s": {"single_postgresql": round1(single_rate), "primary_with_sync_standby": round1(sync_rate),
                        "sync_standby_cost_pct": round1(100.0 * (1.0 - sync_rate / single_rate.max(1e-9)))},
        "switchover": {"ok": switched.is_ok(), "error": switched.as_ref().err().map(ToString::to_string),
                       "took_s": secs(switch_to - switch_from), "longest_write_gap_s": secs(switch_gap),
                       "errors_by_code": errors_between(&log.errors, switch_from, switch_to + 5_000_000)},
        "kill": {"seconds_without_writes": secs(kill_gap), "writes_resumed_after_s": resumed.map(|r| secs(r - killed)),
                 "primary_after": new_primary,
                 "errors_by_code": errors_between(&log.errors, killed, resumed.unwrap_or(killed) + 5_000_000)},
        "verdict": if pass { "PASS" } else { "FAIL" },
    });
    std::fs::create_dir_all(&args.out_dir)?;
    std::fs::write(args.out_dir.join("failover.json"), serde_json::to_string_pretty(&doc)? + "\n")?;
    println!("{doc:#}");
    Ok(pass)
}

/// Users `f0…`, one direct conversation each with the next, and a hot group
/// (pull: its members get no pushes to drain); one sender task per connection.
async fn start_load(
    server: &Server,
    args: &Args,
    log: Arc<Mutex<Log>>,
    us: impl Fn() -> u64 + Copy + Send + Sync + 'static,
) -> Result<Load, BoxError> {
    let n = args.conversations.max(2);
    let users: Vec<String> = (0..n).map(|i| format!("f{i}")).collect();
    provision::create_users(server.port, &server.admin, users.clone()).await?;
    let mut devices: Vec<(String, String)> = users.iter().map(|u| (u.clone(), "d1".into())).collect();
    devices.extend(users.iter().take(args.hot_senders).map(|u| (u.clone(), "hot".into())));
    let tokens = provision::issue_tokens(server.port, &server.admin, devices).await?;
    let pairs: Vec<(String, String)> = (0..n).map(|i| (tokens[i].clone(), users[(i + 1) % n].clone())).collect();
    let convs = provision::parallel(server.port, pairs, 32, |mut http, p| async move {
        let body = json!({"kind": "direct", "members": [p.1]});
        let r = match http.call("POST", "/v1/conversations", Some(&p.0), Some(&body)).await {
            Ok((200 | 201, v)) => v["conv_id"].as_str().map(str::to_owned).ok_or_else(|| "no conv_id".into()),
            Ok((s, v)) => Err(format!("create direct: {s} {v}").into()),
            Err(e) => Err(e.into()),
        };
        (http, r)
    })
    .await?;
    let hot_members: Vec<&String> = users.iter().take(args.hot_senders).skip(1).collect();
    let group = json!({"kind": "group", "name": "hot", "members": hot_members, "delivery_mode": "pull"});
    let hot = provision::create_group(server.port, &tokens[0], group).await?;
    let hot = hot["conv_id"].as_str().ok_or("no conv_id")?.to_owned();

    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = vec![];
    let senders = (0..n).map(|i| (i, "d", tokens[i].clone(), convs[i].clone()));
    let hot_senders = (0..args.hot_senders.min(n)).map(|i| (i, "h", tokens[n + i].clone(), hot.clone()));
    for (i, kind, token, conv) in senders.chain(hot_senders) {
        let (user, port, stop, log) = (users[i].clone(), server.port, stop.clone(), log.clone());
        let src = provision::source_addr(tasks.len(), 16);
        tasks.push(tokio::spawn(async move {
            let Ok(mut ws) = provision::connect_retry(port, src, &token).await else { return };
            let mut k = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let key = format!("{kind}-{user}-{k}");
                let fields = json!({"conv_id": conv, "client_msg_id": key, "body": {"type": "text", "text": key}});
                // The same key until acked (P2): a retry answers `dup` or appends once.
                while !stop.load(Ordering::Relaxed) {
                    let answer =
                        tokio::time::timeout(Duration::from_secs(30), ws.request("send", fields.clone())).await;
                    let code = match answer {
                        Ok(Ok(v)) if v["ok"] == true => {
                            let seq = v["seq"].as_i64().unwrap_or(0);
                            let ack = Ack { conv: conv.clone(), user: user.clone(), key: key.clone(), seq, at: us() };
                            log.lock().map(|mut l| l.acks.push(ack)).ok();
                            break;
                        }
                        Ok(Ok(v)) => v["error"]["code"].as_str().unwrap_or("?").to_owned(),
                        Ok(Err(_)) => match provision::connect_retry(port, src, &token).await {
                            Ok(again) => {
                                ws = again;
                                "CONNECTION_LOST".into()
                            }
                            Err(_) => return,
                        },
                        Err(_) => "NO_ANSWER_30S".into(),
                    };
                    log.lock().map(|mut l| l.errors.push((us(), code))).ok();
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                k += 1;
            }
            ws.close().await;
        }));
    }
    Ok(Load { stop, tasks })
}

impl Load {
    async fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            let _ = t.await;
        }
    }
}

/// Acks per second over the next `seconds`.
async fn window_rate(log: &Mutex<Log>, seconds: f64, us: impl Fn() -> u64) -> f64 {
    tokio::time::sleep(Duration::from_secs(2)).await; // connections up, actors warm
    let from = us();
    tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
    let to = us();
    let n = log.lock().map(|l| l.acks.iter().filter(|a| (from..to).contains(&a.at)).count()).unwrap_or(0);
    n as f64 / seconds
}

/// The first ack after `since`, within 5 minutes.
async fn wait_resumed(log: &Mutex<Log>, since: u64, us: impl Fn() -> u64) -> Option<u64> {
    // Acks of requests answered before the kill may still be filed just after it.
    tokio::time::sleep(Duration::from_millis(500)).await;
    while us() < since + 300_000_000 {
        let after = log.lock().ok()?.acks.iter().filter(|a| a.at > since + 500_000).map(|a| a.at).min();
        if after.is_some() {
            return after;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

/// The longest time between two consecutive acks in `from..to` (µs).
fn longest_gap(acks: &[Ack], from: u64, to: u64) -> u64 {
    let mut at: Vec<u64> = acks.iter().map(|a| a.at).filter(|t| (from..to).contains(t)).collect();
    at.sort_unstable();
    at.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(to - from)
}

fn errors_between(errors: &[(u64, String)], from: u64, to: u64) -> BTreeMap<String, u32> {
    let mut by_code = BTreeMap::new();
    for (_, code) in errors.iter().filter(|(t, _)| (from..to).contains(t)) {
        *by_code.entry(code.clone()).or_default() += 1;
    }
    by_code
}

/// (lost, duplicated, sends stored) — every ack looked up on the primary `url` reaches.
async fn verify(url: &str, acks: &[Ack]) -> Result<(usize, usize, usize), BoxError> {
    let store = imcore::store::Store::connect(url, 1).await?;
    let client = store.pool().get().await?;
    let rows =
        client.query("SELECT conv_id, sender_user, client_msg_id, seq FROM events WHERE kind = 'msg'", &[]).await?;
    let mut stored: HashMap<(String, String, String), Vec<i64>> = HashMap::new();
    for r in &rows {
        stored.entry((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?)).or_default().push(r.try_get(3)?);
    }
    let lost = acks
        .iter()
        .filter(|a| {
            stored.get(&(a.conv.clone(), a.user.clone(), a.key.clone())).map_or(true, |seqs| !seqs.contains(&a.seq))
        })
        .count();
    let duplicated = stored.values().filter(|seqs| seqs.len() > 1).count();
    Ok((lost, duplicated, stored.len()))
}

fn secs(us: u64) -> f64 {
    (us as f64 / 100_000.0).round() / 10.0
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}
