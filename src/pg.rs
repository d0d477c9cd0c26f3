//! Embedded PostgreSQL: when no `DATABASE_URL` is given, imcore runs a private
//! PostgreSQL server from the installed binaries in a data directory of its
//! own: the cluster in `<data_dir>/pg`, its password in `<data_dir>/pg-password`
//! (password auth on 127.0.0.1 only; no Unix socket).
//!
//! Invariants: data survives restarts and durability stays at PostgreSQL's
//! defaults; as root the server runs as `postgres` (or `nobody`), and a data
//! directory private to root gets one ACL entry letting that user search it,
//! nothing more; the server never outlives us (its own process group, and
//! SIGINT through `PR_SET_PDEATHSIG` if we die without stopping it). Why:
//! ARCHITECTURE §6.

use std::fs;
use std::io::Write;
use std::net::{Ipv4Addr, TcpListener};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Mutex};
use std::time::{Duration, Instant};

use rand::distributions::Alphanumeric;
use rand::Rng;

const SUPERUSER: &str = "imcore";
pub const DATABASE: &str = "imcore";
const START_TIMEOUT: Duration = Duration::from_secs(60);
const STOP_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum PgError {
    #[error(
        "PostgreSQL server binaries not found (looked in /usr/lib/postgresql/*/bin and `pg_config --bindir`): \
         install the Debian package `postgresql` (apt-get install postgresql-15), or set DATABASE_URL"
    )]
    BinariesNotFound,
    #[error("{step}: {source}")]
    Io {
        step: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{step} failed: {detail}")]
    Failed { step: String, detail: String },
    #[error("data directory {0} is in use by a running imcore (pid {1})")]
    InUse(PathBuf, i32),
    #[error(
        "the embedded PostgreSQL runs as `{user}` (imcore runs as root), which cannot search {dir} on the way to \
         the data directory {root}: let it (`setfacl -m u:{user}:x {dir}`), choose an IMCORE_DATA_DIR it can reach, \
         or set DATABASE_URL"
    )]
    Unreachable { user: &'static str, dir: PathBuf, root: PathBuf },
}

pub(crate) fn io(step: impl Into<String>) -> impl FnOnce(std::io::Error) -> PgError {
    let step = step.into();
    move |source| PgError::Io { step, source }
}

/// Options for a private cluster.
#[derive(Debug, Clone)]
pub struct PgOptions {
    /// Holds `pg/`, `pg-password`, `pg.log`.
    pub root: PathBuf,
    /// Extra `-c name=value` settings (tests raise `max_connections`).
    pub settings: Vec<(String, String)>,
    /// Skip initdb's own fsync of the new cluster (tests only: a fresh throwaway
    /// cluster). Runtime durability is unaffected.
    pub fast_init: bool,
}

impl PgOptions {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into(), settings: Vec::new(), fast_init: false }
    }
}

/// A running private PostgreSQL server. Dropping it stops the server.
#[derive(Debug)]
pub struct EmbeddedPg {
    port: u16,
    password: String,
    pid: i32,
    /// Signalled by the keeper thread when the server process has exited.
    exited: Mutex<mpsc::Receiver<()>>,
}

/// The account the server runs as when we are root.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RunAs {
    pub(crate) name: &'static str,
    pub(crate) uid: u32,
    pub(crate) gid: u32,
}

impl EmbeddedPg {
    /// Initialises the cluster on first use, starts the server and creates the
    /// `imcore` database if missing.
    pub async fn start(opts: PgOptions) -> Result<Self, PgError> {
        let bindir = find_bindir()?;
        let run_as = run_as()?;
        fs::DirBuilder::new().recursive(true).mode(0o755).create(&opts.root).map_err(io("create data directory"))?;
        let root = opts.root.canonicalize().map_err(io("resolve data directory"))?;
        if let Some(r) = run_as {
            make_searchable(&bindir, &root, r)?;
        }
        let cluster = root.join("pg");
        let password = if cluster.join("PG_VERSION").exists() {
            fs::read_to_string(root.join("pg-password")).map_err(io("read pg-password"))?.trim().to_owned()
        } else {
            init_cluster(&bindir, &root, &cluster, run_as, opts.fast_init)?
        };
        take_over_stale_server(&cluster, &root)?;

        let port = free_port()?;
        let log =
            fs::OpenOptions::new().create(true).append(true).open(root.join("pg.log")).map_err(io("open pg.log"))?;
        let mut cmd = Command::new(bindir.join("postgres"));
        cmd.arg("-D").arg(&cluster).args(["-p", &port.to_string()]);
        for (k, v) in [("listen_addresses", "127.0.0.1"), ("unix_socket_directories", "")] {
            cmd.arg("-c").arg(format!("{k}={v}"));
        }
        for (k, v) in &opts.settings {
            cmd.arg("-c").arg(format!("{k}={v}"));
        }
        cmd.stdin(Stdio::null()).stdout(log.try_clone().map_err(io("open pg.log"))?).stderr(log).process_group(0);
        if let Some(r) = run_as {
            cmd.uid(r.uid).gid(r.gid);
        }
        // SAFETY: prctl is async-signal-safe; it runs in the child after the
        // credentials change (which would otherwise clear the death signal).
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGINT) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let (pid, exited) = spawn_kept(cmd)?;
        fs::write(root.join("pg.owner"), std::process::id().to_string()).map_err(io("write pg.owner"))?;
        let pg = Self { port, password, pid, exited: Mutex::new(exited) };
        pg.wait_ready(&root).await?;
        pg.ensure_database().await?;
        tracing::info!(port, data = %cluster.display(), "embedded PostgreSQL is up");
        Ok(pg)
    }

    /// Connection string for `database`.
    pub fn url(&self, database: &str) -> String {
        format!("postgres://{SUPERUSER}:{}@127.0.0.1:{}/{database}", self.password, self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    async fn wait_ready(&self, root: &Path) -> Result<(), PgError> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if self.has_exited(Duration::ZERO) {
                return Err(PgError::Failed {
                    step: "start PostgreSQL".into(),
                    detail: format!("the server exited; see {}", root.join("pg.log").display()),
                });
            }
            match tokio_postgres::connect(&self.url("postgres"), tokio_postgres::NoTls).await {
                Ok(_) => return Ok(()),
                Err(e) if Instant::now() > deadline => {
                    return Err(PgError::Failed { step: "connect to PostgreSQL".into(), detail: e.to_string() })
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    async fn ensure_database(&self) -> Result<(), PgError> {
        let failed =
            |e: tokio_postgres::Error| PgError::Failed { step: "create database".into(), detail: e.to_string() };
        let (client, conn) =
            tokio_postgres::connect(&self.url("postgres"), tokio_postgres::NoTls).await.map_err(failed)?;
        let driver = tokio::spawn(conn);
        let exists = client
            .query_opt("SELECT 1 FROM pg_database WHERE datname = $1", &[&DATABASE])
            .await
            .map_err(failed)?
            .is_some();
        if !exists {
            client.batch_execute(&format!("CREATE DATABASE {DATABASE}")).await.map_err(failed)?;
        }
        drop(client);
        let _ = driver.await;
        Ok(())
    }

    /// Fast shutdown: in-flight transactions roll back, committed data is safe.
    pub fn stop(&self) {
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.pid, libc::SIGINT);
        }
        if !self.has_exited(STOP_TIMEOUT) {
            tracing::warn!(pid = self.pid, "PostgreSQL did not stop in time; killing it");
            // SAFETY: as above.
            unsafe {
                libc::kill(self.pid, libc::SIGKILL);
            }
            self.has_exited(STOP_TIMEOUT);
        }
    }

    fn has_exited(&self, wait: Duration) -> bool {
        let exited = self.exited.lock().unwrap_or_else(|p| p.into_inner());
        // A disconnected channel means the keeper already reported (or died): exited.
        !matches!(exited.recv_timeout(wait), Err(mpsc::RecvTimeoutError::Timeout))
    }
}

impl Drop for EmbeddedPg {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Spawns `cmd` from a thread that lives until the child exits, so the
/// child's parent-death signal fires only when our process dies.
pub(crate) fn spawn_kept(mut cmd: Command) -> Result<(i32, mpsc::Receiver<()>), PgError> {
    let (started_tx, started_rx) = mpsc::channel::<std::io::Result<i32>>();
    let (exited_tx, exited_rx) = mpsc::channel();
    std::thread::Builder::new()
        .name("embedded-pg".into())
        .spawn(move || {
            let mut child: Child = match cmd.spawn() {
                Ok(c) => c,
                Err(e) => {
                    let _ = started_tx.send(Err(e));
                    return;
                }
            };
            let _ = started_tx.send(Ok(child.id() as i32));
            let _ = child.wait();
            let _ = exited_tx.send(());
        })
        .map_err(io("spawn keeper thread"))?;
    let pid = started_rx
        .recv()
        .map_err(|_| PgError::Failed { step: "start PostgreSQL".into(), detail: "keeper thread died".into() })?
        .map_err(io("start postgres"))?;
    Ok((pid, exited_rx))
}

fn init_cluster(
    bindir: &Path,
    root: &Path,
    cluster: &Path,
    run_as: Option<RunAs>,
    fast: bool,
) -> Result<String, PgError> {
    let password: String = rand::thread_rng().sample_iter(&Alphanumeric).take(32).map(char::from).collect();
    fs::DirBuilder::new().mode(0o700).create(cluster).map_err(io("create cluster directory"))?;
    let pwfile = root.join("pg-password");
    fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .mode(0o600)
        .open(&pwfile)
        .and_then(|mut f| f.write_all(password.as_bytes()))
        .map_err(io("write pg-password"))?;
    if let Some(r) = run_as {
        std::os::unix::fs::chown(cluster, Some(r.uid), Some(r.gid)).map_err(io("chown cluster directory"))?;
        std::os::unix::fs::chown(&pwfile, Some(r.uid), Some(r.gid)).map_err(io("chown pg-password"))?;
    }
    let mut cmd = Command::new(bindir.join("initdb"));
    cmd.arg("-D")
        .arg(cluster)
        .args(["-U", SUPERUSER, "--auth=scram-sha-256", "-E", "UTF8", "--no-locale"])
        .arg(format!("--pwfile={}", pwfile.display()));
    if fast {
        cmd.arg("--no-sync");
    }
    if let Some(r) = run_as {
        cmd.uid(r.uid).gid(r.gid);
    }
    let out = cmd.output().map_err(io("run initdb"))?;
    if !out.status.success() {
        let _ = fs::remove_dir_all(cluster);
        return Err(PgError::Failed {
            step: "initdb".into(),
            detail: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    if run_as.is_some() {
        // Only we need the password from here on.
        std::os::unix::fs::chown(&pwfile, Some(0), Some(0)).map_err(io("chown pg-password"))?;
        fs::set_permissions(&pwfile, fs::Permissions::from_mode(0o600)).map_err(io("chmod pg-password"))?;
    }
    Ok(password)
}

/// A server left running by an imcore that died without stopping it is shut
/// down; one whose imcore is still alive means the directory is in use.
fn take_over_stale_server(cluster: &Path, root: &Path) -> Result<(), PgError> {
    let Some(pid) = fs::read_to_string(cluster.join("postmaster.pid"))
        .ok()
        .and_then(|s| s.lines().next().and_then(|l| l.trim().parse::<i32>().ok()))
    else {
        return Ok(());
    };
    if !alive(pid) {
        return Ok(()); // PostgreSQL itself clears a stale pid file.
    }
    let owner = fs::read_to_string(root.join("pg.owner")).ok().and_then(|s| s.trim().parse::<i32>().ok());
    if let Some(owner) = owner.filter(|&o| alive(o) && o != std::process::id() as i32) {
        return Err(PgError::InUse(root.to_path_buf(), owner));
    }
    tracing::warn!(pid, "stopping a PostgreSQL left running by an earlier imcore");
    // SAFETY: plain kill(2).
    unsafe {
        libc::kill(pid, libc::SIGINT);
    }
    let deadline = Instant::now() + STOP_TIMEOUT;
    while alive(pid) {
        if Instant::now() > deadline {
            return Err(PgError::Failed {
                step: "stop stale PostgreSQL".into(),
                detail: format!("pid {pid} still running"),
            });
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks existence.
    unsafe { libc::kill(pid, 0) == 0 }
}

pub(crate) fn free_port() -> Result<u16, PgError> {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(io("find a free port"))?;
    Ok(l.local_addr().map_err(io("find a free port"))?.port())
}

pub(crate) fn find_bindir() -> Result<PathBuf, PgError> {
    let usable = |p: &Path| p.join("postgres").is_file() && p.join("initdb").is_file();
    let mut versions: Vec<(u32, PathBuf)> = fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| Some((e.file_name().to_str()?.parse().ok()?, e.path().join("bin"))))
        .filter(|(_, p)| usable(p))
        .collect();
    versions.sort();
    if let Some((_, p)) = versions.pop() {
        return Ok(p);
    }
    Command::new("pg_config")
        .arg("--bindir")
        .output()
        .ok()
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()))
        .filter(|p| usable(p))
        .ok_or(PgError::BinariesNotFound)
}

pub(crate) fn run_as() -> Result<Option<RunAs>, PgError> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Ok(None);
    }
    let passwd = fs::read_to_string("/etc/passwd").map_err(io("read /etc/passwd"))?;
    ["postgres", "nobody"]
        .iter()
        .find_map(|name| {
            passwd.lines().find_map(|l| {
                let f: Vec<&str> = l.split(':').collect();
                (f.len() > 3 && f[0] == *name)
                    .then(|| Some(RunAs { name, uid: f[2].parse().ok()?, gid: f[3].parse().ok()? }))?
            })
        })
        .map(Some)
        .ok_or(PgError::Failed {
            step: "find an unprivileged user".into(),
            detail: "neither postgres nor nobody exists".into(),
        })
}

/// Lets `r` search `root`, the only directory on the way to the cluster that
/// is ours to change; any other blocking directory stops start-up with
/// [`PgError::Unreachable`] naming it.
pub(crate) fn make_searchable(bindir: &Path, root: &Path, r: RunAs) -> Result<(), PgError> {
    let mut way: Vec<&Path> = root.ancestors().collect();
    way.reverse();
    for dir in way {
        if can_search(bindir, dir, r)? {
            continue;
        }
        if dir == root && grant_search(root, r.uid) && can_search(bindir, root, r)? {
            tracing::info!(dir = %root.display(), user = r.name, "granted search permission on the data directory");
            continue;
        }
        return Err(PgError::Unreachable { user: r.name, dir: dir.to_path_buf(), root: root.to_path_buf() });
    }
    Ok(())
}

/// Whether `r` can search `dir`, tried for real (so ACLs and every other rule
/// count): a harmless `postgres --version` run as `r` from inside `dir`, which
/// fails to start when the change of directory (done after the change of
/// user) is refused.
fn can_search(bindir: &Path, dir: &Path, r: RunAs) -> Result<bool, PgError> {
    let probe = Command::new(bindir.join("postgres"))
        .arg("--version")
        .current_dir(dir)
        .uid(r.uid)
        .gid(r.gid)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    match probe {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => Ok(false),
        Err(e) => Err(PgError::Io { step: format!("try {} as {}", dir.display(), r.name), source: e }),
    }
}

/// Adds the POSIX ACL entry `user:<uid>:--x` to `dir`, keeping what the mode
/// gives everyone else (the mask is the group bits plus search, so the owning
/// group gains nothing). False when that cannot be done exactly: `dir` has an
/// ACL already (merging could widen what its mask limits), or the file system
/// has no ACLs.
fn grant_search(dir: &Path, uid: u32) -> bool {
    const NAME: &[u8] = b"system.posix_acl_access\0";
    // Entry tags (linux/posix_acl.h), in the order the kernel requires.
    const USER_OBJ: u16 = 0x01;
    const USER: u16 = 0x02;
    const GROUP_OBJ: u16 = 0x04;
    const MASK: u16 = 0x10;
    const OTHER: u16 = 0x20;
    const NO_ID: u32 = u32::MAX;
    let (Ok(meta), Ok(path)) = (fs::metadata(dir), std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())) else {
        return false;
    };
    // SAFETY: both strings are NUL-terminated; a null buffer of size 0 only asks for the size.
    let existing = unsafe { libc::getxattr(path.as_ptr(), NAME.as_ptr().cast(), std::ptr::null_mut(), 0) };
    if existing >= 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ENODATA) {
        return false;
    }
    let mode = meta.permissions().mode();
    let bits = |shift: u32| ((mode >> shift) & 0o7) as u16;
    let entries = [
        (USER_OBJ, bits(6), NO_ID),
        (USER, 0o1, uid),
        (GROUP_OBJ, bits(3), NO_ID),
        (MASK, bits(3) | 0o1, NO_ID),
        (OTHER, bits(0), NO_ID),
    ];
    let mut acl = 2u32.to_le_bytes().to_vec(); // POSIX_ACL_XATTR_VERSION
    for (tag, perm, id) in entries {
        acl.extend_from_slice(&tag.to_le_bytes());
        acl.extend_from_slice(&perm.to_le_bytes());
        acl.extend_from_slice(&id.to_le_bytes());
    }
    // SAFETY: NUL-terminated strings and a buffer of the length given.
    unsafe { libc::setxattr(path.as_ptr(), NAME.as_ptr().cast(), acl.as_ptr().cast(), acl.len(), 0) == 0 }
}
