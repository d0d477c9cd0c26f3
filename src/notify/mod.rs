//! Offline notifications (PROTOCOL v1.3, ARCHITECTURE §5 "Offline
//! notifications"): the batches this node commits are followed in process,
//! and each member's device that is connected nowhere gets the events due
//! to it through its push gateway. Nothing is written in the send's
//! transaction; durable per-conversation progress, leased, is written after
//! the work, so a crash or a dead node's lag is redone (at least once).
//!
//! `due`: who an event notifies (pure); `queue`: coalescing, retries and the
//! seqs still owed; `gateway`: the HTTP client; `runner`: the notifier's
//! thread; `progress`: the durable progress and recovery.

mod due;
mod gateway;
mod progress;
mod queue;
mod runner;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use imcore_actors::ConvId;
use tokio::sync::mpsc;

use crate::config::NotifySettings;
use crate::delivery::{Delivery, Follower};
use crate::metrics::count_notifications;
use crate::store::{Appended, Store};

/// Batches not handed over (the notifier was `backlog` behind): per
/// conversation the first seq to read back from the database.
type Lost = Arc<Mutex<HashMap<ConvId, i64>>>;

/// The committing side of the notifier: hands each batch over, never waits.
struct Handoff {
    input: mpsc::Sender<Arc<Appended>>,
    lost: Lost,
}

impl Follower for Handoff {
    fn committed(&self, appended: &Arc<Appended>) {
        let Err(mpsc::error::TrySendError::Full(appended)) = self.input.try_send(appended.clone()) else { return };
        let Some(first) = appended.events.first().map(|e| e.seq) else { return };
        count_notifications("backlog_lost", 1);
        let mut lost = self.lost.lock().unwrap_or_else(|e| e.into_inner());
        let at = lost.entry(appended.conv_id.clone()).or_insert(first);
        *at = (*at).min(first);
    }
}

/// Starts the notifier on a thread of its own (its HTTP client is the
/// actix one, bound to a thread) with a pool of its own, and has `delivery`
/// hand it this node's batches. It ends once `delivery` is dropped.
pub fn start(database_url: String, settings: NotifySettings, delivery: &Arc<Delivery>) -> std::io::Result<()> {
    let (input, batches) = mpsc::channel(settings.backlog.max(1));
    let lost = Lost::default();
    let (weak, their_lost) = (Arc::downgrade(delivery), lost.clone());
    std::thread::Builder::new().name("notify".into()).spawn(move || {
        actix_web::rt::System::new().block_on(async move {
            let Some(store) = connect(&database_url, settings.pool_size, &batches).await else { return };
            let (runner, answers) = runner::Runner::new(store, weak, settings, their_lost);
            runner.run(answers, batches).await;
        })
    })?;
    delivery.follow(Arc::new(Handoff { input, lost }));
    Ok(())
}

/// The notifier's pool, retried until the database answers or the server is gone.
async fn connect(url: &str, pool_size: u32, batches: &mpsc::Receiver<Arc<Appended>>) -> Option<Store> {
    loop {
        match Store::connect(url, pool_size.max(1)).await {
            Ok(store) => return Some(store),
            Err(e) if !batches.is_closed() => {
                tracing::warn!(error = %crate::store::Report(&e), "notifier: database unreachable; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(_) => return None,
        }
    }
}
