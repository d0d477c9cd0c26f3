//! imcore-load: load generators for imcore.
//!
//! * `imcore-load [write] …` — the in-process write-path benchmark (the
//!   default when no subcommand is given): `actor` vs `direct` through the
//!   library, no network.
//! * `imcore-load ws …` — end to end: starts the `imcore` server binary as a
//!   child process per write path and drives it over real WebSocket
//!   connections on loopback (hot group, fan-out, connection scale, latency at
//!   half load). See `ws/mod.rs`.
//! * `imcore-load retention` — in process: the purge rate, a hot group during
//!   a purge, and sends that probe a million tombstones. See `retention/mod.rs`.
//! * `imcore-load failover` — end to end: the server on a pg_auto_failover
//!   formation under load, a switchover and the primary killed. See
//!   `ws/failover.rs`.
//! * `imcore-load since` — in process: the reconnect delta of a user in
//!   10,000 conversations, 10 of them changed. See `since.rs`.
//! * `imcore-load peer-xmpp` — the latency scenario against an XMPP server
//!   (ejabberd, set up by benches/peers/ejabberd/run.sh). See `peer_xmpp/`.
//!
//! Every run is bounded in messages and time and stops by itself, and checks
//! what it wrote: a run that did not verify makes the command fail.

mod environment;
mod peer_xmpp;
mod percentiles;
mod retention;
mod senders;
mod since;
mod verdict;
mod write;
mod ws;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "imcore-load",
    about = "imcore load generators: in-process write path (default) and end-to-end WebSocket",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    /// With no subcommand: the `write` benchmark.
    #[command(flatten)]
    write: write::Args,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// In-process write path: actor vs direct through the library (the default).
    Write(write::Args),
    /// End to end over WebSocket against a server child process per write path.
    Ws(Box<ws::Args>),
    /// In process: purge rate, a hot group during a purge, sends probing a million tombstones.
    Retention(retention::Args),
    /// End to end: a pg_auto_failover formation under load, switchover and primary killed.
    Failover(ws::failover::Args),
    /// In process: the reconnect delta (PROTOCOL §7) of a user in many conversations.
    Since(since::Args),
    /// End to end: the latency scenario against an XMPP server's MUC room archived in PostgreSQL.
    PeerXmpp(peer_xmpp::Args),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    match cli.cmd {
        Some(Cmd::Ws(args)) => ws::main(*args),
        Some(Cmd::Write(args)) => write::main(args),
        Some(Cmd::Retention(args)) => retention::main(args),
        Some(Cmd::Failover(args)) => ws::failover::main(args),
        Some(Cmd::Since(args)) => since::main(args),
        Some(Cmd::PeerXmpp(args)) => peer_xmpp::main(args),
        None => write::main(cli.write),
    }
}
