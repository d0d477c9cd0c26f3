//! The small rules at the operator and client edges: the admin token's floor,
//! its throttle and its log line; debug logs without client content; user
//! ids that differ only in case; a refused WebSocket upgrade that costs the
//! cluster's connection sequence nothing. Records go to evidence/im-16.

use std::time::{Duration, Instant};

use imcore::config::Config;
use imcore::startup::Application;
use serde_json::{json, Value};
use tokio::process::Command;

use crate::cluster_harness::{Nats, CLUSTER_KEY, NODE_PASSWORD, NODE_USER};
use crate::evidence::Check;
use crate::harness::TestDb;
use crate::input_forms::row_counts;
use crate::server::{free_port, http_raw, spawn_binary, TestServer, Ws, ADMIN};

const SUITE: &str = "im-16";

fn code(v: &Value) -> &str {
    v["error"]["code"].as_str().unwrap_or("")
}

#[actix_web::test]
async fn the_server_refuses_to_start_with_an_admin_token_under_32_characters() {
    let check = Check::start(
        SUITE,
        "16-low-admin-token",
        "floor",
        "a configured admin token under 32 characters stops startup with an error naming the floor (the binary \
         exits non-zero before touching the database); 32 characters start",
    );
    let db = TestDb::with_pool(2).await;
    let mut config = Config::for_database(db.url.clone());
    config.admin_token = Some("x".repeat(31));
    let short = Application::build(config).await.err().map(|e| e.to_string()).unwrap_or_default();
    let exact = TestServer::with(|c| c.admin_token = Some("x".repeat(32))).await;
    let (exact_status, _) = http_raw(exact.port, "POST", "/v1/admin/retention/run", Some(&"x".repeat(32)), None).await;
    exact.stop().await;
    let exact = exact_status == 200;
    let out = Command::new(env!("CARGO_BIN_EXE_imcore"))
        .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
        .env("IMCORE_ADMIN_TOKEN", "change-me")
        .env("IMCORE_LISTEN", format!("127.0.0.1:{}", free_port()))
        .output();
    let out = tokio::time::timeout(Duration::from_secs(30), out).await.expect("in time").expect("run imcore");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let pass = short.contains("at least 32")
        && exact
        && !out.status.success()
        && stderr.contains("at least 32")
        && !stderr.contains("change-me");
    let observed =
        json!({"31_chars": short, "32_chars_start": exact, "binary_exit": out.status.code(), "binary_stderr": stderr});
    assert!(check.resolve(observed, pass));
}

#[actix_web::test]
async fn failed_admin_guesses_are_throttled_per_address_and_logged_once_without_the_token() {
    let check = Check::start(
        SUITE,
        "16-low-admin-token",
        "throttle and log",
        "from one address, 20 wrong admin tokens answer UNAUTHORIZED, then every admin request (the right token \
         too) answers OVERLOADED unchecked while the budget refills (10/min); a 300-guess flood reaches the \
         comparison 20 times and writes one warn line; 10.5 s later a guess is compared again and the second line \
         counts what came between; no line holds the guess or the token",
    );
    let db = TestDb::with_pool(4).await;
    let port = free_port();
    let log = std::env::temp_dir().join(format!("imcore-admin-guard-{}-{port}.log", std::process::id()));
    let mut server =
        spawn_binary(&db.url, port, &[("IMCORE_LOG", "warn"), ("IMCORE_POOL_SIZE", "4")], Some(&log)).await;
    let (status, _) = http_raw(port, "POST", "/v1/admin/users", Some(ADMIN), Some(r#"{"user_id":"u-ana"}"#)).await;
    assert_eq!(status, 201);
    let guess = "guess-0123456789abcdef0123456789abcdef";
    let started = Instant::now();
    let mut answers: Vec<(u16, String)> = vec![];
    for _ in 0..300 {
        let (status, v) = http_raw(port, "POST", "/v1/admin/retention/run", Some(guess), None).await;
        answers.push((status, code(&v).to_owned()));
    }
    let flood_ms = started.elapsed().as_millis() as u64;
    let (right_status, right) = http_raw(port, "POST", "/v1/admin/retention/run", Some(ADMIN), None).await;
    let (health, _) = http_raw(port, "GET", "/healthz", None, None).await;
    // Past the log's interval, with one failure refilled: the next guess is
    // compared again and writes the second line, counting what came between.
    tokio::time::sleep(Duration::from_millis(10_500)).await;
    let (later, _) = http_raw(port, "POST", "/v1/admin/retention/run", Some(guess), None).await;
    server.kill().await.expect("stop the server");
    let text = std::fs::read_to_string(&log).expect("read the log");
    let _ = std::fs::remove_file(&log);
    let unauthorized = answers.iter().filter(|(s, c)| *s == 401 && c == "UNAUTHORIZED").count();
    let overloaded = answers.iter().filter(|(s, c)| *s == 503 && c == "OVERLOADED").count();
    let lines: Vec<&str> = text.lines().filter(|l| l.contains("admin authentication failed")).collect();
    let pass = answers[..20].iter().all(|(s, _)| *s == 401)
        && unauthorized == 20
        && overloaded == 280
        && right_status == 503
        && code(&right) == "OVERLOADED"
        && health == 200
        && later == 401
        && lines.len() == 2
        && lines[0].contains("failures=1 refused=0")
        && lines[1].contains("failures=20 refused=281")
        && !text.contains(guess)
        && !text.contains(ADMIN);
    let observed = json!({
        "guesses": answers.len(), "unauthorized": unauthorized, "overloaded": overloaded, "flood_ms": flood_ms,
        "right_token_while_blocked": [right_status, code(&right)], "healthz": health,
        "guess_after_10_5_s": later, "warn_lines": lines, "log_has_guess_or_token": text.contains(guess) || text.contains(ADMIN),
    });
    assert!(check.resolve(observed, pass), "{text}");
}

#[actix_web::test]
async fn debug_logs_carry_no_message_body_unless_the_database_driver_is_named() {
    let check = Check::start(
        SUITE,
        "16-low-debug-log",
        "IMCORE_LOG=debug",
        "with IMCORE_LOG=debug a sent body appears nowhere in the server's output; with \
         IMCORE_LOG=debug,tokio_postgres=debug (the driver named) it does, so the check can fail",
    );
    let db = TestDb::with_pool(4).await;
    let mut observed = serde_json::Map::new();
    for filter in ["debug", "debug,tokio_postgres=debug"] {
        let port = free_port();
        let log = std::env::temp_dir().join(format!("imcore-debug-log-{}-{port}.log", std::process::id()));
        let mut server =
            spawn_binary(&db.url, port, &[("IMCORE_LOG", filter), ("IMCORE_POOL_SIZE", "4")], Some(&log)).await;
        let user = format!("u-{port}");
        let (status, _) =
            http_raw(port, "POST", "/v1/admin/users", Some(ADMIN), Some(&json!({"user_id": user}).to_string())).await;
        assert_eq!(status, 201);
        let (_, issued) = http_raw(
            port,
            "POST",
            &format!("/v1/admin/users/{user}/devices"),
            Some(ADMIN),
            Some(r#"{"device_id":"d1"}"#),
        )
        .await;
        let token = issued["token"].as_str().expect("token").to_owned();
        let (_, conv) =
            http_raw(port, "POST", "/v1/conversations", Some(&token), Some(r#"{"kind":"group","name":"g"}"#)).await;
        let conv = conv["conv_id"].as_str().expect("conv_id").to_owned();
        let secret = format!("body-secret-{port}-{}", rand::random::<u32>());
        let send = json!({"client_msg_id": "k1", "body": {"type": "text", "text": secret}}).to_string();
        let (sent, _) =
            http_raw(port, "POST", &format!("/v1/conversations/{conv}/messages"), Some(&token), Some(&send)).await;
        assert!(sent == 201 || sent == 200, "send: {sent}");
        let mut ws = Ws::connect(port, Some(&token)).await.expect("upgrade");
        ws.request("sync", json!({"conv_id": conv, "after_seq": 0})).await;
        server.kill().await.expect("stop the server");
        let text = std::fs::read_to_string(&log).expect("read the log");
        let _ = std::fs::remove_file(&log);
        observed.insert(
            filter.to_owned(),
            json!({"log_lines": text.lines().count(), "body_logged": text.contains(&secret),
                   "token_logged": text.contains(&token)}),
        );
    }
    let seen = |filter: &str, key: &str| observed[filter][key] == true;
    let pass = !seen("debug", "body_logged")
        && !seen("debug", "token_logged")
        && seen("debug,tokio_postgres=debug", "body_logged");
    assert!(check.resolve(Value::Object(observed.clone()), pass), "{observed:?}");
}

#[actix_web::test]
async fn a_new_user_id_with_capitals_is_refused_so_no_two_users_differ_only_in_case() {
    let check = Check::start(
        SUITE,
        "16-low-user-id-case",
        "admin create",
        "creating `ANA`, `Ana` or `u-Ben` answers BAD_REQUEST and stores nothing; `ana` is created; the case \
         variants name no user anywhere (devices: NOT_FOUND; invite: refused or skipped, never a second user)",
    );
    let s = TestServer::start().await;
    let before = row_counts(&s.db).await;
    let mut refused = vec![];
    for id in ["ANA", "Ana", "u-Ben"] {
        let (status, v) = s.admin("/v1/admin/users", json!({"user_id": id})).await;
        refused.push(json!([id, status, code(&v)]));
    }
    let after = row_counts(&s.db).await;
    let ana = s.user("ana").await;
    let (device_status, device) = s.admin("/v1/admin/users/ANA/devices", json!({"device_id": "d1"})).await;
    let mut a = s.ws(&ana).await;
    let group = a.request("create_conversation", json!({"kind": "group", "name": "g"})).await;
    let conv = group["conv_id"].as_str().expect("conv_id").to_owned();
    let invite = a.request("invite", json!({"conv_id": conv, "user_ids": ["ANA"]})).await;
    let members = a.request("members", json!({"conv_id": conv})).await;
    let users: i64 = s.db.client().await.query_one("SELECT count(*) FROM users", &[]).await.expect("count").get(0);
    let pass = refused.iter().all(|r| r[1] == 400 && r[2] == "BAD_REQUEST")
        && before == after
        && device_status == 404
        && members["members"].as_array().map(Vec::len) == Some(1)
        && users == 1;
    let observed = json!({"refused": refused, "rows_before": before, "rows_after": after,
        "device_for_ANA": [device_status, code(&device)], "invite_ANA": invite, "users": users});
    assert!(check.resolve(observed, pass));
}

#[actix_web::test]
async fn a_refused_upgrade_on_a_clustered_node_draws_no_connection_id() {
    let check = Check::start(
        SUITE,
        "16-low-ws-auth-first",
        "clustered node, 50 refused upgrades",
        "upgrades with a missing, unknown or admin token answer 401 and leave the sequence conn_ids where it was; \
         one accepted upgrade then draws exactly one id (the measure moves)",
    );
    let nats = Nats::start().await;
    let s = TestServer::with(|c| {
        c.nats_url = Some(nats.url());
        c.bus.nats_user = Some(NODE_USER.into());
        c.bus.nats_password = Some(NODE_PASSWORD.into());
        c.bus.cluster_key = Some(CLUSTER_KEY.into());
    })
    .await;
    let ana = s.user("u-ana").await;
    let db = s.db.client().await;
    let drawn = || async {
        let row = db.query_one("SELECT last_value, is_called FROM conn_ids", &[]).await.expect("conn_ids");
        (row.get::<_, i64>(0), row.get::<_, bool>(1))
    };
    let before = drawn().await;
    let mut refusals = vec![];
    for i in 0..50 {
        let token = match i % 3 {
            0 => None,
            1 => Some(format!("bad-{i}")),
            _ => Some(ADMIN.to_owned()),
        };
        refusals.push(Ws::connect(s.port, token.as_deref()).await.err());
    }
    let after_refused = drawn().await;
    let mut ws = s.ws(&ana).await;
    let after_accepted = drawn().await;
    ws.request("ping", json!({})).await;
    let moved = match (before, after_accepted) {
        ((_, false), (1, true)) => true,
        ((b, true), (a, true)) => a == b + 1,
        _ => false,
    };
    let pass = refusals.iter().all(|r| *r == Some(401)) && after_refused == before && moved;
    let observed = json!({"refusals": refusals.len(), "all_401": refusals.iter().all(|r| *r == Some(401)),
        "seq_before": before, "seq_after_refused": after_refused, "seq_after_accepted": after_accepted});
    assert!(check.resolve(observed, pass));
}

/// This machine's address on its default route, if it has one (no packet is
/// sent: a UDP connect only picks the source address).
fn outside_address() -> Option<std::net::IpAddr> {
    let socket = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    socket.connect("192.0.2.1:9").ok()?;
    Some(socket.local_addr().ok()?.ip()).filter(|ip| !ip.is_loopback() && !ip.is_unspecified())
}

/// The status of a bare `GET /metrics` to `addr`.
async fn metrics_status(addr: std::net::SocketAddr) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    tcp.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.expect("request");
    let mut head = [0u8; 12];
    tcp.read_exact(&mut head).await.expect("status line");
    String::from_utf8_lossy(&head[9..12]).parse().unwrap_or(0)
}

#[actix_web::test]
async fn metrics_answer_loopback_peers_or_the_metrics_token_holder_only() {
    let check = Check::start(
        SUITE,
        "16-metrics-access",
        "loopback or token",
        "without IMCORE_METRICS_TOKEN, /metrics answers 200 to a loopback peer and 401 to a peer on another \
         address; with it, 401 without or with a wrong token (the admin token too), 200 with it; a token under \
         32 characters stops startup",
    );
    let open = TestServer::with(|c| c.listen = "0.0.0.0:0".parse().expect("address")).await;
    let loopback = http_raw(open.port, "GET", "/metrics", None, None).await.0;
    let outside = match outside_address() {
        Some(ip) => Some(metrics_status((ip, open.port).into()).await),
        None => None,
    };
    open.stop().await;
    let token = "m".repeat(32);
    let guarded = TestServer::with(|c| c.metrics_token = Some(token.clone())).await;
    let mut answers = vec![];
    for given in [None, Some("wrong"), Some(ADMIN), Some(token.as_str())] {
        answers.push(http_raw(guarded.port, "GET", "/metrics", given, None).await.0);
    }
    guarded.stop().await;
    let db = TestDb::with_pool(2).await;
    let mut config = Config::for_database(db.url.clone());
    config.metrics_token = Some("m".repeat(31));
    let short = Application::build(config).await.err().map(|e| e.to_string()).unwrap_or_default();
    let pass = loopback == 200
        && outside.is_none_or(|status| status == 401)
        && answers == [401, 401, 401, 200]
        && short.contains("IMCORE_METRICS_TOKEN");
    let observed = json!({"no_token": {"loopback": loopback, "other_address": outside}, "with_token": {
        "none_wrong_admin_right": answers}, "31_chars": short});
    assert!(check.resolve(observed, pass));
}
