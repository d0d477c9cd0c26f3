//! imcore — an instant-messaging core.
//!
//! # Layout
//! * [`domain`] — rules independent of transport and storage: bodies and their
//!   fingerprints, roles and permission bits, events, rejections.
//! * [`store`] — PostgreSQL, one module per transaction family: `write` (send,
//!   join, leave under the conversation row locks, for one or several
//!   conversations at once), `commit_stage` (merges conversations' batches into
//!   one transaction), `sync`, `read`, `inbox`, `conversations`, `accounts`,
//!   `migrate`; `port` makes the store the actors' `ConversationStore`.
//! * [`writer`] — the configurable write path: `actor` (hub → conversation
//!   actor → commit stage) or `direct` (one transaction per op, the baseline).
//! * [`delivery`] — fan-out after commit through the route registry: frames
//!   encoded once, bounded per-connection mailboxes, a slow device is closed.
//! * [`protocol`] — wire shapes (events, conversations, pushes) and error codes.
//! * [`pg`] — the embedded PostgreSQL used when no `DATABASE_URL` is given.
//! * [`gateway`] — HTTP and WebSocket (PROTOCOL §3–6); PROTOCOL error codes
//!   are produced only here; one op dispatch serves both transports.
//! * [`metrics`] — Prometheus counters, histograms and sampled gauges.
//! * [`config`], [`startup`], [`telemetry`] — configuration, the server
//!   builder (port 0 for tests), logs.
//! * The concurrency core (conversation actors, hub, route registry) is the
//!   `imcore-actors` crate.
//!
//! # Invariants (ARCHITECTURE §2)
//! P1 gapless seqs and P5 `next_seq = max + 1`: seqs are allocated from the
//! locked conversation row in the transaction that inserts the events. P2 one
//! event per request key: a partial unique index, and the replay lookup under
//! the lock. P3/P4 membership periods: an exclusion constraint and a partial
//! unique index; joins and leaves are events sharing the seq space. P6 per
//! connection send order: the session queues each op on its conversation's
//! actor in frame order, and the actor commits its queue in order. P7 routes:
//! compare-and-remove on `conn_id` in the registry. P8 read cursors:
//! `greatest(…)` capped at head in one statement.

pub mod config;
pub mod delivery;
pub mod domain;
pub mod gateway;
pub mod metrics;
pub mod pg;
pub mod protocol;
pub mod startup;
pub mod store;
pub mod telemetry;
pub mod writer;
