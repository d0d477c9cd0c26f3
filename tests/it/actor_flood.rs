//! A flood of sends to conversations that do not exist (ARCHITECTURE §3,
//! idle eviction): one caller sends to 20,000 random, nonexistent `conv_id`s, every
//! send is answered `NOT_MEMBER`, and shortly after no conversation actor is
//! left alive and the process's resident memory has not grown.
//!
//! Resident memory is a property of the whole process, and the other tests of
//! this binary run alongside in it. So the flood runs in a process of its own:
//! this binary again, filtered to the one ignored test below, against a
//! database of the parent's cluster.

use std::time::{Duration, Instant};

use futures_util::stream::{FuturesUnordered, StreamExt};
use imcore::config::EngineSettings;
use imcore::domain::Rejection;
use imcore::store::Store;
use imcore::writer::{Engine, WriteFailure, Writer};
use uuid::Uuid;

use crate::env::{cid, send_op, text, uid};
use crate::harness::TestDb;

/// The flood's database, handed from the parent to the child process.
const DB_URL_VAR: &str = "IMCORE_FLOOD_DB_URL";
/// The child's test, by its full name in this binary.
const CHILD: &str = "actor_flood::flood_in_a_process_of_its_own";

const WARM_UP: usize = 1_000;
const SENDS: usize = 20_000;
/// Sends one caller keeps outstanding, as a pipelining client does.
const WINDOW: usize = 256;
/// Resident-memory growth tolerated over the flood (allocator noise).
const MAX_GROWTH_KB: u64 = 20 * 1024;
/// How long the actors may take to go once answered.
const SETTLE: Duration = Duration::from_secs(5);

#[actix_web::test]
async fn a_flood_of_sends_to_nonexistent_conversations_leaves_no_actors_and_no_memory_behind() {
    let db = TestDb::with_pool(2).await;
    let exe = std::env::current_exe().expect("the test binary");
    let out = tokio::process::Command::new(exe)
        .args([CHILD, "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env(DB_URL_VAR, &db.url)
        .output()
        .await
        .expect("run the flood in its own process");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    assert!(out.status.success(), "the flood failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("1 passed"), "the flood did not run:\n{stdout}");
}

/// The flood itself. Run alone (`--ignored`) it uses a database of a cluster
/// of its own.
#[actix_web::test]
#[ignore = "measures its own process's memory: run by the test above, in a process of its own"]
async fn flood_in_a_process_of_its_own() {
    let own_db;
    let store = match std::env::var(DB_URL_VAR) {
        Ok(url) => Store::connect(&url, 16).await.expect("connect to the flood's database"),
        Err(_) => {
            own_db = TestDb::with_pool(16).await;
            own_db.store.clone()
        }
    };
    store.create_user(&uid("u-flood"), None).await.expect("create user");
    // The server's engine with its defaults: actor path, commit stage, idle
    // timeout 60 s.
    let engine = Engine::start(store, &EngineSettings::default());
    let Writer::Actor(hub) = &engine.writer else { panic!("the default write path is the actor path") };

    // Pools, arbiters and the allocator's arenas warm up first.
    let warm_up = flood(&engine.writer, WARM_UP).await;
    let settled_after_warm_up = settle(|| hub.live_actors()).await;
    let rss_before = rss_kb();

    let started = Instant::now();
    let answers = flood(&engine.writer, SENDS).await;
    let flood_took = started.elapsed();
    let settled = settle(|| hub.live_actors()).await;
    let rss_after = rss_kb();
    let growth_kb = rss_after.saturating_sub(rss_before);

    println!(
        "flood: {SENDS} sends in {flood_took:?}, answers {answers:?}; live actors {} after {:?} \
         (after warm-up: {} after {:?}); actors started {}; RSS {rss_before} kB -> {rss_after} kB (+{growth_kb} kB)",
        settled.0,
        settled.1,
        settled_after_warm_up.0,
        settled_after_warm_up.1,
        hub.actors_started(),
    );
    assert_eq!(warm_up.not_member, WARM_UP, "every warm-up send is answered NOT_MEMBER: {warm_up:?}");
    assert_eq!(answers.not_member, SENDS, "every send is answered NOT_MEMBER: {answers:?}");
    assert_eq!(settled.0, 0, "no conversation actor is left alive {SETTLE:?} after the flood");
    assert!(growth_kb < MAX_GROWTH_KB, "resident memory grew by {growth_kb} kB over the flood");
}

#[derive(Debug, Default)]
struct Answers {
    not_member: usize,
    other: usize,
}

/// One caller sending to `n` random conversations that do not exist, in
/// order, with up to [`WINDOW`] sends outstanding.
async fn flood(writer: &Writer, n: usize) -> Answers {
    let mut answers = Answers::default();
    let mut outstanding = FuturesUnordered::new();
    for i in 0..n {
        if outstanding.len() >= WINDOW {
            count(&mut answers, outstanding.next().await);
        }
        let conv = cid(&format!("c-flood-{}", Uuid::new_v4()));
        let key = format!("k{i}");
        outstanding.push(writer.write(conv, send_op("u-flood", &key, text(&key))));
    }
    while let Some(answer) = outstanding.next().await {
        count(&mut answers, Some(answer));
    }
    answers
}

fn count<T>(answers: &mut Answers, answer: Option<Result<T, WriteFailure>>) {
    match answer {
        Some(Err(WriteFailure::Rejected(Rejection::NotMember))) => answers.not_member += 1,
        _ => answers.other += 1,
    }
}

/// Polls the live-actor count until it is 0 or [`SETTLE`] has passed: the
/// count and how long it took.
async fn settle(live: impl Fn() -> usize) -> (usize, Duration) {
    let started = Instant::now();
    loop {
        let n = live();
        if n == 0 || started.elapsed() >= SETTLE {
            return (n, started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// This process's resident memory (`VmRSS`), in kB.
fn rss_kb() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("read /proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/self/status")
}
