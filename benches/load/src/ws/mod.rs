//! `imcore-load ws`: end-to-end benchmarks over WebSocket against the
//! `imcore` binary, a child process per server run on a fresh database
//! (PostgreSQL embedded in `--data-dir`, or `--database-url`); users and
//! tokens from the admin API, load from 127.0.0.x source addresses only, every
//! run bounded in messages and time, each server stopped with SIGTERM.
//!
//! Scenarios (`--scenarios`): `hot`, `fanout` and `connections` by default;
//! `groups`, `groups-churn`, `latency`, `cluster`, `storm` and `notify` when named. With `--nodes N` a
//! server run is N nodes on one database joined by a `nats-server` of the
//! run's own (`nodes.rs`). What each measures, and its results:
//! benches/README.md. A run that did not verify makes the command fail
//! (`verdict`).

mod cluster;
mod conns;
pub mod failover;
mod fanout;
mod frame;
mod groups;
mod hot;
mod log_check;
mod nodes;
mod notify;
pub(crate) mod provision;
pub(crate) mod server;
mod storm;

use std::path::PathBuf;
use std::time::Instant;

use serde_json::{json, Value};

use imcore::pg_formation::{Formation, Timers};
use imcore::store::Store;
use nodes::Nodes;
use provision::BoxError;
use server::{Pg, Server};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Which scenarios to run (`groups` takes ~5 minutes; it, `latency`,
    /// `cluster` and `storm` run only when named).
    #[arg(long, value_delimiter = ',', default_value = "hot,fanout,connections")]
    scenarios: Vec<String>,
    /// A PostgreSQL server to create the benchmark databases in (any database
    /// of it; each server run gets its own). Unset: embedded in --data-dir.
    #[arg(long)]
    database_url: Option<String>,
    /// Form a pg_auto_failover formation (primary + synchronous standby, from
    /// Debian's packages) in --data-dir and run every server on its primary;
    /// torn down at the end.
    #[arg(long, conflicts_with = "database_url")]
    formation: bool,
    /// With --formation: every server reads `sync` pages on the standby too
    /// (`IMCORE_STANDBY_URL`).
    #[arg(long, requires = "formation")]
    standby_reads: bool,
    #[arg(long, default_value = "./var/ws-bench")]
    data_dir: PathBuf,
    /// The server binary. Default: `imcore` next to this binary, else target/release/imcore.
    #[arg(long)]
    server_bin: Option<PathBuf>,
    /// Extra server environment, `NAME=value` (repeatable), e.g. IMCORE_POOL_SIZE=32.
    #[arg(long = "server-env")]
    server_env: Vec<String>,
    /// `imcore` nodes per server run (hot, fanout, latency; the cluster
    /// scenario's multi-node runs). More than one: joined by a `nats-server`.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    nodes: u16,
    /// Cluster: sender connections of the hot-group runs.
    #[arg(long, value_delimiter = ',', default_value = "64,256")]
    cluster_senders: Vec<usize>,
    /// Cluster: members of the fan-out group (push mode).
    #[arg(long, default_value_t = 1000)]
    cluster_members: usize,
    /// Write paths of the hot-group scenario, each on its own server and database.
    #[arg(long, value_delimiter = ',', default_value = "actor,direct")]
    write_paths: Vec<String>,
    /// Hot group: sender connections per run.
    #[arg(long, value_delimiter = ',', default_value = "8,64,256,1024")]
    senders: Vec<usize>,
    /// Latency: sender connections of each run (one send in flight each).
    #[arg(long, value_delimiter = ',', default_value = "1,2,8")]
    latency_senders: Vec<usize>,
    /// Hot group: sends in flight per sender connection.
    #[arg(long, default_value_t = 4)]
    window: usize,
    /// Hot group: receiver devices online.
    #[arg(long, default_value_t = 64)]
    receivers: usize,
    /// Hot group: longest sending time of a run, seconds.
    #[arg(long, default_value_t = 8.0)]
    seconds: f64,
    /// Hot group: most messages of a run.
    #[arg(long, default_value_t = 200_000)]
    messages: u64,
    /// Hot group delivery mode (`push`; `pull` sends members only a coalesced head).
    #[arg(long, default_value = "push")]
    hot_delivery: String,
    /// Half-load run (§4) at half the best `actor` rate, with this many sender
    /// connections (unset: as many as the best run had; 0: skip).
    #[arg(long)]
    half_senders: Option<usize>,
    /// Fan-out: group sizes (every member online).
    #[arg(long, value_delimiter = ',', default_value = "1000,10000")]
    fanout_members: Vec<usize>,
    /// Fan-out: delivery modes.
    #[arg(long, value_delimiter = ',', default_value = "push,pull")]
    fanout_modes: Vec<String>,
    /// Fan-out: messages per second of the one sender.
    #[arg(long, default_value_t = 10.0)]
    fanout_rate: f64,
    /// Fan-out: messages per run.
    #[arg(long, default_value_t = 50)]
    fanout_messages: usize,
    /// Connection scale: cumulative stages of idle connections.
    #[arg(long, value_delimiter = ',', default_value = "10000,50000,100000")]
    connections: Vec<usize>,
    /// Connection scale: devices per user.
    #[arg(long, default_value_t = 100)]
    devices_per_user: usize,
    /// Connection scale: WebSocket handshakes in flight.
    #[arg(long, default_value_t = 256)]
    connect_concurrency: usize,
    /// Source addresses 127.0.0.1..=127.0.0.n (each has its own ephemeral ports).
    #[arg(long, default_value_t = 16)]
    source_addrs: usize,
    #[command(flatten)]
    groups: groups::GroupArgs,
    #[command(flatten)]
    churn: groups::churn::ChurnArgs,
    #[command(flatten)]
    notify: notify::NotifyArgs,
    /// Reconnect storm: devices online on the node that is killed.
    #[arg(long, default_value_t = 20_000)]
    storm_devices: usize,
    /// Reconnect storm: groups every device's user is in.
    #[arg(long, default_value_t = 20)]
    storm_groups: usize,
    /// Where the evidence files go.
    #[arg(long, default_value = "evidence/bench")]
    out_dir: PathBuf,
}

impl Args {
    /// A closed-loop hot-group run of `senders` with this command line's
    /// window, receivers and bounds.
    fn hot_params<'a>(
        &'a self,
        scenario: &'static str,
        path: &'a str,
        senders: usize,
        delivery_mode: &'a str,
    ) -> hot::Params<'a> {
        hot::Params {
            scenario,
            write_path: path,
            senders,
            window: self.window,
            receivers: self.receivers,
            seconds: self.seconds,
            messages: self.messages,
            rate: None,
            source_addrs: self.source_addrs,
            delivery_mode,
        }
    }
}

pub fn main(args: Args) -> std::process::ExitCode {
    crate::verdict::run_on_runtime("imcore-load ws", run(args))
}

struct Ctx {
    args: Args,
    bin: PathBuf,
    pg: Pg,
    /// With `--formation`: the formation, and with `--standby-reads` its
    /// standby's URL (any database).
    formation: Option<(Formation, Option<String>)>,
    env: Vec<(String, String)>,
    /// The `nats-server` binary, found once when runs have several nodes.
    nats: Option<PathBuf>,
    /// The open-file limit, raised as far as this process may.
    nofile: u64,
    machine: Value,
    started: Instant,
}

impl Ctx {
    /// `IMCORE_STANDBY_URL` for a server on database `db`, with `--standby-reads`.
    fn standby_env(&self, db: &str) -> Option<(String, String)> {
        let url = self.formation.as_ref()?.1.as_ref()?;
        Some(("IMCORE_STANDBY_URL".to_owned(), server::with_database(url, db)))
    }
}

/// The names of the runs that did not verify.
async fn run(args: Args) -> Result<Vec<String>, BoxError> {
    let nofile = server::raise_nofile(1 << 20);
    let bin = server::server_binary(args.server_bin.as_deref())?;
    let named = |s: &str| args.scenarios.iter().any(|x| x == s);
    if args.nodes > 1 && (named("connections") || named("groups")) {
        return Err("--nodes above 1 is for the hot, fanout, latency and cluster scenarios".into());
    }
    if (named("cluster") || named("storm")) && args.nodes < 2 {
        return Err("the cluster and storm scenarios need --nodes N of 2 or more".into());
    }
    let nats = if args.nodes > 1 { Some(nodes::nats_binary()?) } else { None };
    std::fs::create_dir_all(&args.data_dir)?;
    let (pg, formation) = match args.formation {
        true => {
            let formation = Formation::start(&args.data_dir.join("formation"), Timers::default()).await?;
            let primary = formation.primary().await.ok_or("the formation has no primary")?;
            let mut pg = Pg::start(Some(&formation.node_url(primary)), &args.data_dir).await?;
            pg.postmaster = formation.postmaster(primary);
            let standby = args.standby_reads.then(|| formation.node_url(1 - primary));
            eprintln!("imcore-load ws: pg_auto_failover primary {primary}, standby reads {}", args.standby_reads);
            (pg, Some((formation, standby)))
        }
        false => (Pg::start(args.database_url.as_deref(), &args.data_dir).await?, None),
    };
    let env = args
        .server_env
        .iter()
        .map(|kv| kv.split_once('=').map(|(k, v)| (k.to_owned(), v.to_owned())).ok_or("--server-env is NAME=value"))
        .collect::<Result<Vec<_>, _>>()?;
    let machine = machine(&pg).await?;
    eprintln!("imcore-load ws: server {} | open files {nofile} | {machine}", bin.display());
    let ctx = Ctx { args, bin, pg, formation, env, nats, nofile, machine, started: Instant::now() };
    let result = scenarios(&ctx).await;
    eprintln!("imcore-load ws: done in {:.0} s", ctx.started.elapsed().as_secs_f64());
    ctx.pg.stop();
    result
}

async fn scenarios(ctx: &Ctx) -> Result<Vec<String>, BoxError> {
    let want = |s: &str| ctx.args.scenarios.iter().any(|x| x == s);
    let mut failed = vec![];
    if want("hot") {
        failed.extend(hot_group(ctx).await?);
    }
    if want("fanout") {
        failed.extend(fan_out(ctx).await?);
    }
    if want("connections") {
        failed.extend(connections(ctx).await?);
    }
    if want("groups") {
        failed.extend(groups::run(ctx).await?);
    }
    if want("groups-churn") {
        failed.extend(groups::churn::run(ctx).await?);
    }
    if want("latency") {
        failed.extend(latency(ctx).await?);
    }
    if want("cluster") {
        failed.extend(cluster::run(ctx).await?);
    }
    if want("storm") {
        failed.extend(storm::run(ctx).await?);
    }
    if want("notify") {
        failed.extend(notify::run(ctx).await?);
    }
    Ok(failed)
}

/// A fresh database and `n` nodes on it, with `env` beside `--server-env`.
async fn start_nodes(
    ctx: &Ctx,
    name: &str,
    write_path: &str,
    n: usize,
    env: &[(String, String)],
) -> Result<(Nodes, Store, String), BoxError> {
    let db_name = format!("imcore_bench_{name}");
    let url = ctx.pg.create_db(&db_name).await?;
    let env: Vec<(String, String)> = ctx.env.iter().chain(env).chain(&ctx.standby_env(&db_name)).cloned().collect();
    let nodes = Nodes::start(ctx, name, write_path, &url, n, &env).await?;
    let db = Store::connect(&url, 4).await?;
    for (i, s) in nodes.servers().iter().enumerate() {
        let node = if n > 1 { format!(" node {i}") } else { String::new() };
        eprintln!("server {name}{node}: pid {}, port {}, write path {write_path}", s.pid, s.port);
    }
    Ok((nodes, db, db_name))
}

/// SIGTERM to the nodes, then their database is dropped.
async fn stop_nodes(ctx: &Ctx, mut nodes: Nodes, db: Store, db_name: &str) {
    nodes.stop();
    drop_database(ctx, db, db_name).await;
}

/// A fresh database and one server on it (scenarios that run on one node only).
async fn start_server(ctx: &Ctx, name: &str, write_path: &str) -> Result<(Server, Store, String), BoxError> {
    let db_name = format!("imcore_bench_{name}");
    let url = ctx.pg.create_db(&db_name).await?;
    let log = ctx.args.data_dir.join(format!("server-{name}.log"));
    let env: Vec<(String, String)> = ctx.env.iter().chain(&ctx.standby_env(&db_name)).cloned().collect();
    let server = Server::start(&ctx.bin, write_path, &url, &log, &env).await?;
    let db = Store::connect(&url, 4).await?;
    eprintln!("server {name}: pid {}, port {}, write path {write_path}", server.pid, server.port);
    Ok((server, db, db_name))
}

/// SIGTERM to the server, then its database is dropped.
async fn stop_server(ctx: &Ctx, mut server: Server, db: Store, db_name: &str) {
    server.stop();
    drop_database(ctx, db, db_name).await;
}

/// Closes the run's own connections to its database, then drops it.
async fn drop_database(ctx: &Ctx, db: Store, db_name: &str) {
    drop(db);
    if let Err(e) = ctx.pg.drop_db(db_name).await {
        eprintln!("drop database {db_name}: {e}");
    }
}

async fn hot_group(ctx: &Ctx) -> Result<Vec<String>, BoxError> {
    let a = &ctx.args;
    let max_c = a.senders.iter().copied().max().unwrap_or(1).max(a.half_senders.unwrap_or(0));
    let mut runs: Vec<Value> = vec![];
    let mut profile = json!({});
    for path in &a.write_paths {
        let path = path.as_str();
        let (nodes, db, db_name) = start_nodes(ctx, &format!("hot_{path}"), path, a.nodes.into(), &[]).await?;
        let result = async {
            let (nodes, db) = (&nodes, &db);
            let setup = hot::setup(nodes.first(), max_c, a.receivers).await?;
            let mut runs = vec![];
            for &c in &a.senders {
                let p = a.hot_params("hot-group", path, c, &a.hot_delivery);
                runs.push(hot::run(nodes, &ctx.pg, db, &setup, &p).await?);
            }
            // The best run that verified: a rate bought by closing connections is no maximum.
            let best = runs
                .iter()
                .filter(|r| r["verified"] == true)
                .filter_map(|r| Some((r["acked_per_s"].as_f64()?, r["senders"].as_u64()? as usize)))
                .max_by(|x, y| x.0.total_cmp(&y.0));
            if let (true, Some((best, best_c))) = (path == "actor", best) {
                let senders = a.half_senders.unwrap_or(best_c);
                let p = hot::Params {
                    rate: Some((best / 2.0).max(1.0)),
                    ..a.hot_params("half-load", path, senders, &a.hot_delivery)
                };
                if senders > 0 {
                    runs.push(hot::run(nodes, &ctx.pg, db, &setup, &p).await?);
                }
            }
            // What one durable commit costs right now (the floor of a batch's latency).
            let commit_ms = ctx.pg.commit_probe(200).await?;
            Ok::<_, BoxError>((runs, commit_ms))
        }
        .await;
        stop_nodes(ctx, nodes, db, &db_name).await;
        let (mut r, commit_ms) = result?;
        runs.append(&mut r);
        profile[format!("commit_ms_after_{path}")] = json!((commit_ms * 1000.0).round() / 1000.0);
    }
    let ratios: Vec<Value> = a
        .senders
        .iter()
        .map(|&c| {
            let rate = |p: &str| {
                runs.iter()
                    .find(|r| r["scenario"] == "hot-group" && r["write_path"] == p && r["senders"] == c)
                    .and_then(|r| r["acked_per_s"].as_f64())
            };
            let ratio = match (rate("actor"), rate("direct")) {
                (Some(x), Some(d)) if d > 0.0 => json!((x / d * 10.0).round() / 10.0),
                _ => Value::Null,
            };
            json!({"senders": c, "actor_over_direct": ratio})
        })
        .collect();
    eprintln!("actor/direct: {}", Value::Array(ratios.clone()));
    let extra = json!({"ratios": ratios, "profile": profile, "delivery_rule": hot::DELIVERY_RULE});
    write_evidence(ctx, "ws-hot-group.json", runs, extra)
}

/// The latency floor: closed loop, one send in flight per sender, push mode,
/// no other receivers; each write path on its own server and database.
async fn latency(ctx: &Ctx) -> Result<Vec<String>, BoxError> {
    let a = &ctx.args;
    let max_c = a.latency_senders.iter().copied().max().unwrap_or(1);
    let mut runs: Vec<Value> = vec![];
    for path in &a.write_paths {
        let path = path.as_str();
        let (nodes, db, db_name) = start_nodes(ctx, &format!("latency_{path}"), path, a.nodes.into(), &[]).await?;
        let result = async {
            let setup = hot::setup(nodes.first(), max_c, 0).await?;
            let mut runs = vec![];
            for &c in &a.latency_senders {
                let p = hot::Params { window: 1, receivers: 0, ..a.hot_params("latency", path, c, "push") };
                runs.push(hot::run(&nodes, &ctx.pg, &db, &setup, &p).await?);
            }
            Ok::<_, BoxError>(runs)
        }
        .await;
        stop_nodes(ctx, nodes, db, &db_name).await;
        runs.append(&mut result?);
    }
    let commit_ms = ctx.pg.commit_probe(200).await?;
    write_evidence(
        ctx,
        "ws-latency.json",
        runs,
        json!({"profile": {"commit_ms": (commit_ms * 1000.0).round() / 1000.0}}),
    )
}

async fn fan_out(ctx: &Ctx) -> Result<Vec<String>, BoxError> {
    let a = &ctx.args;
    let max_m = a.fanout_members.iter().copied().max().unwrap_or(0);
    let (nodes, db, db_name) = start_nodes(ctx, "fanout", "actor", a.nodes.into(), &[]).await?;
    let result = async {
        let (nodes, db) = (&nodes, &db);
        let mut devs = fanout::setup(nodes.first(), max_m, a.source_addrs).await?;
        let mut runs = vec![];
        let mut members = a.fanout_members.clone();
        members.sort_unstable();
        let params: Vec<fanout::Params> = members
            .iter()
            .flat_map(|&m| a.fanout_modes.iter().map(move |mode| (m, mode)))
            .map(|(members, mode)| fanout::Params {
                members,
                mode,
                rate: a.fanout_rate,
                messages: a.fanout_messages,
                ack_ms: false,
            })
            .collect();
        for p in &params {
            fanout::create_group(nodes.first(), db, &devs, p).await?;
        }
        for p in &params {
            runs.push(fanout::run(nodes, &ctx.pg, db, &mut devs, p).await?);
        }
        devs.close();
        Ok::<_, BoxError>(runs)
    }
    .await;
    stop_nodes(ctx, nodes, db, &db_name).await;
    let runs = result?;
    write_evidence(ctx, "fanout.json", runs, json!({}))
}

async fn connections(ctx: &Ctx) -> Result<Vec<String>, BoxError> {
    let a = &ctx.args;
    let p = conns::Params {
        stages: a.connections.clone(),
        devices_per_user: a.devices_per_user,
        source_addrs: a.source_addrs,
        concurrency: a.connect_concurrency,
    };
    let (server, db, db_name) = start_server(ctx, "connections", "actor").await?;
    let result = conns::run(&server, &ctx.pg, &p).await;
    stop_server(ctx, server, db, &db_name).await;
    let runs = result?;
    write_evidence(ctx, "connections.json", runs, json!({}))
}

/// Writes the scenario's evidence; returns the runs that did not verify.
fn write_evidence(ctx: &Ctx, file: &str, runs: Vec<Value>, extra: Value) -> Result<Vec<String>, BoxError> {
    let failed = crate::verdict::unverified(&runs);
    let mut doc = json!({
        "machine": ctx.machine,
        "date": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        "git_rev": git_rev(),
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "durability": {"fsync": "on", "synchronous_commit": "on"},
        "runs": runs,
    });
    if ctx.args.nodes > 1 {
        doc["nodes"] = json!(ctx.args.nodes);
    }
    if let (Value::Object(d), Value::Object(e)) = (&mut doc, extra) {
        d.extend(e);
    }
    std::fs::create_dir_all(&ctx.args.out_dir)?;
    let path = ctx.args.out_dir.join(file);
    std::fs::write(&path, serde_json::to_string_pretty(&doc)? + "\n")?;
    eprintln!("wrote {}", path.display());
    Ok(failed)
}

pub(crate) async fn machine(pg: &Pg) -> Result<Value, BoxError> {
    let os = std::fs::read_to_string("/etc/os-release")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("PRETTY_NAME=").map(|v| v.trim_matches('"').to_owned())))
        .unwrap_or_else(|| std::env::consts::OS.to_owned());
    let mem_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("MemTotal:").and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            })
        })
        .map_or(0.0, |kib| (kib / 1024.0 / 1024.0 * 10.0).round() / 10.0);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim().to_owned();
    Ok(json!({
        "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "memory_gib": mem_gib,
        "os": os,
        "kernel": kernel,
        "postgres": pg.version().await?,
    }))
}

pub(crate) fn git_rev() -> String {
    let out = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    let rev = out(&["rev-parse", "--short", "HEAD"]).unwrap_or_else(|| "unknown".into());
    match out(&["status", "--porcelain"]) {
        Some(s) if !s.is_empty() => format!("{rev}-dirty"),
        _ => rev,
    }
}
