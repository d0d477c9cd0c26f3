//! The PostgreSQL store: one module per transaction family.
//!
//! The write transaction's hot statements are prepared once per pooled
//! connection (`connection`, `write::prepared`): no parse or plan per use.
//! Every other statement goes out with
//! [`query_typed`](tokio_postgres::GenericClient::query_typed) (parameter types
//! given), which is one round trip — a plain `query(&str)` would first prepare
//! (a second round trip). The conversation row lock is held across round
//! trips, not across fsync (ARCHITECTURE §3).

/// The columns of an event row as `sync::event_from_row` decodes them (0–19),
/// of the events aliased `e`.
macro_rules! event_columns {
    () => {
        "e.seq, e.kind, e.created_at, e.message_id, e.sender_user, e.sender_device, e.client_msg_id,
         e.body, e.subject_user, e.actor, e.reason, e.target_seq, e.change, e.recalled,
         e.reply_to, e.mentions, e.mention_all, e.edited_at, e.emoji, e.reaction_on"
    };
}

mod access;
mod accounts;
mod blocks;
mod changes;
mod commit_stage;
mod connection;
mod conversations;
mod error;
mod heads;
mod inbox;
mod members;
mod migrate;
mod notify;
mod people;
mod port;
mod presence;
mod pushers;
mod read;
mod retention;
mod signals;
mod since_token;
mod standby;
mod sync;
mod tail;
mod write;

use std::sync::Arc;

use crate::config::{LargeGroupSettings, StoreSettings};

pub use access::Access;
pub use accounts::{token_hash, DeviceToken, TokenOwner};
pub use blocks::Block;
pub use changes::{InboxDelta, SINCE_MAX_AGE, SINCE_MAX_CHANGED};
use commit_stage::CommitStage;
pub use conversations::{direct_conv_id, ConversationInfo, CreateConversation, CreatedConversation, GroupSettings};
pub use error::{ErrorClass, Report, StoreError};
pub use inbox::{InboxItem, InboxPage, INBOX_DEFAULT_LIMIT, INBOX_MAX_LIMIT, INBOX_PAGE, UNREAD_CAP, UNREAD_SCAN_ROWS};
pub use members::{
    past_prefix, Application, ApplicationPage, MemberInfo, MemberNext, MemberPage, MemberQuery, MEMBERS_ACTIVE,
    MEMBERS_DEFAULT_LIMIT, MEMBERS_MAX_LIMIT, MEMBERS_PAGE, MEMBERS_SEARCH,
};
pub use migrate::{MIGRATIONS, SCHEMA_VERSION};
pub use notify::{Behind, ConvFacts, DueRow};
pub use people::{FoundUser, SEARCH_USERS};
pub use presence::Membership;
pub use pushers::{NewPusher, NotifyLevel};
pub use read::{MarkedRead, MemberRead, ReadsPage};
pub use retention::{Pace, PurgeReport};
pub use sync::{ReactionCount, SyncEvent, SyncPage, SyncRequest, SYNC_DEFAULT_LIMIT, SYNC_FORWARD, SYNC_MAX_LIMIT};
pub use tail::{Tail, TailCounts};
pub use write::{
    Appended, BanOp, BatchJob, ConvCache, EditOp, GroupChange, GroupOp, Invited, JoinOp, LeaveOp, ProfilePatch,
    ReactOp, RecallAck, RecallOp, Roster, SendAck, SendOp, WriteOp, WriteOutcome, Written, WrittenBatch,
};

pub use connection::{Pool, PooledClient};
pub use heads::Heads;

/// Session settings for every pooled connection. A transaction that holds a
/// conversation row lock must never wait forever (ARCHITECTURE §3, faults).
/// No JIT: it starts by estimated cost, and a plan the planned-once settings
/// price a disabled method into (`write::txn`) costs 10^10, so it was
/// compiled by LLVM at every execution, tens of ms to seconds of CPU that a
/// statement timeout cannot interrupt.
const SESSION_OPTIONS: &str =
    "-c lock_timeout=5000 -c statement_timeout=30000 -c idle_in_transaction_session_timeout=60000 -c jit=off";

/// Handle to the database; cheap to clone.
#[derive(Clone)]
pub struct Store {
    pool: Pool,
    /// Where actor batches are committed, merged across conversations; unset:
    /// one transaction per batch.
    commit_stage: Option<CommitStage>,
    /// The sizes at which groups change how they deliver (ARCHITECTURE §9).
    large_groups: LargeGroupSettings,
    /// Recent events of hot conversations, for `sync` (ARCHITECTURE §4).
    tail: Arc<Tail>,
    /// What this node knows committed, per conversation (ARCHITECTURE §6).
    heads: Arc<Heads>,
    /// Where history reads go when it has replayed far enough.
    standby: Option<Arc<standby::Standby>>,
}

impl Store {
    /// A pool of `pool_size` connections, other settings at their defaults
    /// (tests, tools).
    pub async fn connect(url: &str, pool_size: u32) -> Result<Self, StoreError> {
        Self::connect_with(url, &StoreSettings::pool(pool_size)).await
    }

    pub async fn connect_with(url: &str, settings: &StoreSettings) -> Result<Self, StoreError> {
        let pool = pool_on(url, settings).await?;
        let standby = match &settings.standby_url {
            Some(url) => Some(Arc::new(standby::Standby::new(pool_on(url, settings).await?))),
            None => None,
        };
        Ok(Self {
            pool,
            commit_stage: None,
            large_groups: settings.large_groups,
            tail: Arc::new(Tail::new(settings.sync_tail_bytes)),
            heads: Arc::default(),
            standby,
        })
    }

    /// Routes actor batches through a commit stage of `workers` merging
    /// workers (0: none). Must run inside a Tokio runtime.
    pub fn with_commit_stage(mut self, workers: usize, max_ops: usize) -> Self {
        self.commit_stage = (workers > 0).then(|| CommitStage::start(self.clone(), workers, max_ops));
        self
    }

    /// The tail cache `sync` reads first.
    pub fn tail(&self) -> &Arc<Tail> {
        &self.tail
    }

    /// The heads known committed here; delivery notes other nodes' batches.
    pub fn heads(&self) -> &Arc<Heads> {
        &self.heads
    }

    /// After a batch committed, before its acks and its delivery: a caller
    /// that syncs after either finds its events (in the tail, on a standby).
    fn committed(&self, appended: &Appended) {
        self.tail.committed(appended);
        self.heads.saw(&appended.conv_id, appended.head);
    }

    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// A primary reachable within the connect timeout (not a standby in
    /// recovery) and the schema at this build's version.
    pub async fn ready(&self) -> bool {
        let Some(c) = self.pool.probe().await else { return false };
        let primary = c.query_prepared("SELECT NOT pg_is_in_recovery()", &[]).await;
        primary.is_ok_and(|rows| rows.first().is_some_and(|r| r.try_get(0).unwrap_or(false)))
            && migrate::up_to_date(&**c).await.unwrap_or(false)
    }
}

/// A pool on `url` (the primary's, or the standby's) with the session settings.
async fn pool_on(url: &str, settings: &StoreSettings) -> Result<Pool, StoreError> {
    let mut config: tokio_postgres::Config = url.parse().map_err(StoreError::InvalidUrl)?;
    if config.get_options().is_none() {
        config.options(SESSION_OPTIONS);
    }
    if config.get_application_name().is_none() {
        config.application_name("imcore");
    }
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(settings.connect_timeout());
    }
    let builder = bb8::Pool::builder()
        .max_size(settings.pool_size)
        .connection_timeout(settings.pool_timeout())
        // Checks, without a round trip, that the connection is not known
        // closed (`connection::Manager::is_valid`).
        .test_on_check_out(true);
    Ok(Pool::build(builder, config, settings.connect_timeout()).await?)
}
