//! imcore's concurrency core.
//!
//! # Layout
//! * [`ids`] — typed identifiers, parsed once at the edge (PROTOCOL §1).
//! * [`store`] — the port conversation actors write through ([`ConversationStore`]);
//!   the PostgreSQL implementation lives in the `imcore` crate.
//! * [`conversation`] — one actor per hot conversation: serialises and batches
//!   its writes (group commit), one batch in flight, bounded queue.
//! * [`hub`] — `conv_id → actor`, created on demand, compare-and-remove on exit.
//! * [`registry`] — routes `(user, device) → connection` (P7: an older
//!   connection's cleanup never removes a newer route).
//!
//! Correctness (gapless seqs P1, one event per request key P2) rests on the
//! store's row-locked transaction; the actors here only make it fast.

pub mod conversation;
pub mod hub;
pub mod ids;
pub mod registry;
pub mod store;
#[cfg(feature = "test-util")]
pub mod testing;

pub use conversation::{ActorConfig, ConversationActor, Submit, WriteError, WriteResult};
pub use hub::{Hub, HubConfig};
pub use ids::{ClientMsgId, ConvId, DeviceId, InvalidId, UserId};
pub use store::{BatchCommitted, ConversationStore, Fanout};
