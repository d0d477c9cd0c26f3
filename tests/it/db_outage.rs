//! PostgreSQL going away under a running server and coming back (PROTOCOL §2,
//! §6): the server runs on a PostgreSQL of its own (not the shared test
//! cluster), which is stopped and started again on the same data directory
//! and port. Records go to evidence/im-05.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use imcore::config::Config;
use imcore::pg::{EmbeddedPg, PgOptions, DATABASE};
use imcore::startup::Application;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::evidence::Check;
use crate::server::{Ws, ADMIN};

const SUITE: &str = "im-05";
/// What a request may take while the database is down: the pool gives up
/// connecting after 10 s; a loaded machine gets the rest.
const DOWN_BOUND: Duration = Duration::from_secs(20);

/// `(status, body)` of one request, or `None` if no answer came within `bound`.
async fn request(
    port: u16,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: &Value,
    bound: Duration,
) -> Option<(u16, Value)> {
    let exchange = async {
        let mut s = TcpStream::connect(("127.0.0.1", port)).await.ok()?;
        let body = body.to_string();
        let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n{auth}\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).await.ok()?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).await.ok()?;
        let text = String::from_utf8_lossy(&raw).into_owned();
        let (head, rest) = text.split_once("\r\n\r\n")?;
        let status = head.split_whitespace().nth(1)?.parse().ok()?;
        // Small JSON answers: actix sends them with Content-Length.
        Some((status, serde_json::from_str(rest).unwrap_or(Value::String(rest.to_owned()))))
    };
    tokio::time::timeout(bound, exchange).await.ok().flatten()
}

/// PostgreSQL started by hand on a cluster `EmbeddedPg` initialised, on the
/// port it used before (`EmbeddedPg::start` always picks a new one).
struct Restarted(Child);

impl Restarted {
    fn start(root: &Path, port: u16) -> Self {
        let bindir = std::fs::read_dir("/usr/lib/postgresql")
            .expect("/usr/lib/postgresql")
            .flatten()
            .map(|e| e.path().join("bin"))
            .filter(|p| p.join("postgres").is_file())
            .max()
            .expect("PostgreSQL binaries");
        let mut cmd = Command::new(bindir.join("postgres"));
        cmd.arg("-D").arg(root.join("pg")).args(["-p", &port.to_string()]);
        cmd.args(["-c", "listen_addresses=127.0.0.1", "-c", "unix_socket_directories="]);
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).process_group(0);
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            // The cluster belongs to the account EmbeddedPg ran it as.
            let meta = std::fs::metadata(root.join("pg")).expect("cluster directory");
            cmd.uid(std::os::unix::fs::MetadataExt::uid(&meta)).gid(std::os::unix::fs::MetadataExt::gid(&meta));
        }
        Self(cmd.spawn().expect("restart postgres"))
    }
}

impl Drop for Restarted {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own, not yet reaped, child: fast shutdown.
        unsafe {
            libc::kill(self.0.id() as i32, libc::SIGINT);
        }
        let _ = self.0.wait();
    }
}

/// Polls `/readyz` until it answers `want` or `within` passed; the time it took.
async fn ready_becomes(port: u16, want: u16, within: Duration) -> Option<u64> {
    let started = Instant::now();
    while started.elapsed() < within {
        if let Some((status, _)) = request(port, "GET", "/readyz", None, &Value::Null, DOWN_BOUND).await {
            if status == want {
                return Some(started.elapsed().as_millis() as u64);
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

fn send_fields(conv: &str, key: &str) -> Value {
    json!({"conv_id": conv, "client_msg_id": key, "body": {"type": "text", "text": key}})
}

#[actix_web::test]
async fn while_postgresql_is_down_writes_fail_fast_and_readyz_says_so_then_everything_recovers() {
    let check = Check::start(
        SUITE,
        "05-postgresql-outage",
        "server on its own PostgreSQL, fast shutdown then restart on the same data directory and port",
        "while PostgreSQL is down /readyz answers 503 and a send answers INTERNAL or OVERLOADED within 20 s (over \
         WebSocket and HTTP), never hanging; once it is back /readyz answers 200 again, retrying the failed sends \
         with the same client_msg_id succeeds (once each), and sync shows every acked seq, gapless",
    );
    let root: PathBuf = std::env::temp_dir().join(format!("imcore-outage-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let mut opts = PgOptions::new(&root);
    opts.fast_init = true;
    let pg = EmbeddedPg::start(opts).await.expect("start PostgreSQL");
    let pg_port = pg.port();
    let mut config = Config::for_database(pg.url(DATABASE));
    config.admin_token = Some(ADMIN.into());
    (config.engine.write.arbiters, config.workers, config.store.pool_size) = (1, 1, 4);
    let app = Application::build(config).await.expect("build the server");
    let port = app.port();
    let trigger = app.shutdown_trigger();
    let running = actix_web::rt::spawn(app.run_until_stopped());

    let admin = |path: &str, body: Value| {
        let path = path.to_owned();
        async move { request(port, "POST", &path, Some(ADMIN), &body, DOWN_BOUND).await.expect("admin answer") }
    };
    let mut tokens = vec![];
    for user in ["u-ana", "u-ben"] {
        admin("/v1/admin/users", json!({"user_id": user})).await;
        let (_, v) = admin(&format!("/v1/admin/users/{user}/devices"), json!({"device_id": "d1"})).await;
        tokens.push(v["token"].as_str().expect("token").to_owned());
    }
    let create = json!({"kind": "direct", "members": ["u-ben"]});
    let (_, created) =
        request(port, "POST", "/v1/conversations", Some(&tokens[0]), &create, DOWN_BOUND).await.expect("create");
    let conv = created["conv_id"].as_str().expect("conv_id").to_owned();
    let mut a = Ws::connect(port, Some(&tokens[0])).await.expect("connect");
    let mut acked = vec![];
    for i in 0..5 {
        acked.push(a.request("send", send_fields(&conv, &format!("before-{i}"))).await["seq"].clone());
    }

    pg.stop();
    // Dropping it would signal its pid again, which may be reused by now.
    std::mem::forget(pg);
    let started = Instant::now();
    let ws_send = async { tokio::time::timeout(DOWN_BOUND, a.request("send", send_fields(&conv, "during-ws"))).await };
    let (messages, during_http) = (format!("/v1/conversations/{conv}/messages"), send_fields(&conv, "during-http"));
    let http_send = request(port, "POST", &messages, Some(&tokens[0]), &during_http, DOWN_BOUND);
    let ready_down = request(port, "GET", "/readyz", None, &Value::Null, DOWN_BOUND);
    let (ws_down, http_down, ready_down) = tokio::join!(ws_send, http_send, ready_down);
    let down_ms = started.elapsed().as_millis() as u64;
    let ws_down = ws_down.unwrap_or(Value::Null);
    let failed_fast = |code: &Value| code == "INTERNAL" || code == "OVERLOADED";

    let restarted = Restarted::start(&root, pg_port);
    let ready_again_ms = ready_becomes(port, 200, Duration::from_secs(60)).await;
    let ws_retry = tokio::time::timeout(DOWN_BOUND, a.request("send", send_fields(&conv, "during-ws")))
        .await
        .unwrap_or(Value::Null);
    let (http_retry_status, http_retry) = request(
        port,
        "POST",
        &format!("/v1/conversations/{conv}/messages"),
        Some(&tokens[0]),
        &send_fields(&conv, "during-http"),
        DOWN_BOUND,
    )
    .await
    .unwrap_or((0, Value::Null));
    acked.extend([ws_retry["seq"].clone(), http_retry["seq"].clone()]);
    let page = a.request("sync", json!({"conv_id": conv, "after_seq": 0, "limit": 100})).await;
    let synced: Vec<Value> = page["events"].as_array().into_iter().flatten().map(|e| e["seq"].clone()).collect();
    let every_acked_synced = acked.iter().all(|s| s.is_i64() && synced.contains(s));
    let gapless = synced.iter().enumerate().all(|(i, s)| *s == json!(i + 1)) && page["head"] == json!(synced.len());

    a.close().await;
    trigger.fire();
    let _ = tokio::time::timeout(Duration::from_secs(15), running).await;
    drop(restarted);
    let _ = std::fs::remove_dir_all(&root);
    let pass = ready_down.as_ref().is_some_and(|(st, _)| *st == 503)
        && failed_fast(&ws_down["error"]["code"])
        && http_down.as_ref().is_some_and(|(st, v)| (*st == 500 || *st == 503) && failed_fast(&v["error"]["code"]))
        && ready_again_ms.is_some()
        && ws_retry["ok"] == true
        && http_retry_status == 201
        && every_acked_synced
        && gapless
        && synced.len() == 2 + 5 + 2;
    let pass = check.resolve(
        json!({"readyz_down": ready_down, "ws_send_down": ws_down, "http_send_down": http_down,
               "down_answers_ms": down_ms, "ready_again_after_ms": ready_again_ms, "ws_retry": ws_retry,
               "http_retry": [http_retry_status, http_retry], "acked": acked, "synced": synced,
               "every_acked_synced": every_acked_synced, "gapless": gapless}),
        pass,
    );
    assert!(pass);
}
