//! The rules of who joins and leaves: the unchecked joins and leaves of a
//! conversation's creation, and the group ops `invite`, `join`, `approve`,
//! `reject`, `leave` and `kick` (PROTOCOL §5). Each join or leave is an event
//! (P4): the user's membership period opens or closes at its seq (P3).

use std::collections::HashSet;

use imcore_actors::UserId;

use super::batch::{BatchBuilder, MemberChange};
use super::ops::{Invited, JoinOp, LeaveOp, WriteOutcome, Written};
use super::Roster;
use crate::domain::{EventKind, JoinMode, LeaveReason, Permission, Rejection, Role, Standing};

impl BatchBuilder {
    pub(super) fn join(&mut self, op: &JoinOp, known_users: &HashSet<UserId>, members: &mut Roster) -> WriteOutcome {
        self.status.writable()?;
        if !known_users.contains(&op.user) {
            return Err(Rejection::NotFound("user".into()));
        }
        if members.contains_key(&op.user) {
            return Err(Rejection::AlreadyMember);
        }
        if self.member_count >= self.max_member {
            return Err(Rejection::GroupFull);
        }
        let seq = self.open(&op.user, &op.actor, op.role, members);
        Ok(Written::Joined { seq })
    }

    pub(super) fn leave(&mut self, op: &LeaveOp, members: &mut Roster) -> WriteOutcome {
        if !members.contains_key(&op.user) {
            return Err(Rejection::NotMember);
        }
        let seq = self.close(&op.user, &op.actor, op.reason, members);
        Ok(Written::Left { seq })
    }

    /// `invite`: every user known (else `NOT_FOUND`, nothing changes); current
    /// members skipped; the rest join when the caller holds `INVITE`, and
    /// become pending applications when it is a plain member of an approval
    /// group. Past `max_member` the whole invite is refused.
    pub(super) fn invite(
        &mut self,
        caller: (&UserId, &Standing),
        users: &[UserId],
        (known_users, blockers): (&HashSet<UserId>, &HashSet<(UserId, UserId)>),
        applications: &HashSet<UserId>,
        members: &mut Roster,
    ) -> WriteOutcome {
        let (actor, standing) = caller;
        let may_add = standing.can(self.join_mode, self.now, Permission::Invite);
        if !may_add && self.join_mode != JoinMode::Approval {
            return Err(Rejection::Forbidden("your role may not invite".into()));
        }
        let unknown: Vec<&str> = users.iter().filter(|u| !known_users.contains(*u)).map(UserId::as_str).collect();
        if !unknown.is_empty() {
            return Err(Rejection::unknown_users(&unknown));
        }
        // One invitee who blocked the inviter refuses the whole request, like an unknown one.
        if users.iter().any(|u| blockers.contains(&(u.clone(), actor.clone()))) {
            return Err(Rejection::Blocked);
        }
        let (skipped, new): (Vec<UserId>, Vec<UserId>) = users.iter().cloned().partition(|u| members.contains_key(u));
        if may_add && i64::from(self.member_count) + new.len() as i64 > i64::from(self.max_member) {
            return Err(Rejection::GroupFull);
        }
        let (mut joined, mut pending) = (vec![], vec![]);
        for user in new {
            if may_add {
                if self.has_application(&user, applications) {
                    self.drop_application(&user);
                }
                self.open(&user, actor, Role::Member, members);
                joined.push(user);
            } else {
                if !self.has_application(&user, applications) {
                    self.file_application(&user, actor);
                }
                pending.push(user);
            }
        }
        Ok(Written::Invited(Invited { joined, pending, skipped, head: self.next_seq - 1 }))
    }

    /// `join` of the caller: anyone, in a `free` group; an application in an
    /// `approval` group. An `invite` group, or a direct conversation, answers
    /// as an unknown one (`NOT_MEMBER`): no existence leak. A dismissed or
    /// banned group says so (before the roster: a dismissed group keeps its
    /// members' rows, yet none of them is a member).
    pub(super) fn self_join(
        &mut self,
        user: &UserId,
        applications: &HashSet<UserId>,
        members: &mut Roster,
    ) -> WriteOutcome {
        // First, as for every group op (PROTOCOL §2 "Check order"): only one
        // who was ever a member, or a stranger in a race with a dismissal or a
        // ban (the gate lets a stranger's join through to active groups only),
        // gets here with a group that is not active.
        self.status.writable()?;
        if !self.group || self.join_mode == JoinMode::Invite {
            return Err(Rejection::NotMember);
        }
        if members.contains_key(user) {
            return Err(Rejection::AlreadyMember);
        }
        if self.join_mode == JoinMode::Approval {
            if !self.has_application(user, applications) {
                self.file_application(user, user);
            }
            return Ok(Written::Pending);
        }
        if self.member_count >= self.max_member {
            return Err(Rejection::GroupFull);
        }
        Ok(Written::Joined { seq: self.open(user, user, Role::Member, members) })
    }

    /// `approve` (`accept`) or `reject` an application, by the owner or an admin.
    pub(super) fn decide_application(
        &mut self,
        caller: (&UserId, &Standing),
        user: &UserId,
        accept: bool,
        applications: &HashSet<UserId>,
        members: &mut Roster,
    ) -> WriteOutcome {
        if !caller.1.is_manager(self.now) {
            return Err(Rejection::Forbidden("only the owner and admins decide applications".into()));
        }
        if !self.has_application(user, applications) {
            return Err(Rejection::NotFound("application".into()));
        }
        if !accept {
            self.drop_application(user);
            return Ok(Written::Rejected);
        }
        if members.contains_key(user) {
            return Err(Rejection::AlreadyMember);
        }
        if self.member_count >= self.max_member {
            return Err(Rejection::GroupFull);
        }
        self.drop_application(user);
        Ok(Written::Joined { seq: self.open(user, caller.0, Role::Member, members) })
    }

    /// `leave` of the caller: any member but the owner.
    pub(super) fn self_leave(&mut self, caller: (&UserId, &Standing), members: &mut Roster) -> WriteOutcome {
        if caller.1.role == Role::Owner {
            return Err(Rejection::Forbidden(
                "the owner cannot leave: transfer ownership or dismiss the group first".into(),
            ));
        }
        Ok(Written::Left { seq: self.close(caller.0, caller.0, LeaveReason::Left, members) })
    }

    /// `kick`: `KICK`; never oneself or the owner; an admin only by the owner.
    pub(super) fn kick(&mut self, caller: (&UserId, &Standing), user: &UserId, members: &mut Roster) -> WriteOutcome {
        let (actor, standing) = caller;
        if !standing.can(self.join_mode, self.now, Permission::Kick) {
            return Err(Rejection::Forbidden("your role may not kick".into()));
        }
        let target = members.get(user).ok_or(Rejection::NotFound("member".into()))?;
        if user == actor {
            return Err(Rejection::Forbidden("nobody kicks themselves: leave instead".into()));
        }
        if target.role == Role::Owner {
            return Err(Rejection::Forbidden("the owner cannot be kicked".into()));
        }
        if target.is_manager(self.now) && standing.role_at(self.now) != Role::Owner {
            return Err(Rejection::Forbidden("only the owner kicks an admin".into()));
        }
        Ok(Written::Left { seq: self.close(user, actor, LeaveReason::Kicked, members) })
    }

    /// Appends the `join` of `user` and opens its period there.
    fn open(&mut self, user: &UserId, actor: &UserId, role: Role, members: &mut Roster) -> i64 {
        let seq = self.append(EventKind::Join { subject: user.clone(), actor: actor.clone() });
        self.opened.insert(user.clone(), seq);
        members.insert(user.clone(), Standing::new(role));
        self.member_count += 1;
        self.membership_changes += 1;
        self.member_changes.push(MemberChange::Open { user: user.clone(), seq, role });
        seq
    }

    /// Appends the `leave` of `user` and closes its period there (inclusive).
    fn close(&mut self, user: &UserId, actor: &UserId, reason: LeaveReason, members: &mut Roster) -> i64 {
        let seq = self.append(EventKind::Leave { subject: user.clone(), actor: actor.clone(), reason });
        members.remove(user);
        self.member_count -= 1;
        self.membership_changes += 1;
        let view = self.view();
        self.member_changes.push(MemberChange::Close { user: user.clone(), seq, view });
        seq
    }
}
