//! How a group delivers as it grows (ARCHITECTURE §9 "Large groups"): what
//! its admins chose, and the mode that choice gives at a member count.
//! Invariant: the mode changes only where [`DeliverySetting::mode_at`] says,
//! so a group between the two thresholds never flaps.

use std::str::FromStr;

use super::DeliveryMode;

/// What a group's admins chose: `auto` follows the member count; `push` and
/// `pull` hold whatever the size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum DeliverySetting {
    Auto,
    Push,
    Pull,
}

/// The member counts `auto` switches at: `pull` above `pull_above`, back to
/// `push` below `push_below`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Thresholds {
    pub pull_above: i32,
    pub push_below: i32,
}

impl DeliverySetting {
    pub fn as_str(self) -> &'static str {
        match self {
            DeliverySetting::Auto => "auto",
            DeliverySetting::Push => "push",
            DeliverySetting::Pull => "pull",
        }
    }

    /// The mode of a group of `members` that delivered in `now` so far. In
    /// `auto`, between the thresholds the mode stays what it was
    /// (hysteresis); the pull threshold is judged first, so thresholds set
    /// the wrong way round give no hysteresis but never flap either.
    pub fn mode_at(self, now: DeliveryMode, members: i32, t: Thresholds) -> DeliveryMode {
        match self {
            DeliverySetting::Push => DeliveryMode::Push,
            DeliverySetting::Pull => DeliveryMode::Pull,
            DeliverySetting::Auto if members > t.pull_above => DeliveryMode::Pull,
            DeliverySetting::Auto if members < t.push_below => DeliveryMode::Push,
            DeliverySetting::Auto => now,
        }
    }
}

impl FromStr for DeliverySetting {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        match s {
            "auto" => Ok(DeliverySetting::Auto),
            "push" => Ok(DeliverySetting::Push),
            "pull" => Ok(DeliverySetting::Pull),
            _ => Err(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Thresholds = Thresholds { pull_above: 500, push_below: 400 };

    #[test]
    fn auto_switches_above_the_pull_threshold_and_back_only_below_the_push_one() {
        use DeliveryMode::{Pull, Push};
        let auto = DeliverySetting::Auto;
        assert_eq!(auto.mode_at(Push, 500, T), Push);
        assert_eq!(auto.mode_at(Push, 501, T), Pull);
        assert_eq!(auto.mode_at(Pull, 450, T), Pull, "between the thresholds it stays");
        assert_eq!(auto.mode_at(Push, 450, T), Push, "between the thresholds it stays");
        assert_eq!(auto.mode_at(Pull, 400, T), Pull);
        assert_eq!(auto.mode_at(Pull, 399, T), Push);
        assert_eq!(DeliverySetting::Push.mode_at(Pull, 100_000, T), Push, "an explicit mode wins");
        assert_eq!(DeliverySetting::Pull.mode_at(Push, 2, T), Pull, "an explicit mode wins");
        let backwards = Thresholds { pull_above: 10, push_below: 20 };
        assert_eq!(auto.mode_at(Push, 15, backwards), Pull, "no flapping when set the wrong way round");
    }
}
