//! The rules of `send`.

use std::collections::HashMap;

use uuid::Uuid;

use super::batch::BatchBuilder;
use super::lookup::{Prior, RequestKey, SendAckWithHash, Targets};
use super::ops::{SendAck, SendOp, WriteOutcome, Written};
use super::Roster;
use crate::domain::{EventKind, Permission, Rejection};

impl BatchBuilder {
    /// PROTOCOL §5 `send`: replay → tombstone → dismissed → member → blocked →
    /// mute → permission → `reply_to` and `mentions` (`NOT_FOUND`) → append.
    pub(super) fn send(
        &mut self,
        op: &SendOp,
        prior: &HashMap<RequestKey, Prior>,
        members: &Roster,
        targets: &Targets,
    ) -> WriteOutcome {
        let key = (self.conv.clone(), op.sender.clone(), op.client_msg_id.clone());
        let earlier = self.appended_keys.get(&key).or_else(|| prior.get(&key).and_then(|p| p.event.as_ref()));
        if let Some(earlier) = earlier {
            return if op.body.replays(&earlier.hash) {
                Ok(Written::Sent(SendAck { dup: true, ..earlier.ack.clone() }))
            } else {
                Err(Rejection::IdempotencyMismatch)
            };
        }
        // A purged send's key is never appended again (P9): the same request
        // learns its original went, a different one that the key is taken.
        if let Some(hash) = prior.get(&key).and_then(|p| p.tombstone.as_deref()) {
            return Err(if op.body.replays(hash) {
                Rejection::IdempotencyKeyExpired
            } else {
                Rejection::IdempotencyMismatch
            });
        }
        self.status.writable()?;
        let Some(member) = members.get(&op.sender) else {
            return Err(Rejection::NotMember);
        };
        if member.blocked {
            return Err(Rejection::Blocked);
        }
        if member.muted(self.mute_all, self.now) {
            return Err(Rejection::Muted);
        }
        if !member.can(self.join_mode, self.now, Permission::SendMsg) {
            return Err(Rejection::Forbidden("your role may not send messages".into()));
        }
        if op.body.mention_all() && !member.can(self.join_mode, self.now, Permission::AtAll) {
            return Err(Rejection::Forbidden("your role may not mention everyone".into()));
        }
        if let Some(seq) = op.reply_to {
            // A recalled message is still one the sender saw: a reply to it stands.
            self.message(&op.sender, seq, targets).ok_or(Rejection::NotFound("message replied to".into()))?;
        }
        if let Some(absent) = op.mentions.iter().find(|u| !members.contains_key(u)) {
            return Err(Rejection::NotFound(format!("mentioned member {absent}").into()));
        }
        let message_id = Uuid::now_v7();
        let seq = self.append(EventKind::Msg {
            message_id,
            sender: op.sender.clone(),
            sender_device: op.device.clone(),
            client_msg_id: op.client_msg_id.clone(),
            body: Some(op.body.text().to_owned()),
            recalled: false,
            reply_to: op.reply_to,
            mentions: op.mentions.clone(),
            mention_all: op.body.mention_all(),
            edited_at: None,
        });
        let ack = SendAck { seq, message_id, dup: false, created_at: self.now };
        self.appended_keys.insert(key, SendAckWithHash { ack: ack.clone(), hash: op.body.fingerprint().to_vec() });
        Ok(Written::Sent(ack))
    }
}
