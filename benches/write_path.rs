//! Criterion benchmarks of the write path, in-process against a real
//! PostgreSQL (a private cluster started for the run, durability on):
//! sends to one group through the conversation actor (batched) and through the
//! `direct` path (one transaction per send), at a few sender counts.
//! Throughput is reported in sends per second; the estimates criterion wrote
//! for this run, and `actor` over `direct` at each sender count, go to
//! `evidence/bench/criterion.json`. The end-to-end load generator
//! (`imcore-load`) is where the targets are recorded.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use futures_util::future::join_all;
use imcore::config::{EngineSettings, WritePath, WriteSettings};
use imcore::domain::Body;
use imcore::pg::{EmbeddedPg, PgOptions, DATABASE};
use imcore::store::{CreateConversation, GroupSettings, SendOp, Store, WriteOp};
use imcore::writer::{Engine, Writer};
use imcore_actors::{ClientMsgId, ConvId, DeviceId, UserId};
use serde_json::json;

const MEMBERS: usize = 64;

struct Fixture {
    _pg: EmbeddedPg,
    store: Store,
    users: Vec<UserId>,
}

async fn fixture() -> Fixture {
    let root = std::env::temp_dir().join(format!("imcore-bench-{}", std::process::id()));
    let mut opts = PgOptions::new(&root);
    opts.fast_init = true;
    let pg = EmbeddedPg::start(opts).await.expect("start PostgreSQL");
    let store = Store::connect(&pg.url(DATABASE), 16).await.expect("connect");
    store.migrate().await.expect("migrate");
    let users: Vec<UserId> = (0..MEMBERS).map(|i| UserId::parse(&format!("b{i}")).expect("id")).collect();
    for u in &users {
        store.create_user(u, None).await.expect("user");
    }
    Fixture { _pg: pg, store, users }
}

/// Sends `total` messages to `conv` from `senders` closed-loop senders.
async fn send_all(writer: &Writer, conv: &ConvId, users: &[UserId], senders: usize, total: u64, run: u64) -> Duration {
    let next = Arc::new(AtomicU64::new(0));
    let body = Body::parse(&json!({"type": "text", "text": "x".repeat(80)}), 16 * 1024).expect("body");
    let started = Instant::now();
    join_all((0..senders).map(|s| {
        let (writer, next, body, conv) = (writer.clone(), next.clone(), body.clone(), conv.clone());
        let user = users[s % users.len()].clone();
        let device = DeviceId::parse(&format!("d{s}")).expect("id");
        async move {
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= total {
                    break;
                }
                let key = ClientMsgId::parse(&format!("r{run}-{n}")).expect("id");
                let op = WriteOp::Send(SendOp {
                    sender: user.clone(),
                    device: device.clone(),
                    client_msg_id: key,
                    body: body.clone(),
                    reply_to: None,
                    mentions: Vec::new(),
                });
                writer.write(conv.clone(), op).await.expect("send");
            }
        }
    }))
    .await;
    started.elapsed()
}

fn write_path(c: &mut Criterion) {
    let system = actix::System::new();
    let fx = system.block_on(fixture());
    let mut group = c.benchmark_group("send");
    group.sample_size(10).measurement_time(Duration::from_secs(4)).throughput(Throughput::Elements(1));
    let run = AtomicU64::new(0);
    for path in [WritePath::Actor, WritePath::Direct] {
        for senders in SENDERS {
            let name = match path {
                WritePath::Actor => "actor",
                WritePath::Direct => "direct",
            };
            let (writer, conv) = system.block_on(async {
                let write = WriteSettings { arbiters: 2, ..WriteSettings::on(path) };
                let writer =
                    Engine::start(fx.store.clone(), &EngineSettings { write, ..EngineSettings::default() }).writer;
                let conv = fx
                    .store
                    .create_conversation(&CreateConversation::Group {
                        creator: fx.users[0].clone(),
                        conv_id: Some(ConvId::parse(&format!("bench-{name}-{senders}")).expect("id")),
                        name: "bench".into(),
                        members: fx.users[1..].to_vec(),
                        settings: GroupSettings::default(),
                    })
                    .await
                    .expect("group")
                    .info
                    .conv_id;
                (writer, conv)
            });
            group.bench_with_input(BenchmarkId::new(name, senders), &senders, |b, &senders| {
                b.iter_custom(|iters| {
                    let r = run.fetch_add(1, Ordering::Relaxed);
                    system.block_on(send_all(&writer, &conv, &fx.users, senders, iters, r))
                })
            });
        }
    }
    group.finish();
    let durability = system.block_on(durability(&fx.store));
    record_evidence(durability);
}

const PATHS: [&str; 2] = ["actor", "direct"];
const SENDERS: [usize; 2] = [1, 64];

/// `fsync` and `synchronous_commit` as the run's PostgreSQL has them.
async fn durability(store: &Store) -> serde_json::Value {
    let conn = store.pool().get().await.expect("connection");
    let mut settings = serde_json::Map::new();
    for name in ["fsync", "synchronous_commit"] {
        let value: String = conn.query_one("SELECT current_setting($1)", &[&name]).await.expect("setting").get(0);
        settings.insert(name.to_owned(), value.into());
    }
    settings.into()
}

/// Writes `evidence/bench/criterion.json` from the estimates criterion saved
/// for this run (`target/criterion/send/<path>/<senders>/new/estimates.json`:
/// nanoseconds per send, one send being one iteration).
fn record_evidence(durability: serde_json::Value) {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let home = std::env::var("CRITERION_HOME").map(std::path::PathBuf::from).unwrap_or(root.join("target/criterion"));
    let read = |path: &str, senders: usize| -> Option<(f64, f64)> {
        let file = home.join(format!("send/{path}/{senders}/new/estimates.json"));
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(file).ok()?).ok()?;
        Some((v["mean"]["point_estimate"].as_f64()?, v["median"]["point_estimate"].as_f64()?))
    };
    let per_s = |ns: f64| (1e9 / ns).round();
    let mut rows = vec![];
    for (path, senders) in PATHS.iter().flat_map(|&p| SENDERS.map(|s| (p, s))) {
        let Some((mean, median)) = read(path, senders) else { continue };
        rows.push(json!({"write_path": path, "senders": senders, "mean_ns_per_send": mean.round(),
                         "median_ns_per_send": median.round(), "sends_per_s_at_mean": per_s(mean)}));
    }
    let ratios: Vec<_> = SENDERS
        .iter()
        .filter_map(|&s| Some((s, read("actor", s)?.0, read("direct", s)?.0)))
        .map(|(s, actor, direct)| json!({"senders": s, "actor_over_direct": (direct / actor * 10.0).round() / 10.0}))
        .collect();
    let git =
        |args: &[&str]| std::process::Command::new("git").args(args).current_dir(root).output().ok().map(|o| o.stdout);
    let rev = git(&["rev-parse", "--short", "HEAD"]).map(|o| String::from_utf8_lossy(&o).trim().to_owned());
    let dirty = git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|o| !o.is_empty());
    let doc = json!({
        "command": "cargo bench --bench write_path",
        "date": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        "git_rev": rev.map(|r| if dirty { format!("{r}-dirty") } else { r }),
        "durability": durability,
        "runs": rows,
        "ratios": ratios,
    });
    let out = root.join("evidence/bench/criterion.json");
    match serde_json::to_string_pretty(&doc) {
        Ok(text) => match std::fs::write(&out, text + "\n") {
            Ok(()) => println!("wrote {}", out.display()),
            Err(e) => eprintln!("write {}: {e}", out.display()),
        },
        Err(e) => eprintln!("encode criterion evidence: {e}"),
    }
}

criterion_group!(benches, write_path);
criterion_main!(benches);
