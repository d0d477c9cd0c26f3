//! The rules of `react` (PROTOCOL v1.2): a set per (user, message, emoji).
//! Turning on what is on, or off what is off, appends nothing; otherwise a
//! `reaction` event is appended and the set and its counts change in the same
//! transaction. At most [`MAX_EMOJI_PER_MESSAGE`] distinct emoji per message.

use std::collections::HashMap;

use super::batch::BatchBuilder;
use super::lookup::{ReactionState, Targets};
use super::ops::{ReactOp, WriteOutcome, Written};
use super::Roster;
use crate::domain::{Emoji, EventKind, Rejection, MAX_EMOJI_PER_MESSAGE};

impl BatchBuilder {
    /// Checks: dismissed → member → mute → the target is a visible,
    /// unrecalled `msg` (`NOT_FOUND`) → already as asked (nothing appended)
    /// → the emoji limit (`TOO_MANY_REACTIONS`) → append.
    pub(super) fn react(
        &mut self,
        op: &ReactOp,
        targets: &Targets,
        read: &ReactionState,
        members: &Roster,
    ) -> WriteOutcome {
        self.status.writable()?;
        let member = members.get(&op.actor).ok_or(Rejection::NotMember)?;
        if member.muted(self.mute_all, self.now) {
            return Err(Rejection::Muted);
        }
        self.message(&op.actor, op.target_seq, targets)
            .filter(|t| t.recalled_by.is_none())
            .ok_or(Rejection::NotFound("message".into()))?;
        let key = (op.actor.clone(), op.target_seq, op.emoji.clone());
        let was = self.reacting.own.get(&key).map_or_else(|| read.own.contains(&key), |&(now, _, _)| now);
        if was == op.on {
            return Ok(Written::Reacted { seq: None });
        }
        let on_target = self.emoji_on(op.target_seq, read);
        if op.on && !on_target.contains_key(&op.emoji) && on_target.len() >= MAX_EMOJI_PER_MESSAGE {
            return Err(Rejection::TooManyReactions(on_target.len()));
        }
        let seq = self.append(EventKind::Reaction {
            sender: op.actor.clone(),
            sender_device: op.device.clone(),
            target_seq: op.target_seq,
            emoji: op.emoji.clone(),
            on: op.on,
        });
        let before = read.own.contains(&key);
        self.reacting.own.insert(key, (op.on, before, seq));
        let count = self.reacting.counts.entry((op.target_seq, op.emoji.clone())).or_insert((0, seq));
        count.0 += if op.on { 1 } else { -1 };
        Ok(Written::Reacted { seq: Some(seq) })
    }

    /// The emoji on `target` now (count above 0), as read and as this batch changed them.
    fn emoji_on(&self, target: i64, read: &ReactionState) -> HashMap<Emoji, i64> {
        let mut on: HashMap<Emoji, i64> = read.counts.get(&target).cloned().unwrap_or_default();
        for ((t, emoji), (delta, _)) in &self.reacting.counts {
            if *t == target {
                *on.entry(emoji.clone()).or_default() += i64::from(*delta);
            }
        }
        on.retain(|_, n| *n > 0);
        on
    }
}
