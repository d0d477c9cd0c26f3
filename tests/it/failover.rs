//! PostgreSQL failing over under a running server (ARCHITECTURE §6, "The
//! database failing over"): a pg_auto_failover formation (monitor, primary,
//! synchronous standby) from Debian's packages, the server on its multi-host
//! URL, a burst of sends over WebSocket, the primary's machine SIGKILLed
//! mid-burst, every client retrying with the same key, and every ack checked
//! on the new primary. Skipped, saying why, without the packages. Records go
//! to evidence/im-17.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use imcore::config::Config;
use imcore::pg_formation::{self, Formation, Timers};
use imcore::startup::Application;
use serde_json::{json, Value};

use crate::evidence::Check;
use crate::server::{http_raw, Ws, ADMIN};

const SUITE: &str = "im-17";
const SENDERS: usize = 4;
const PER_SENDER: usize = 50;
/// The primary is killed once this many sends were acked.
const KILL_AFTER: usize = 60;
/// Longest any one request may take, failover included; a loaded machine gets most of it.
const REQUEST_BOUND: Duration = Duration::from_secs(30);
/// Every send acked within this, failover included.
const BURST_BOUND: Duration = Duration::from_secs(120);
/// An error answer while there is no primary comes within the connect timeout (1 s here); a loaded machine gets the rest.
const ERROR_BOUND: Duration = Duration::from_secs(15);

/// One acked send, as its client saw it.
struct Ack {
    sender: String,
    key: String,
    seq: i64,
    at: Instant,
}

#[derive(Default)]
struct Observed {
    acks: Vec<Ack>,
    errors: BTreeMap<String, u32>,
    slowest_error: Duration,
    unacked: Vec<String>,
}

/// `/readyz`'s status, 0 if no answer came within 10 s.
async fn ready_status(port: u16) -> u16 {
    let mut http = imcore_client::Http::new(port);
    let answer = tokio::time::timeout(Duration::from_secs(10), http.request("GET", "/readyz", None, None)).await;
    answer.ok().and_then(Result::ok).map_or(0, |(status, _)| status)
}

#[actix_web::test]
async fn a_primary_killed_mid_burst_loses_no_acked_send_and_duplicates_none() {
    if let Some(reason) = pg_formation::missing() {
        eprintln!("skipped: {reason}");
        return;
    }
    let lost_check = Check::start(
        SUITE,
        "34-failover-no-acked-send-lost-or-duplicated",
        "pg_auto_failover monitor + primary + synchronous standby (fast timers); 4 WebSocket senders × 50 sends \
         to one group; the primary's keeper and PostgreSQL SIGKILLed after 60 acks; clients retry with the same key",
        "every send is eventually acked; on the new primary every acked (sender, client_msg_id) is stored once, at \
         the acked seq; no key stored twice; the conversation's seqs gapless",
    );
    let shed_check = Check::start(
        SUITE,
        "34-failover-writes-shed-and-readyz-follows",
        "the same run: what clients and /readyz saw between the kill and the new primary",
        "every failed send answers OVERLOADED or INTERNAL (retryable) within 15 s, never hanging, or its connection \
         closes with 1013 (reconnect and sync: a batch committed at the kill that the server never learned of leaves \
         a gap, which resyncs every device of the conversation); /readyz answers \
         503 while there is no primary and 200 again after; the pool reaches the new primary without a restart",
    );
    let left_check = Check::start(
        SUITE,
        "34-failover-formation-leaves-no-process",
        "the same run, after the server stopped and the formation was dropped",
        "before the drop, the formation's PostgreSQL processes are found by their working directory under its \
         root (so the probe sees them); after it, none is: every PostgreSQL process of the monitor and both \
         nodes is gone (children run in sessions of their own; the monitor's health-check worker outlived its \
         killed postmaster before)",
    );
    let root = std::env::temp_dir().join(format!("imcore-failover-{}", std::process::id()));
    let mut formation = Formation::start(&root, Timers::fast()).await.expect("form pg_auto_failover");
    let root = formation.root().to_path_buf();
    let first = formation.primary().await.expect("a primary");

    let mut config = Config::for_database(formation.url());
    config.admin_token = Some(ADMIN.into());
    (config.engine.write.arbiters, config.workers, config.store.pool_size) = (1, 1, 8);
    config.store.connect_timeout_ms = 1_000;
    let app = Application::build(config).await.expect("build the server on the formation");
    let port = app.port();
    let trigger = app.shutdown_trigger();
    let running = actix_web::rt::spawn(app.run_until_stopped());

    let admin = |path: String, body: Value| async move {
        let (status, v) = http_raw(port, "POST", &path, Some(ADMIN), Some(&body.to_string())).await;
        assert_eq!(status, 201, "{path}: {v}");
        v
    };
    let users: Vec<String> = (0..SENDERS).map(|i| format!("u-s{i}")).collect();
    let mut tokens = vec![];
    for u in &users {
        admin("/v1/admin/users".into(), json!({"user_id": u})).await;
        let v = admin(format!("/v1/admin/users/{u}/devices"), json!({"device_id": "d1"})).await;
        tokens.push(v["token"].as_str().expect("token").to_owned());
    }
    let group = json!({"kind": "group", "name": "failover", "members": users[1..], "delivery_mode": "pull"});
    let (_, created) = http_raw(port, "POST", "/v1/conversations", Some(&tokens[0]), Some(&group.to_string())).await;
    let conv = created["conv_id"].as_str().expect("conv_id").to_owned();

    let observed = RefCell::new(Observed::default());
    let (acked, done) = (Cell::new(0usize), Cell::new(false));
    let killed_at: Cell<Option<Instant>> = Cell::new(None);
    let senders = join_all(users.iter().zip(&tokens).map(|(user, token)| {
        let (conv, observed, acked) = (&conv, &observed, &acked);
        async move {
            let mut ws = Ws::connect(port, Some(token)).await.expect("connect");
            let deadline = Instant::now() + BURST_BOUND;
            for k in 0..PER_SENDER {
                let key = format!("{user}-{k}");
                let fields = json!({"conv_id": conv, "client_msg_id": key, "body": {"type": "text", "text": key}});
                loop {
                    if Instant::now() > deadline {
                        observed.borrow_mut().unacked.push(key);
                        break;
                    }
                    let asked = Instant::now();
                    let id = ws.start("send", fields.clone()).await;
                    let reply = tokio::time::timeout(REQUEST_BOUND, ws.reply_or_close(id)).await;
                    let code = match reply {
                        Ok(Ok(v)) if v["ok"] == true => {
                            let seq = v["seq"].as_i64().expect("seq");
                            observed.borrow_mut().acks.push(Ack { sender: user.clone(), key, seq, at: Instant::now() });
                            acked.set(acked.get() + 1);
                            break;
                        }
                        Ok(Ok(v)) => {
                            let mut o = observed.borrow_mut();
                            o.slowest_error = o.slowest_error.max(asked.elapsed());
                            v["error"]["code"].as_str().unwrap_or("?").to_owned()
                        }
                        Ok(Err(close)) => {
                            ws = Ws::connect(port, Some(token)).await.expect("reconnect");
                            format!("CLOSED_{}", close.unwrap_or(0))
                        }
                        Err(_) => "NO_ANSWER".into(),
                    };
                    *observed.borrow_mut().errors.entry(code).or_default() += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
            ws.close().await;
        }
    }));
    let senders = async {
        senders.await;
        done.set(true);
    };
    let killer = async {
        while acked.get() < KILL_AFTER && !done.get() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        formation.kill(first);
        killed_at.set(Some(Instant::now()));
    };
    // /readyz polled through the run: (ms after the kill, status).
    let readyz = async {
        let mut seen: Vec<(u64, u16)> = vec![];
        while !done.get() {
            let status = ready_status(port).await;
            if let Some(k) = killed_at.get() {
                if seen.last().map_or(true, |(_, s)| *s != status) {
                    seen.push((k.elapsed().as_millis() as u64, status));
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        seen
    };
    let ((), (), mut readyz) = tokio::join!(senders, killer, readyz);
    let observed = observed.into_inner();
    let killed_at = killed_at.get().expect("the primary was killed");
    readyz.push((killed_at.elapsed().as_millis() as u64, ready_status(port).await));

    // Checked on the new primary, straight from its table.
    let second = formation.primary().await;
    let (client, connection) =
        tokio_postgres::connect(&formation.url(), tokio_postgres::NoTls).await.expect("connect to the new primary");
    actix_web::rt::spawn(connection);
    let rows = client
        .query("SELECT seq, kind, sender_user, client_msg_id FROM events WHERE conv_id = $1 ORDER BY seq", &[&conv])
        .await
        .expect("read the log");
    let seqs: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
    let mut stored: HashMap<(String, String), Vec<i64>> = HashMap::new();
    for r in rows.iter().filter(|r| r.get::<_, String>(1) == "msg") {
        stored.entry((r.get(2), r.get(3))).or_default().push(r.get(0));
    }
    let lost: Vec<&str> = observed
        .acks
        .iter()
        .filter(|a| stored.get(&(a.sender.clone(), a.key.clone())).map_or(true, |s| !s.contains(&a.seq)))
        .map(|a| a.key.as_str())
        .collect();
    let duplicated: Vec<&(String, String)> = stored.iter().filter(|(_, s)| s.len() > 1).map(|(k, _)| k).collect();
    let gapless = seqs.iter().enumerate().all(|(i, s)| *s == i as i64 + 1);
    let (before, after): (Vec<&Ack>, Vec<&Ack>) = observed.acks.iter().partition(|a| a.at < killed_at);
    let last_before = before.iter().map(|a| a.at).max();
    let first_after = after.iter().map(|a| a.at).min();
    let without_writes_ms = last_before.zip(first_after).map(|(b, a)| a.duration_since(b).as_millis() as u64);

    trigger.fire();
    let _ = tokio::time::timeout(Duration::from_secs(15), running).await;
    let before = pg_formation::processes_under(&root);
    drop(formation);
    let left = pg_formation::processes_under(&root);
    let left_pass = left_check
        .resolve(json!({ "processes_before": before, "processes_left": left }), !before.is_empty() && left.is_empty());

    let all_acked = observed.acks.len() == SENDERS * PER_SENDER && observed.unacked.is_empty();
    let pass = all_acked && lost.is_empty() && duplicated.is_empty() && gapless && second.is_some_and(|s| s != first);
    let lost_pass = lost_check.resolve(
        json!({"acked": observed.acks.len(), "acked_before_kill": before.len(), "unacked": observed.unacked,
               "stored_sends": stored.len(), "lost": lost, "duplicated": duplicated, "log_len": seqs.len(),
               "gapless": gapless, "primary_before": first, "primary_after": second,
               "ms_without_acks_across_the_kill": without_writes_ms}),
        pass,
    );
    let retryable = observed.errors.keys().all(|c| ["OVERLOADED", "INTERNAL", "CLOSED_1013"].contains(&c.as_str()));
    let went_503 = readyz.iter().any(|(_, s)| *s == 503);
    let back_200 = readyz.last().is_some_and(|(_, s)| *s == 200) && went_503;
    let shed_pass = shed_check.resolve(
        json!({"errors_by_code": observed.errors, "slowest_error_ms": observed.slowest_error.as_millis() as u64,
               "readyz_after_kill_ms_status": readyz}),
        retryable && observed.slowest_error <= ERROR_BOUND && back_200 && all_acked,
    );
    assert!(lost_pass && shed_pass && left_pass);
}
