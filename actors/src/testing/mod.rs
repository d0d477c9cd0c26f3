//! Test doubles for fast actor tests, behind the `test-util`
//! feature. [`MemoryStore`] never stands in for PostgreSQL in the real test
//! tier; it exists so the actor and hub can be exercised in milliseconds.

mod memory_store;
mod recording_fanout;

pub use memory_store::{Appended, Event, MemoryCache, MemoryStore, MemoryStoreError, SendOp, SendOutcome};
pub use recording_fanout::RecordingFanout;
