//! The route registry: which live connection serves each `(user, device)`.
//! Delivery lanes read it to reach the live devices of the online users a
//! batch concerns ([`RouteRegistry::routes_of`], ARCHITECTURE §5); a
//! connection registers once authenticated and unregisters on close.
//!
//! Invariant P7: a device's route is its newest connection's (the higher
//! [`ConnId`]; [`RouteRegistry::register`] never lets a lower id displace it),
//! and an older connection's cleanup, however late, never removes it
//! ([`RouteRegistry::unregister`] is compare-and-remove on the `conn_id`).
//! One map, user → device → route, each operation under its user's shard
//! lock; no guard leaves the registry, and only `R::clone` runs under a lock
//! (keep it cheap). Why: ARCHITECTURE §5.

use std::collections::hash_map::{self, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use dashmap::DashMap;

use crate::ids::{DeviceId, UserId};

/// Identifies one connection for the life of the process.
///
/// Allocated by [`RouteRegistry::next_conn_id`] from one process-wide counter
/// (or, with several nodes, by [`ConnId::from_cluster_sequence`] from one
/// cluster-wide sequence), so ids are unique and strictly increasing in
/// allocation order: a connection accepted later has a higher id. The registry
/// relies on that order to tell a reconnect (higher id) from a stale
/// registration arriving late (lower id).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(u64);

impl ConnId {
    /// An id drawn from a source every node of a cluster shares (one
    /// PostgreSQL sequence), so that "newer" means the same on every node. A
    /// process takes all its ids from that source or all from
    /// [`RouteRegistry::next_conn_id`], never from both.
    pub fn from_cluster_sequence(n: u64) -> Self {
        ConnId(n)
    }

    /// The raw number, for logs and metrics.
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for ConnId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "c{}", self.0)
    }
}

/// The process-wide source of [`ConnId`]s. Starts at 1 so that 0 never names a
/// connection. A `u64` does not wrap in practice (10⁹ connections a second for
/// five centuries).
static NEXT_CONN_ID: AtomicU64 = AtomicU64::new(1);

/// Where to push to one device: the connection serving it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route<R> {
    /// The connection this route belongs to; the key of compare-and-remove.
    pub conn_id: ConnId,
    /// Where pushes go (in the server, the WebSocket session's `Recipient`).
    pub recipient: R,
}

/// What [`RouteRegistry::register`] did.
#[must_use = "a replaced connection must be kicked, a stale one closed"]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Registered<R> {
    /// The device had no route; the new one is installed.
    New,
    /// The new route is installed; this was the device's previous route. The
    /// caller sends it `kicked: replaced` and closes it. Its later
    /// `unregister` is a no-op, as P7 requires.
    ///
    /// `prev.conn_id` equals the registering `conn_id` only if the caller
    /// registered the same connection twice (its recipient is updated); the
    /// caller must not kick itself then.
    Replaced(Route<R>),
    /// Refused: the device is already routed to a newer connection
    /// (`current > conn_id`), so this registration arrived late and the
    /// connection it belongs to has already been superseded. Nothing changed;
    /// the caller closes its connection (`kicked: replaced`).
    Stale {
        /// The newer connection that keeps the route.
        current: ConnId,
    },
}

/// Routes `(user, device)` to the newest connection of that device (P7).
///
/// `R` is the push recipient; the registry only stores and clones it. See the
/// [module docs](self) for the invariants and the locking rules.
pub struct RouteRegistry<R> {
    /// `user → device → route`. A user entry exists exactly while the user has
    /// at least one route: the last `unregister` of a user removes the entry
    /// under the same shard lock that emptied it, and `register` creates it
    /// under the same lock that fills it.
    users: DashMap<UserId, HashMap<DeviceId, Route<R>>>,
    /// Number of routes, for metrics. Changed only under the shard lock of the
    /// user whose route was added or removed, so it never underflows; with
    /// operations in flight it may lag the map for an instant, when quiet it
    /// is exact.
    connections: AtomicUsize,
}

impl<R> Default for RouteRegistry<R>
where
    R: Clone + Send + Sync + 'static,
{
    fn default() -> Self {
        Self::new()
    }
}

impl<R> fmt::Debug for RouteRegistry<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RouteRegistry")
            .field("users", &self.users.len())
            .field("connections", &self.connections.load(Ordering::Relaxed))
            .finish()
    }
}

impl<R> RouteRegistry<R>
where
    R: Clone + Send + Sync + 'static,
{
    pub fn new() -> Self {
        Self { users: DashMap::new(), connections: AtomicUsize::new(0) }
    }

    /// A fresh connection id, higher than every id allocated before it in this
    /// process. Call it when the connection is accepted, before it
    /// authenticates, so the id order is the connection order.
    pub fn next_conn_id(&self) -> ConnId {
        // Relaxed suffices: a read-modify-write always sees the latest value of
        // the counter, so ids are unique and increase in allocation order.
        ConnId(NEXT_CONN_ID.fetch_add(1, Ordering::Relaxed))
    }

    /// Makes `conn_id` the route of `(user, device)`, unless the device is
    /// already routed to a newer connection.
    ///
    /// * no route → installs it, [`Registered::New`];
    /// * a route with an older (or the same) `conn_id` → installs it and hands
    ///   back the previous route, [`Registered::Replaced`]: the caller kicks it;
    /// * a route with a newer `conn_id` → changes nothing,
    ///   [`Registered::Stale`]: the caller closes its own connection.
    ///
    /// Staleness is judged against the current route only: the registry keeps
    /// no tombstones (they would grow with every device ever seen). If a newer
    /// connection registered *and already unregistered* before an older one's
    /// registration arrives, the older one is installed — it is then the only
    /// live connection of the device, which is the right route.
    pub fn register(&self, user: UserId, device: DeviceId, conn_id: ConnId, recipient: R) -> Registered<R> {
        let route = Route { conn_id, recipient };
        // The entry guard holds the user's shard write lock: creating the user
        // entry and filling it are one step, so no unregister can remove the
        // entry in between (and `or_default` never leaves an empty entry: every
        // path below either inserts or finds an existing route).
        let mut devices = self.users.entry(user).or_default();
        let (outcome, refused) = match devices.entry(device) {
            hash_map::Entry::Vacant(slot) => {
                slot.insert(route);
                self.connections.fetch_add(1, Ordering::Relaxed);
                (Registered::New, None)
            }
            hash_map::Entry::Occupied(mut slot) => {
                let current = slot.get().conn_id;
                if current > conn_id {
                    (Registered::Stale { current }, Some(route))
                } else {
                    (Registered::Replaced(slot.insert(route)), None)
                }
            }
        };
        drop(devices);
        // Dropped after the lock is released: a recipient's drop is its code.
        drop(refused);
        outcome
    }

    /// Removes the route of `(user, device)` if it is still `conn_id`'s, and
    /// reports whether it did (compare-and-remove, P7).
    ///
    /// A connection calls this when it closes, however late: if a newer
    /// connection has taken over the device since, its route stays and this
    /// returns `false`. When the removed route was the user's last, the user
    /// entry goes too — under the same shard lock, so a concurrent `register`
    /// for that user either lands before (and the entry stays, non-empty) or
    /// after (and creates a fresh entry).
    pub fn unregister(&self, user: &UserId, device: &DeviceId, conn_id: ConnId) -> bool {
        let mut removed: Option<Route<R>> = None;
        let emptied_user = self.users.remove_if_mut(user, |_, devices| {
            if let hash_map::Entry::Occupied(slot) = devices.entry(device.clone()) {
                if slot.get().conn_id == conn_id {
                    removed = Some(slot.remove());
                    self.connections.fetch_sub(1, Ordering::Relaxed);
                }
            }
            // Remove the user entry exactly when it has no routes left. Checked
            // even if nothing was removed: an empty entry should never exist,
            // and this keeps the registry self-healing if one ever did.
            devices.is_empty()
        });
        // Both dropped here, after the shard lock is released.
        drop(emptied_user);
        removed.is_some()
    }

    /// The routes of every live device of `user`, for fan-out. A snapshot:
    /// clones taken under the user's shard read lock, no guard returned, so
    /// the caller may push to them freely. Empty if the user has none.
    pub fn routes_of(&self, user: &UserId) -> Vec<(DeviceId, Route<R>)> {
        let mut routes = Vec::new();
        self.routes_of_into(user, &mut routes);
        routes
    }

    /// [`Self::routes_of`] into `out` (cleared first), so that fan-out reuses
    /// one buffer instead of allocating one per user.
    pub fn routes_of_into(&self, user: &UserId, out: &mut Vec<(DeviceId, Route<R>)>) {
        out.clear();
        if let Some(devices) = self.users.get(user) {
            out.extend(devices.iter().map(|(device, route)| (device.clone(), route.clone())));
        }
    }

    /// The route of one device, cloned.
    pub fn route(&self, user: &UserId, device: &DeviceId) -> Option<Route<R>> {
        self.users.get(user)?.get(device).cloned()
    }

    /// Live routes (one per connected device). Exact when no operation is in
    /// flight; otherwise an instantaneous estimate, fine for metrics.
    pub fn connection_count(&self) -> usize {
        self.connections.load(Ordering::Relaxed)
    }

    /// Users with at least one live route. Counted shard by shard, so with
    /// operations in flight it is not a single-instant snapshot.
    pub fn user_count(&self) -> usize {
        self.users.len()
    }
}
