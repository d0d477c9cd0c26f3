//! The operator's ban and unban of a group (PROTOCOL "Banned groups"): a
//! `group` event without an actor records each change, and the status moves
//! with it in the batch's transaction, under the row lock every write checks
//! it under. A dismissal is final: a dismissed group is neither banned nor
//! unbanned. Asking for the status a group already has appends nothing.

use super::batch::BatchBuilder;
use super::ops::{BanOp, WriteOutcome, Written};
use crate::domain::{ConvStatus, EventKind, Rejection, BANNED_CHANGE, UNBANNED_CHANGE};

impl BatchBuilder {
    pub(super) fn ban(&mut self, op: &BanOp) -> WriteOutcome {
        if !self.group {
            return Err(Rejection::Forbidden("only a group is banned".into()));
        }
        if self.status == ConvStatus::Dismissed {
            return Err(Rejection::ConvDismissed);
        }
        let (status, change) =
            if op.banned { (ConvStatus::Banned, BANNED_CHANGE) } else { (ConvStatus::Active, UNBANNED_CHANGE) };
        if self.status == status {
            return Ok(Written::Status { seq: None });
        }
        let seq = self.append(EventKind::Group { actor: None, change: change.into() });
        (self.status, self.profile.status) = (status, Some(status));
        Ok(Written::Status { seq: Some(seq) })
    }
}

#[cfg(test)]
mod tests {
    use imcore_actors::ConvId;

    use super::super::lookup::ConvRow;
    use super::*;

    fn builder(group: bool, status: ConvStatus) -> BatchBuilder {
        let row = ConvRow { group, status, ..ConvRow::test_group(5, 2, 500) };
        BatchBuilder::new(&ConvId::parse("g").expect("id"), &row)
    }

    #[test]
    fn a_ban_and_an_unban_each_append_once_and_move_the_status() {
        let mut b = builder(true, ConvStatus::Active);
        assert_eq!(b.ban(&BanOp { banned: true }), Ok(Written::Status { seq: Some(5) }));
        assert_eq!(b.ban(&BanOp { banned: true }), Ok(Written::Status { seq: None }), "already banned");
        assert_eq!(b.status.writable(), Err(Rejection::ConvBanned));
        assert_eq!(b.ban(&BanOp { banned: false }), Ok(Written::Status { seq: Some(6) }));
        assert_eq!((b.status, b.profile.status), (ConvStatus::Active, Some(ConvStatus::Active)));
        let changes: Vec<_> = b.events.iter().map(|e| e.kind.clone()).collect();
        assert_eq!(
            changes,
            [BANNED_CHANGE, UNBANNED_CHANGE].map(|c| EventKind::Group { actor: None, change: c.into() })
        );
    }

    #[test]
    fn a_dismissed_group_or_a_direct_conversation_is_never_banned() {
        let mut dismissed = builder(true, ConvStatus::Dismissed);
        assert_eq!(dismissed.ban(&BanOp { banned: true }), Err(Rejection::ConvDismissed));
        assert_eq!(dismissed.ban(&BanOp { banned: false }), Err(Rejection::ConvDismissed));
        let mut direct = builder(false, ConvStatus::Active);
        assert!(matches!(direct.ban(&BanOp { banned: true }), Err(Rejection::Forbidden(_))));
        assert!(dismissed.events.is_empty() && direct.events.is_empty());
    }
}
