//! An event of a conversation's log, as stored (PROTOCOL §5 "Event object").

use chrono::{DateTime, Utc};
use imcore_actors::{ClientMsgId, ConvId, DeviceId, UserId};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::Emoji;

/// Serde: how committed batches cross the bus between nodes (ARCHITECTURE §7).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    pub conv_id: ConvId,
    pub seq: i64,
    pub created_at: DateTime<Utc>,
    pub kind: EventKind,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum EventKind {
    Msg {
        message_id: Uuid,
        sender: UserId,
        sender_device: DeviceId,
        client_msg_id: ClientMsgId,
        /// Canonical JSON text, the latest edit's; `None` once recalled.
        body: Option<String>,
        recalled: bool,
        /// The seq of the `msg` this one replies to.
        reply_to: Option<i64>,
        /// Distinct members, in the order the sender gave.
        mentions: Vec<UserId>,
        /// The body's `mention_all: true` (counted by `unread_mentions`).
        mention_all: bool,
        /// The time of the latest `edit`.
        edited_at: Option<DateTime<Utc>>,
    },
    /// The sender's new body for its `msg` at `target_seq`; `None` once the
    /// target is recalled (its content goes with it).
    Edit {
        sender: UserId,
        sender_device: DeviceId,
        client_msg_id: ClientMsgId,
        target_seq: i64,
        body: Option<String>,
    },
    /// `sender` turned `emoji` on or off on the `msg` at `target_seq`.
    Reaction {
        sender: UserId,
        sender_device: DeviceId,
        target_seq: i64,
        emoji: Emoji,
        on: bool,
    },
    Recall {
        sender: UserId,
        sender_device: Option<DeviceId>,
        target_seq: i64,
    },
    Join {
        subject: UserId,
        actor: UserId,
    },
    Leave {
        subject: UserId,
        actor: UserId,
        reason: LeaveReason,
    },
    Group {
        /// `None`: the operator (a ban or unban), not a member.
        actor: Option<UserId>,
        /// JSON object text naming what changed.
        change: String,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LeaveReason {
    Left,
    Kicked,
    Dismissed,
}

impl LeaveReason {
    pub fn as_str(self) -> &'static str {
        match self {
            LeaveReason::Left => "left",
            LeaveReason::Kicked => "kicked",
            LeaveReason::Dismissed => "dismissed",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "left" => Some(LeaveReason::Left),
            "kicked" => Some(LeaveReason::Kicked),
            "dismissed" => Some(LeaveReason::Dismissed),
            _ => None,
        }
    }
}

/// The `change` of the `group` event that dismisses a group (PROTOCOL §5):
/// it closes every open membership period at its seq.
pub const DISMISSED_CHANGE: &str = r#"{"status":"dismissed"}"#;
/// The `change` of the operator's ban of a group, and of its unban.
pub const BANNED_CHANGE: &str = r#"{"status":"banned"}"#;
pub const UNBANNED_CHANGE: &str = r#"{"status":"active"}"#;

impl EventKind {
    /// Whether this event dismisses its group.
    pub fn dismisses(&self) -> bool {
        matches!(self, EventKind::Group { change, .. } if change == DISMISSED_CHANGE)
    }

    pub fn name(&self) -> &'static str {
        match self {
            EventKind::Msg { .. } => "msg",
            EventKind::Recall { .. } => "recall",
            EventKind::Join { .. } => "join",
            EventKind::Leave { .. } => "leave",
            EventKind::Group { .. } => "group",
            EventKind::Edit { .. } => "edit",
            EventKind::Reaction { .. } => "reaction",
        }
    }
}
