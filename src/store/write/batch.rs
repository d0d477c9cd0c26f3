//! The batch being built: the ops of a conversation checked in order against
//! its locked row, each appending its event at the next seq.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use imcore_actors::{ConvId, UserId};

use super::lookup::{ConvRow, RequestKey, SendAckWithHash};
use crate::domain::{Event, EventKind, JoinMode, Role};

/// Rows and changes accumulated while the ops of a batch are checked in order.
pub(super) struct BatchBuilder {
    pub(super) next_seq: i64,
    pub(super) member_count: i32,
    pub(super) membership_changes: i64,
    /// Request keys appended earlier in this batch: a second op with the same key is its replay.
    pub(super) appended_keys: HashMap<RequestKey, SendAckWithHash>,
    pub(super) events: Vec<Event>,
    pub(super) member_changes: Vec<MemberChange>,
    pub(super) now: DateTime<Utc>,
    pub(super) conv: ConvId,
    pub(super) dismissed: bool,
    pub(super) mute_all: bool,
    pub(super) join_mode: JoinMode,
    pub(super) max_member: i32,
}

pub(super) enum MemberChange {
    Open { user: UserId, seq: i64, role: Role },
    Close { user: UserId, seq: i64 },
}

impl BatchBuilder {
    pub(super) fn new(conv: &ConvId, row: &ConvRow) -> Self {
        Self {
            next_seq: row.next_seq,
            member_count: row.member_count,
            membership_changes: 0,
            appended_keys: HashMap::new(),
            events: Vec::new(),
            member_changes: Vec::new(),
            now: row.now,
            conv: conv.clone(),
            dismissed: row.dismissed,
            mute_all: row.mute_all,
            join_mode: row.join_mode,
            max_member: row.max_member,
        }
    }

    pub(super) fn append(&mut self, kind: EventKind) -> i64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.events.push(Event { conv_id: self.conv.clone(), seq, created_at: self.now, kind });
        seq
    }

    pub(super) fn version_bump(&self) -> i64 {
        i64::from(self.membership_changes > 0)
    }
}
