//! Routes across nodes (P7, ARCHITECTURE §7). Every node registers its own
//! connections in its own registry; when one becomes a device's route, the
//! node announces a *claim* `(user, device, conn)` on the bus. Connection ids
//! come from one PostgreSQL sequence (`conn_ids`), so "newer" is the same
//! order on every node: the higher id. A node that gets a claim compares it
//! with its own route of that device:
//!
//! * its route is older → removed (compare-and-remove on its id) and kicked
//!   (`kicked: replaced`);
//! * its route is newer → it answers with its own claim, so the node that
//!   registered the older connection after the newer one's claim went by
//!   (registries keep no tombstones) hears of it and kicks its own.
//!
//! Cleanups stay local and compare-and-remove: no node ever removes another
//! node's route, and a late cleanup never removes a newer route.

use imcore_actors::registry::{ConnId, Route, RouteRegistry};
use imcore_actors::{DeviceId, UserId};

/// What a claim from another node did to this node's route of the device.
#[derive(Debug, PartialEq, Eq)]
pub enum Settled<R> {
    /// This node has no route of the device, or it is the claimed one.
    Nothing,
    /// This node's route was older and is removed: the caller kicks it.
    Superseded(Route<R>),
    /// This node's route is newer: the caller announces it again.
    Newer(ConnId),
}

/// Applies the claim that `claimed` routes `user`'s `device` on another node.
pub fn settle<R>(routes: &RouteRegistry<R>, user: &UserId, device: &DeviceId, claimed: ConnId) -> Settled<R>
where
    R: Clone + Send + Sync + 'static,
{
    match routes.route(user, device) {
        // Compare-and-remove: a newer local connection registered meanwhile stays
        // (and announces itself).
        Some(route) if route.conn_id < claimed => match routes.unregister(user, device, route.conn_id) {
            true => Settled::Superseded(route),
            false => Settled::Nothing,
        },
        Some(route) if route.conn_id > claimed => Settled::Newer(route.conn_id),
        _ => Settled::Nothing,
    }
}

#[cfg(test)]
mod tests {
    use imcore_actors::registry::Registered;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;

    const NODES: usize = 3;
    const CONNS: u64 = 9;

    /// What is still to happen in the simulated cluster.
    #[derive(Debug, Clone, Copy)]
    enum Step {
        /// Connection `conn` (accepted on `node`) registers there.
        Register { node: usize, conn: u64 },
        /// A claim of `conn` from `from` reaches `to`.
        Claim { to: usize, conn: u64 },
        /// The session of `conn` on `node`, kicked or refused, cleans up.
        Cleanup { node: usize, conn: u64 },
    }

    fn ids() -> (UserId, DeviceId) {
        (UserId::parse("ann").expect("user"), DeviceId::parse("phone").expect("device"))
    }

    fn claims_from(from: usize, conn: u64) -> impl Iterator<Item = Step> {
        (0..NODES).filter(move |&to| to != from).map(move |to| Step::Claim { to, conn })
    }

    /// One device connects `CONNS` times, alternating between the nodes;
    /// registrations, claims and cleanups happen in an order drawn from `seed`.
    fn run(seed: u64) -> Vec<(usize, ConnId)> {
        let mut rng = StdRng::seed_from_u64(seed);
        let (user, device) = ids();
        let nodes: Vec<RouteRegistry<()>> = (0..NODES).map(|_| RouteRegistry::new()).collect();
        let mut pending: Vec<Step> =
            (1..=CONNS).map(|conn| Step::Register { node: conn as usize % NODES, conn }).collect();
        while !pending.is_empty() {
            let step = pending.swap_remove(rng.gen_range(0..pending.len()));
            match step {
                Step::Register { node, conn } => {
                    let id = ConnId::from_cluster_sequence(conn);
                    match nodes[node].register(user.clone(), device.clone(), id, ()) {
                        Registered::New => pending.extend(claims_from(node, conn)),
                        Registered::Replaced(prev) => {
                            pending.push(Step::Cleanup { node, conn: prev.conn_id.get() });
                            pending.extend(claims_from(node, conn));
                        }
                        Registered::Stale { .. } => pending.push(Step::Cleanup { node, conn }),
                    }
                }
                Step::Claim { to, conn } => {
                    match settle(&nodes[to], &user, &device, ConnId::from_cluster_sequence(conn)) {
                        Settled::Nothing => {}
                        Settled::Superseded(old) => pending.push(Step::Cleanup { node: to, conn: old.conn_id.get() }),
                        Settled::Newer(mine) => pending.extend(claims_from(to, mine.get())),
                    }
                }
                Step::Cleanup { node, conn } => {
                    nodes[node].unregister(&user, &device, ConnId::from_cluster_sequence(conn));
                }
            }
        }
        nodes
            .iter()
            .enumerate()
            .filter_map(|(n, routes)| routes.route(&user, &device).map(|r| (n, r.conn_id)))
            .collect()
    }

    #[test]
    fn a_device_alternating_between_nodes_ends_with_one_route_its_newest_in_every_order() {
        for seed in 0..500 {
            let newest = ConnId::from_cluster_sequence(CONNS);
            assert_eq!(run(seed), [(CONNS as usize % NODES, newest)], "seed {seed}");
        }
    }

    #[test]
    fn an_older_claim_is_answered_and_a_newer_one_supersedes() {
        let (user, device) = ids();
        let routes = RouteRegistry::<()>::new();
        let id = ConnId::from_cluster_sequence;
        assert!(matches!(routes.register(user.clone(), device.clone(), id(5), ()), Registered::New));
        assert_eq!(settle(&routes, &user, &device, id(3)), Settled::Newer(id(5)));
        assert_eq!(settle(&routes, &user, &device, id(5)), Settled::Nothing);
        assert_eq!(
            settle(&routes, &user, &device, id(7)),
            Settled::Superseded(Route { conn_id: id(5), recipient: () })
        );
        assert_eq!(routes.route(&user, &device), None);
        // The superseded connection's own cleanup, however late, removes nothing.
        assert!(!routes.unregister(&user, &device, id(5)));
    }
}
