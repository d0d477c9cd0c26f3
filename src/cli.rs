//! The command line: with no subcommand the server (every flag of
//! [`Config`]); `admin …` talks to a running server over HTTP ([`crate::admin`]).

use clap::{Args, Parser, Subcommand};

use crate::config::Config;

#[derive(Debug, Parser)]
#[command(name = "imcore", version, about = "imcore instant-messaging server")]
pub struct Cli {
    #[command(flatten)]
    pub config: Config,

    #[command(subcommand)]
    pub command: Option<Command>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Administer a running server (users, devices, epochs, retention, bans).
    Admin(AdminArgs),
}

#[derive(Debug, Args)]
pub struct AdminArgs {
    /// The server: `http://host:port` or `host:port`. Default: the configured
    /// listen address (`--listen`, `IMCORE_LISTEN`).
    #[arg(long, env = "IMCORE_SERVER")]
    pub server: Option<String>,

    #[command(subcommand)]
    pub command: AdminCommand,
}

#[derive(Debug, Subcommand)]
pub enum AdminCommand {
    /// Users.
    #[command(subcommand)]
    User(UserCommand),
    /// Devices and their tokens.
    #[command(subcommand)]
    Device(DeviceCommand),
    /// Conversation epochs (after restoring a backup).
    #[command(subcommand)]
    Epoch(EpochCommand),
    /// The retention purge.
    #[command(subcommand)]
    Retention(RetentionCommand),
    /// Groups the operator bans (no writes; members still read).
    #[command(subcommand)]
    Conversation(ConversationCommand),
}

#[derive(Debug, Subcommand)]
pub enum UserCommand {
    /// Creates a user.
    Add {
        user_id: String,
        /// Display name.
        #[arg(long)]
        name: Option<String>,
    },
}

#[derive(Debug, Subcommand)]
pub enum DeviceCommand {
    /// Issues a device token (again: rotates it) and prints it with a login URL for the web client.
    Add { user_id: String, device_id: String },
}

#[derive(Debug, Subcommand)]
pub enum EpochCommand {
    /// Bumps a conversation's epoch: clients resync it from `min_seq`.
    Bump { conv_id: String },
}

#[derive(Debug, Subcommand)]
pub enum ConversationCommand {
    /// Bans a group: every write answers `CONV_BANNED` until it is unbanned.
    Ban { conv_id: String },
    /// Lifts a ban.
    Unban { conv_id: String },
}

#[derive(Debug, Subcommand)]
pub enum RetentionCommand {
    /// Runs the retention purge now.
    Run,
}
