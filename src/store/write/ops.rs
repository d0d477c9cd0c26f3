//! The write requests of one conversation, and what each one's caller gets
//! back. Every op that changes a conversation is one of these: it goes
//! through the conversation's actor and is applied under the row lock in the
//! batch's transaction (ARCHITECTURE §3). Ops and answers are serialized
//! only between nodes (a write forwarded to the conversation's home, §7).

use chrono::{DateTime, Utc};
use imcore_actors::{ClientMsgId, DeviceId, UserId};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::domain::{Body, DeliverySetting, Emoji, JoinMode, LeaveReason, Rejection, Role};

/// One write request against one conversation.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum WriteOp {
    Send(SendOp),
    /// A join without permission checks: the members of a new conversation.
    Join(JoinOp),
    /// A leave without permission checks.
    Leave(LeaveOp),
    /// A group op of a device (PROTOCOL §5 "Membership and groups"), checked
    /// in the order written there.
    Group(GroupOp),
    Recall(RecallOp),
    Edit(EditOp),
    React(ReactOp),
    /// The operator bans or unbans a group (the admin endpoint, not a user).
    Ban(BanOp),
}

impl WriteOp {
    /// Who asks: the sender or editor, the user joined or left, the caller of a
    /// group op, recall or reaction; `None`: the operator.
    pub fn caller(&self) -> Option<&UserId> {
        match self {
            WriteOp::Send(s) => Some(&s.sender),
            WriteOp::Edit(e) => Some(&e.sender),
            WriteOp::React(r) => Some(&r.actor),
            WriteOp::Join(j) => Some(&j.user),
            WriteOp::Leave(l) => Some(&l.user),
            WriteOp::Recall(r) => Some(&r.actor),
            WriteOp::Group(g) => Some(&g.actor),
            WriteOp::Ban(_) => None,
        }
    }

    /// Who made a change to the membership or the settings, for an op that
    /// may make one (the actor of a `delivery` change it causes); `None` for
    /// the ops that never do (messages, recalls, edits, reactions).
    pub fn member_actor(&self) -> Option<&UserId> {
        match self {
            WriteOp::Join(j) => Some(&j.actor),
            WriteOp::Leave(l) => Some(&l.actor),
            WriteOp::Group(g) => Some(&g.actor),
            WriteOp::Send(_) | WriteOp::Edit(_) | WriteOp::React(_) | WriteOp::Recall(_) | WriteOp::Ban(_) => None,
        }
    }

    /// Every user whose standing in the conversation the op's rules read:
    /// the caller, and the users it names. No allocation: it runs for every
    /// op of every batch.
    pub fn users(&self) -> impl Iterator<Item = &UserId> {
        let named: &[UserId] = match self {
            WriteOp::Send(s) => s.mentions.as_slice(),
            WriteOp::Edit(_)
            | WriteOp::React(_)
            | WriteOp::Join(_)
            | WriteOp::Leave(_)
            | WriteOp::Recall(_)
            | WriteOp::Ban(_) => &[],
            WriteOp::Group(GroupOp { change, .. }) => match change {
                GroupChange::Invite(named) => named.as_slice(),
                GroupChange::Approve(u)
                | GroupChange::Reject(u)
                | GroupChange::Kick(u)
                | GroupChange::TransferOwner(u)
                | GroupChange::SetRole { user: u, .. }
                | GroupChange::SetPerms { user: u, .. }
                | GroupChange::Mute { user: u, .. } => std::slice::from_ref(u),
                GroupChange::Join
                | GroupChange::Leave
                | GroupChange::SetAlias(_)
                | GroupChange::Update(_)
                | GroupChange::Dismiss => &[],
            },
        };
        self.caller().into_iter().chain(named)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SendOp {
    pub sender: UserId,
    pub device: DeviceId,
    pub client_msg_id: ClientMsgId,
    pub body: Body,
    /// The seq of a `msg` the sender can see.
    #[serde(default)]
    pub reply_to: Option<i64>,
    /// Distinct users, each to be a current member (at most `MAX_MENTIONS`).
    #[serde(default)]
    pub mentions: Vec<UserId>,
}

impl SendOp {
    /// A send with neither a reply nor mentions: what the one-trip path takes.
    pub fn plain(sender: UserId, device: DeviceId, client_msg_id: ClientMsgId, body: Body) -> Self {
        Self { sender, device, client_msg_id, body, reply_to: None, mentions: Vec::new() }
    }
}

/// `edit` of the sender's `msg` at `target_seq`: its body becomes `body`.
/// Idempotent by `(conv, sender, client_msg_id)`, like a send.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EditOp {
    pub sender: UserId,
    pub device: DeviceId,
    pub client_msg_id: ClientMsgId,
    pub target_seq: i64,
    pub body: Body,
}

impl EditOp {
    /// The request's fingerprint: over the target and the body, and never
    /// equal to a send's (which is over a body's JSON text alone), so a key
    /// taken by one kind of request never replays as the other.
    pub fn fingerprint(&self) -> [u8; 32] {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        h.update(b"edit\0");
        h.update(self.target_seq.to_be_bytes());
        h.update(self.body.fingerprint());
        h.finalize().into()
    }
}

/// `react`: `actor` turns `emoji` on or off on the `msg` at `target_seq`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReactOp {
    pub actor: UserId,
    pub device: DeviceId,
    pub target_seq: i64,
    pub emoji: Emoji,
    pub on: bool,
}

/// `user` joins with `role`; `actor` is who added them (the user itself for a self-join).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JoinOp {
    pub user: UserId,
    pub actor: UserId,
    pub role: Role,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LeaveOp {
    pub user: UserId,
    pub actor: UserId,
    pub reason: LeaveReason,
}

/// `recall` of the message at `target_seq` by `actor` from its `device`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RecallOp {
    pub actor: UserId,
    pub device: DeviceId,
    pub target_seq: i64,
}

/// The operator's ban (`banned`) or unban of a group (PROTOCOL "Banned groups").
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BanOp {
    pub banned: bool,
}

/// `actor` (the caller) asks for `change`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GroupOp {
    pub actor: UserId,
    pub change: GroupChange,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum GroupChange {
    /// Distinct users.
    Invite(Vec<UserId>),
    /// The caller joins (`free`) or applies (`approval`).
    Join,
    Approve(UserId),
    Reject(UserId),
    Leave,
    Kick(UserId),
    /// `role` is `Admin` or `Member`; `until` only with `Admin`.
    SetRole {
        user: UserId,
        role: Role,
        until: Option<DateTime<Utc>>,
    },
    SetPerms {
        user: UserId,
        extra_perms: u32,
    },
    Mute {
        user: UserId,
        until: Option<DateTime<Utc>>,
    },
    /// The caller's own alias; `None` clears it.
    SetAlias(Option<String>),
    TransferOwner(UserId),
    Update(ProfilePatch),
    Dismiss,
}

impl GroupChange {
    /// The op's wire name.
    pub fn op(&self) -> &'static str {
        match self {
            GroupChange::Invite(_) => "invite",
            GroupChange::Join => "join",
            GroupChange::Approve(_) => "approve",
            GroupChange::Reject(_) => "reject",
            GroupChange::Leave => "leave",
            GroupChange::Kick(_) => "kick",
            GroupChange::SetRole { .. } => "set_role",
            GroupChange::SetPerms { .. } => "set_perms",
            GroupChange::Mute { .. } => "mute_member",
            GroupChange::SetAlias(_) => "set_alias",
            GroupChange::TransferOwner(_) => "transfer_owner",
            GroupChange::Update(_) => "update_group",
            GroupChange::Dismiss => "dismiss",
        }
    }
}

/// `update_group`: the settings given (at least one).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ProfilePatch {
    pub name: Option<String>,
    pub join_mode: Option<JoinMode>,
    pub max_member: Option<i32>,
    pub mute_all: Option<bool>,
    /// The delivery setting (`auto`, `push`, `pull`).
    pub delivery_mode: Option<DeliverySetting>,
    pub recall_window_ms: Option<i64>,
    #[serde(default)]
    pub edit_window_ms: Option<i64>,
    /// `Some(None)`: unlimited.
    pub retention_ms: Option<Option<i64>>,
}

impl ProfilePatch {
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SendAck {
    pub seq: i64,
    pub message_id: Uuid,
    pub dup: bool,
    pub created_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Written {
    Sent(SendAck),
    Joined {
        seq: i64,
    },
    Left {
        seq: i64,
    },
    /// A group op appended its `group` event at `seq`.
    Changed {
        seq: i64,
    },
    Invited(Invited),
    Recalled(RecallAck),
    /// `edit`'s answer: the seq of the `edit` event, the first one's on a repeat.
    Edited(RecallAck),
    /// `react`'s answer: the seq of the `reaction` event, `None` when the
    /// set already was as asked and nothing was appended.
    Reacted {
        seq: Option<i64>,
    },
    /// An application filed (`join` of an approval group); no event.
    Pending,
    /// An application rejected; no event.
    Rejected,
    /// A ban or unban: the seq of its `group` event, `None` when the group
    /// already stood so and nothing was appended.
    Status {
        seq: Option<i64>,
    },
}

impl Written {
    /// The seq of the event the op appended, or of its first append on a repeat.
    pub fn seq(&self) -> Option<i64> {
        match self {
            Written::Sent(SendAck { seq, .. })
            | Written::Joined { seq }
            | Written::Left { seq }
            | Written::Changed { seq }
            | Written::Recalled(RecallAck { seq, .. })
            | Written::Edited(RecallAck { seq, .. }) => Some(*seq),
            Written::Invited(invited) => Some(invited.head),
            Written::Reacted { seq } | Written::Status { seq } => *seq,
            Written::Pending | Written::Rejected => None,
        }
    }
}

/// `recall`'s answer: the seq of the `recall` event, the first one's on a repeat.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecallAck {
    pub seq: i64,
    pub dup: bool,
}

/// What an `invite` did with each user named.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Invited {
    pub joined: Vec<UserId>,
    /// Applications filed (a plain member's invite in an approval group).
    pub pending: Vec<UserId>,
    /// Already members.
    pub skipped: Vec<UserId>,
    /// The conversation's head after the invite.
    pub head: i64,
}

pub type WriteOutcome = Result<Written, Rejection>;

#[cfg(test)]
mod tests {
    use imcore_actors::{ClientMsgId, ConvId, DeviceId, UserId};
    use serde_json::json;

    use super::*;
    use crate::domain::{Event, EventKind};

    /// A write forwarded to its conversation's home crosses the bus as JSON
    /// (ARCHITECTURE §7): the v1.2 ops, answers and events come back whole.
    #[test]
    fn history_ops_answers_and_events_cross_the_bus_whole() {
        let (user, device) = (UserId::parse("u-a").expect("id"), DeviceId::parse("d").expect("id"));
        let body = Body::parse(&json!({"text": "hi"}), 1024).expect("body");
        let ops = [
            WriteOp::Send(SendOp {
                reply_to: Some(3),
                mentions: vec![UserId::parse("u-b").expect("id")],
                ..SendOp::plain(user.clone(), device.clone(), ClientMsgId::parse("k").expect("id"), body.clone())
            }),
            WriteOp::Edit(EditOp {
                sender: user.clone(),
                device: device.clone(),
                client_msg_id: ClientMsgId::parse("e").expect("id"),
                target_seq: 3,
                body,
            }),
            WriteOp::React(ReactOp {
                actor: user.clone(),
                device: device.clone(),
                target_seq: 3,
                emoji: Emoji::parse("👍").expect("emoji"),
                on: true,
            }),
        ];
        for op in ops {
            let text = serde_json::to_string(&op).expect("encode");
            let back: WriteOp = serde_json::from_str(&text).expect("decode");
            assert_eq!(serde_json::to_string(&back).expect("encode"), text);
        }
        for written in [Written::Edited(RecallAck { seq: 4, dup: false }), Written::Reacted { seq: None }] {
            let back: Written =
                serde_json::from_str(&serde_json::to_string(&written).expect("encode")).expect("decode");
            assert_eq!(back, written);
        }
        let event = Event {
            conv_id: ConvId::parse("g").expect("id"),
            seq: 5,
            created_at: chrono::Utc::now(),
            kind: EventKind::Reaction {
                sender: user,
                sender_device: device,
                target_seq: 3,
                emoji: Emoji::parse("👍").expect("emoji"),
                on: false,
            },
        };
        let back: Event = serde_json::from_str(&serde_json::to_string(&event).expect("encode")).expect("decode");
        assert_eq!(back, event);
        // An emoji is checked again on arrival.
        assert!(serde_json::from_str::<Emoji>(r#""a b""#).is_err());
    }
}
