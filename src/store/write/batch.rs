//! The batch being built: the ops of a conversation checked in order against
//! its locked row, each appending its event at the next seq. Pure: what it
//! reads was looked up before, what it changes is written after.

use std::collections::{BTreeMap, HashMap, HashSet};

use chrono::{DateTime, Utc};
use imcore_actors::{ConvId, UserId};
use serde_json::json;

use super::lookup::{ConvRow, RequestKey, SendAckWithHash, Target, Targets};
use super::ops::ProfilePatch;
use crate::domain::{
    ConvStatus, DeliveryMode, DeliverySetting, Emoji, Event, EventKind, JoinMode, Role, Standing, Thresholds,
};

/// Rows and changes accumulated while the ops of a batch are checked in order.
pub(super) struct BatchBuilder {
    /// The seq of the batch's first event.
    pub(super) first_seq: i64,
    pub(super) next_seq: i64,
    pub(super) member_count: i32,
    /// Changes to who is a member or where one stands: the cache's version moves.
    pub(super) membership_changes: i64,
    /// Request keys appended earlier in this batch: a second op with the same key is its replay.
    pub(super) appended_keys: HashMap<RequestKey, SendAckWithHash>,
    pub(super) events: Vec<Event>,
    pub(super) member_changes: Vec<MemberChange>,
    /// Changes to the conversation row itself (settings, owner, status).
    pub(super) profile: ConvPatch,
    /// Applications filed (`true`) or removed (`false`) by this batch, over
    /// those found before it.
    pub(super) applications: HashMap<UserId, bool>,
    /// Users whose period this batch opened, at that seq.
    pub(super) opened: HashMap<UserId, i64>,
    /// Targets recalled by this batch → the seq of their `recall`.
    pub(super) recalled: HashMap<i64, i64>,
    /// Targets from before this batch whose body the batch erases.
    pub(super) erased: Vec<i64>,
    /// Targets from before this batch that the batch edits → their latest body.
    pub(super) edited: BTreeMap<i64, String>,
    /// The reactions this batch changed (`react`).
    pub(super) reacting: Reacting,
    pub(super) now: DateTime<Utc>,
    pub(super) conv: ConvId,
    pub(super) group: bool,
    pub(super) status: ConvStatus,
    pub(super) mute_all: bool,
    pub(super) join_mode: JoinMode,
    pub(super) max_member: i32,
    /// As of the ops checked so far.
    pub(super) delivery_mode: DeliveryMode,
    pub(super) delivery_setting: DeliverySetting,
    /// Some part of the batch is in `pull` mode: delivery sends it all as a `head`.
    pub(super) pulled: bool,
    pub(super) recall_window_ms: i64,
    /// As of the ops checked so far; `None`: unlimited.
    pub(super) retention_ms: Option<i64>,
    pub(super) name: Option<String>,
    pub(super) owner: Option<UserId>,
    pub(super) edit_window_ms: i64,
}

/// A change to the membership rows, written in order after the checks.
pub(super) enum MemberChange {
    Open {
        user: UserId,
        seq: i64,
        role: Role,
    },
    /// `view`: the conversation as its leaver last saw it ([`BatchBuilder::view`]).
    Close {
        user: UserId,
        seq: i64,
        view: String,
    },
    /// Role, its `until`, extra bits and mute of a current member.
    Standing {
        user: UserId,
        standing: Standing,
    },
    Alias {
        user: UserId,
        alias: Option<String>,
    },
    /// Dismissal: every open period ends at `seq`; the roster stays as it was.
    CloseAll {
        seq: i64,
    },
    Apply {
        user: UserId,
        by: UserId,
    },
    Unapply {
        user: UserId,
    },
}

/// What a batch changes on the conversation row besides `next_seq`,
/// `member_count` and `member_version`.
#[derive(Debug, Default)]
pub(super) struct ConvPatch {
    pub(super) settings: ProfilePatch,
    pub(super) owner: Option<UserId>,
    pub(super) status: Option<ConvStatus>,
    /// The mode the group delivers in, when the batch changed it.
    pub(super) delivery_mode: Option<DeliveryMode>,
}

impl ConvPatch {
    pub(super) fn is_empty(&self) -> bool {
        self.settings.is_empty() && self.owner.is_none() && self.status.is_none() && self.delivery_mode.is_none()
    }
}

impl BatchBuilder {
    pub(super) fn new(conv: &ConvId, row: &ConvRow) -> Self {
        Self {
            first_seq: row.next_seq,
            next_seq: row.next_seq,
            member_count: row.member_count,
            membership_changes: 0,
            appended_keys: HashMap::new(),
            events: Vec::new(),
            member_changes: Vec::new(),
            profile: ConvPatch::default(),
            applications: HashMap::new(),
            opened: HashMap::new(),
            recalled: HashMap::new(),
            erased: Vec::new(),
            edited: BTreeMap::new(),
            reacting: Reacting::default(),
            now: row.now,
            conv: conv.clone(),
            group: row.group,
            status: row.status,
            mute_all: row.mute_all,
            join_mode: row.join_mode,
            max_member: row.max_member,
            delivery_mode: row.delivery_mode,
            delivery_setting: row.delivery_setting,
            pulled: row.delivery_mode == DeliveryMode::Pull,
            recall_window_ms: row.recall_window_ms,
            retention_ms: row.retention_ms,
            name: row.name.clone(),
            owner: row.owner.clone(),
            edit_window_ms: row.edit_window_ms,
        }
    }

    pub(super) fn append(&mut self, kind: EventKind) -> i64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.events.push(Event { conv_id: self.conv.clone(), seq, created_at: self.now, kind });
        seq
    }

    /// The message at `target` is recalled by the event at `seq`: its body
    /// goes, and the bodies of its edits, in the database and in this batch's
    /// events alike.
    pub(super) fn erase(&mut self, target: i64, seq: i64) {
        self.recalled.insert(target, seq);
        if target < self.first_seq {
            self.erased.push(target);
            // The append's erasure is the row's last word (one statement
            // must not update a row twice).
            self.edited.remove(&target);
        }
        for e in &mut self.events {
            match &mut e.kind {
                EventKind::Msg { body, recalled, .. } if e.seq == target => (*body, *recalled) = (None, true),
                EventKind::Edit { target_seq, body, .. } if *target_seq == target => *body = None,
                _ => {}
            }
        }
    }

    /// The conversation as it stands after the ops checked so far: what a
    /// member leaving now keeps seeing (`get_conversation`, PROTOCOL §5).
    pub(super) fn view(&self) -> String {
        json!({
            "name": self.name,
            "owner": self.owner.as_ref().map(UserId::as_str),
            "join_mode": self.join_mode.as_str(),
            "max_member": self.max_member,
            "member_count": self.member_count,
            "mute_all": self.mute_all,
            "delivery_mode": self.delivery_mode.as_str(),
            "delivery_setting": self.delivery_setting.as_str(),
            "recall_window_ms": self.recall_window_ms,
            "retention_ms": self.retention_ms,
            "edit_window_ms": self.edit_window_ms,
        })
        .to_string()
    }

    /// The message at `target` now shows `text` (an `edit` at `self.now`).
    pub(super) fn set_body(&mut self, target: i64, text: &str) {
        if target < self.first_seq {
            self.edited.insert(target, text.to_owned());
        } else if let Some(e) = self.events.get_mut((target - self.first_seq) as usize) {
            if let EventKind::Msg { body, edited_at, .. } = &mut e.kind {
                (*body, *edited_at) = (Some(text.to_owned()), Some(self.now));
            }
        }
    }

    /// The `msg` at `seq` as `user` sees it: appended earlier in this batch,
    /// or as the lookup found it; `None` when it is not a `msg` inside one of
    /// the user's periods.
    pub(super) fn message(&self, user: &UserId, seq: i64, targets: &Targets) -> Option<Target> {
        let recalled_here = self.recalled.get(&seq).copied();
        if seq >= self.first_seq {
            let e = self.events.get((seq - self.first_seq) as usize)?;
            let EventKind::Msg { sender, .. } = &e.kind else { return None };
            // A member who joined after the message (in this batch) never saw it.
            let visible = !self.opened.get(user).is_some_and(|&from| from > e.seq);
            return visible.then(|| Target {
                sender: sender.clone(),
                created_at: e.created_at,
                recalled_by: recalled_here,
                visible,
            });
        }
        let found = targets.get(&(user.clone(), seq)).filter(|t| t.visible)?;
        Some(Target { recalled_by: found.recalled_by.or(recalled_here), ..found.clone() })
    }

    /// After each op that may change the member count or the delivery
    /// setting: the mode the setting gives now. A change is a `group` event
    /// `{"delivery":{"mode","setting","member_count"}}` of `actor` (whose op
    /// made it), in this transaction, right after that op's events; a batch
    /// with any part in `pull` is delivered as `pull` (ARCHITECTURE §9).
    pub(super) fn settle_delivery(&mut self, actor: &UserId, t: Thresholds) {
        if !self.group || self.status != ConvStatus::Active {
            return;
        }
        let mode = self.delivery_setting.mode_at(self.delivery_mode, self.member_count, t);
        if mode != self.delivery_mode {
            (self.delivery_mode, self.profile.delivery_mode) = (mode, Some(mode));
            let change = json!({"delivery": {
                "mode": mode.as_str(), "setting": self.delivery_setting.as_str(), "member_count": self.member_count,
            }});
            self.append(EventKind::Group { actor: Some(actor.clone()), change: change.to_string() });
        }
        self.pulled |= mode == DeliveryMode::Pull;
    }

    pub(super) fn version_bump(&self) -> i64 {
        i64::from(self.membership_changes > 0)
    }

    /// Whether `user` has an application pending, `found` being those the
    /// transaction found before the batch.
    pub(super) fn has_application(&self, user: &UserId, found: &HashSet<UserId>) -> bool {
        self.applications.get(user).copied().unwrap_or_else(|| found.contains(user))
    }

    pub(super) fn file_application(&mut self, user: &UserId, by: &UserId) {
        self.applications.insert(user.clone(), true);
        self.member_changes.push(MemberChange::Apply { user: user.clone(), by: by.clone() });
    }

    pub(super) fn drop_application(&mut self, user: &UserId) {
        self.applications.insert(user.clone(), false);
        self.member_changes.push(MemberChange::Unapply { user: user.clone() });
    }
}

/// The reactions a batch changed, over those it read.
#[derive(Debug, Default)]
pub(super) struct Reacting {
    /// (user, target, emoji) → on after the batch, on before it, and the seq
    /// of the batch's last change.
    pub(super) own: BTreeMap<(UserId, i64, Emoji), (bool, bool, i64)>,
    /// (target, emoji) → the change of its count, and the seq of the batch's
    /// first change (the order of a new emoji in the list).
    pub(super) counts: BTreeMap<(i64, Emoji), (i32, i64)>,
}
