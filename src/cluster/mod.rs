//! Several imcore nodes on one PostgreSQL (ARCHITECTURE §7). PostgreSQL keeps
//! every write correct on its own (row locks, unique keys); what the nodes
//! exchange goes over NATS, and only when `IMCORE_NATS_URL` is set: a single
//! node runs no bus at all.
//!
//! * `bus` — the NATS connection: this node's committed batches, route
//!   claims and revocations out, the other nodes' in; a bus that may have
//!   lost messages makes every device here resync.
//! * `publisher` — sends what this node hands the bus, in order, and keeps
//!   it until NATS confirms it.
//! * `forward` — writes carried to their conversation's home node and their
//!   answers back.
//! * `routing` — what a route claim from another node does here (P7 across
//!   nodes: the connection with the highest cluster-wide id keeps the route).
//! * `home` — which node a conversation's writes go to.
//! * `write` — writing at a conversation's home, here or forwarded.
//! * `seal` — every bus message signed with the cluster's key, and checked.
//! * `node` — a node's name.

mod bus;
mod forward;
mod home;
mod node;
mod publisher;
mod routing;
mod seal;
mod write;

pub use bus::{Bus, BusError};
pub use routing::{settle, Settled};
pub use write::write_at_home;
