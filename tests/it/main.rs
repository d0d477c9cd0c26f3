//! The real test tier: a real PostgreSQL, real connections, real sockets.
//! One binary, so the run shares one cluster.

mod actor_flood;
mod actor_path;
mod admin_commands;
mod bounds;
mod cluster;
mod cluster_harness;
mod cluster_trust;
mod commit_isolation;
mod commit_stall;
mod db_outage;
mod edge_rules;
mod embedded_pg;
#[macro_use]
mod env;
mod evidence;
mod failover;
mod fuzz_edges;
mod gateway;
mod gateway_connections;
mod gateway_contract;
mod gateway_faults;
mod gateway_races;
mod groups;
mod harness;
mod history;
mod inbox;
mod input_forms;
mod leaks;
mod limits;
mod live;
mod live_cluster;
mod nats_cluster;
mod notify;
mod overload;
mod people;
mod persistence;
mod presence;
mod recall;
mod retention;
mod server;
mod since;
mod startup;
mod store_rules;
mod sync_points;
mod web;
