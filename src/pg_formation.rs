//! A pg_auto_failover formation on one machine — a monitor and two nodes, a
//! primary with a synchronous standby — run from Debian's packages
//! (`postgresql-15-auto-failover`, `pg-auto-failover-cli`) for the failover
//! test and the failover benchmark. Not used by the server, which only sees a
//! multi-host `DATABASE_URL`.
//!
//! Invariants: everything lives under one root directory, runs as the
//! unprivileged account the embedded PostgreSQL uses, and dies with us (each
//! keeper in its own process group, killed on drop with whatever still runs
//! in the root; SIGTERM by `PR_SET_PDEATHSIG` if we die first). Why and how:
//! ARCHITECTURE §6, "The database failing over".

use std::fs;
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tokio_postgres::NoTls;

use crate::pg::{self, PgError, RunAs, DATABASE};

/// The account the keepers connect as (the cluster's initdb superuser).
const USER: &str = "postgres";
const FORMING_TIMEOUT: Duration = Duration::from_secs(120);

/// The monitor's timers (GUCs `pgautofailover.*`, in ms), set before the nodes
/// join. `None`: pg_auto_failover's defaults.
#[derive(Debug, Clone, Copy, Default)]
pub struct Timers {
    pub health_check_period: Option<u32>,
    pub health_check_timeout: Option<u32>,
    pub health_check_retry_delay: Option<u32>,
    pub node_considered_unhealthy_timeout: Option<u32>,
    pub primary_demote_timeout: Option<u32>,
}

impl Timers {
    /// Short timers for a test on one machine (a failover in about 10 s).
    pub fn fast() -> Self {
        Self {
            health_check_period: Some(1_000),
            health_check_timeout: Some(1_000),
            health_check_retry_delay: Some(500),
            node_considered_unhealthy_timeout: Some(3_000),
            primary_demote_timeout: Some(3_000),
        }
    }

    fn settings(&self) -> Vec<(&'static str, u32)> {
        [
            ("health_check_period", self.health_check_period),
            ("health_check_timeout", self.health_check_timeout),
            ("health_check_retry_delay", self.health_check_retry_delay),
            ("node_considered_unhealthy_timeout", self.node_considered_unhealthy_timeout),
            ("primary_demote_timeout", self.primary_demote_timeout),
        ]
        .into_iter()
        .filter_map(|(k, v)| Some((k, v?)))
        .collect()
    }
}

/// One node as the monitor sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeState {
    pub name: String,
    pub port: u16,
    pub reported: String,
    pub goal: String,
}

impl NodeState {
    /// Settled as the primary (with or without a standby in sync).
    pub fn is_primary(&self) -> bool {
        self.reported == self.goal && (self.reported == "primary" || self.reported == "wait_primary")
    }
}

/// A running formation; dropping it kills every process and removes the root.
pub struct Formation {
    root: PathBuf,
    run_as: Option<RunAs>,
    monitor_port: u16,
    ports: [u16; 2],
    /// Process groups of the monitor's and the nodes' keepers, `None` once killed.
    groups: Vec<Option<i32>>,
}

/// Why a formation cannot run here (the packages are missing), or `None`.
pub fn missing() -> Option<String> {
    let autoctl = ["/usr/bin/pg_autoctl", "/usr/local/bin/pg_autoctl"].iter().any(|p| Path::new(p).is_file());
    let extension = fs::read_dir("/usr/share/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .any(|v| v.path().join("extension/pgautofailover.control").is_file());
    (!(autoctl && extension)).then(|| {
        "pg_auto_failover is not installed (apt-get install postgresql-15-auto-failover pg-auto-failover-cli)".into()
    })
}

impl Formation {
    /// Creates the monitor (with `timers`), then the primary, then the
    /// standby, and returns once the standby is in sync.
    pub async fn start(root: &Path, timers: Timers) -> Result<Self, PgError> {
        let bindir = pg::find_bindir()?;
        let run_as = pg::run_as()?;
        let _ = fs::remove_dir_all(root);
        fs::DirBuilder::new().recursive(true).mode(0o755).create(root).map_err(pg::io("create formation root"))?;
        let root = root.canonicalize().map_err(pg::io("resolve formation root"))?;
        if let Some(r) = run_as {
            pg::make_searchable(&bindir, &root, r)?;
            std::os::unix::fs::chown(&root, Some(r.uid), Some(r.gid)).map_err(pg::io("chown formation root"))?;
        }
        let monitor_port = pg::free_port()?;
        let ports = [pg::free_port()?, pg::free_port()?];
        let mut f = Self { root, run_as, monitor_port, ports, groups: vec![] };
        let pgctl = bindir.join("pg_ctl");
        f.keeper(&[
            "create",
            "monitor",
            "--pgdata",
            &f.path("monitor"),
            "--pgport",
            &monitor_port.to_string(),
            "--pgctl",
            &pgctl.to_string_lossy(),
            "--hostname",
            "127.0.0.1",
            "--auth",
            "trust",
            "--no-ssl",
            "--run",
        ])?;
        let monitor = f.wait_connect(&f.monitor_url()).await?;
        for (k, v) in timers.settings() {
            monitor.batch_execute(&format!("ALTER SYSTEM SET pgautofailover.{k} = {v}")).await.map_err(failed)?;
        }
        monitor.batch_execute("SELECT pg_reload_conf()").await.map_err(failed)?;
        for i in 0..2 {
            f.create_node(i, &pgctl)?;
            f.wait_formed(i + 1).await?;
        }
        Ok(f)
    }

    /// The URL the server gets: both nodes, whichever is primary.
    pub fn url(&self) -> String {
        format!(
            "postgres://{USER}@127.0.0.1:{},127.0.0.1:{}/{DATABASE}?target_session_attrs=read-write",
            self.ports[0], self.ports[1]
        )
    }

    /// Node `i` alone (0 or 1), whatever its role.
    pub fn node_url(&self, i: usize) -> String {
        format!("postgres://{USER}@127.0.0.1:{}/{DATABASE}", self.ports[i])
    }

    /// Node `i`'s postmaster (benchmarks count its CPU), if it runs.
    pub fn postmaster(&self, i: usize) -> Option<i32> {
        let pid = fs::read_to_string(Path::new(&self.path(&format!("node{i}"))).join("postmaster.pid")).ok()?;
        pid.lines().next()?.trim().parse().ok()
    }

    /// The nodes as the monitor sees them, in node order.
    pub async fn states(&self) -> Result<Vec<NodeState>, PgError> {
        let client = connect(&self.monitor_url()).await?;
        let rows = client
            .query(
                "SELECT nodename, nodeport, reportedstate::text, goalstate::text FROM pgautofailover.node \
                 ORDER BY nodeid",
                &[],
            )
            .await
            .map_err(failed)?;
        rows.iter()
            .map(|r| {
                let port: i32 = r.try_get(1).map_err(failed)?;
                Ok(NodeState {
                    name: r.try_get(0).map_err(failed)?,
                    port: u16::try_from(port).unwrap_or(0),
                    reported: r.try_get(2).map_err(failed)?,
                    goal: r.try_get(3).map_err(failed)?,
                })
            })
            .collect()
    }

    /// The index of the settled primary, if there is one.
    pub async fn primary(&self) -> Option<usize> {
        let states = self.states().await.ok()?;
        let port = states.iter().find(|s| s.is_primary())?.port;
        self.ports.iter().position(|p| *p == port)
    }

    /// SIGKILLs node `i`'s keeper and its PostgreSQL at once, like a machine
    /// lost (killing PostgreSQL alone, its keeper would restart it).
    pub fn kill(&mut self, i: usize) {
        if let Some(group) = self.groups.get_mut(i + 1).and_then(Option::take) {
            // SAFETY: kill(2) on a process group we created.
            unsafe {
                libc::kill(-group, libc::SIGKILL);
            }
        }
    }

    /// A planned switchover (`pg_autoctl perform switchover`); returns once
    /// the monitor reports it done.
    pub fn switchover(&self) -> Result<(), PgError> {
        let out = self
            .command(&["perform", "switchover", "--pgdata", &self.path("monitor"), "--wait", "120"])
            .output()
            .map_err(pg::io("run pg_autoctl perform switchover"))?;
        if !out.status.success() {
            let detail = String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or_default().to_owned();
            return Err(PgError::Failed { step: "pg_autoctl perform switchover".into(), detail });
        }
        Ok(())
    }

    /// The directory everything of the formation lives under, resolved.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn monitor_url(&self) -> String {
        format!("postgres://{USER}@127.0.0.1:{}/pg_auto_failover", self.monitor_port)
    }

    fn path(&self, name: &str) -> String {
        self.root.join(name).to_string_lossy().into_owned()
    }

    fn create_node(&mut self, i: usize, pgctl: &Path) -> Result<(), PgError> {
        let monitor =
            format!("postgres://autoctl_node@127.0.0.1:{}/pg_auto_failover?sslmode=disable", self.monitor_port);
        self.keeper(&[
            "create",
            "postgres",
            "--pgdata",
            &self.path(&format!("node{i}")),
            "--pgport",
            &self.ports[i].to_string(),
            "--pgctl",
            &pgctl.to_string_lossy(),
            "--listen",
            "127.0.0.1",
            "--hostname",
            "127.0.0.1",
            "--name",
            &format!("node{i}"),
            "--dbname",
            DATABASE,
            "--monitor",
            &monitor,
            "--auth",
            "trust",
            "--no-ssl",
            "--run",
        ])
    }

    /// `pg_autoctl` as the unprivileged account, its files under the root.
    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new("pg_autoctl");
        cmd.args(args).current_dir(&self.root);
        for var in ["XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_RUNTIME_DIR", "HOME", "PG_REGRESS_SOCK_DIR"] {
            cmd.env(var, &self.root);
        }
        cmd.env("PGHOST", "127.0.0.1");
        if let Some(r) = self.run_as {
            cmd.uid(r.uid).gid(r.gid);
        }
        cmd
    }

    /// Starts a keeper in a process group of its own, its output in `<name>.log`.
    fn keeper(&mut self, args: &[&str]) -> Result<(), PgError> {
        let name = format!("keeper{}", self.groups.len());
        let log = fs::File::create(self.root.join(format!("{name}.log"))).map_err(pg::io("open keeper log"))?;
        let mut cmd = self.command(args);
        cmd.stdin(Stdio::null()).stdout(log.try_clone().map_err(pg::io("open keeper log"))?).stderr(log);
        cmd.process_group(0);
        // SAFETY: prctl is async-signal-safe; it runs in the child after the
        // credentials change (which would otherwise clear the death signal).
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let (pid, _exited) = pg::spawn_kept(cmd)?;
        self.groups.push(Some(pid));
        Ok(())
    }

    async fn wait_connect(&self, url: &str) -> Result<tokio_postgres::Client, PgError> {
        let deadline = Instant::now() + FORMING_TIMEOUT;
        loop {
            match connect(url).await {
                Ok(c) => return Ok(c),
                Err(e) if Instant::now() > deadline => return Err(e),
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }

    /// Waits until `nodes` nodes have settled, one of them primary, the rest
    /// secondaries. A standby's base backup waits for a checkpoint, which a
    /// spread checkpoint would make minutes: the primary is asked for one.
    async fn wait_formed(&self, nodes: usize) -> Result<(), PgError> {
        let deadline = Instant::now() + FORMING_TIMEOUT;
        loop {
            let states = self.states().await.unwrap_or_default();
            let settled = states.iter().all(|s| s.reported == s.goal);
            let primaries = states.iter().filter(|s| s.reported == "primary" || s.reported == "single").count();
            let secondaries = states.iter().filter(|s| s.reported == "secondary").count();
            if states.len() == nodes && settled && primaries == 1 && secondaries == nodes - 1 {
                return Ok(());
            }
            if Instant::now() > deadline {
                let detail = format!("{states:?}; logs in {}", self.root.display());
                return Err(PgError::Failed { step: "form the pg_auto_failover formation".into(), detail });
            }
            if nodes > 1 {
                if let Ok(c) = connect(&self.node_url(0)).await {
                    let _ = c.batch_execute("CHECKPOINT").await;
                }
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

impl Drop for Formation {
    fn drop(&mut self) {
        for group in self.groups.iter_mut().filter_map(Option::take) {
            // SAFETY: kill(2) on a process group we created.
            unsafe {
                libc::kill(-group, libc::SIGKILL);
            }
        }
        // PostgreSQL's backends leave once their postmaster is gone, but each
        // runs in a session of its own, out of its keeper's group, and the
        // monitor's health-check worker can outlive it (after a failover):
        // what still runs in the root is found by its working directory.
        std::thread::sleep(Duration::from_millis(500));
        for pid in processes_under(&self.root) {
            // SAFETY: kill(2) on a process of this formation.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
        let _ = fs::remove_dir_all(&self.root);
    }
}

/// The processes whose working directory lies under `root` (each
/// PostgreSQL process works in its data directory).
pub fn processes_under(root: &Path) -> Vec<i32> {
    let Ok(procs) = fs::read_dir("/proc") else {
        return vec![];
    };
    procs
        .flatten()
        .filter_map(|p| p.file_name().to_str()?.parse().ok())
        .filter(|pid: &i32| fs::read_link(format!("/proc/{pid}/cwd")).is_ok_and(|cwd| cwd.starts_with(root)))
        .collect()
}

async fn connect(url: &str) -> Result<tokio_postgres::Client, PgError> {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await.map_err(failed)?;
    tokio::spawn(connection);
    Ok(client)
}

fn failed(e: tokio_postgres::Error) -> PgError {
    PgError::Failed { step: "talk to the pg_auto_failover formation".into(), detail: e.to_string() }
}
