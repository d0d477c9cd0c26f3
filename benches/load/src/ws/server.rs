//! The systems under test: PostgreSQL (embedded, or a server given by URL; one
//! fresh database per server run) and the `imcore` server as a child process,
//! plus CPU and memory readings from `/proc`.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use imcore::pg::{EmbeddedPg, PgOptions, DATABASE};
use imcore::store::Store;

use imcore_client::Http;

use super::provision::BoxError;

pub struct Pg {
    /// Kept alive while benchmarking; stopped when dropped.
    embedded: Option<EmbeddedPg>,
    /// URL of the maintenance database; per-run databases replace its name.
    url: String,
    /// The postmaster, when it runs on this machine and we know it.
    pub postmaster: Option<i32>,
    pub admin: Store,
}

impl Pg {
    pub async fn start(url: Option<&str>, data_dir: &Path) -> Result<Self, BoxError> {
        let (embedded, url, postmaster) = match url {
            Some(u) => (None, u.to_owned(), None),
            None => {
                let pg = EmbeddedPg::start(PgOptions::new(data_dir)).await?;
                let url = pg.url(DATABASE);
                let pid = std::fs::read_to_string(data_dir.join("pg/postmaster.pid"))
                    .ok()
                    .and_then(|s| s.lines().next().and_then(|l| l.trim().parse().ok()));
                (Some(pg), url, pid)
            }
        };
        let admin = Store::connect(&url, 2).await?;
        Ok(Self { embedded, url, postmaster, admin })
    }

    pub fn url_of(&self, db: &str) -> String {
        with_database(&self.url, db)
    }

    /// A fresh database named `db` (dropped first if left over).
    pub async fn create_db(&self, db: &str) -> Result<String, BoxError> {
        let conn = self.admin.pool().get().await?;
        conn.batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)")).await?;
        conn.batch_execute(&format!("CREATE DATABASE {db}")).await?;
        Ok(self.url_of(db))
    }

    pub async fn drop_db(&self, db: &str) -> Result<(), BoxError> {
        let conn = self.admin.pool().get().await?;
        conn.batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)")).await?;
        Ok(())
    }

    pub async fn version(&self) -> Result<String, BoxError> {
        let conn = self.admin.pool().get().await?;
        Ok(conn.query_one("SHOW server_version", &[]).await?.get(0))
    }

    /// Mean latency (ms) of `n` one-row INSERT transactions, one after another:
    /// what one commit (WAL flush) costs on this machine right now.
    pub async fn commit_probe(&self, n: usize) -> Result<f64, BoxError> {
        let conn = self.admin.pool().get().await?;
        conn.batch_execute("CREATE TABLE IF NOT EXISTS bench_commit_probe (x int8)").await?;
        let started = Instant::now();
        for i in 0..n as i64 {
            conn.execute("INSERT INTO bench_commit_probe VALUES ($1)", &[&i]).await?;
        }
        let ms = started.elapsed().as_secs_f64() * 1000.0 / n.max(1) as f64;
        conn.batch_execute("DROP TABLE bench_commit_probe").await?;
        Ok(ms)
    }

    /// CPU seconds of the postmaster and its children (the backends).
    pub fn cpu_s(&self) -> f64 {
        let Some(pm) = self.postmaster else { return 0.0 };
        let mut total = proc_cpu_s(pm);
        if let Ok(dir) = std::fs::read_dir("/proc") {
            for e in dir.flatten() {
                let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else { continue };
                if proc_stat(pid).is_some_and(|f| f.get(1).and_then(|p| p.parse::<i32>().ok()) == Some(pm)) {
                    total += proc_cpu_s(pid);
                }
            }
        }
        total
    }

    pub fn stop(self) {
        if let Some(pg) = self.embedded {
            pg.stop();
        }
    }
}

/// `url` with its database replaced by `db`.
pub fn with_database(url: &str, db: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, format!("?{q}")),
        None => (url, String::new()),
    };
    let base = base.rsplit_once('/').map_or(base, |(b, _)| b);
    format!("{base}/{db}{query}")
}

/// The `imcore` binary: next to this one, or `target/release/imcore`.
pub fn server_binary(given: Option<&Path>) -> Result<PathBuf, BoxError> {
    if let Some(p) = given {
        return Ok(p.to_owned());
    }
    let beside = std::env::current_exe()?.with_file_name("imcore");
    if beside.exists() {
        return Ok(beside);
    }
    let release = PathBuf::from("target/release/imcore");
    if release.exists() {
        return Ok(release);
    }
    Err(format!(
        "no imcore binary at {} or target/release/imcore; build it with `cargo build --release`",
        beside.display()
    )
    .into())
}

/// A running `imcore` child process.
pub struct Server {
    child: Child,
    pub port: u16,
    pub admin: String,
    pub pid: i32,
}

impl Server {
    pub async fn start(
        bin: &Path,
        write_path: &str,
        database_url: &str,
        log: &Path,
        extra_env: &[(String, String)],
    ) -> Result<Self, BoxError> {
        let port = imcore_client::free_port()?;
        let admin = format!("bench-admin-{:032x}", rand::random::<u128>());
        let log = std::fs::File::create(log)?;
        let mut cmd = Command::new(bin);
        cmd.env("IMCORE_WRITE_PATH", write_path)
            .env("IMCORE_LISTEN", format!("127.0.0.1:{port}"))
            .env("DATABASE_URL", database_url)
            .env("IMCORE_ADMIN_TOKEN", &admin)
            .env("IMCORE_LOG", "warn")
            // Tens of thousands of connections from 16 loopback addresses
            // (and 100 devices per user): the per-client caps are not measured here.
            .env("IMCORE_MAX_CONNECTIONS_PER_IP", "0")
            .env("IMCORE_MAX_CONNECTIONS_PER_USER", "0")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        for (k, v) in extra_env {
            cmd.env(k, v);
        }
        die_with_us(&mut cmd);
        let child = cmd.spawn()?;
        let pid = child.id() as i32;
        let mut server = Self { child, port, admin, pid };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = server.child.try_wait()? {
                return Err(format!("imcore exited at start-up: {status}").into());
            }
            if let Ok((200, _)) = Http::new(port).call("GET", "/readyz", None, None).await {
                return Ok(server);
            }
            if Instant::now() > deadline {
                server.stop();
                return Err("imcore did not become ready in 60 s".into());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn cpu_s(&self) -> f64 {
        proc_cpu_s(self.pid)
    }

    pub fn rss_kib(&self) -> u64 {
        proc_status_kib(self.pid, "VmRSS:")
    }

    pub fn hwm_kib(&self) -> u64 {
        proc_status_kib(self.pid, "VmHWM:")
    }

    /// SIGTERM (graceful shutdown), then SIGKILL after 30 s.
    pub fn stop(&mut self) {
        stop_child(&mut self.child, "imcore");
    }

    /// SIGKILL, like a crashed machine: nothing said to anyone.
    pub fn kill(&mut self) -> std::io::Result<()> {
        self.child.kill()?;
        self.child.wait().map(drop)
    }
}

/// The child gets SIGTERM when this process dies: no server outlives a run.
pub fn die_with_us(cmd: &mut Command) {
    // SAFETY: prctl is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// SIGTERM, then SIGKILL after 30 s. Stopping a stopped child does nothing
/// (its pid may belong to another process by now).
pub fn stop_child(child: &mut Child, what: &str) {
    if let Ok(Some(_)) = child.try_wait() {
        return;
    }
    let pid = child.id() as i32;
    // SAFETY: kill(2) on our own child, not yet reaped.
    unsafe {
        libc::kill(pid, libc::SIGTERM);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("{what} (pid {pid}) did not stop in 30 s; killing it");
    let _ = child.kill();
    let _ = child.wait();
}

/// Fields after the command name of `/proc/<pid>/stat` (index 0 = state).
pub(crate) fn proc_stat(pid: i32) -> Option<Vec<String>> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &s[s.rfind(')')? + 1..];
    Some(rest.split_whitespace().map(str::to_owned).collect())
}

/// utime + stime of `pid`, in seconds.
pub fn proc_cpu_s(pid: i32) -> f64 {
    // SAFETY: sysconf has no preconditions.
    let tick = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    proc_stat(pid)
        .map(|f| {
            let n = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            (n(11) + n(12)) as f64 / tick
        })
        .unwrap_or(0.0)
}

pub fn proc_status_kib(pid: i32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(key).and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok()))
        })
        .unwrap_or(0)
}

/// CPU seconds of this process (the load generator).
pub fn self_cpu_s() -> f64 {
    // SAFETY: getrusage fills the struct we own.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return 0.0;
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Raises the open-file limit as far as allowed (children inherit it).
pub fn raise_nofile(want: u64) -> u64 {
    // SAFETY: get/setrlimit on a struct we own.
    unsafe {
        let mut lim: libc::rlimit = std::mem::zeroed();
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        let target =
            libc::rlimit { rlim_cur: want as libc::rlim_t, rlim_max: (want as libc::rlim_t).max(lim.rlim_max) };
        if libc::setrlimit(libc::RLIMIT_NOFILE, &target) != 0 {
            let soft = libc::rlimit { rlim_cur: lim.rlim_max, rlim_max: lim.rlim_max };
            libc::setrlimit(libc::RLIMIT_NOFILE, &soft);
        }
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        lim.rlim_cur as u64
    }
}

/// The processes serving a run: one `imcore`, or several nodes and their NATS.
pub trait ServerProcs {
    /// CPU seconds of each `imcore` process.
    fn node_cpu_s(&self) -> Vec<f64>;
    /// CPU seconds of the NATS server joining the nodes, if any.
    fn nats_cpu_s(&self) -> Option<f64>;
}

impl ServerProcs for Server {
    fn node_cpu_s(&self) -> Vec<f64> {
        vec![self.cpu_s()]
    }

    fn nats_cpu_s(&self) -> Option<f64> {
        None
    }
}

/// CPU readings over a window: server, PostgreSQL, load generator.
pub struct CpuWindow {
    at: Instant,
    nodes: Vec<f64>,
    nats: Option<f64>,
    pg: f64,
    generator: f64,
}

impl CpuWindow {
    pub fn start(server: &impl ServerProcs, pg: &Pg) -> Self {
        Self {
            at: Instant::now(),
            nodes: server.node_cpu_s(),
            nats: server.nats_cpu_s(),
            pg: pg.cpu_s(),
            generator: self_cpu_s(),
        }
    }

    /// `(seconds, server cores, postgres cores, generator cores)` busy on
    /// average, and the server's CPU seconds: every node's summed, and with
    /// several nodes each node's and their NATS server's too.
    pub fn end(&self, server: &impl ServerProcs, pg: &Pg) -> serde_json::Value {
        let secs = self.at.elapsed().as_secs_f64().max(1e-9);
        let r = |x: f64| (x * 100.0).round() / 100.0;
        let nodes: Vec<f64> = server.node_cpu_s().iter().zip(&self.nodes).map(|(now, then)| now - then).collect();
        let spent: f64 = nodes.iter().sum();
        let mut cpu = serde_json::json!({
            "window_s": r(secs),
            "server_cores": r(spent / secs),
            "postgres_cores": r((pg.cpu_s() - self.pg) / secs),
            "generator_cores": r((self_cpu_s() - self.generator) / secs),
            "server_cpu_s": r(spent),
        });
        if nodes.len() > 1 {
            cpu["server_cpu_s_per_node"] = nodes.iter().map(|&s| r(s)).collect();
        }
        if let (Some(now), Some(then)) = (server.nats_cpu_s(), self.nats) {
            cpu["nats_cores"] = serde_json::json!(r((now - then) / secs));
        }
        cpu
    }
}

/// Push efficiency: `deliveries` pushed in a window per second of server CPU
/// spent in it (`cpu` from [`CpuWindow::end`]).
pub fn deliveries_per_server_core_s(deliveries: u64, cpu: &serde_json::Value) -> Option<f64> {
    let spent = cpu["server_cpu_s"].as_f64().filter(|s| *s > 0.0)?;
    Some((deliveries as f64 / spent).round())
}
