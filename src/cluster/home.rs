//! A home node per conversation (ARCHITECTURE §7). A conversation's writes go
//! to one node at a time, so a hot group whose members are spread over every
//! node still makes one batch stream, not one per node contending for its row
//! lock. The home is chosen by rendezvous hashing over the live nodes: every
//! node computes the same home from the same set, and a node joining or
//! leaving moves only the conversations it wins or held.
//!
//! Nodes taking homes announce themselves on the bus every [`HEARTBEAT`]; one
//! not heard for [`NODE_TIMEOUT`] is gone. Correctness does not rest on the
//! nodes agreeing: while they disagree (a node just joined or left), two
//! actors may write one conversation and its row lock orders them (P1, P2
//! hold as on one node). What a disagreement costs is the order of one
//! connection's writes that straddle the change (P6 for those few).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use imcore_actors::ConvId;
use sha2::{Digest, Sha256};

use super::node::NodeId;
use crate::metrics::metrics;

/// How often a node taking homes says it is alive.
pub const HEARTBEAT: Duration = Duration::from_millis(500);
/// A node not heard for this long is gone: its conversations move. Four
/// heartbeats, so one late or lost heartbeat moves nothing.
pub const NODE_TIMEOUT: Duration = Duration::from_secs(2);

/// The nodes that take homes, as this node knows them.
pub struct Homes {
    me: NodeId,
    /// The live nodes, this one included.
    live: RwLock<Arc<[NodeId]>>,
    /// When each other node was last heard.
    heard: Mutex<HashMap<NodeId, Instant>>,
}

impl Homes {
    pub fn new(me: NodeId) -> Self {
        Self { live: RwLock::new(Arc::from([me.clone()])), me, heard: Mutex::new(HashMap::new()) }
    }

    /// Where `conv`'s writes go: `None` for here.
    pub fn home_of(&self, conv: &ConvId) -> Option<NodeId> {
        let live = self.live.read().unwrap_or_else(|e| e.into_inner()).clone();
        let home = live.iter().max_by_key(|node| weight(node, conv))?;
        (*home != self.me).then(|| home.clone())
    }

    /// `node` said it is alive at `now`.
    pub(super) fn heard(&self, node: NodeId, now: Instant) {
        let mut heard = self.heard.lock().unwrap_or_else(|e| e.into_inner());
        if heard.insert(node.clone(), now).is_none() {
            tracing::info!(node = node.as_str(), "cluster: a node takes homes; conversations move to it");
            self.publish(&heard);
        }
    }

    /// Forgets the nodes not heard since `NODE_TIMEOUT` before `now`; returns them.
    pub(super) fn expire(&self, now: Instant) -> Vec<NodeId> {
        let mut heard = self.heard.lock().unwrap_or_else(|e| e.into_inner());
        let mut silent = Vec::new();
        heard.retain(|node, at| {
            let alive = now.duration_since(*at) < NODE_TIMEOUT;
            if !alive {
                tracing::warn!(node = node.as_str(), "cluster: a node went silent; its conversations move");
                silent.push(node.clone());
            }
            alive
        });
        if !silent.is_empty() {
            self.publish(&heard);
        }
        silent
    }

    /// Cut off from the bus: every conversation is homed here until the
    /// others are heard again.
    pub(super) fn alone(&self) {
        let mut heard = self.heard.lock().unwrap_or_else(|e| e.into_inner());
        if !heard.is_empty() {
            heard.clear();
            self.publish(&heard);
        }
    }

    fn publish(&self, heard: &HashMap<NodeId, Instant>) {
        let live: Arc<[NodeId]> = heard.keys().cloned().chain([self.me.clone()]).collect();
        metrics().cluster_nodes.set(live.len() as i64);
        *self.live.write().unwrap_or_else(|e| e.into_inner()) = live;
    }
}

/// Rendezvous weight of `node` for `conv`: the same on every node and every
/// build (SHA-256, not the standard library's unspecified hasher).
fn weight(node: &NodeId, conv: &ConvId) -> u64 {
    let digest = Sha256::new().chain_update(node.as_str()).chain_update([0]).chain_update(conv.as_str()).finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(first)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conv(i: usize) -> ConvId {
        ConvId::parse(&format!("g-{i}")).expect("conv id")
    }

    #[test]
    fn every_node_computes_the_same_homes_and_a_leaving_node_moves_only_its_own() {
        let nodes: Vec<NodeId> = (0..3).map(|i| NodeId::named(&format!("imcore-n{i}"))).collect();
        let view = |me: usize, live: &[usize]| {
            let homes = Homes::new(nodes[me].clone());
            for &n in live.iter().filter(|&&n| n != me) {
                homes.heard(nodes[n].clone(), Instant::now());
            }
            homes
        };
        let home = |homes: &Homes, me: usize, c: &ConvId| homes.home_of(c).unwrap_or_else(|| nodes[me].clone());
        let all: Vec<Homes> = (0..3).map(|me| view(me, &[0, 1, 2])).collect();
        // Node 2 leaves: conversations homed on 0 or 1 stay there.
        let without_2 = view(0, &[0, 1]);
        let mut per_node = [0usize; 3];
        for i in 0..3000 {
            let c = conv(i);
            let at = home(&all[0], 0, &c);
            assert!((1..3).all(|me| home(&all[me], me, &c) == at), "nodes disagree on {c}");
            per_node[nodes.iter().position(|n| *n == at).expect("a live node")] += 1;
            let moved = home(&without_2, 0, &c);
            if at != nodes[2] {
                assert_eq!(moved, at, "{c} moved though its home stayed");
            }
        }
        assert!(per_node.iter().all(|&n| n > 800), "homes spread evenly over 3 nodes: {per_node:?}");
    }

    #[test]
    fn a_node_not_heard_for_the_timeout_is_gone_and_alone_forgets_everyone() {
        let (me, other) = (NodeId::named("imcore-me"), NodeId::named("imcore-other"));
        let homes = Homes::new(me);
        let start = Instant::now();
        homes.heard(other.clone(), start);
        let theirs = (0..100).map(conv).find(|c| homes.home_of(c).is_some()).expect("some homed on the other");
        assert!(homes.expire(start + NODE_TIMEOUT / 2).is_empty());
        assert_eq!(homes.home_of(&theirs), Some(other.clone()));
        assert_eq!(homes.expire(start + NODE_TIMEOUT), std::slice::from_ref(&other));
        assert_eq!(homes.home_of(&theirs), None);
        homes.heard(other.clone(), start);
        homes.alone();
        assert_eq!(homes.home_of(&theirs), None);
    }
}
