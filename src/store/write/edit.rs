//! The rules of `edit` (PROTOCOL v1.2): the sender of a `msg`, a current
//! member not muted, replaces its body within `edit_window_ms` of its
//! `created_at`. The `edit` event is appended and the target's stored body
//! and `edited_at` set in the same transaction, so every read shows the
//! latest text. Idempotent like `send`, by the same request key.

use std::collections::HashMap;

use chrono::Duration;
use uuid::Uuid;

use super::batch::BatchBuilder;
use super::lookup::{Prior, RequestKey, SendAckWithHash, Targets};
use super::ops::{EditOp, RecallAck, SendAck, WriteOutcome, Written};
use super::Roster;
use crate::domain::{EventKind, Rejection, ERASED_FINGERPRINT};

impl BatchBuilder {
    /// Checks: replay → tombstone → dismissed → member → mute → the target is
    /// a visible, unrecalled `msg` (`NOT_FOUND`) → the caller sent it
    /// (`FORBIDDEN`) → the window (`EDIT_WINDOW_EXPIRED`) → append.
    pub(super) fn edit(
        &mut self,
        op: &EditOp,
        prior: &HashMap<RequestKey, Prior>,
        targets: &Targets,
        members: &Roster,
    ) -> WriteOutcome {
        let key = (self.conv.clone(), op.sender.clone(), op.client_msg_id.clone());
        let fingerprint = op.fingerprint();
        let earlier = self.appended_keys.get(&key).or_else(|| prior.get(&key).and_then(|p| p.event.as_ref()));
        if let Some(earlier) = earlier {
            return if earlier.hash == fingerprint || earlier.hash == ERASED_FINGERPRINT {
                Ok(Written::Edited(RecallAck { seq: earlier.ack.seq, dup: true }))
            } else {
                Err(Rejection::IdempotencyMismatch)
            };
        }
        if let Some(hash) = prior.get(&key).and_then(|p| p.tombstone.as_deref()) {
            return Err(if hash == fingerprint || hash == ERASED_FINGERPRINT {
                Rejection::IdempotencyKeyExpired
            } else {
                Rejection::IdempotencyMismatch
            });
        }
        self.status.writable()?;
        let member = members.get(&op.sender).ok_or(Rejection::NotMember)?;
        if member.muted(self.mute_all, self.now) {
            return Err(Rejection::Muted);
        }
        let target = self
            .message(&op.sender, op.target_seq, targets)
            .filter(|t| t.recalled_by.is_none())
            .ok_or(Rejection::NotFound("message".into()))?;
        if target.sender != op.sender {
            return Err(Rejection::Forbidden("only its sender edits a message".into()));
        }
        if self.now > target.created_at + Duration::milliseconds(self.edit_window_ms) {
            return Err(Rejection::EditWindowExpired);
        }
        let text = op.body.text();
        let seq = self.append(EventKind::Edit {
            sender: op.sender.clone(),
            sender_device: op.device.clone(),
            client_msg_id: op.client_msg_id.clone(),
            target_seq: op.target_seq,
            body: Some(text.to_owned()),
        });
        self.set_body(op.target_seq, text);
        // An edit's key has no message_id: its replay answers with the seq.
        let ack = SendAck { seq, message_id: Uuid::nil(), dup: false, created_at: self.now };
        self.appended_keys.insert(key, SendAckWithHash { ack, hash: fingerprint.to_vec() });
        Ok(Written::Edited(RecallAck { seq, dup: false }))
    }
}
