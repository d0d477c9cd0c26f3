//! The member counts at which a group's delivery changes by itself
//! (ARCHITECTURE §9 "Large groups"): judged in the write transaction.

use clap::Args;

use crate::domain::Thresholds;

/// When a group in `auto` delivery switches between `push` and `pull`, and
/// from what size a `push` group's joins and leaves reach online devices as
/// one summary per batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Args)]
pub struct LargeGroupSettings {
    /// A group in `auto` delivery switches to `pull` once it has more members than this.
    #[arg(long = "auto-pull-above-members", env = "IMCORE_AUTO_PULL_ABOVE_MEMBERS", default_value_t = LargeGroupSettings::default().pull_above)]
    pub pull_above: i32,

    /// An `auto` group in `pull` switches back to `push` once it has fewer
    /// members than this (hysteresis: keep it below the pull threshold).
    #[arg(long = "auto-push-below-members", env = "IMCORE_AUTO_PUSH_BELOW_MEMBERS", default_value_t = LargeGroupSettings::default().push_below)]
    pub push_below: i32,

    /// A `push` group with more members than this pushes a batch's joins and
    /// leaves of others as one `members_changed` frame (`sync` still returns each).
    #[arg(long = "members-summary-above", env = "IMCORE_MEMBERS_SUMMARY_ABOVE", default_value_t = LargeGroupSettings::default().summary_above)]
    pub summary_above: i32,

    /// A member's `last_active_seq` (the `members` order `active`) moves to a
    /// newer message only once the one it holds is this many ms old: a hot
    /// group's steady senders then cost a roster row write a minute, not one
    /// per batch. `0` = every batch (exact).
    #[arg(long = "activity-resolution-ms", env = "IMCORE_ACTIVITY_RESOLUTION_MS", default_value_t = LargeGroupSettings::default().activity_resolution_ms)]
    pub activity_resolution_ms: i64,
}

impl Default for LargeGroupSettings {
    fn default() -> Self {
        Self { pull_above: 500, push_below: 400, summary_above: 100, activity_resolution_ms: 60_000 }
    }
}

impl LargeGroupSettings {
    pub fn thresholds(&self) -> Thresholds {
        Thresholds { pull_above: self.pull_above, push_below: self.push_below }
    }
}
