//! imcore's concurrency core.
//!
//! # Layout
//! * [`ids`] — typed identifiers, parsed once at the edge (PROTOCOL §1).
//! * [`store`] — the port conversation actors write through ([`ConversationStore`]);
//!   the PostgreSQL implementation lives in the `imcore` crate.
//! * `lifecycle` — an actor's table entry: at most one per conversation, the
//!   eviction handshake (gate, predecessor's exit), compare-and-remove on exit.
//!   Actors hold a lease on their entry, never the hub.
//! * `idle` — idle actors, idlest first, for eviction at the cap on live
//!   actors.
//! * [`conversation`] — one actor per hot conversation: serialises and batches
//!   its writes (group commit), one batch in flight, bounded queue; retires
//!   early when its batches appended nothing.
//! * [`hub`] — routes ops to actors through the table, starts them on its
//!   arbiters (evicting the idlest at the cap), drains them at shutdown.
//! * [`registry`] — routes `(user, device) → connection` (P7: an older
//!   connection's cleanup never removes a newer route).
//!
//! Dependencies run one way: `ids` ← `store` ← `lifecycle` ← `conversation`
//! ← `hub`; `idle` depends on nothing.
//!
//! Correctness (gapless seqs P1, one event per request key P2) rests on the
//! store's row-locked transaction; the actors here only make it fast.

pub mod conversation;
pub mod hub;
mod idle;
pub mod ids;
mod lifecycle;
pub mod registry;
pub mod store;
#[cfg(feature = "test-util")]
pub mod testing;

pub use conversation::{ActorConfig, ConversationActor, InternalError, Submit, WriteError, WriteResult};
pub use hub::{Hub, HubConfig};
pub use ids::{ClientMsgId, ConvId, DeviceId, InvalidId, UserId};
pub use store::{BatchCommitted, ConversationStore, Fanout};
