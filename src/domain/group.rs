//! Group settings, roles and permission bits (ARCHITECTURE §9, PROTOCOL §5).

use std::fmt;
use std::str::FromStr;

/// Longest duration setting (`recall_window_ms`, `retention_ms`): 100 years.
/// Far past any real use, and far inside what both chrono and PostgreSQL
/// intervals can add to a time, so no check against one can overflow.
pub const MAX_DURATION_MS: i64 = 100 * 36_524 * 24 * 3_600 * 1_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Owner,
    Admin,
    Member,
}

/// `push`: events are pushed to members' devices; `pull` (huge groups): a coalesced `head`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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

impl Role {
    /// The role's permission bits; a member may invite in `invite` and `free` groups.
    pub fn bits(self, join_mode: JoinMode) -> u32 {
        match self {
            Role::Owner => ALL,
            Role::Admin => ALL & !(Permission::SetAdmin as u32) & !(Permission::Dismiss as u32),
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
        assert_eq!(Role::Owner.bits(JoinMode::Invite), 1 | 2 | 4 | 8 | 16 | 32 | 64 | 128 | 1024);
        assert!(!Role::Admin.can(JoinMode::Invite, Permission::SetAdmin));
        assert!(!Role::Admin.can(JoinMode::Invite, Permission::Dismiss));
        assert!(Role::Admin.can(JoinMode::Invite, Permission::AtAll));
        assert!(Role::Member.can(JoinMode::Free, Permission::Invite));
        assert!(!Role::Member.can(JoinMode::Approval, Permission::Invite));
        assert!(!Role::Member.can(JoinMode::Invite, Permission::AtAll));
    }
}
