//! Several nodes for the cluster tests (ARCHITECTURE §7): a `nats-server`
//! started from the installed binary, and the `imcore` binary itself as child
//! processes on 127.0.0.x with port 0, all on one test database — so a node
//! can be killed with SIGKILL like a crashed machine. NATS runs with
//! authorization: only the nodes' user may publish or subscribe on
//! `imcore.>` ([`NATS_CONFIG`]), and the nodes sign with [`CLUSTER_KEY`]. A
//! missing `nats-server` fails the test with how to install it; nothing is
//! skipped.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::{Child, Command};
use tokio::sync::watch;

use crate::harness::TestDb;
use crate::server::{http_raw, Ws, ADMIN};
use crate::sync_points::sample;

/// Starting a node or NATS takes well under this.
const START: Duration = Duration::from_secs(30);

/// The nodes' NATS user and password, and the key they sign with.
pub const NODE_USER: &str = "imcore-node";
pub const NODE_PASSWORD: &str = "node-password-not-for-production";
pub const CLUSTER_KEY: &str = "cluster-key-of-the-tests-0123456789abcdef";
/// A NATS user that is not a node: it may use NATS, never `imcore.>`.
pub const OUTSIDER: &str = "outsider";
pub const OUTSIDER_PASSWORD: &str = "outsider-password";

/// The test server's configuration: the README's recipe.
pub const NATS_CONFIG: &str = r#"
authorization {
  users = [
    { user: "imcore-node", password: "node-password-not-for-production",
      permissions: { publish: ["imcore.>"], subscribe: ["imcore.>"] } }
    { user: "outsider", password: "outsider-password",
      permissions: { publish: { deny: ["imcore.>"] }, subscribe: { deny: ["imcore.>"] } } }
  ]
}
"#;

/// The routes between the servers of a NATS cluster authenticate too (the
/// recipe's `cluster { authorization }`).
pub const ROUTE_USER: &str = "imcore-route";
pub const ROUTE_PASSWORD: &str = "route-password-not-for-production";

/// A server's `cluster` block: routes on a port of its own choosing, to the
/// servers listening for routes on `routes`.
fn cluster_block(routes: &[u16]) -> String {
    let urls: Vec<String> =
        routes.iter().map(|p| format!("\"nats-route://{ROUTE_USER}:{ROUTE_PASSWORD}@127.0.0.1:{p}\"")).collect();
    format!(
        "cluster {{\n  name: imcore\n  host: 127.0.0.1\n  port: -1\n  authorization {{ user: \"{ROUTE_USER}\", password: \"{ROUTE_PASSWORD}\" }}\n  routes = [ {} ]\n}}\n",
        urls.join(", ")
    )
}

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
    config: PathBuf,
    /// In a NATS cluster: its route port, and its monitoring port (`/varz`).
    cluster: Option<(u16, u16)>,
}

/// What a starting `nats-server` said about itself.
#[derive(Default)]
struct Said {
    client: Option<u16>,
    route: Option<u16>,
    monitor: Option<u16>,
    routes_created: usize,
}

fn port_after(line: &str, what: &str) -> Option<u16> {
    line.split_once(what)?.1.trim().rsplit_once(':')?.1.parse().ok()
}

impl Nats {
    /// On a free port of its choosing.
    pub async fn start() -> Self {
        Self::on_port(None).await
    }

    /// On `port` (a restart keeps the port the nodes reconnect to).
    async fn on_port(port: Option<u16>) -> Self {
        let config = std::env::temp_dir().join(format!("imcore-nats-{}.conf", uuid::Uuid::new_v4().simple()));
        std::fs::write(&config, NATS_CONFIG).expect("write the NATS configuration");
        Self::with_config(port, config).await
    }

    /// `n` servers in one NATS cluster, each routed to every other one
    /// (server `k` to the `k` before it) by the time this returns.
    pub async fn cluster(n: usize) -> Vec<Self> {
        let mut servers: Vec<Self> = Vec::new();
        for _ in 0..n {
            let routes: Vec<u16> = servers.iter().filter_map(|s| s.cluster.map(|(route, _)| route)).collect();
            let config = std::env::temp_dir().join(format!("imcore-nats-{}.conf", uuid::Uuid::new_v4().simple()));
            std::fs::write(&config, cluster_block(&routes) + NATS_CONFIG).expect("write the NATS configuration");
            servers.push(Self::spawn(None, config, Some(routes.len())).await);
        }
        servers
    }

    /// The clients connected to this server of a NATS cluster (`/varz`).
    pub async fn connections(&self) -> u64 {
        let (_, monitor) = self.cluster.expect("a server of a NATS cluster");
        let (status, varz) = http_raw(monitor, "GET", "/varz", None, None).await;
        assert_eq!(status, 200, "/varz: {varz}");
        varz["connections"].as_u64().expect("connections")
    }

    /// With TLS: a certificate for 127.0.0.1 signed by a CA of its own (made
    /// with `openssl`). The server, and the CA's certificate file.
    pub async fn start_tls() -> (Self, PathBuf) {
        let dir = std::env::temp_dir().join(format!("imcore-nats-tls-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("a directory for the certificates");
        let san = dir.join("san.cnf");
        std::fs::write(&san, "subjectAltName=IP:127.0.0.1\n").expect("write the SAN extension");
        let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
        let steps: [Vec<&str>; 3] = [
            [
                &["req", "-x509"][..],
                &ec,
                &["-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=imcore test CA"],
            ]
            .concat(),
            [&["req"][..], &ec, &["-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1"]].concat(),
            vec![
                "x509",
                "-req",
                "-in",
                "server.csr",
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                "server.pem",
                "-days",
                "1",
                "-extfile",
                "san.cnf",
            ],
        ];
        for args in steps {
            let made = Command::new("openssl").args(&args).current_dir(&dir).output().await.expect("run openssl");
            assert!(made.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&made.stderr));
        }
        let config = dir.join("nats.conf");
        let tls = format!(
            "tls {{ cert_file: \"{}\", key_file: \"{}\" }}\n",
            dir.join("server.pem").display(),
            dir.join("server.key").display()
        );
        std::fs::write(&config, tls + NATS_CONFIG).expect("write the NATS configuration");
        (Self::with_config(None, config).await, dir.join("ca.pem"))
    }

    async fn with_config(port: Option<u16>, config: PathBuf) -> Self {
        Self::spawn(port, config, None).await
    }

    /// With `routes`, a server of a NATS cluster, ready once it has that many
    /// routes to the others.
    async fn spawn(port: Option<u16>, config: PathBuf, routes: Option<usize>) -> Self {
        let port_arg = port.map_or("-1".to_owned(), |p| p.to_string());
        let mut args = vec!["-c".to_owned(), config.to_string_lossy().into_owned()];
        args.extend(["-a", "127.0.0.1", "-p", &port_arg].map(str::to_owned));
        if routes.is_some() {
            args.extend(["-m", "-1"].map(str::to_owned));
        }
        let mut child = Command::new(nats_binary())
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start nats-server");
        let stderr = child.stderr.take().expect("nats-server stderr");
        let said = std::cell::RefCell::new(Said::default());
        let (port, cluster) = watch_output(stderr, "nats-server", |line| {
            let mut said = said.borrow_mut();
            said.client = said.client.or(port_after(line, "Listening for client connections on "));
            said.route = said.route.or(port_after(line, "Listening for route connections on "));
            said.monitor = said.monitor.or(port_after(line, "Starting http monitor on "));
            said.routes_created += usize::from(line.contains("Route connection created"));
            match routes {
                None => Some((said.client?, None)),
                Some(n) if said.routes_created >= n => Some((said.client?, Some((said.route?, said.monitor?)))),
                Some(_) => None,
            }
        })
        .await;
        Self { child, port, config, cluster }
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
        *self = Self::with_config(Some(self.port), self.config.clone()).await;
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.config);
        // A TLS server's directory holds its certificates too.
        if let Some(dir) = self.config.parent().filter(|d| d.to_string_lossy().contains("imcore-nats-tls-")) {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// Waits until each of `nodes` knows exactly these nodes take homes (their
/// heartbeats heard, the silent ones forgotten), so they agree on every
/// conversation's home.
pub async fn homes_settled(nodes: &[&Node]) {
    let deadline = tokio::time::Instant::now() + START;
    for node in nodes {
        while node.metric("imcore_cluster_nodes").await != nodes.len() as f64 {
            assert!(tokio::time::Instant::now() < deadline, "the nodes never settled on who takes homes");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// One `imcore` process.
pub struct Node {
    child: Child,
    pub host: Ipv4Addr,
    pub port: u16,
}

/// What a node is started with, credentials and key included.
fn node_command(host: Ipv4Addr, database_url: &str, nats_url: &str, data_dir: &Path, homes: bool) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_imcore"));
    command
        .env("IMCORE_HOME_NODE", if homes { "on" } else { "off" })
        .env("DATABASE_URL", database_url)
        .env("IMCORE_NATS_URL", nats_url)
        .env("IMCORE_LISTEN", format!("{host}:0"))
        .env("IMCORE_ADMIN_TOKEN", ADMIN)
        .env("IMCORE_DATA_DIR", data_dir)
        .env("IMCORE_LOG", "info")
        .env("IMCORE_WORKERS", "1")
        .env("IMCORE_ARBITERS", "1")
        .env("IMCORE_POOL_SIZE", "6")
        .env("IMCORE_NATS_USER", NODE_USER)
        .env("IMCORE_NATS_PASSWORD", NODE_PASSWORD)
        .env("IMCORE_CLUSTER_KEY", CLUSTER_KEY)
        .env("NO_COLOR", "1");
    command
}

impl Node {
    async fn start(
        host: Ipv4Addr,
        database_url: &str,
        nats_url: &str,
        data_dir: &Path,
        homes: bool,
        env: &[(&str, &str)],
    ) -> Self {
        let mut child = node_command(host, database_url, nats_url, data_dir, homes)
            .envs(env.iter().copied())
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

    /// The value of `series` in the node's `/metrics` (0 when absent).
    pub async fn metric(&self, series: &str) -> f64 {
        let mut stream = TcpStream::connect((self.host, self.port)).await.expect("connect for /metrics");
        let ask = b"GET /metrics HTTP/1.1\r\nHost: imcore\r\nConnection: close\r\n\r\n";
        stream.write_all(ask).await.expect("ask for /metrics");
        let mut text = String::new();
        stream.read_to_string(&mut text).await.expect("read /metrics");
        sample(&Value::String(text), series)
    }
}

/// A TCP relay between one node and NATS, for cutting that node alone off:
/// it copies both ways until [`Relay::blackhole`] makes it swallow what the
/// node sends (a network dropping packets), and [`Relay::cut`] closes its
/// connections; the node's next connection is relayed again.
pub struct Relay {
    pub port: u16,
    swallow: Arc<AtomicBool>,
    cuts: watch::Sender<u64>,
}

impl Relay {
    async fn start(nats_port: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the relay");
        let port = listener.local_addr().expect("relay address").port();
        let swallow = Arc::new(AtomicBool::new(false));
        let (cuts, _) = watch::channel(0);
        let (swallowing, cut) = (swallow.clone(), cuts.clone());
        tokio::spawn(async move {
            while let Ok((node, _)) = listener.accept().await {
                let Ok(nats) = TcpStream::connect(("127.0.0.1", nats_port)).await else { continue };
                tokio::spawn(relay(node, nats, swallowing.clone(), cut.subscribe()));
            }
        });
        Self { port, swallow, cuts }
    }

    pub fn blackhole(&self) {
        self.swallow.store(true, Ordering::SeqCst);
    }

    /// Closes the relayed connections; later ones are copied faithfully.
    pub fn cut(&self) {
        self.swallow.store(false, Ordering::SeqCst);
        self.cuts.send_modify(|n| *n += 1);
    }
}

async fn relay(node: TcpStream, nats: TcpStream, swallow: Arc<AtomicBool>, mut cut: watch::Receiver<u64>) {
    let (mut from_node, mut to_node) = node.into_split();
    let (mut from_nats, mut to_nats) = nats.into_split();
    let upstream = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match from_node.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if !swallow.load(Ordering::SeqCst) && to_nats.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    let downstream = tokio::io::copy(&mut from_nats, &mut to_node);
    tokio::select! {
        () = upstream => {}
        _ = downstream => {}
        _ = cut.changed() => {}
    }
}

/// `n` nodes on 127.0.0.1 … 127.0.0.n, one NATS server (or a NATS cluster),
/// one database.
pub struct Cluster {
    /// Three servers and NATS keep both cores busy: no latency-bound or
    /// browser test runs beside a cluster.
    _cpu: tokio::sync::MutexGuard<'static, ()>,
    /// The nodes' database, for the test's life.
    pub db: TestDb,
    pub nats: Nats,
    /// The other servers of a NATS cluster that `nats` is one of.
    pub nats_peers: Vec<Nats>,
    pub nodes: Vec<Node>,
    data_dir: PathBuf,
}

impl Cluster {
    /// `n` nodes taking conversations' homes, once each knows all the others.
    pub async fn start(n: u8) -> Self {
        Self::start_relayed(n, None).await.0
    }

    /// As [`Cluster::start`], each node with `env` set besides.
    pub async fn start_with_env(n: u8, env: &[(&str, &str)]) -> Self {
        let (cluster, _) = Self::start_nodes(n, None, true, 1, env).await;
        homes_settled(&cluster.nodes.iter().collect::<Vec<_>>()).await;
        cluster
    }

    /// `n` nodes each writing every conversation itself (`IMCORE_HOME_NODE=off`).
    pub async fn start_writing_locally(n: u8) -> Self {
        Self::start_nodes(n, None, false, 1, &[]).await.0
    }

    /// Node `relayed` (if any) reaches NATS through a [`Relay`].
    pub async fn start_relayed(n: u8, relayed: Option<usize>) -> (Self, Option<Relay>) {
        let (cluster, relay) = Self::start_nodes(n, relayed, true, 1, &[]).await;
        homes_settled(&cluster.nodes.iter().collect::<Vec<_>>()).await;
        (cluster, relay)
    }

    /// `n` nodes taking homes on a NATS cluster of `servers`, each node given
    /// every server's URL (`IMCORE_NATS_URL`, comma-separated).
    pub async fn start_on_nats_cluster(n: u8, servers: usize) -> Self {
        let (cluster, _) = Self::start_nodes(n, None, true, servers, &[]).await;
        homes_settled(&cluster.nodes.iter().collect::<Vec<_>>()).await;
        cluster
    }

    async fn start_nodes(
        n: u8,
        relayed: Option<usize>,
        homes: bool,
        servers: usize,
        env: &[(&str, &str)],
    ) -> (Self, Option<Relay>) {
        let cpu = crate::harness::alone_with_the_cpu().await;
        let db = TestDb::with_pool(2).await;
        let mut nats_peers = if servers > 1 { Nats::cluster(servers).await } else { vec![Nats::start().await] };
        let nats = nats_peers.remove(0);
        let urls: Vec<String> = std::iter::once(&nats).chain(&nats_peers).map(Nats::url).collect();
        let relay = match relayed {
            Some(_) => Some(Relay::start(nats.port).await),
            None => None,
        };
        let data_dir = std::env::temp_dir().join(format!("imcore-cluster-{}", uuid::Uuid::new_v4().simple()));
        let mut nodes = Vec::new();
        for i in 1..=n {
            let url = match &relay {
                Some(r) if relayed == Some(usize::from(i) - 1) => format!("nats://127.0.0.1:{}", r.port),
                _ => urls.join(","),
            };
            nodes.push(Node::start(Ipv4Addr::new(127, 0, 0, i), &db.url, &url, &data_dir, homes, env).await);
        }
        (Self { _cpu: cpu, db, nats, nats_peers, nodes, data_dir }, relay)
    }

    /// Starts one more node with `env` changed (`None` removes a variable),
    /// expecting it to refuse to start: its exit status and all it printed.
    pub async fn node_refused(&self, env: &[(&str, Option<&str>)]) -> (Option<i32>, String) {
        let host = Ipv4Addr::new(127, 0, 0, 9);
        let mut command = node_command(host, &self.db.url, &self.nats.url(), &self.data_dir, true);
        for (key, value) in env {
            match value {
                Some(v) => command.env(key, v),
                None => command.env_remove(key),
            };
        }
        let run = command.stdout(Stdio::piped()).stderr(Stdio::piped()).kill_on_drop(true).output();
        let output =
            tokio::time::timeout(START, run).await.expect("the node neither started nor refused").expect("run");
        let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
        (output.status.code(), strip_ansi(&text))
    }

    /// One more node on `nats_url` with `env` set: started (listening), or
    /// the error it exited with.
    pub async fn try_node(&self, nats_url: &str, env: &[(&str, &str)]) -> Result<Node, String> {
        let host = Ipv4Addr::new(127, 0, 0, 9);
        let mut command = node_command(host, &self.db.url, nats_url, &self.data_dir, false);
        command.envs(env.iter().copied());
        let mut child =
            command.stdout(Stdio::piped()).stderr(Stdio::piped()).kill_on_drop(true).spawn().expect("start a node");
        let mut lines = BufReader::new(child.stdout.take().expect("node stdout")).lines();
        let listening = tokio::time::timeout(START, async {
            while let Ok(Some(line)) = lines.next_line().await {
                let line = strip_ansi(&line);
                if let Some((_, rest)) = line.split_once("imcore is listening") {
                    return rest
                        .split_once("port=")
                        .and_then(|(_, p)| p.split_whitespace().next()?.parse::<u16>().ok());
                }
            }
            None
        })
        .await
        .expect("the node neither started nor exited");
        match listening {
            Some(port) => {
                tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
                Ok(Node { child, host, port })
            }
            None => {
                let mut printed = String::new();
                if let Some(mut stderr) = child.stderr.take() {
                    let _ = stderr.read_to_string(&mut printed).await;
                }
                Err(strip_ansi(&printed))
            }
        }
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
