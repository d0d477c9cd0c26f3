//! Who is online (PROTOCOL v1.2 presence): a user is online while any of its
//! devices is connected, here or (with a bus) on another node, which says so
//! (`Live::Online`). A change is announced to the users who share a direct
//! conversation with the user, on every node: coming online at once, going
//! offline only after a grace period, so a reconnect within it announces
//! nothing; neither while another node has the user online (ARCHITECTURE §7).
//!
//! Invariant: per user, one entry while it has a connection here or is in
//! its grace; every change of it happens under that entry's shard lock, and
//! a grace timer ends the entry only if no connection came back meanwhile
//! (its `generation` is unchanged).

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use dashmap::mapref::entry::Entry;
use dashmap::DashMap;
use imcore_actors::UserId;

use crate::delivery::{Delivery, Live};
use crate::domain::format_time;
use crate::store::Store;

/// A user with a connection here, or in its grace.
#[derive(Debug, Clone, Copy)]
struct Local {
    conns: usize,
    /// Bumped on every change; a grace timer acts only on the one it saw.
    generation: u64,
}

pub struct Online {
    local: DashMap<UserId, Local>,
    grace: Duration,
    store: Store,
    delivery: Arc<Delivery>,
}

impl Online {
    pub fn new(store: Store, delivery: Arc<Delivery>, grace: Duration) -> Arc<Self> {
        Arc::new(Self { local: DashMap::new(), grace, store, delivery })
    }

    /// Whether `user` is online here (a connection, or its grace running)
    /// or on another node.
    pub fn is_online(&self, user: &UserId) -> bool {
        self.local.contains_key(user) || self.delivery.online_elsewhere(user)
    }

    /// A connection of `user` came up (its route is registered).
    pub fn connect(self: &Arc<Self>, user: &UserId) {
        let first = match self.local.entry(user.clone()) {
            Entry::Occupied(mut e) => {
                let l = e.get_mut();
                l.conns += 1;
                l.generation += 1;
                false
            }
            Entry::Vacant(e) => {
                e.insert(Local { conns: 1, generation: 0 });
                true
            }
        };
        if first {
            self.delivery.live(Live::Online { user: user.clone(), online: true });
            if !self.delivery.online_elsewhere(user) {
                let this = self.clone();
                let user = user.clone();
                spawn(async move { this.announce(&user, true, None).await });
            }
        }
    }

    /// A connection of `user` that [`Online::connect`] counted went away.
    pub fn disconnect(self: &Arc<Self>, user: &UserId) {
        let last = match self.local.get_mut(user) {
            Some(mut l) => {
                l.conns = l.conns.saturating_sub(1);
                l.generation += 1;
                (l.conns == 0).then_some(l.generation)
            }
            None => None,
        };
        let Some(generation) = last else { return };
        let this = self.clone();
        let user = user.clone();
        spawn(async move {
            tokio::time::sleep(this.grace).await;
            let gone = this.local.remove_if(&user, |_, l| l.conns == 0 && l.generation == generation).is_some();
            if gone {
                this.delivery.live(Live::Online { user: user.clone(), online: false });
                if this.delivery.online_elsewhere(&user) {
                    return;
                }
                let at = Utc::now();
                if let Err(e) = this.store.set_last_seen(&user, at).await {
                    tracing::warn!(error = %e, %user, "last_seen not written");
                }
                this.announce(&user, false, Some(at)).await;
            }
        });
    }

    /// Pushes the change to the online users sharing a direct conversation
    /// with `user`, on every node.
    async fn announce(&self, user: &UserId, online: bool, last_seen: Option<DateTime<Utc>>) {
        let peers = match self.store.direct_peers(user).await {
            Ok(peers) => peers,
            Err(e) => {
                tracing::warn!(error = %e, %user, "presence change not announced");
                return;
            }
        };
        let frame: Arc<str> = crate::protocol::push_presence(user.as_str(), online, last_seen.map(format_time)).into();
        for peer in &peers {
            self.delivery.to_user(peer, &frame, None);
        }
        if self.delivery.clustered() && !peers.is_empty() {
            self.delivery.live(Live::ToUsers { users: peers, frame: frame.to_string() });
        }
    }
}

/// Runs `task` on the current runtime; a session that stops while its
/// runtime shuts down has none, and then nothing is announced.
fn spawn(task: impl std::future::Future<Output = ()> + Send + 'static) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(task);
    }
}
