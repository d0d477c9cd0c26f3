//! The rules of `recall` (PROTOCOL §5): a current member recalls a `msg`
//! inside one of its membership periods — its own within `recall_window_ms`
//! of the message's `created_at`, anyone's with `RECALL_OTHER`. The `recall`
//! event is appended and the target's body erased in the same transaction:
//! a recalled message's content is gone, not hidden.

use chrono::Duration;

use super::batch::BatchBuilder;
use super::lookup::{Target, Targets};
use super::ops::{RecallAck, RecallOp, WriteOutcome, Written};
use super::Roster;
use crate::domain::{EventKind, Permission, Rejection};

impl BatchBuilder {
    /// Checks: active → caller is a member → the target is a `msg` it can
    /// see (`NOT_FOUND`) → already recalled (`dup`) → the caller's right.
    pub(super) fn recall(&mut self, op: &RecallOp, targets: &Targets, roster: &Roster) -> WriteOutcome {
        if self.dismissed {
            return Err(Rejection::ConvDismissed);
        }
        let standing = roster.get(&op.actor).ok_or(Rejection::NotMember)?;
        let target = self.recall_target(op, targets).ok_or(Rejection::NotFound("message".into()))?;
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

    /// The target: a `msg` appended earlier in this batch, or one the lookup found.
    fn recall_target(&self, op: &RecallOp, targets: &Targets) -> Option<Target> {
        let recalled_here = self.recalled.get(&op.target_seq).copied();
        if op.target_seq >= self.first_seq {
            let e = self.events.get((op.target_seq - self.first_seq) as usize)?;
            let EventKind::Msg { sender, .. } = &e.kind else { return None };
            // A member who joined after the message (in this batch) never saw it.
            let visible = !self.opened.get(&op.actor).is_some_and(|&from| from > e.seq);
            return visible.then(|| Target {
                sender: sender.clone(),
                created_at: e.created_at,
                recalled_by: recalled_here,
                visible,
            });
        }
        let found = targets.get(&(op.actor.clone(), op.target_seq)).filter(|t| t.visible)?;
        Some(Target { recalled_by: found.recalled_by.or(recalled_here), ..found.clone() })
    }
}
