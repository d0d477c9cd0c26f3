//! The real test tier: a real PostgreSQL, real connections, real sockets.
//! One binary, so the run shares one cluster.

mod env;
mod evidence;
mod harness;
mod seed_000;
mod store_rules;
