//! The rules of `recall` (PROTOCOL §5): a current member recalls a `msg`
//! inside one of its membership periods — its own within `recall_window_ms`
//! of the message's `created_at`, anyone's with `RECALL_OTHER`. The `recall`
//! event is appended and the target's body erased in the same transaction:
//! a recalled message's content is gone, not hidden.

use chrono::Duration;

use super::batch::BatchBuilder;
use super::lookup::Targets;
use super::ops::{RecallAck, RecallOp, WriteOutcome, Written};
use super::Roster;
use crate::domain::{EventKind, Permission, Rejection};

impl BatchBuilder {
    /// Checks: active → caller is a member → the target is a `msg` it can
    /// see (`NOT_FOUND`) → already recalled (`dup`) → the caller's right.
    pub(super) fn recall(&mut self, op: &RecallOp, targets: &Targets, roster: &Roster) -> WriteOutcome {
        self.status.writable()?;
        let standing = roster.get(&op.actor).ok_or(Rejection::NotMember)?;
        let target = self.message(&op.actor, op.target_seq, targets).ok_or(Rejection::NotFound("message".into()))?;
        if let Some(seq) = target.recalled_by {
            return Ok(Written::Recalled(RecallAck { seq, dup: true }));
        }
        if !standing.can(self.join_mode, self.now, Permission::RecallOther) {
            if target.sender != op.actor {
                return Err(Rejection::Forbidden("only the owner and admins recall others' messages".into()));
            }
            if self.now > target.created_at + Duration::milliseconds(self.recall_window_ms) {
                return Err(Rejection::RecallWindowExpired);
            }
        }
        let seq = self.append(EventKind::Recall {
            sender: op.actor.clone(),
            sender_device: Some(op.device.clone()),
            target_seq: op.target_seq,
        });
        self.erase(op.target_seq, seq);
        Ok(Written::Recalled(RecallAck { seq, dup: false }))
    }
}
