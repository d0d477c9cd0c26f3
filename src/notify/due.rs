//! Which committed events notify whom (PROTOCOL v1.3): pure rules over an
//! event and one member's pusher row. A `msg` notifies the members who could
//! see it (membership at its seq) but its sender, by their level; `join`,
//! `leave` and `group` notify only their subject, when someone else acted,
//! in groups.
//! Reactions, edits, recalls never notify.

use imcore_actors::UserId;

use crate::domain::{Event, EventKind};
use crate::store::{ConvFacts, DueRow, NotifyLevel};

/// What one notification says of its event (the gateway's `notification`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    pub seq: i64,
    /// `<conv_id>:<seq>`: unique per event, so a gateway can de-duplicate.
    pub event_id: String,
    /// The event's kind (`msg`, `join`, `leave`, `group`).
    pub kind: &'static str,
    pub sender: UserId,
    /// Direct chats, mentions and what happened to the user itself.
    pub high: bool,
    /// The group's name, the sender's display name (filled by the caller).
    pub room_name: Option<String>,
    pub sender_name: Option<String>,
}

/// A user's level in a conversation: theirs, else all in direct chats and
/// groups up to `all_max_members`, mentions above.
pub fn level_of(row: &DueRow, facts: &ConvFacts, all_max_members: i32) -> NotifyLevel {
    row.level.unwrap_or(if facts.direct || facts.member_count <= all_max_members {
        NotifyLevel::All
    } else {
        NotifyLevel::Mentions
    })
}

/// The notice `event` gives `row`'s user at `level`, if any.
pub fn notice(event: &Event, row: &DueRow, level: NotifyLevel, direct: bool) -> Option<Notice> {
    let user = &row.user;
    let visible = row.from_seq <= event.seq && row.to_seq.map_or(true, |to| event.seq <= to);
    // A pusher registered after the event is not told of it (recovery reads back).
    if !visible || level == NotifyLevel::None || event.created_at < row.pushkey_at {
        return None;
    }
    let (sender, high) = match &event.kind {
        EventKind::Msg { sender, mentions, mention_all, .. } => {
            let mentioned = *mention_all || mentions.contains(user);
            if sender == user || (level == NotifyLevel::Mentions && !mentioned) {
                return None;
            }
            (sender, direct || mentioned)
        }
        // In a direct chat these are its creation's: the first message tells.
        EventKind::Join { subject, actor } | EventKind::Leave { subject, actor, .. } => {
            if direct || subject != user || actor == user {
                return None;
            }
            (actor, true)
        }
        EventKind::Group { actor: Some(actor), change } => {
            if direct || actor == user || !names_subject(change, user) {
                return None;
            }
            (actor, true)
        }
        // An operator's ban or unban (no actor) concerns no member in particular.
        EventKind::Group { actor: None, .. }
        | EventKind::Edit { .. }
        | EventKind::Reaction { .. }
        | EventKind::Recall { .. } => return None,
    };
    Some(Notice {
        seq: event.seq,
        event_id: format!("{}:{}", event.conv_id.as_str(), event.seq),
        kind: event.kind.name(),
        sender: sender.clone(),
        high,
        room_name: None,
        sender_name: None,
    })
}

/// Whether a `group` change names `user` as the member it is about (a role,
/// permissions, a mute, the new owner).
fn names_subject(change: &str, user: &UserId) -> bool {
    let Ok(serde_json::Value::Object(change)) = serde_json::from_str::<serde_json::Value>(change) else {
        return false;
    };
    change
        .values()
        .any(|v| [v.get("user_id"), v.get("to")].into_iter().flatten().any(|u| u.as_str() == Some(user.as_str())))
}

#[cfg(test)]
mod tests {
    use chrono::Utc;
    use imcore_actors::{ClientMsgId, ConvId, DeviceId};

    use super::*;
    use crate::domain::LeaveReason;

    fn user(s: &str) -> UserId {
        UserId::parse(s).expect("user")
    }

    fn row(u: &str, from: i64, to: Option<i64>) -> DueRow {
        DueRow {
            user: user(u),
            device: DeviceId::parse("phone").expect("device"),
            app_id: "app".into(),
            pushkey: "k".into(),
            url: "http://gw/".into(),
            data: None,
            pushkey_at: Utc::now() - chrono::Duration::hours(1),
            from_seq: from,
            to_seq: to,
            level: None,
        }
    }

    fn event(seq: i64, kind: EventKind) -> Event {
        Event { conv_id: ConvId::parse("g1").expect("conv"), seq, created_at: Utc::now(), kind }
    }

    fn msg(seq: i64, sender: &str, mentions: &[&str], mention_all: bool) -> Event {
        event(
            seq,
            EventKind::Msg {
                message_id: uuid::Uuid::nil(),
                sender: user(sender),
                sender_device: DeviceId::parse("d").expect("device"),
                client_msg_id: ClientMsgId::parse("m").expect("id"),
                body: Some("{}".into()),
                recalled: false,
                reply_to: None,
                mentions: mentions.iter().map(|m| user(m)).collect(),
                mention_all,
                edited_at: None,
            },
        )
    }

    #[test]
    fn a_message_notifies_members_who_see_it_but_not_its_sender() {
        let all = NotifyLevel::All;
        assert!(notice(&msg(5, "bob", &[], false), &row("ann", 1, None), all, false).is_some());
        assert!(notice(&msg(5, "ann", &[], false), &row("ann", 1, None), all, false).is_none());
        // Kicked at 4: nothing after it; joined at 6: nothing before.
        assert!(notice(&msg(5, "bob", &[], false), &row("ann", 1, Some(4)), all, false).is_none());
        assert!(notice(&msg(5, "bob", &[], false), &row("ann", 6, None), all, false).is_none());
        assert!(notice(&msg(5, "bob", &[], false), &row("ann", 1, None), NotifyLevel::None, true).is_none());
    }

    #[test]
    fn mentions_level_lets_only_mentions_through_with_high_priority() {
        let m = NotifyLevel::Mentions;
        assert!(notice(&msg(5, "bob", &[], false), &row("ann", 1, None), m, false).is_none());
        assert_eq!(notice(&msg(5, "bob", &["ann"], false), &row("ann", 1, None), m, false).map(|n| n.high), Some(true));
        assert!(notice(&msg(5, "bob", &[], true), &row("ann", 1, None), m, false).is_some());
        assert_eq!(
            notice(&msg(5, "bob", &[], false), &row("ann", 1, None), NotifyLevel::All, false).map(|n| n.high),
            Some(false)
        );
    }

    #[test]
    fn membership_and_group_events_notify_only_their_subject_acted_on_by_another() {
        let kick = event(7, EventKind::Leave { subject: user("ann"), actor: user("own"), reason: LeaveReason::Kicked });
        let all = NotifyLevel::All;
        assert!(notice(&kick, &row("ann", 1, Some(7)), all, false).is_some());
        assert!(notice(&kick, &row("ann", 1, Some(7)), all, true).is_none(), "not in a direct chat");
        assert!(notice(&kick, &row("bob", 1, None), all, false).is_none());
        let left = event(7, EventKind::Leave { subject: user("ann"), actor: user("ann"), reason: LeaveReason::Left });
        assert!(notice(&left, &row("ann", 1, Some(7)), all, false).is_none());
        let role =
            event(8, EventKind::Group { actor: Some(user("own")), change: r#"{"role":{"user_id":"ann"}}"#.into() });
        assert!(notice(&role, &row("ann", 1, None), all, false).is_some());
        assert!(notice(&role, &row("bob", 1, None), all, false).is_none());
    }
}
