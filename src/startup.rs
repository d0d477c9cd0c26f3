//! Building and running the server. `Application::build` binds the listener
//! (port 0 works) and returns before serving, so tests boot the very same
//! server on an ephemeral port.

use std::fs;
use std::io::Write;
use std::net::TcpListener;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Arc;

use actix_web::dev::Server;
use actix_web::{web, App, HttpServer};
use rand::RngCore;

use crate::config::{Config, SHUTDOWN_GRACE};
use crate::delivery::{Delivery, Routes};
use crate::gateway::{self, AppState};
use crate::pg::{EmbeddedPg, PgError, PgOptions, DATABASE};
use crate::store::{Store, StoreError};
use crate::writer::Writer;

#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    #[error("embedded PostgreSQL: {0}")]
    Pg(#[from] PgError),
    #[error("database: {0}")]
    Store(#[from] StoreError),
    #[error("{0}: {1}")]
    Io(&'static str, #[source] std::io::Error),
}

pub struct Application {
    port: u16,
    server: Server,
    /// Kept alive while serving; dropped (stopped) after the server stops.
    embedded_pg: Option<EmbeddedPg>,
}

impl Application {
    pub async fn build(config: Config) -> Result<Self, StartupError> {
        let (database_url, embedded_pg) = match &config.database_url {
            Some(url) => (url.clone(), None),
            None => {
                let pg = EmbeddedPg::start(PgOptions::new(&config.data_dir)).await?;
                (pg.url(DATABASE), Some(pg))
            }
        };
        let store = Store::connect(&database_url, config.pool_size).await?;
        let applied = store.migrate().await?;
        tracing::info!(applied, "schema is current");
        let admin_token = match &config.admin_token {
            Some(t) => t.clone(),
            None => admin_token_file(&config.data_dir)?,
        };
        let listener = TcpListener::bind(config.listen).map_err(|e| StartupError::Io("bind listener", e))?;
        let port = listener.local_addr().map_err(|e| StartupError::Io("bind listener", e))?.port();
        let store = store.with_commit_stage(config.commit_workers, config.commit_max_ops);
        let delivery = Arc::new(Delivery::new(Arc::new(Routes::new()), store.clone()));
        let writer =
            Writer::new(config.write_path, store.clone(), delivery.clone(), config.actor_config(), config.arbiters);
        let state = web::Data::new(AppState { store, writer, delivery, admin_token, config: Arc::new(config) });
        let server = HttpServer::new(move || App::new().app_data(state.clone()).configure(gateway::routes))
            .listen(listener)
            .map_err(|e| StartupError::Io("listen", e))?
            .shutdown_timeout(SHUTDOWN_GRACE.as_secs())
            .run();
        tracing::info!(port, "imcore is listening");
        Ok(Self { port, server, embedded_pg })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Serves until SIGINT/SIGTERM (actix-web's signal handling), then stops the
    /// embedded PostgreSQL, if any, after the server has drained.
    pub async fn run_until_stopped(self) -> std::io::Result<()> {
        let result = self.server.await;
        drop(self.embedded_pg);
        result
    }
}

/// The generated admin token, kept in `<data_dir>/admin-token` (mode 0600).
fn admin_token_file(data_dir: &Path) -> Result<String, StartupError> {
    let path = data_dir.join("admin-token");
    if let Ok(token) = fs::read_to_string(&path) {
        tracing::info!(path = %path.display(), "admin token is in this file");
        return Ok(token.trim().to_owned());
    }
    let mut raw = [0u8; 32];
    rand::thread_rng().fill_bytes(&mut raw);
    let token = hex::encode(raw);
    fs::create_dir_all(data_dir).map_err(|e| StartupError::Io("create data directory", e))?;
    fs::OpenOptions::new()
        .create_new(true)
        .write(true)
        .mode(0o600)
        .open(&path)
        .and_then(|mut f| f.write_all(token.as_bytes()))
        .map_err(|e| StartupError::Io("write admin token", e))?;
    tracing::info!(path = %path.display(), "generated an admin token; it is in this file");
    Ok(token)
}
