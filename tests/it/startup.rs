//! Start-up: migrations applied once under concurrency, and the embedded
//! PostgreSQL keeping its data across restarts.

use futures_util::future::join_all;
use imcore::pg::{EmbeddedPg, PgOptions, DATABASE};
use imcore::store::{Store, MIGRATIONS, SCHEMA_VERSION};
use serde_json::json;

use crate::evidence::Check;
use crate::harness::{connect, empty_database};

#[actix_web::test]
async fn processes_migrating_one_database_at_once_apply_each_migration_exactly_once() {
    let check = Check::start(
        "im-04",
        "schema-migrations-once",
        "schema",
        "4 stores migrating one empty database at once: each migration applied exactly once (advisory lock), applying again is a no-op, /readyz condition true",
    );
    let url = empty_database().await;
    let stores = join_all((0..4).map(|_| Store::connect(&url, 2))).await;
    let applied: Vec<usize> = join_all(stores.iter().map(|s| async {
        let store = s.as_ref().expect("connect");
        store.migrate().await.expect("migrate")
    }))
    .await;
    let again = stores[0].as_ref().expect("connect").migrate().await.expect("migrate again");
    let c = connect(&url).await;
    let versions: Vec<i32> = c
        .query("SELECT version FROM imcore_schema_migrations ORDER BY version", &[])
        .await
        .expect("versions")
        .iter()
        .map(|r| r.get(0))
        .collect();
    let expected: Vec<i32> = MIGRATIONS.iter().map(|m| m.0).collect();
    let ready = stores[1].as_ref().expect("connect").ready().await;
    let pass = applied.iter().sum::<usize>() == MIGRATIONS.len() && again == 0 && versions == expected && ready;
    let pass = check.resolve(
        json!({"applied_per_process": applied, "applied_again": again, "recorded_versions": versions, "schema_version": SCHEMA_VERSION, "ready": ready}),
        pass,
    );
    assert!(pass);
}

#[actix_web::test]
async fn the_embedded_postgresql_keeps_its_data_across_restarts() {
    let root = std::env::temp_dir().join(format!("imcore-embedded-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let mut opts = PgOptions::new(&root);
    opts.fast_init = true;
    let first = EmbeddedPg::start(opts.clone()).await.expect("first start");
    let store = Store::connect(&first.url(DATABASE), 2).await.expect("connect");
    store.migrate().await.expect("migrate");
    let user = imcore_actors::UserId::parse("u-kept").expect("id");
    store.create_user(&user, None).await.expect("user");
    drop(store);
    drop(first); // stops the server (fast shutdown)
    let second = EmbeddedPg::start(opts).await.expect("second start");
    let c = connect(&second.url(DATABASE)).await;
    let kept: i64 =
        c.query_one("SELECT count(*) FROM users WHERE user_id = 'u-kept'", &[]).await.expect("count").get(0);
    drop(c);
    drop(second);
    let _ = std::fs::remove_dir_all(&root);
    assert_eq!(kept, 1, "the user created before the restart is still there");
}
