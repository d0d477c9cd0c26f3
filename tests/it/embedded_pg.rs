//! The embedded PostgreSQL started by root in a data directory private to
//! root (what `mktemp -d` makes): it runs, and the directory stays private.

use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::PathBuf;

use imcore::pg::{EmbeddedPg, PgError, PgOptions, DATABASE};

use crate::harness::connect;

fn private_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("imcore-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::DirBuilder::new().mode(0o700).create(&dir).expect("create a 0700 directory");
    dir
}

fn fast(root: &std::path::Path) -> PgOptions {
    let mut opts = PgOptions::new(root);
    opts.fast_init = true;
    opts
}

#[actix_web::test]
async fn the_embedded_postgresql_runs_in_a_data_directory_private_to_root() {
    let root = private_dir("private");
    let started = EmbeddedPg::start(fast(&root)).await;
    let mode = std::fs::metadata(&root).expect("stat").permissions().mode();
    let password_mode = std::fs::metadata(root.join("pg-password")).map(|m| m.permissions().mode() & 0o777).ok();
    let answered = match &started {
        Ok(pg) => {
            let c = connect(&pg.url(DATABASE)).await;
            c.query_one("SELECT 1 + 1", &[]).await.expect("query").get::<_, i32>(0) == 2
        }
        Err(_) => false,
    };
    let error = started.as_ref().err().map(ToString::to_string);
    drop(started);
    let _ = std::fs::remove_dir_all(&root);
    assert!(answered, "the server answers: {error:?}");
    assert_eq!(mode & 0o007, 0, "others still get nothing from the data directory");
    assert_eq!(password_mode, Some(0o600), "the password stays readable by its owner only");
}

/// A blocking directory above the data directory is not the server's to
/// change: start-up stops with one line naming it.
#[actix_web::test]
async fn a_blocked_way_to_the_data_directory_stops_start_up_with_one_line_naming_it() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return; // not root: the server runs as us and every usable directory works
    }
    let outer = private_dir("blocked");
    let root = outer.join("data");
    std::fs::create_dir(&root).expect("create the data directory");
    let started = EmbeddedPg::start(fast(&root)).await;
    let outer_mode = std::fs::metadata(&outer).expect("stat").permissions().mode();
    let _ = std::fs::remove_dir_all(&outer);
    let Err(e @ PgError::Unreachable { .. }) = started else { panic!("refused as unreachable: {started:?}") };
    let line = e.to_string();
    assert!(!line.contains('\n'), "one line: {line}");
    assert!(line.contains(&format!("cannot search {} ", outer.display())), "names the blocking directory: {line}");
    assert_eq!(outer_mode & 0o077, 0, "the blocking directory was left as it was");
}
