//! The whole server in-process on port 0, and the tests' face of the shared
//! protocol client (`imcore-client`): the same calls, failing the test
//! instead of returning errors, with bounded waits.

use std::process::Stdio;
use std::time::{Duration, Instant};

use imcore::config::Config;
use imcore::gateway::AppState;
use imcore::startup::{Application, ShutdownTrigger};
use imcore_client::ClientError;
pub use imcore_client::Closed;
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};

use crate::harness::TestDb;

pub const ADMIN: &str = "test-admin-token-0123456789abcdef";
const WAIT: Duration = Duration::from_secs(10);

pub struct TestServer {
    pub port: u16,
    pub db: TestDb,
    pub trigger: ShutdownTrigger,
    pub running: tokio::task::JoinHandle<std::io::Result<()>>,
    /// The server's own writer and delivery.
    pub state: actix_web::web::Data<AppState>,
    config: Config,
}

impl TestServer {
    pub async fn start() -> Self {
        Self::with(|_| {}).await
    }

    /// Starts on a fresh database; `tweak` adjusts the configuration.
    pub async fn with(tweak: impl FnOnce(&mut Config)) -> Self {
        let db = TestDb::with_pool(4).await;
        let mut config = Config::for_database(db.url.clone());
        config.admin_token = Some(ADMIN.into());
        config.engine.write.arbiters = 1;
        config.workers = 1;
        config.store.pool_size = 8;
        tweak(&mut config);
        Self::serve(db, config).await
    }

    async fn serve(db: TestDb, config: Config) -> Self {
        let app = Application::build(config.clone()).await.expect("build the server");
        let (port, trigger, state) = (app.port(), app.shutdown_trigger(), app.state().clone());
        let running = actix_web::rt::spawn(app.run_until_stopped());
        Self { port, db, trigger, running, state, config }
    }

    /// Shuts down gracefully; [`Stopped::start`] serves the same database
    /// on the same port again.
    pub async fn stop(self) -> Stopped {
        self.trigger.fire();
        let stopped = tokio::time::timeout(WAIT * 3, self.running).await.expect("stopped in time");
        stopped.expect("server task").expect("server stopped cleanly");
        let mut config = self.config;
        config.listen.set_port(self.port);
        Stopped { db: self.db, config }
    }

    pub async fn http(&self, method: &str, path: &str, token: Option<&str>, body: Option<&Value>) -> (u16, Value) {
        let body = body.map(|b| b.to_string());
        http_raw(self.port, method, path, token, body.as_deref()).await
    }

    /// A sample of `/metrics`, if the series is there.
    pub async fn metric(&self, series: &str) -> Option<f64> {
        let (_, m) = self.http("GET", "/metrics", None, None).await;
        m.as_str()?
            .lines()
            .find(|l| l.starts_with(series))
            .and_then(|l| l.split_whitespace().last())
            .and_then(|v| v.parse().ok())
    }

    pub async fn admin(&self, path: &str, body: Value) -> (u16, Value) {
        self.http("POST", path, Some(ADMIN), Some(&body)).await
    }

    /// Creates `user` and returns a token for its device `d1`.
    pub async fn user(&self, user: &str) -> String {
        let (status, _) = self.admin("/v1/admin/users", json!({"user_id": user})).await;
        assert_eq!(status, 201, "create user {user}");
        self.device(user, "d1").await
    }

    /// Issues (or rotates) the token of `user`'s `device`.
    pub async fn device(&self, user: &str, device: &str) -> String {
        let (status, v) = self.admin(&format!("/v1/admin/users/{user}/devices"), json!({"device_id": device})).await;
        assert_eq!(status, 201, "issue device {user}/{device}: {v}");
        v["token"].as_str().expect("token").to_owned()
    }

    /// A connection, routed by the time this returns (a ping was answered,
    /// and the session registers before it reads any frame).
    pub async fn ws(&self, token: &str) -> Ws {
        let mut ws = Ws::connect(self.port, Some(token)).await.expect("websocket upgrade");
        ws.request("ping", json!({})).await;
        ws
    }

    /// A direct chat created by `a`'s token with `b`; its conv_id.
    pub async fn direct(&self, token: &str, other: &str) -> String {
        let (status, v) = self
            .http("POST", "/v1/conversations", Some(token), Some(&json!({"kind": "direct", "members": [other]})))
            .await;
        assert!(status == 201 || status == 200, "create direct: {status} {v}");
        v["conv_id"].as_str().expect("conv_id").to_owned()
    }
}

/// A [`TestServer`] that stopped, with its database and port.
pub struct Stopped {
    db: TestDb,
    config: Config,
}

impl Stopped {
    pub async fn start(self) -> TestServer {
        TestServer::serve(self.db, self.config).await
    }
}

/// One HTTP/1.1 request on a fresh connection.
pub async fn http_raw(port: u16, method: &str, path: &str, token: Option<&str>, body: Option<&str>) -> (u16, Value) {
    let mut http = imcore_client::Http::new(port);
    tokio::time::timeout(WAIT, http.request(method, path, token, body))
        .await
        .expect("response in time")
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

/// A loopback port nobody listens on.
pub fn free_port() -> u16 {
    imcore_client::free_port().expect("a free port")
}

/// A WebSocket connection (`imcore_client::Ws`) whose calls fail the test.
pub struct Ws(imcore_client::Ws);

impl Ws {
    /// `Err(status)` when the upgrade is refused.
    pub async fn connect(port: u16, token: Option<&str>) -> Result<Self, u16> {
        upgraded(imcore_client::Ws::connect(port, token).await)
    }

    pub async fn connect_url(url: &str) -> Result<Self, u16> {
        upgraded(imcore_client::Ws::connect_url(url).await)
    }

    pub async fn send_text(&mut self, text: String) {
        self.0.send_text(text).await.expect("send frame");
    }

    /// Sends `{"id", "op", ...fields}` without waiting; returns the id.
    pub async fn start(&mut self, op: &str, fields: Value) -> u64 {
        self.0.start(op, fields).await.expect("send frame")
    }

    /// Like [`Ws::start`]; `None` when the connection is gone.
    pub async fn try_start(&mut self, op: &str, fields: Value) -> Option<u64> {
        self.0.start(op, fields).await.ok()
    }

    /// The reply with this id (pushes arriving meanwhile are kept).
    pub async fn reply(&mut self, id: u64) -> Value {
        self.0.reply(id).await.unwrap_or_else(|e| panic!("waiting for reply {id}: {e}"))
    }

    /// The reply with this id, or the close code when the connection closed first.
    pub async fn reply_or_close(&mut self, id: u64) -> Result<Value, Option<u16>> {
        match self.0.reply(id).await {
            Ok(v) => Ok(v),
            Err(ClientError::Closed { code }) => Err(code),
            Err(e) => panic!("waiting for reply {id}: {e}"),
        }
    }

    pub async fn request(&mut self, op: &str, fields: Value) -> Value {
        let id = self.start(op, fields).await;
        self.reply(id).await
    }

    /// The next frame that is not a reply to a request.
    pub async fn reply_without_id(&mut self) -> Value {
        self.0.reply_without_id().await.expect("a reply without id")
    }

    /// The next push, if one comes within `wait`. Presence pushes (PROTOCOL
    /// v1.2), which a user sharing a direct chat gets whenever the other one
    /// connects or leaves, are passed over: [`Ws::live_push_within`] sees them.
    pub async fn push_within(&mut self, wait: Duration) -> Option<Value> {
        let until = tokio::time::Instant::now() + wait;
        loop {
            let left = until.checked_duration_since(tokio::time::Instant::now())?;
            let push = self.0.push_within(left).await?;
            if push["push"] != "presence" {
                return Some(push);
            }
        }
    }

    /// The next push of any kind, if one comes within `wait`.
    pub async fn live_push_within(&mut self, wait: Duration) -> Option<Value> {
        self.0.push_within(wait).await
    }

    pub async fn push(&mut self) -> Value {
        self.push_within(WAIT).await.expect("a push")
    }

    /// Reads until the server closes; the close code and the pushes seen.
    pub async fn closed(&mut self) -> Closed {
        match self.0.closed_within(WAIT).await {
            Ok(mut closed) => {
                closed.pushes.retain(|p| p["push"] != "presence");
                closed
            }
            Err(ClientError::Timeout(_)) => panic!("the server did not close the connection in time"),
            Err(e) => panic!("reading until close: {e}"),
        }
    }

    pub async fn close(self) {
        self.0.close().await;
    }
}

fn upgraded(r: Result<imcore_client::Ws, ClientError>) -> Result<Ws, u16> {
    match r {
        Ok(ws) => Ok(Ws(ws)),
        Err(ClientError::Refused(status)) => Err(status),
        Err(e) => panic!("websocket connect: {e}"),
    }
}

/// The real server binary as a child process on `port`, once `/readyz`
/// answers: one worker and one arbiter, a pool of 8, errors logged to
/// nowhere; `env` overrides or adds settings, `log` takes stdout and stderr.
pub async fn spawn_binary(db_url: &str, port: u16, env: &[(&str, &str)], log: Option<&std::path::Path>) -> Child {
    let data_dir = std::env::temp_dir().join(format!("imcore-binary-{}-{port}", std::process::id()));
    let (out, err) = match log {
        Some(path) => {
            let file = std::fs::File::create(path).expect("log file");
            (Stdio::from(file.try_clone().expect("log file")), Stdio::from(file))
        }
        None => (Stdio::null(), Stdio::null()),
    };
    let child = Command::new(env!("CARGO_BIN_EXE_imcore"))
        .env("DATABASE_URL", db_url)
        .env("IMCORE_LISTEN", format!("127.0.0.1:{port}"))
        .env("IMCORE_ADMIN_TOKEN", ADMIN)
        .env("IMCORE_DATA_DIR", data_dir)
        .env("IMCORE_LOG", "error")
        .env("IMCORE_WORKERS", "1")
        .env("IMCORE_ARBITERS", "1")
        .env("IMCORE_POOL_SIZE", "8")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .kill_on_drop(true)
        .spawn()
        .expect("spawn the server binary");
    let deadline = Instant::now() + WAIT * 3;
    loop {
        if TcpStream::connect(("127.0.0.1", port)).await.is_ok()
            && http_raw(port, "GET", "/readyz", None, None).await.0 == 200
        {
            return child;
        }
        assert!(Instant::now() < deadline, "the server binary did not become ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
