//! The group ops of PROTOCOL §5, checked in the one order of PROTOCOL §2
//! "Check order" (the stranger gate turned away whoever was never a member):
//! the conversation is active (`CONV_DISMISSED`, `CONV_BANNED`) → the caller
//! is a current member (`NOT_MEMBER`, also for an unknown conversation) → it
//! is a group (`FORBIDDEN`) → the permission bit (`FORBIDDEN`) → the target
//! is a current member (`NOT_FOUND`) → the role rules (`FORBIDDEN`). Membership
//! ops are in `membership`; here are the dispatch and the ops that change
//! where a member stands or the group's settings, each appending one `group`
//! event whose `change` names what changed.

use std::collections::HashSet;

use imcore_actors::UserId;
use serde_json::{json, Map, Value};

use super::batch::{BatchBuilder, MemberChange};
use super::ops::{GroupChange, GroupOp, ProfilePatch, WriteOutcome, Written};
use super::Roster;
use crate::domain::{format_time, ConvStatus, EventKind, Permission, Rejection, Role, Standing, DISMISSED_CHANGE};

impl BatchBuilder {
    /// `blockers`: (blocker, blocked) pairs among the invitees and inviters.
    pub(super) fn group(
        &mut self,
        op: &GroupOp,
        known_users: &HashSet<UserId>,
        blockers: &HashSet<(UserId, UserId)>,
        applications: &HashSet<UserId>,
        members: &mut Roster,
    ) -> WriteOutcome {
        match op.change {
            GroupChange::Join => self.self_join(&op.actor, applications, members),
            _ => self.member_op(op, known_users, blockers, applications, members),
        }
    }

    /// A group op of a current member.
    fn member_op(
        &mut self,
        op: &GroupOp,
        known_users: &HashSet<UserId>,
        blockers: &HashSet<(UserId, UserId)>,
        applications: &HashSet<UserId>,
        members: &mut Roster,
    ) -> WriteOutcome {
        // Before the roster: a dismissed group keeps its members' rows, yet none of them is a member.
        self.status.writable()?;
        let standing = members.get(&op.actor).cloned().ok_or(Rejection::NotMember)?;
        if !self.group {
            return Err(Rejection::Forbidden("group ops do not apply to a direct conversation".into()));
        }
        let caller = (&op.actor, &standing);
        match &op.change {
            GroupChange::Invite(users) => self.invite(caller, users, (known_users, blockers), applications, members),
            GroupChange::Join => self.self_join(&op.actor, applications, members),
            GroupChange::Approve(user) => self.decide_application(caller, user, true, applications, members),
            GroupChange::Reject(user) => self.decide_application(caller, user, false, applications, members),
            GroupChange::Leave => self.self_leave(caller, members),
            GroupChange::Kick(user) => self.kick(caller, user, members),
            GroupChange::SetRole { user, role, until } => {
                self.require(&standing, Permission::SetAdmin, "only the owner sets roles")?;
                let mut target = self.target(members, user)?;
                if target.role == Role::Owner {
                    return Err(Rejection::Forbidden("the owner's role changes only by transfer_owner".into()));
                }
                (target.role, target.role_until) = (*role, until.filter(|_| *role == Role::Admin));
                let change = json!({"role": {
                    "user_id": user, "role": role.as_str(), "until": target.role_until.map(format_time),
                }});
                Ok(self.stand(&op.actor, user, target, change, members))
            }
            GroupChange::SetPerms { user, extra_perms } => {
                self.require(&standing, Permission::SetAdmin, "only the owner sets permissions")?;
                let mut target = self.target(members, user)?;
                if target.role == Role::Owner {
                    return Err(Rejection::Forbidden("the owner holds every permission".into()));
                }
                target.extra_perms = *extra_perms;
                let change = json!({"perms": {"user_id": user, "extra_perms": extra_perms}});
                Ok(self.stand(&op.actor, user, target, change, members))
            }
            GroupChange::Mute { user, until } => {
                self.require(&standing, Permission::Mute, "your role may not mute")?;
                let mut target = self.target(members, user)?;
                if target.is_manager(self.now) && standing.role_at(self.now) != Role::Owner {
                    return Err(Rejection::Forbidden("only the owner mutes the owner or an admin".into()));
                }
                target.mute_until = *until;
                let change = json!({"mute": {"user_id": user, "mute_until": until.map(format_time)}});
                Ok(self.stand(&op.actor, user, target, change, members))
            }
            GroupChange::SetAlias(alias) => {
                self.member_changes.push(MemberChange::Alias { user: op.actor.clone(), alias: alias.clone() });
                Ok(self.changed(&op.actor, json!({"alias": {"user_id": op.actor, "alias": alias}})))
            }
            GroupChange::TransferOwner(user) => self.transfer(caller, user, members),
            GroupChange::Update(patch) => self.update(&op.actor, &standing, patch),
            GroupChange::Dismiss => {
                self.require(&standing, Permission::Dismiss, "only the owner dismisses the group")?;
                let seq =
                    self.append(EventKind::Group { actor: Some(op.actor.clone()), change: DISMISSED_CHANGE.into() });
                self.member_changes.push(MemberChange::CloseAll { seq });
                self.membership_changes += 1;
                (self.status, self.profile.status) = (ConvStatus::Dismissed, Some(ConvStatus::Dismissed));
                Ok(Written::Changed { seq })
            }
        }
    }

    fn require(&self, standing: &Standing, bit: Permission, why: &'static str) -> Result<(), Rejection> {
        if standing.can(self.join_mode, self.now, bit) {
            Ok(())
        } else {
            Err(Rejection::Forbidden(why.into()))
        }
    }

    fn target(&self, members: &Roster, user: &UserId) -> Result<Standing, Rejection> {
        members.get(user).cloned().ok_or(Rejection::NotFound("member".into()))
    }

    /// Appends a `group` event of `actor` with `change`.
    fn changed(&mut self, actor: &UserId, change: Value) -> Written {
        let change = change.to_string();
        Written::Changed { seq: self.append(EventKind::Group { actor: Some(actor.clone()), change }) }
    }

    /// `user` now stands as `standing`: its row, the cache and the event.
    fn stand(&mut self, actor: &UserId, user: &UserId, standing: Standing, change: Value, m: &mut Roster) -> Written {
        m.insert(user.clone(), standing.clone());
        self.member_changes.push(MemberChange::Standing { user: user.clone(), standing });
        self.membership_changes += 1;
        self.changed(actor, change)
    }

    /// `transfer_owner`: the owner hands over to a current member and becomes an admin.
    fn transfer(&mut self, caller: (&UserId, &Standing), user: &UserId, members: &mut Roster) -> WriteOutcome {
        let (actor, standing) = caller;
        if standing.role != Role::Owner {
            return Err(Rejection::Forbidden("only the owner transfers ownership".into()));
        }
        let target = self.target(members, user)?;
        if user == actor {
            return Err(Rejection::Forbidden("you are the owner already".into()));
        }
        for (who, role) in [(actor, Role::Admin), (user, Role::Owner)] {
            let now =
                Standing { role, role_until: None, ..if who == user { target.clone() } else { standing.clone() } };
            members.insert(who.clone(), now.clone());
            self.member_changes.push(MemberChange::Standing { user: who.clone(), standing: now });
        }
        self.membership_changes += 1;
        (self.owner, self.profile.owner) = (Some(user.clone()), Some(user.clone()));
        Ok(self.changed(actor, json!({"owner": {"from": actor, "to": user}})))
    }

    /// `update_group`: `EDIT_INFO`, `MUTE` for `mute_all`, and `DISMISS` for
    /// a `retention_ms` that shortens the retention: a purge under it erases
    /// history, which only who may dismiss the group may decide.
    fn update(&mut self, actor: &UserId, standing: &Standing, patch: &ProfilePatch) -> WriteOutcome {
        self.require(standing, Permission::EditInfo, "your role may not edit the group")?;
        if patch.mute_all.is_some() {
            self.require(standing, Permission::Mute, "your role may not mute the group")?;
        }
        if let Some(Some(ms)) = patch.retention_ms {
            if !self.retention_ms.is_some_and(|now| ms >= now) {
                self.require(standing, Permission::Dismiss, "only the owner shortens the retention")?;
            }
        }
        if patch.max_member.is_some_and(|n| n < self.member_count) {
            return Err(Rejection::BadRequest(format!(
                "max_member may not be below the group's {} members",
                self.member_count
            )));
        }
        let mut change = Map::new();
        let s = &mut self.profile.settings;
        if let Some(name) = &patch.name {
            (self.name, s.name) = (Some(name.clone()), Some(name.clone()));
            change.insert("name".into(), name.as_str().into());
        }
        if let Some(mode) = patch.join_mode {
            (self.join_mode, s.join_mode) = (mode, Some(mode));
            change.insert("join_mode".into(), mode.as_str().into());
        }
        if let Some(n) = patch.max_member {
            (self.max_member, s.max_member) = (n, Some(n));
            change.insert("max_member".into(), n.into());
        }
        if let Some(on) = patch.mute_all {
            (self.mute_all, s.mute_all) = (on, Some(on));
            change.insert("mute_all".into(), on.into());
        }
        // The setting; the mode it gives is settled after the op (`settle_delivery`).
        if let Some(setting) = patch.delivery_mode {
            (self.delivery_setting, s.delivery_mode) = (setting, Some(setting));
            change.insert("delivery_mode".into(), setting.as_str().into());
        }
        if let Some(ms) = patch.recall_window_ms {
            (self.recall_window_ms, s.recall_window_ms) = (ms, Some(ms));
            change.insert("recall_window_ms".into(), ms.into());
        }
        if let Some(ms) = patch.edit_window_ms {
            (self.edit_window_ms, s.edit_window_ms) = (ms, Some(ms));
            change.insert("edit_window_ms".into(), ms.into());
        }
        if let Some(ms) = patch.retention_ms {
            (self.retention_ms, s.retention_ms) = (ms, Some(ms));
            change.insert("retention_ms".into(), ms.into());
        }
        Ok(self.changed(actor, json!({ "profile": change })))
    }
}

/// The rules without a database: a builder over a locked row as the lookups
/// would have found it.
#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use chrono::Duration;
    use imcore_actors::{ConvId, UserId};

    use super::super::batch::{BatchBuilder, MemberChange};
    use super::super::lookup::ConvRow;
    use super::super::ops::{GroupChange, GroupOp, Invited, ProfilePatch, Written};
    use super::super::Roster;
    use crate::domain::{JoinMode, Rejection, Role, Standing};

    fn uid(s: &str) -> UserId {
        UserId::parse(s).expect("id")
    }

    /// A group of owner `o`, admin `a`, members `m` and `n`, as of seq 4.
    fn arrange(join_mode: JoinMode) -> (BatchBuilder, Roster) {
        let row = ConvRow { join_mode, ..ConvRow::test_group(5, 4, 5) };
        let mut roster = Roster::default();
        for (u, role) in [("o", Role::Owner), ("a", Role::Admin), ("m", Role::Member), ("n", Role::Member)] {
            roster.insert(uid(u), Standing::new(role));
        }
        (BatchBuilder::new(&ConvId::parse("g").expect("id"), &row), roster)
    }

    fn op(b: &mut BatchBuilder, r: &mut Roster, actor: &str, change: GroupChange) -> Result<Written, Rejection> {
        let known: HashSet<UserId> = ["o", "a", "m", "n", "x", "y"].into_iter().map(uid).collect();
        b.group(&GroupOp { actor: uid(actor), change }, &known, &HashSet::new(), &HashSet::new(), r)
    }

    #[test]
    fn an_invite_joins_skips_members_and_refuses_whole_past_max_member() {
        let (mut b, mut r) = arrange(JoinMode::Invite);
        let full = op(&mut b, &mut r, "m", GroupChange::Invite(vec![uid("x"), uid("y")]));
        assert_eq!(full, Err(Rejection::GroupFull));
        assert!(b.events.is_empty() && b.member_changes.is_empty(), "a refused invite changes nothing");
        let invited = op(&mut b, &mut r, "m", GroupChange::Invite(vec![uid("n"), uid("x")]));
        let expect = Invited { joined: vec![uid("x")], pending: vec![], skipped: vec![uid("n")], head: 5 };
        assert_eq!(invited, Ok(Written::Invited(expect)));
        assert_eq!((b.member_count, b.next_seq), (5, 6));
        assert!(r.contains_key(&uid("x")));
    }

    #[test]
    fn a_plain_member_of_an_approval_group_files_applications() {
        let (mut b, mut r) = arrange(JoinMode::Approval);
        let invited = op(&mut b, &mut r, "m", GroupChange::Invite(vec![uid("x")]));
        let expect = Invited { joined: vec![], pending: vec![uid("x")], skipped: vec![], head: 4 };
        assert_eq!(invited, Ok(Written::Invited(expect)));
        assert!(matches!(b.member_changes.as_slice(), [MemberChange::Apply { .. }]));
        assert_eq!(
            op(&mut b, &mut r, "m", GroupChange::Approve(uid("x"))),
            Err(Rejection::Forbidden("only the owner and admins decide applications".into()))
        );
        assert_eq!(op(&mut b, &mut r, "a", GroupChange::Approve(uid("x"))), Ok(Written::Joined { seq: 5 }));
        assert_eq!(
            op(&mut b, &mut r, "a", GroupChange::Approve(uid("x"))),
            Err(Rejection::NotFound("application".into()))
        );
    }

    #[test]
    fn role_rules_protect_the_owner_and_admins() {
        let (mut b, mut r) = arrange(JoinMode::Invite);
        let forbidden = |res: Result<Written, Rejection>| matches!(res, Err(Rejection::Forbidden(_)));
        assert!(forbidden(op(&mut b, &mut r, "a", GroupChange::Kick(uid("o")))));
        assert!(forbidden(op(&mut b, &mut r, "a", GroupChange::Kick(uid("a")))));
        assert!(forbidden(op(&mut b, &mut r, "a", GroupChange::Mute { user: uid("o"), until: None })));
        assert!(forbidden(op(&mut b, &mut r, "m", GroupChange::Kick(uid("n")))));
        assert!(forbidden(op(&mut b, &mut r, "o", GroupChange::Leave)));
        assert_eq!(op(&mut b, &mut r, "a", GroupChange::Kick(uid("x"))), Err(Rejection::NotFound("member".into())));
        assert_eq!(op(&mut b, &mut r, "x", GroupChange::Leave), Err(Rejection::NotMember));
        assert_eq!(op(&mut b, &mut r, "o", GroupChange::Kick(uid("a"))), Ok(Written::Left { seq: 5 }));
        assert_eq!(op(&mut b, &mut r, "a", GroupChange::Leave), Err(Rejection::NotMember), "kicked in this batch");
    }

    #[test]
    fn a_temporary_admin_loses_its_bits_at_until() {
        let (mut b, mut r) = arrange(JoinMode::Invite);
        let until = b.now + Duration::milliseconds(1);
        let set = GroupChange::SetRole { user: uid("m"), role: Role::Admin, until: Some(until) };
        assert_eq!(op(&mut b, &mut r, "o", set), Ok(Written::Changed { seq: 5 }));
        assert_eq!(op(&mut b, &mut r, "m", GroupChange::Kick(uid("n"))), Ok(Written::Left { seq: 6 }));
        b.now = until;
        let late = op(&mut b, &mut r, "m", GroupChange::Kick(uid("o")));
        assert_eq!(late, Err(Rejection::Forbidden("your role may not kick".into())));
    }

    #[test]
    fn a_dismissed_group_refuses_every_write_but_keeps_its_roster() {
        let (mut b, mut r) = arrange(JoinMode::Free);
        assert_eq!(
            op(&mut b, &mut r, "a", GroupChange::Dismiss),
            Err(Rejection::Forbidden("only the owner dismisses the group".into()))
        );
        assert_eq!(op(&mut b, &mut r, "o", GroupChange::Dismiss), Ok(Written::Changed { seq: 5 }));
        assert_eq!(op(&mut b, &mut r, "m", GroupChange::Leave), Err(Rejection::ConvDismissed));
        assert_eq!(op(&mut b, &mut r, "x", GroupChange::Join), Err(Rejection::ConvDismissed));
        assert!(r.contains_key(&uid("m")));
    }

    #[test]
    fn only_the_dismiss_bit_shortens_the_retention() {
        let (mut b, mut r) = arrange(JoinMode::Invite);
        let retention =
            |ms: Option<i64>| GroupChange::Update(ProfilePatch { retention_ms: Some(ms), ..Default::default() });
        let refused = Err(Rejection::Forbidden("only the owner shortens the retention".into()));
        assert_eq!(op(&mut b, &mut r, "a", retention(Some(1))), refused, "from unlimited");
        assert_eq!(op(&mut b, &mut r, "o", retention(Some(60_000))), Ok(Written::Changed { seq: 5 }));
        assert_eq!(op(&mut b, &mut r, "a", retention(Some(59_999))), refused, "shorter");
        assert_eq!(op(&mut b, &mut r, "a", retention(Some(60_000))), Ok(Written::Changed { seq: 6 }), "the same");
        assert_eq!(op(&mut b, &mut r, "a", retention(Some(90_000))), Ok(Written::Changed { seq: 7 }), "longer");
        assert_eq!(op(&mut b, &mut r, "a", retention(None)), Ok(Written::Changed { seq: 8 }), "unlimited");
        assert_eq!(op(&mut b, &mut r, "a", retention(Some(90_000))), refused, "judged against this batch's");
    }
}
