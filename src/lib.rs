//! imcore — an instant-messaging core.
//!
//! The design — data model, invariants P1–P9 and where each is enforced, the
//! write, read and delivery paths — is [`architecture`] (`src/ARCHITECTURE.md`);
//! the wire contract is [`protocol`] (`src/protocol/PROTOCOL.md`). The code
//! cites them as `ARCHITECTURE §N` and `PROTOCOL §N`. Beside them:
//! [`operations`] (`src/OPERATIONS.md`: several nodes, limits, admin) and
//! [`storage_plan`] (`src/STORAGE_PLAN.md`: past one PostgreSQL, on paper).
//!
//! # Layout
//! * [`domain`] — rules independent of transport and storage: bodies and their
//!   fingerprints, roles and permission bits, events, rejections.
//! * [`store`] — PostgreSQL, one module per transaction family: `write` (send,
//!   edit, react, recall, join, leave and group ops under the conversation row
//!   locks, for one or several conversations at once), `commit_stage` (merges
//!   conversations' batches into one transaction), `sync`, `read`, `inbox`,
//!   `conversations`, `accounts`, `access` (the stranger gate's probe),
//!   `blocks`, `signals` (the reads behind typing and presence),
//!   `migrate`; `port` makes the store the actors' `ConversationStore`;
//!   `error` classifies database failures by SQLSTATE, once.
//! * [`writer`] — the configurable write path: `actor` (hub → conversation
//!   actor → commit stage) or `direct` (one transaction per op, the baseline);
//!   `Engine::start` assembles it with delivery, for the server, the tests
//!   and the benchmarks alike.
//! * [`delivery`] — fan-out after commit through the route registry: frames
//!   encoded once, bounded per-connection mailboxes, a slow device is closed;
//!   recipients from what each lane keeps about its online users.
//! * [`cluster`] — several nodes on one PostgreSQL: the NATS bus that carries
//!   committed batches, route claims and writes forwarded to a conversation's
//!   home node between them (optional; a single node runs without it).
//! * [`notify`] — offline notifications (PROTOCOL v1.3): this node's
//!   committed batches followed, due notices coalesced and POSTed to push
//!   gateways, durable leased progress so a crash or a dead node loses none.
//! * [`online`] — who is online (presence, PROTOCOL v1.2): connections counted
//!   per user, changes announced to direct peers after a grace period.
//! * [`budget`] — the global memory budget in bytes for queued message bodies
//!   and queued push frames; beyond it `OVERLOADED` or a 1013 close.
//! * [`protocol`] — wire shapes (events, conversations, pushes) and error codes.
//! * [`pg`] — the embedded PostgreSQL used when no `DATABASE_URL` is given.
//! * [`pg_formation`] — a pg_auto_failover formation on one machine, for the
//!   failover test and benchmark.
//! * [`gateway`] — HTTP and WebSocket (PROTOCOL §3–6); PROTOCOL error codes
//!   are produced only here; one op dispatch serves both transports.
//! * [`metrics`] — Prometheus counters, histograms and sampled gauges.
//! * [`config`], [`startup`], [`telemetry`] — configuration, the server
//!   builder (port 0 for tests), logs; [`cli`] — the command line (the
//!   server, or `admin …`), [`admin`] — the admin commands, over HTTP.
//! * The web client (`src/web/`) is embedded in the
//!   binary and served at `/` (`gateway::client`).
//! * The concurrency core (conversation actors, hub, route registry) is the
//!   `imcore-actors` crate.
//!
//! # Where each hop runs
//! One WebSocket `send` on the actor path, with the commit stage (thread
//! names as observed, `actix-rt|system:0|arbiter:N` shortened; each arbiter
//! is a current-thread Tokio runtime, the delivery lanes are plain threads):
//!
//! ```text
//!  thread                        hop
//!  ────────────────────────────  ──────────────────────────────────────────────
//!  HTTP worker (arbiter:N)       1 the connection's socket loop reads the
//!                                  frame, the session actor parses it;
//!                                  ops::dispatch queues the op on the
//!                                  conversation's actor (Hub::enqueue, try_send)
//!                                  and awaits its reply
//!         │ actix mailbox
//!         ▼
//!  actor arbiter (arbiter:M)     2 the conversation actor queues it; its batch
//!                                  task (actix::spawn) hands the batch on
//!         │ mpsc
//!         ▼
//!  System thread                 3 a commit-stage worker task commits the
//!  (built the Application;         batches waiting in one transaction
//!  "main" in the binary)
//!         │ oneshot
//!         ▼
//!  actor arbiter (arbiter:M)     4 finish_batch answers every op (oneshot → 6)
//!                                  and hands the batch to every lane (send;
//!                                  past the backlog a `Missed` notice)
//!         │ mpsc (unbounded; the backlog is counted)
//!         ▼
//!  delivery-0 … delivery-K       5 encode once; queue the shared frame in
//!                                  each receiving device's outbox
//!         │ outbox (bounded), one wakeup of an idle writer
//!         ▼
//!  HTTP worker(s)                6 the sender's socket loop writes the ack,
//!                                  each receiver's its pushes
//! ```
//!
//! On a node of a cluster, hop 4 also hands the batch to the `bus` thread
//! (`try_send`), which encodes it and publishes it to NATS; the other nodes'
//! batches come from that thread straight to hop 5 (through the reorder
//! stage, as this node's own do then). A write whose conversation is homed on
//! another node leaves at hop 2 for that thread instead (`try_send`), crosses
//! NATS, and enters the home node's hop 2 from its bus thread; the answer
//! comes back the same way to the session.
//!
//! Nothing on an arbiter blocks: the gateway and the actors only `try_send`
//! or await; fan-out (encoding, one push per device) is on the lanes, and a
//! full lane or mailbox drops rather than waits (its users resync). The exceptions are bounded
//! CPU work on an HTTP worker: a new conversation's events are handed to the
//! lanes (with any batch of it that committed meanwhile, under a
//! per-conversation map entry) and the answer awaits their fan-out, and the
//! `direct` path hands its batch to the lanes under a per-conversation lock,
//! once its predecessors were (it awaits them, up to 1 s; not on a node of a
//! cluster, whose reorder stage orders them). With `commit_workers = 0` the
//! batch task runs its own transaction on the actor's arbiter instead of the
//! System thread. Log lines are written synchronously by whichever thread
//! logs.
//!
//! # Invariants
//! P1–P9 and the mechanism that keeps each are tabled in ARCHITECTURE §2;
//! each mechanism's doc comment names the invariant it keeps.

#[doc = include_str!("ARCHITECTURE.md")]
pub mod architecture {}
#[doc = include_str!("STORAGE_PLAN.md")]
pub mod storage_plan {}
#[doc = include_str!("OPERATIONS.md")]
pub mod operations {}
pub mod admin;
pub mod budget;
pub mod cli;
pub mod cluster;
pub mod config;
pub mod delivery;
pub mod domain;
pub mod gateway;
pub mod metrics;
pub mod notify;
pub mod online;
pub mod pg;
pub mod pg_formation;
pub mod protocol;
pub mod startup;
pub mod store;
pub mod telemetry;
pub mod writer;
