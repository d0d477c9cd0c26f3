//! The port conversation actors write through. The actor layer knows nothing
//! of SQL or JSON: ops, outcomes and the cached state are the store's types.

use std::future::Future;

use crate::ids::ConvId;

/// A store that commits a batch of one conversation's ops in one transaction.
///
/// Correctness never rests on the actor: an implementation must keep every
/// invariant even when two actors (two nodes) write one conversation at once,
/// by locking the conversation row inside the transaction.
pub trait ConversationStore: Send + Sync + 'static {
    /// One write request: a send, a membership change…
    type Op: Send + 'static;
    /// What the caller of one op gets back: its own result or rejection.
    type Outcome: Send + 'static;
    /// State the store may keep between batches of one conversation (member
    /// roles, `member_version`…). It is revalidated under the row lock, so a
    /// stale cache costs a reload, never a wrong answer.
    type Cache: Default + Send + 'static;
    /// What was appended, handed to [`Fanout`] after commit.
    type Committed: Send + 'static;
    /// The batch failed as a whole: nothing of it was committed, or the
    /// commit's fate is unknown. Callers retry with the same request key.
    /// Each caller gets it as the source of its [`WriteError::Internal`].
    ///
    /// [`WriteError::Internal`]: crate::WriteError::Internal
    type Error: std::error::Error + Send + Sync + 'static;

    /// Applies `ops` in order in one transaction. On success there is exactly
    /// one outcome per op, in the same order; an op that fails its checks fails
    /// alone and the others still commit.
    fn commit_batch(
        &self,
        conv: ConvId,
        cache: Self::Cache,
        ops: Vec<Self::Op>,
    ) -> impl Future<Output = Result<BatchCommitted<Self>, Self::Error>> + Send + 'static;
}

/// A committed batch.
pub struct BatchCommitted<S: ConversationStore + ?Sized> {
    pub outcomes: Vec<S::Outcome>,
    pub cache: S::Cache,
    pub committed: S::Committed,
    /// Events the batch appended: 0 when every op was refused or replayed.
    /// An actor none of whose batches appended anything retires as soon as it
    /// is idle (the conversation does not exist, or its callers are not
    /// members), instead of staying warm for nothing.
    pub appended: usize,
}

/// Where committed events go after the callers have their replies: delivery
/// to live devices. Must not block: it is called on the conversation's actor.
pub trait Fanout<C>: Send + Sync + 'static {
    fn deliver(&self, conv: &ConvId, committed: C);
}
