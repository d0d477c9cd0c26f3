//! The servers of one run: a single `imcore`, or `N` nodes on the run's one
//! database joined by a `nats-server` of the run's own (ARCHITECTURE §7),
//! each node on its own loopback port. Provisioning goes to node 0 (they
//! share the database); connection `i` goes to node `i % N`, so deliveries
//! cross nodes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use imcore_client::Http;
use serde_json::{json, Value};
use tokio::net::TcpStream;

use super::provision::BoxError;
use super::server::{die_with_us, proc_cpu_s, stop_child, Server, ServerProcs};

/// Where Debian's `nats-server` package puts the binary, then `PATH`.
pub fn nats_binary() -> Result<PathBuf, BoxError> {
    let installed = ["/usr/sbin/nats-server", "/usr/bin/nats-server"].into_iter().map(PathBuf::from);
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).map(|d| d.join("nats-server")).collect::<Vec<_>>())
        .unwrap_or_default();
    installed.chain(on_path).find(|p| p.is_file()).ok_or_else(|| {
        "no nats-server in /usr/sbin, /usr/bin or on PATH: several nodes need it (Debian: apt-get install nats-server)"
            .into()
    })
}

/// The nodes' NATS user.
const NODE_USER: &str = "imcore-node";

/// A `nats-server` child process on a free loopback port, with authorization
/// as the README's recipe has it: only the nodes' user (`password`) may use
/// `imcore.>`.
struct Nats {
    child: Child,
    pid: i32,
    port: u16,
    password: String,
}

/// 32 random bytes, hex.
fn secret() -> String {
    (0..32).map(|_| format!("{:02x}", rand::random::<u8>())).collect()
}

impl Nats {
    async fn start(bin: &Path, log: &Path, config: &Path) -> Result<Self, BoxError> {
        let port = imcore_client::free_port()?;
        let password = secret();
        std::fs::write(
            config,
            format!(
                "authorization {{ users = [ {{ user: \"{NODE_USER}\", password: \"{password}\", \
                 permissions: {{ publish: [\"imcore.>\"], subscribe: [\"imcore.>\"] }} }} ] }}\n"
            ),
        )?;
        let log = std::fs::File::create(log)?;
        let mut cmd = Command::new(bin);
        cmd.args(["-c", &config.to_string_lossy(), "-a", "127.0.0.1", "-p", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        die_with_us(&mut cmd);
        let child = cmd.spawn()?;
        let pid = child.id() as i32;
        let mut nats = Self { child, pid, port, password };
        let deadline = Instant::now() + Duration::from_secs(30);
        while TcpStream::connect(("127.0.0.1", port)).await.is_err() {
            if let Some(status) = nats.child.try_wait()? {
                return Err(format!("nats-server exited at start-up: {status}").into());
            }
            if Instant::now() > deadline {
                nats.stop();
                return Err("nats-server did not listen in 30 s".into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(nats)
    }

    fn stop(&mut self) {
        stop_child(&mut self.child, "nats-server");
    }
}

pub struct Nodes {
    servers: Vec<Server>,
    nats: Option<Nats>,
}

impl Nodes {
    /// `n` servers on `database_url` (with NATS when `n > 1`), logging to
    /// `server-{name}.log` in `ctx`'s data directory, or `server-{name}-node{i}.log`
    /// and `nats-{name}.log`.
    pub async fn start(
        ctx: &super::Ctx,
        name: &str,
        write_path: &str,
        database_url: &str,
        n: usize,
        env: &[(String, String)],
    ) -> Result<Self, BoxError> {
        let dir = &ctx.args.data_dir;
        let mut nodes = Self { servers: vec![], nats: None };
        if n <= 1 {
            let log = dir.join(format!("server-{name}.log"));
            nodes.servers.push(Server::start(&ctx.bin, write_path, database_url, &log, env).await?);
            return Ok(nodes);
        }
        let nats_bin = ctx.nats.as_deref().ok_or("several nodes need --nodes above 1 (and nats-server)")?;
        let (log, config) = (dir.join(format!("nats-{name}.log")), dir.join(format!("nats-{name}.conf")));
        let nats = nodes.nats.insert(Nats::start(nats_bin, &log, &config).await?);
        let mut env = env.to_vec();
        env.push(("IMCORE_NATS_URL".into(), format!("nats://127.0.0.1:{}", nats.port)));
        env.push(("IMCORE_NATS_USER".into(), NODE_USER.into()));
        env.push(("IMCORE_NATS_PASSWORD".into(), nats.password.clone()));
        env.push(("IMCORE_CLUSTER_KEY".into(), secret()));
        eprintln!("nats {name}: pid {}, port {}", nats.pid, nats.port);
        for i in 0..n {
            let log = dir.join(format!("server-{name}-node{i}.log"));
            match Server::start(&ctx.bin, write_path, database_url, &log, &env).await {
                Ok(server) => nodes.servers.push(server),
                Err(e) => {
                    nodes.stop();
                    return Err(format!("node {i} of {n}: {e}").into());
                }
            }
        }
        Ok(nodes)
    }

    pub fn count(&self) -> usize {
        self.servers.len()
    }

    pub fn servers(&self) -> &[Server] {
        &self.servers
    }

    /// Node 0: users, devices and groups are made through it.
    pub fn first(&self) -> &Server {
        &self.servers[0]
    }

    /// The port connection `i` goes to.
    pub fn port(&self, i: usize) -> u16 {
        self.servers[i % self.servers.len()].port
    }

    /// `sync` pages the nodes (but node `except`) read on PostgreSQL so far,
    /// summed, by where (`imcore_sync_reads_total{from}`: the standby, or the
    /// primary and why).
    pub async fn sync_reads(&self, except: Option<usize>) -> Result<BTreeMap<String, f64>, BoxError> {
        let mut reads = BTreeMap::new();
        for (_, s) in self.servers.iter().enumerate().filter(|(i, _)| Some(*i) != except) {
            let (_, text) = Http::new(s.port).call("GET", "/metrics", None, None).await?;
            for line in text.as_str().unwrap_or_default().lines() {
                let Some(rest) = line.strip_prefix("imcore_sync_reads_total{from=\"") else { continue };
                if let Some((from, n)) = rest.split_once("\"} ") {
                    *reads.entry(from.to_owned()).or_default() += n.parse::<f64>().unwrap_or(0.0);
                }
            }
        }
        Ok(reads)
    }

    /// The node of connection `i`, when there are several.
    pub fn node_of(&self, i: usize) -> Option<usize> {
        (self.servers.len() > 1).then(|| i % self.servers.len())
    }

    /// Kills node `i` (SIGKILL); from then on its CPU reads 0.
    pub fn kill(&mut self, i: usize) -> Result<(), BoxError> {
        let node = self.servers.get_mut(i).ok_or("no such node")?;
        Ok(node.kill()?)
    }

    /// RSS of the nodes together.
    pub fn rss_kib(&self) -> u64 {
        self.servers.iter().map(Server::rss_kib).sum()
    }

    /// SIGTERM to every node, then to NATS (the nodes leave the bus first).
    pub fn stop(&mut self) {
        for s in &mut self.servers {
            s.stop();
        }
        if let Some(nats) = &mut self.nats {
            nats.stop();
        }
    }
}

impl ServerProcs for Nodes {
    fn node_cpu_s(&self) -> Vec<f64> {
        self.servers.iter().map(Server::cpu_s).collect()
    }

    fn nats_cpu_s(&self) -> Option<f64> {
        self.nats.as_ref().map(|n| proc_cpu_s(n.pid))
    }
}

/// `sync` pages read since `before`, by where, and the standby's share.
pub fn reads_since(before: &BTreeMap<String, f64>, after: BTreeMap<String, f64>) -> Value {
    let by: BTreeMap<String, f64> =
        after.into_iter().map(|(k, n)| (k.clone(), n - before.get(&k).unwrap_or(&0.0))).collect();
    let total = by.values().fold(0.0, |sum, n| sum + n);
    let standby = by.get("standby").copied().unwrap_or(0.0);
    json!({"by": by, "total": total, "standby_share": (standby / total.max(1.0) * 1000.0).round() / 1000.0})
}
