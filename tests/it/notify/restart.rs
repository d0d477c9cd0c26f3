//! kill -9 with notifications pending: the server binary as a child process,
//! its gateway failing; after the kill and a restart (a new node, which
//! takes the dead one's leases over once they ran out) every notification
//! that was due arrives.

use std::time::{Duration, Instant};

use serde_json::json;

use super::gateway::Gateway;
use super::SUITE;
use crate::evidence::Check;
use crate::harness::TestDb;
use crate::server::{free_port, http_raw, spawn_binary, ADMIN};

/// Short notifier timers, so the dead node's leases run out within the test.
const NOTIFY_ENV: [(&str, &str); 5] = [
    ("IMCORE_POOL_SIZE", "4"),
    ("IMCORE_NOTIFY_LEASE_MS", "1500"),
    ("IMCORE_NOTIFY_FLUSH_MS", "200"),
    ("IMCORE_NOTIFY_BACKOFF_MS", "200"),
    ("IMCORE_NOTIFY_COALESCE_MS", "300"),
];

async fn post(port: u16, path: &str, token: &str, body: serde_json::Value) -> serde_json::Value {
    let (status, v) = http_raw(port, "POST", path, Some(token), Some(&body.to_string())).await;
    assert!(status == 200 || status == 201, "{path}: {status} {v}");
    v
}

#[actix_web::test]
async fn notifications_pending_at_a_kill_9_all_arrive_after_the_restart() {
    let check = Check::start(
        SUITE,
        "28-kill9-pending-arrive",
        "3 conversations, gateway failing at the kill",
        "after restart every due event_id is delivered (duplicates counted)",
    );
    let gw = Gateway::start(Duration::ZERO);
    gw.fail_next(usize::MAX);
    let db = TestDb::with_pool(2).await;
    let port = free_port();
    let mut server = spawn_binary(&db.url, port, &NOTIFY_ENV, None).await;
    let token = |v: serde_json::Value| v["token"].as_str().expect("token").to_owned();
    let mut tokens = Vec::new();
    for u in ["ann", "p1", "p2", "p3"] {
        post(port, "/v1/admin/users", ADMIN, json!({"user_id": u})).await;
        tokens
            .push(token(post(port, &format!("/v1/admin/users/{u}/devices"), ADMIN, json!({"device_id": "d1"})).await));
    }
    let pusher = json!({"app_id": "im.test", "pushkey": "ann-k", "url": gw.url});
    post(port, "/v1/pushers", &tokens[0], pusher).await;
    let mut due = Vec::new();
    for t in &tokens[1..] {
        let conv = post(port, "/v1/conversations", t, json!({"kind": "direct", "members": ["ann"]})).await;
        let conv = conv["conv_id"].as_str().expect("conv_id").to_owned();
        let body = json!({"client_msg_id": "m1", "body": {"text": "hi"}});
        let ack = post(port, &format!("/v1/conversations/{conv}/messages"), t, body).await;
        due.push(format!("{conv}:{}", ack["seq"]));
    }
    // Pending: every one tried at least once, and failing.
    let until = Instant::now() + Duration::from_secs(15);
    while gw.attempts("ann-k").len() < due.len() && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let tried_before = gw.attempts("ann-k").len();
    server.kill().await.expect("kill -9");
    gw.fail_next(0);
    let _restarted = spawn_binary(&db.url, port, &NOTIFY_ENV, None).await;
    let until = Instant::now() + Duration::from_secs(20);
    let delivered = loop {
        let got: Vec<String> =
            gw.delivered("ann-k").iter().map(|n| n["event_id"].as_str().unwrap_or_default().to_owned()).collect();
        if due.iter().all(|d| got.contains(d)) || Instant::now() > until {
            break got;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let duplicates = delivered.len() - due.iter().filter(|d| delivered.contains(d)).count();
    let pass = tried_before >= due.len() && due.iter().all(|d| delivered.contains(d));
    let observed = json!({"due": due, "delivered": delivered, "duplicates": duplicates, "failed_attempts_before_kill": tried_before});
    let pass = check.resolve(observed, pass);
    assert!(pass);
}
