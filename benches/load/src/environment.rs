//! What an in-process benchmark runs against, and what its evidence records
//! about it: the PostgreSQL (embedded unless a URL is given), the machine,
//! the durability settings and the revision measured.

use std::path::Path;

use imcore::config::StoreSettings;
use imcore::pg::{EmbeddedPg, PgOptions, DATABASE};
use imcore::store::Store;
use serde_json::{json, Value};

pub type BoxError = Box<dyn std::error::Error>;

/// The store on `database_url`, else on an embedded PostgreSQL in `data_dir`
/// (kept running as long as the returned guard lives), migrated.
pub async fn database(
    database_url: Option<&str>,
    data_dir: &Path,
    settings: &StoreSettings,
) -> Result<(Option<EmbeddedPg>, Store), BoxError> {
    let (pg, url) = match database_url {
        Some(url) => (None, url.to_owned()),
        None => {
            let pg = EmbeddedPg::start(PgOptions::new(data_dir)).await?;
            let url = pg.url(DATABASE);
            (Some(pg), url)
        }
    };
    let store = Store::connect_with(&url, settings).await?;
    store.migrate().await?;
    Ok((pg, store))
}

pub async fn machine(store: &Store) -> Result<Value, BoxError> {
    let conn = store.pool().get().await?;
    let pg: String = conn.query_one("SHOW server_version", &[]).await?.get(0);
    let os = std::fs::read_to_string("/etc/os-release")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("PRETTY_NAME=").map(|v| v.trim_matches('"').to_owned())))
        .unwrap_or_else(|| std::env::consts::OS.to_owned());
    Ok(json!({
        "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "os": os,
        "postgres": pg,
    }))
}

/// `fsync` and `synchronous_commit` as the server runs them.
pub async fn durability(store: &Store) -> Result<Value, BoxError> {
    Ok(
        json!({"fsync": setting(store, "fsync").await?, "synchronous_commit": setting(store, "synchronous_commit").await?}),
    )
}

async fn setting(store: &Store, name: &str) -> Result<String, BoxError> {
    let conn = store.pool().get().await?;
    Ok(conn.query_one("SELECT current_setting($1)", &[&name]).await?.get(0))
}

pub fn git_rev() -> String {
    std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|| "unknown".into())
}

/// Writes `doc` to `out` as pretty JSON.
pub fn write_json(out: &Path, doc: &Value) -> Result<(), BoxError> {
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(out, serde_json::to_string_pretty(doc)? + "\n")?;
    eprintln!("wrote {}", out.display());
    Ok(())
}
