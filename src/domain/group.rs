//! Group settings, roles and permission bits (ARCHITECTURE §9, PROTOCOL §5).

use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Utc};

use super::Rejection;

/// Most users one `invite` names.
pub const MAX_INVITE_USERS: usize = 1000;
/// Most users one `send` mentions.
pub const MAX_MENTIONS: usize = 50;
/// Largest `max_member` (PROTOCOL §5 `update_group`).
pub const MAX_GROUP_SIZE: i64 = 100_000;
/// Longest duration setting (`recall_window_ms`, `retention_ms`): 100 years.
/// Far past any real use, and far inside what both chrono and PostgreSQL
/// intervals can add to a time, so no check against one can overflow.
pub const MAX_DURATION_MS: i64 = 100 * 36_524 * 24 * 3_600 * 1_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Role {
    Owner,
    Admin,
    Member,
}

/// `push`: events are pushed to members' devices; `pull` (huge groups): a coalesced `head`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum DeliveryMode {
    Push,
    Pull,
}

impl DeliveryMode {
    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryMode::Push => "push",
            DeliveryMode::Pull => "pull",
        }
    }
}

impl FromStr for DeliveryMode {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        match s {
            "push" => Ok(DeliveryMode::Push),
            "pull" => Ok(DeliveryMode::Pull),
            _ => Err(()),
        }
    }
}

/// Where a conversation stands (PROTOCOL §5 `status`): `dismissed` by its
/// owner, for good; `banned` by the operator until unbanned. Only an active
/// conversation takes writes; its members read in every status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ConvStatus {
    Active,
    Dismissed,
    Banned,
}

impl ConvStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            ConvStatus::Active => "active",
            ConvStatus::Dismissed => "dismissed",
            ConvStatus::Banned => "banned",
        }
    }

    /// The refusal of a write in this status, if any.
    pub fn writable(self) -> Result<(), Rejection> {
        match self {
            ConvStatus::Active => Ok(()),
            ConvStatus::Dismissed => Err(Rejection::ConvDismissed),
            ConvStatus::Banned => Err(Rejection::ConvBanned),
        }
    }
}

impl FromStr for ConvStatus {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        match s {
            "active" => Ok(ConvStatus::Active),
            "dismissed" => Ok(ConvStatus::Dismissed),
            "banned" => Ok(ConvStatus::Banned),
            _ => Err(()),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum JoinMode {
    Invite,
    Approval,
    Free,
}

/// A permission bit; values are the wire values of PROTOCOL §5.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Permission {
    SendMsg = 1,
    RecallOther = 2,
    Kick = 4,
    Invite = 8,
    Mute = 16,
    SetAdmin = 32,
    EditInfo = 64,
    AtAll = 128,
    Dismiss = 1024,
}

const ALL: u32 = 1 | 2 | 4 | 8 | 16 | 32 | 64 | 128 | 1024;

/// The bits of an admin: all but `SET_ADMIN` and `DISMISS`. `extra_perms`
/// may hold only these (PROTOCOL §5 `set_perms`).
pub const ADMIN_BITS: u32 = ALL & !(Permission::SetAdmin as u32) & !(Permission::Dismiss as u32);

/// Where a current member stands: its role and the attributes with time in
/// them. Every permission and mute decision is taken from this at the
/// transaction's time, under the conversation's row lock, so a temporary
/// admin's role and a mute end by themselves at their time, with no job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Standing {
    pub role: Role,
    /// An `admin` role given `until` a time (a temporary admin).
    pub role_until: Option<DateTime<Utc>>,
    /// Bits added to the role's (a subset of [`ADMIN_BITS`]).
    pub extra_perms: u32,
    pub mute_until: Option<DateTime<Utc>>,
    /// In a direct conversation: the other member blocked this one, which
    /// may then not send (`BLOCKED`). Written only by `block`/`unblock`.
    pub blocked: bool,
}

impl Standing {
    pub fn new(role: Role) -> Self {
        Self { role, role_until: None, extra_perms: 0, mute_until: None, blocked: false }
    }

    /// The role at `now`: a temporary admin past its `until` is a member.
    pub fn role_at(&self, now: DateTime<Utc>) -> Role {
        match (self.role, self.role_until) {
            (Role::Admin, Some(until)) if until <= now => Role::Member,
            (role, _) => role,
        }
    }

    /// Role bits | `extra_perms`, at `now`.
    pub fn bits(&self, join_mode: JoinMode, now: DateTime<Utc>) -> u32 {
        self.role_at(now).bits(join_mode) | self.extra_perms
    }

    pub fn can(&self, join_mode: JoinMode, now: DateTime<Utc>, p: Permission) -> bool {
        self.bits(join_mode, now) & p as u32 != 0
    }

    /// May not send at `now`: its own `mute_until` is ahead (whatever its
    /// role), or the group is muted and it is neither owner nor admin.
    pub fn muted(&self, mute_all: bool, now: DateTime<Utc>) -> bool {
        self.mute_until.is_some_and(|t| t > now) || (mute_all && self.role_at(now) == Role::Member)
    }

    /// Owner or (current) admin: those whom only the owner may kick or mute.
    pub fn is_manager(&self, now: DateTime<Utc>) -> bool {
        self.role_at(now) != Role::Member
    }
}

impl Role {
    /// The role's permission bits; a member may invite in `invite` and `free` groups.
    pub fn bits(self, join_mode: JoinMode) -> u32 {
        match self {
            Role::Owner => ALL,
            Role::Admin => ADMIN_BITS,
            Role::Member => match join_mode {
                JoinMode::Invite | JoinMode::Free => Permission::SendMsg as u32 | Permission::Invite as u32,
                JoinMode::Approval => Permission::SendMsg as u32,
            },
        }
    }

    pub fn can(self, join_mode: JoinMode, p: Permission) -> bool {
        self.bits(join_mode) & p as u32 != 0
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Owner => "owner",
            Role::Admin => "admin",
            Role::Member => "member",
        }
    }
}

impl FromStr for Role {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        match s {
            "owner" => Ok(Role::Owner),
            "admin" => Ok(Role::Admin),
            "member" => Ok(Role::Member),
            _ => Err(()),
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl JoinMode {
    pub fn as_str(self) -> &'static str {
        match self {
            JoinMode::Invite => "invite",
            JoinMode::Approval => "approval",
            JoinMode::Free => "free",
        }
    }
}

impl FromStr for JoinMode {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        match s {
            "invite" => Ok(JoinMode::Invite),
            "approval" => Ok(JoinMode::Approval),
            "free" => Ok(JoinMode::Free),
            _ => Err(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_carry_the_bits_of_seed_002() {
        // The design's table, copied as literals: bit value, then owner, admin,
        // member (the member's INVITE "depends on join_mode": invite and free
        // groups yes, approval groups no).
        use Permission::*;
        let table = [
            (SendMsg, 1, true, true, true),
            (RecallOther, 2, true, true, false),
            (Kick, 4, true, true, false),
            (Invite, 8, true, true, true),
            (Mute, 16, true, true, false),
            (SetAdmin, 32, true, false, false),
            (EditInfo, 64, true, true, false),
            (AtAll, 128, true, true, false),
            (Dismiss, 1024, true, false, false),
        ];
        for (bit, value, owner, admin, member) in table {
            assert_eq!(bit as u32, value, "{bit:?}");
            for mode in [JoinMode::Invite, JoinMode::Free, JoinMode::Approval] {
                let member = member && !(bit == Invite && mode == JoinMode::Approval);
                for (role, want) in [(Role::Owner, owner), (Role::Admin, admin), (Role::Member, member)] {
                    assert_eq!(role.can(mode, bit), want, "{role} {bit:?} in a {} group", mode.as_str());
                }
            }
        }
        // No role holds a bit outside the table.
        let all: u32 = table.iter().map(|row| row.1).sum();
        for role in [Role::Owner, Role::Admin, Role::Member] {
            assert_eq!(role.bits(JoinMode::Free) & !all, 0, "{role}");
        }
    }

    #[test]
    fn a_temporary_admin_is_a_member_from_its_until_on() {
        let now = Utc::now();
        let temp = Standing { role_until: Some(now), ..Standing::new(Role::Admin) };
        assert_eq!(temp.role_at(now - chrono::Duration::milliseconds(1)), Role::Admin);
        assert_eq!(temp.role_at(now), Role::Member);
        assert!(!temp.can(JoinMode::Invite, now, Permission::Kick));
        let extra = Standing { extra_perms: Permission::Kick as u32, ..Standing::new(Role::Member) };
        assert!(extra.can(JoinMode::Invite, now, Permission::Kick));
    }

    #[test]
    fn a_mute_blocks_even_an_admin_and_mute_all_only_members() {
        let now = Utc::now();
        let admin = Standing::new(Role::Admin);
        assert!(!admin.muted(true, now));
        assert!(Standing::new(Role::Member).muted(true, now));
        let muted = Standing { mute_until: Some(now + chrono::Duration::seconds(1)), ..admin };
        assert!(muted.muted(false, now));
        assert!(!muted.muted(false, now + chrono::Duration::seconds(1)));
    }
}
