use std::borrow::Cow;

/// Why a well-formed request was refused. Each maps to one PROTOCOL §2 code
/// (`crate::protocol::ErrorCode::from`); a rejected request changed nothing.
/// Serialized only between nodes (a forwarded write's answer, ARCHITECTURE §7).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, serde::Serialize, serde::Deserialize)]
pub enum Rejection {
    #[error("{0}")]
    BadRequest(String),
    #[error("not a member of this conversation")]
    NotMember,
    #[error("{0}")]
    Forbidden(Cow<'static, str>),
    #[error("muted")]
    Muted,
    #[error("the group was dismissed")]
    ConvDismissed,
    #[error("the group is banned by the operator")]
    ConvBanned,
    #[error("already a member")]
    AlreadyMember,
    #[error("the group is full")]
    GroupFull,
    #[error("client_msg_id was already used with a different body")]
    IdempotencyMismatch,
    #[error("the earlier send with this client_msg_id was purged by retention")]
    IdempotencyKeyExpired,
    #[error("the recall window has passed")]
    RecallWindowExpired,
    #[error("the edit window has passed")]
    EditWindowExpired,
    #[error("the message already has {0} distinct reactions")]
    TooManyReactions(usize),
    #[error("the conversation's epoch is now {epoch}")]
    EpochChanged { epoch: i32, min_seq: i64 },
    #[error("{0} not found")]
    NotFound(Cow<'static, str>),
    #[error("{0} already exists")]
    AlreadyExists(Cow<'static, str>),
    /// The other user blocked the caller (PROTOCOL v1.2); the answer says
    /// nothing more.
    #[error("blocked")]
    Blocked,
}

impl Rejection {
    /// `NOT_FOUND` naming each id that is no user ("user zoe", "users ben, zoe"),
    /// so a client can show which one failed.
    pub fn unknown_users(ids: &[&str]) -> Self {
        let noun = if ids.len() == 1 { "user" } else { "users" };
        Rejection::NotFound(format!("{noun} {}", ids.join(", ")).into())
    }
}
