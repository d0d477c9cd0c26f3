//! The real test tier's harness: one PostgreSQL cluster per test run (started
//! like the server's embedded one), one database per test cloned from a
//! migrated template.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use imcore::pg::{EmbeddedPg, PgOptions};
use imcore::store::Store;
use tokio_postgres::NoTls;

const TEMPLATE: &str = "imcore_template";

struct Cluster {
    pg: EmbeddedPg,
}

static CLUSTER: OnceLock<Cluster> = OnceLock::new();
static NEXT_DB: AtomicU32 = AtomicU32::new(0);

fn cluster() -> &'static Cluster {
    CLUSTER.get_or_init(|| {
        // Started on a runtime of its own: the server outlives every test's runtime.
        std::thread::spawn(|| {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
            rt.block_on(start_cluster())
        })
        .join()
        .expect("cluster thread")
    })
}

async fn start_cluster() -> Cluster {
    imcore::telemetry::init(&std::env::var("IMCORE_LOG").unwrap_or_else(|_| "off".into()));
    let root = std::env::temp_dir().join(format!("imcore-test-{}", std::process::id()));
    sweep_stale_clusters();
    let mut opts = PgOptions::new(&root);
    opts.fast_init = true;
    opts.settings.push(("max_connections".into(), "600".into()));
    opts.settings.push(("shared_buffers".into(), "256MB".into()));
    let pg = EmbeddedPg::start(opts).await.expect("start PostgreSQL for the tests");
    let admin = connect(&pg.url("postgres")).await;
    admin.batch_execute(&format!("CREATE DATABASE {TEMPLATE}")).await.expect("create template");
    let store = Store::connect(&pg.url(TEMPLATE), 2).await.expect("connect template");
    store.migrate().await.expect("migrate template");
    Cluster { pg }
}

/// Removes clusters of earlier runs whose test process is gone.
fn sweep_stale_clusters() {
    let Ok(dir) = std::fs::read_dir(std::env::temp_dir()) else { return };
    for entry in dir.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix("imcore-test-")).and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && !PathBuf::from(format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

pub async fn connect(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, NoTls).await.expect("connect");
    tokio::spawn(conn);
    client
}

/// The URL of a new, empty database (no schema): for migration tests.
pub async fn empty_database() -> String {
    let cluster = cluster();
    let name = format!("e_{}_{}", std::process::id(), NEXT_DB.fetch_add(1, Ordering::Relaxed));
    let admin = connect(&cluster.pg.url("postgres")).await;
    admin.batch_execute(&format!("CREATE DATABASE {name}")).await.expect("create empty database");
    cluster.pg.url(&name)
}

/// A fresh database of this test's own, migrated.
pub struct TestDb {
    pub url: String,
    pub store: Store,
}

impl TestDb {
    pub async fn with_pool(pool_size: u32) -> Self {
        let cluster = cluster();
        let name = format!("t_{}_{}", std::process::id(), NEXT_DB.fetch_add(1, Ordering::Relaxed));
        let admin = connect(&cluster.pg.url("postgres")).await;
        // The template may still show a closing connection for a moment.
        let mut tries = 0;
        while let Err(e) = admin.batch_execute(&format!("CREATE DATABASE {name} TEMPLATE {TEMPLATE}")).await {
            tries += 1;
            assert!(tries < 100, "create test database: {e}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let url = cluster.pg.url(&name);
        let store = Store::connect(&url, pool_size).await.expect("connect test database");
        Self { url, store }
    }

    /// A direct client, for inspecting and arranging rows.
    pub async fn client(&self) -> tokio_postgres::Client {
        connect(&self.url).await
    }

    /// Takes the conversation row lock away from the write path of this
    /// database, for negative controls; the product code runs unchanged.
    ///
    /// `conversations` becomes a view over the renamed table that reads it
    /// through a materialized CTE. PostgreSQL applies a locking clause to the
    /// tables and subqueries of a query, not to its CTEs, so the write path's
    /// `SELECT … FROM conversations … FOR NO KEY UPDATE` locks nothing and two
    /// writers of one conversation both read the same `next_seq`. The row
    /// update at the end of a write transaction goes through an `INSTEAD OF`
    /// trigger. Create the conversations first: the view takes no inserts.
    pub async fn take_away_conversation_row_lock(&self) {
        let c = self.client().await;
        let columns: Vec<String> = c
            .query(
                "SELECT column_name::text FROM information_schema.columns
                  WHERE table_schema = 'public' AND table_name = 'conversations' AND column_name <> 'conv_id'
                  ORDER BY ordinal_position",
                &[],
            )
            .await
            .expect("columns of conversations")
            .iter()
            .map(|r| r.get(0))
            .collect();
        let new_values: Vec<String> = columns.iter().map(|col| format!("NEW.{col}")).collect();
        c.batch_execute(&format!(
            "ALTER TABLE conversations RENAME TO conversation_rows;
             CREATE VIEW conversations AS
               WITH unlocked AS MATERIALIZED (SELECT * FROM conversation_rows) SELECT * FROM unlocked;
             CREATE FUNCTION conversations_update() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
               UPDATE conversation_rows SET ({}) = ROW({}) WHERE conv_id = OLD.conv_id;
               RETURN NEW;
             END $$;
             CREATE TRIGGER conversations_update INSTEAD OF UPDATE ON conversations
               FOR EACH ROW EXECUTE FUNCTION conversations_update();",
            columns.join(", "),
            new_values.join(", ")
        ))
        .await
        .expect("take the conversation row lock away");
    }
}

/// Taken by the tests whose verdict is a latency bound and by the tests that
/// keep both cores busy for long (a 100,000-member group, the browser tests, a
/// three-node cluster), so that the harness never runs one beside the other:
/// a bound measured next to a CPU hog in the same process would measure the hog.
static TIMING_SENSITIVE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

pub async fn alone_with_the_cpu() -> tokio::sync::MutexGuard<'static, ()> {
    TIMING_SENSITIVE.lock().await
}
