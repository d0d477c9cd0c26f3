//! Numbered migrations from `schema/`, embedded in the binary and applied at
//! start-up under an advisory lock, so two processes starting at once apply
//! each exactly once. Applying again is a no-op. Every listed version not yet
//! recorded is applied, in ascending order: versions may have gaps, and a
//! version merged below one a database already has is applied too.

use tokio_postgres::GenericClient;

use super::{Store, StoreError};

/// `(version, name, sql)`, ascending.
pub const MIGRATIONS: &[(i32, &str, &str)] = &[
    (1, "core", include_str!("../../schema/0001_core.sql")),
    (2, "groups", include_str!("../../schema/0002_groups.sql")),
    (3, "presence", include_str!("../../schema/0003_presence.sql")),
    (4, "retention", include_str!("../../schema/0004_retention.sql")),
    (5, "since", include_str!("../../schema/0005_since.sql")),
    (6, "cluster", include_str!("../../schema/0006_cluster.sql")),
    (7, "rule_leaks", include_str!("../../schema/0007_rule_leaks.sql")),
    (8, "live", include_str!("../../schema/0008_live.sql")),
    (9, "history", include_str!("../../schema/0009_history.sql")),
    (10, "push", include_str!("../../schema/0010_push.sql")),
    (11, "member_order", include_str!("../../schema/0011_member_order.sql")),
    (12, "banned", include_str!("../../schema/0012_banned.sql")),
    (13, "people", include_str!("../../schema/0013_people.sql")),
    (14, "large_groups", include_str!("../../schema/0014_large_groups.sql")),
    (15, "id_checks", include_str!("../../schema/0015_id_checks.sql")),
    (16, "row_rules", include_str!("../../schema/0016_row_rules.sql")),
];

pub const SCHEMA_VERSION: i32 = MIGRATIONS[MIGRATIONS.len() - 1].0;

/// Arbitrary, fixed: the key of the migration advisory lock.
const LOCK_KEY: i64 = 0x1c04_e5c4;

/// The versions recorded as applied, ascending.
async fn applied_versions(c: &impl GenericClient) -> Result<Vec<i32>, StoreError> {
    let exists: bool = c.query_one("SELECT to_regclass('imcore_schema_migrations') IS NOT NULL", &[]).await?.get(0);
    if !exists {
        return Ok(Vec::new());
    }
    let rows = c.query("SELECT version FROM imcore_schema_migrations ORDER BY version", &[]).await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// Whether every migration of this build is applied.
pub(super) async fn up_to_date(c: &impl GenericClient) -> Result<bool, StoreError> {
    let applied = applied_versions(c).await?;
    Ok(MIGRATIONS.iter().all(|(v, _, _)| applied.contains(v)))
}

impl Store {
    /// Applies the migrations this database lacks; returns how many.
    pub async fn migrate(&self) -> Result<usize, StoreError> {
        let mut conn = self.pool.get().await?;
        conn.execute("SELECT pg_advisory_lock($1)", &[&LOCK_KEY]).await?;
        let result = apply(&mut conn).await;
        // Unlock even when a migration failed; the session ends with the
        // connection otherwise, but pooled connections live on.
        conn.execute("SELECT pg_advisory_unlock($1)", &[&LOCK_KEY]).await?;
        result
    }
}

async fn apply(conn: &mut tokio_postgres::Client) -> Result<usize, StoreError> {
    conn.batch_execute(
        "CREATE TABLE IF NOT EXISTS imcore_schema_migrations (
             version    integer PRIMARY KEY,
             name       text NOT NULL,
             applied_at timestamptz NOT NULL DEFAULT now())",
    )
    .await?;
    let recorded = applied_versions(&*conn).await?;
    let mut applied = 0;
    for (version, name, sql) in MIGRATIONS.iter().filter(|(v, _, _)| !recorded.contains(v)) {
        let tx = conn.transaction().await?;
        tx.batch_execute(sql).await?;
        tx.execute("INSERT INTO imcore_schema_migrations (version, name) VALUES ($1, $2)", &[version, name]).await?;
        tx.commit().await?;
        tracing::info!(version, name, "applied migration");
        applied += 1;
    }
    Ok(applied)
}
