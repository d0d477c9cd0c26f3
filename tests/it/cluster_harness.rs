//! Several nodes for the cluster tests (ARCHITECTURE §7): a `nats-server`
//! started from the installed binary, and the `imcore` binary itself as child
//! processes on 127.0.0.x with port 0, all on one test database — so a node
//! can be killed with SIGKILL like a crashed machine. A missing `nats-server`
//! fails the test with how to install it; nothing is skipped.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::{Child, Command};

use crate::harness::TestDb;
use crate::server::{http_raw, Ws, ADMIN};

/// Starting a node or NATS takes well under this.
const START: Duration = Duration::from_secs(30);

/// Where Debian's `nats-server` package puts the binary, then `PATH`.
fn nats_binary() -> PathBuf {
    let installed = ["/usr/sbin/nats-server", "/usr/bin/nats-server"].into_iter().map(PathBuf::from);
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).map(|d| d.join("nats-server")).collect::<Vec<_>>())
        .unwrap_or_default();
    installed.chain(on_path).find(|p| p.is_file()).unwrap_or_else(|| {
        panic!("nats-server is not installed: the cluster tests need it (Debian: apt-get install nats-server; .ci/run does)")
    })
}

/// Reads `out` line by line until `find` picks a value out of one, then keeps
/// draining it in the background (a full pipe would stall the process).
async fn watch_output<R, T>(out: R, what: &str, find: impl Fn(&str) -> Option<T>) -> T
where
    R: AsyncRead + Unpin + Send + 'static,
{
    let mut lines = BufReader::new(out).lines();
    let found = tokio::time::timeout(START, async {
        while let Ok(Some(line)) = lines.next_line().await {
            if let Some(v) = find(&strip_ansi(&line)) {
                return v;
            }
        }
        panic!("{what} ended before it was ready");
    })
    .await
    .unwrap_or_else(|_| panic!("{what} not ready within {START:?}"));
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    found
}

fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI: ESC [ … final byte in @..~
            for c in chars.by_ref() {
                if ('@'..='~').contains(&c) && c != '[' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// A `nats-server` of this test's own.
pub struct Nats {
    child: Child,
    pub port: u16,
}

impl Nats {
    /// On a free port of its choosing.
    pub async fn start() -> Self {
        Self::on_port(None).await
    }

    /// On `port` (a restart keeps the port the nodes reconnect to).
    async fn on_port(port: Option<u16>) -> Self {
        let port_arg = port.map_or("-1".to_owned(), |p| p.to_string());
        let mut child = Command::new(nats_binary())
            .args(["-a", "127.0.0.1", "-p", &port_arg])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start nats-server");
        let stderr = child.stderr.take().expect("nats-server stderr");
        let port = watch_output(stderr, "nats-server", |line| {
            let (_, addr) = line.split_once("Listening for client connections on ")?;
            addr.trim().rsplit_once(':')?.1.parse::<u16>().ok()
        })
        .await;
        Self { child, port }
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Kills the server (SIGKILL) and waits until it is gone.
    pub async fn kill(&mut self) {
        self.child.kill().await.expect("kill nats-server");
    }

    /// A new server on the same port, after [`Nats::kill`].
    pub async fn restart(&mut self) {
        *self = Self::on_port(Some(self.port)).await;
    }
}

/// One `imcore` process.
pub struct Node {
    child: Child,
    pub host: Ipv4Addr,
    pub port: u16,
}

impl Node {
    async fn start(host: Ipv4Addr, database_url: &str, nats_url: &str, data_dir: &Path) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_imcore"))
            .env("DATABASE_URL", database_url)
            .env("IMCORE_NATS_URL", nats_url)
            .env("IMCORE_LISTEN", format!("{host}:0"))
            .env("IMCORE_ADMIN_TOKEN", ADMIN)
            .env("IMCORE_DATA_DIR", data_dir)
            .env("IMCORE_LOG", "info")
            .env("IMCORE_WORKERS", "1")
            .env("IMCORE_ARBITERS", "1")
            .env("IMCORE_POOL_SIZE", "6")
            .env("NO_COLOR", "1")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("start an imcore node");
        let stdout = child.stdout.take().expect("node stdout");
        let port = watch_output(stdout, "imcore node", |line| {
            let (_, rest) = line.split_once("imcore is listening")?;
            let (_, port) = rest.split_once("port=")?;
            port.split_whitespace().next()?.parse::<u16>().ok()
        })
        .await;
        Self { child, host, port }
    }

    /// Kills the process (SIGKILL): no graceful shutdown, nothing said to anyone.
    pub async fn kill(&mut self) {
        self.child.kill().await.expect("kill the node");
    }

    /// A connection of the device `token` stands for, routed by the time
    /// this returns (a ping was answered).
    pub async fn ws(&self, token: &str) -> Ws {
        let mut ws = self.try_ws(token).await.unwrap_or_else(|s| panic!("websocket upgrade refused: {s}"));
        ws.request("ping", json!({})).await;
        ws
    }

    pub async fn try_ws(&self, token: &str) -> Result<Ws, u16> {
        Ws::connect_url(&format!("ws://{}:{}/v1/ws?token={token}", self.host, self.port)).await
    }
}

/// `n` nodes on 127.0.0.1 … 127.0.0.n, one NATS server, one database.
pub struct Cluster {
    /// The nodes' database, for the test's life.
    _db: TestDb,
    pub nats: Nats,
    pub nodes: Vec<Node>,
    data_dir: PathBuf,
}

impl Cluster {
    pub async fn start(n: u8) -> Self {
        let db = TestDb::with_pool(2).await;
        let nats = Nats::start().await;
        let data_dir = std::env::temp_dir().join(format!("imcore-cluster-{}", uuid::Uuid::new_v4().simple()));
        let mut nodes = Vec::new();
        for i in 1..=n {
            nodes.push(Node::start(Ipv4Addr::new(127, 0, 0, i), &db.url, &nats.url(), &data_dir).await);
        }
        Self { _db: db, nats, nodes, data_dir }
    }

    /// An admin call, through the first node (on 127.0.0.1).
    pub async fn admin(&self, path: &str, body: Value) -> (u16, Value) {
        http_raw(self.nodes[0].port, "POST", path, Some(ADMIN), Some(&body.to_string())).await
    }

    /// Creates `user` and returns the token of its device `d1`.
    pub async fn user(&self, user: &str) -> String {
        let (status, v) = self.admin("/v1/admin/users", json!({"user_id": user})).await;
        assert_eq!(status, 201, "create user {user}: {v}");
        let (status, v) = self.admin(&format!("/v1/admin/users/{user}/devices"), json!({"device_id": "d1"})).await;
        assert_eq!(status, 201, "issue a device token: {v}");
        v["token"].as_str().expect("token").to_owned()
    }

    /// A group `id` created by `token`'s user with `members`, through the first node.
    pub async fn group(&self, token: &str, id: &str, members: &[&str]) {
        let body = json!({"kind": "group", "conv_id": id, "name": id, "members": members});
        let (status, v) =
            http_raw(self.nodes[0].port, "POST", "/v1/conversations", Some(token), Some(&body.to_string())).await;
        assert_eq!(status, 201, "create group: {v}");
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.data_dir);
    }
}
