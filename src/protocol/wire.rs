//! JSON of events, conversations, acks and pushes (PROTOCOL §4, §5).
//! Bodies are stored as canonical JSON text and embedded as raw JSON.

use serde::Serialize;
use serde_json::value::RawValue;
use serde_json::{json, Value};

use super::WireError;
use crate::domain::{format_time, Event, EventKind};
use imcore_actors::UserId;

use crate::store::{ConversationInfo, InboxItem, ReactionCount, SendAck, SyncEvent, SyncPage};

#[derive(Serialize)]
struct Sender<'a> {
    user_id: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    device_id: Option<&'a str>,
}

#[derive(Serialize)]
struct WireEvent<'a> {
    conv_id: &'a str,
    seq: i64,
    kind: &'static str,
    created_at: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    message_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    sender: Option<Sender<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    client_msg_id: Option<&'a str>,
    /// Present (possibly null) on `msg` only.
    #[serde(skip_serializing_if = "Option::is_none")]
    body: Option<Option<&'a RawValue>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    recalled: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    target_seq: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    subject_user: Option<&'a str>,
    /// Of `join`, `leave` and `group`; null on a `group` event of the operator's.
    #[serde(skip_serializing_if = "Option::is_none")]
    actor: Option<Option<&'a str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    change: Option<&'a RawValue>,
    /// v1.2: of a `msg`, only when set.
    #[serde(skip_serializing_if = "Option::is_none")]
    reply_to: Option<i64>,
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    mentions: &'a [UserId],
    #[serde(skip_serializing_if = "Option::is_none")]
    edited_at: Option<String>,
    /// Of a `reaction`.
    #[serde(skip_serializing_if = "Option::is_none")]
    emoji: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    on: Option<bool>,
    /// Of an unrecalled `msg` in a `sync` page, when it has any.
    #[serde(skip_serializing_if = "Option::is_none")]
    reactions: Option<&'a [ReactionCount]>,
}

fn raw(text: &str) -> Option<&RawValue> {
    serde_json::from_str(text).ok()
}

fn wire_event(e: &Event) -> WireEvent<'_> {
    let mut w = WireEvent {
        conv_id: e.conv_id.as_str(),
        seq: e.seq,
        kind: e.kind.name(),
        created_at: format_time(e.created_at),
        message_id: None,
        sender: None,
        client_msg_id: None,
        body: None,
        recalled: None,
        target_seq: None,
        subject_user: None,
        actor: None,
        reason: None,
        change: None,
        reply_to: None,
        mentions: &[],
        edited_at: None,
        emoji: None,
        on: None,
        reactions: None,
    };
    match &e.kind {
        EventKind::Msg {
            message_id,
            sender,
            sender_device,
            client_msg_id,
            body,
            recalled,
            reply_to,
            mentions,
            mention_all: _,
            edited_at,
        } => {
            w.message_id = Some(message_id.to_string());
            w.sender = Some(Sender { user_id: sender.as_str(), device_id: Some(sender_device.as_str()) });
            w.client_msg_id = Some(client_msg_id.as_str());
            w.body = Some(body.as_deref().and_then(raw));
            w.recalled = Some(*recalled);
            w.reply_to = *reply_to;
            w.mentions = mentions;
            w.edited_at = edited_at.map(format_time);
        }
        EventKind::Edit { sender, sender_device, client_msg_id, target_seq, body } => {
            w.sender = Some(Sender { user_id: sender.as_str(), device_id: Some(sender_device.as_str()) });
            w.client_msg_id = Some(client_msg_id.as_str());
            w.target_seq = Some(*target_seq);
            w.body = Some(body.as_deref().and_then(raw));
        }
        EventKind::Reaction { sender, sender_device, target_seq, emoji, on } => {
            w.sender = Some(Sender { user_id: sender.as_str(), device_id: Some(sender_device.as_str()) });
            w.target_seq = Some(*target_seq);
            w.emoji = Some(emoji.as_str());
            w.on = Some(*on);
        }
        EventKind::Recall { sender, sender_device, target_seq } => {
            w.sender = Some(Sender { user_id: sender.as_str(), device_id: sender_device.as_ref().map(|d| d.as_str()) });
            w.target_seq = Some(*target_seq);
        }
        EventKind::Join { subject, actor } => {
            w.subject_user = Some(subject.as_str());
            w.actor = Some(Some(actor.as_str()));
        }
        EventKind::Leave { subject, actor, reason } => {
            w.subject_user = Some(subject.as_str());
            w.actor = Some(Some(actor.as_str()));
            w.reason = Some(reason.as_str());
        }
        EventKind::Group { actor, change } => {
            w.actor = Some(actor.as_ref().map(UserId::as_str));
            w.change = raw(change);
        }
    }
    w
}

/// PROTOCOL §5 event object.
pub fn event_json(e: &Event) -> Value {
    serde_json::to_value(wire_event(e)).unwrap_or(Value::Null)
}

/// One event as JSON text, encoded once per batch and spliced into frames.
pub fn encode_event(e: &Event) -> String {
    serde_json::to_string(&wire_event(e)).unwrap_or_default()
}

/// `event` push for one encoded event, `events` for several (ascending seq).
pub fn push_encoded_events(conv_id: &str, events: &[&str]) -> String {
    let conv = serde_json::to_string(conv_id).unwrap_or_default();
    let mut frame = String::with_capacity(48 + conv.len() + events.iter().map(|e| e.len() + 1).sum::<usize>());
    if let [one] = events {
        frame.push_str(r#"{"push":"event","conv_id":"#);
        frame.push_str(&conv);
        frame.push_str(r#","event":"#);
        frame.push_str(one);
    } else {
        frame.push_str(r#"{"push":"events","conv_id":"#);
        frame.push_str(&conv);
        frame.push_str(r#","events":["#);
        for (i, e) in events.iter().enumerate() {
            if i > 0 {
                frame.push(',');
            }
            frame.push_str(e);
        }
        frame.push(']');
    }
    frame.push('}');
    frame
}

/// `members_changed` (PROTOCOL "Large groups"): of the seqs `from_seq..=head`,
/// the `join`s and `leave`s of others as two counts, and the encoded events
/// (ascending) this device still gets one by one.
pub fn push_members_changed(
    conv_id: &str,
    (from_seq, head): (i64, i64),
    (joined, left): (usize, usize),
    events: &[&str],
) -> String {
    let counts = json!({"push": "members_changed", "conv_id": conv_id, "from_seq": from_seq, "head": head,
                        "joined": joined, "left": left})
    .to_string();
    let open = counts.strip_suffix('}').unwrap_or(&counts);
    format!(r#"{open},"events":[{}]}}"#, events.join(","))
}

pub fn push_head(conv_id: &str, head: i64) -> String {
    json!({"push": "head", "conv_id": conv_id, "head": head}).to_string()
}

/// To the user's own other devices.
pub fn push_read(conv_id: &str, read_seq: i64) -> String {
    json!({"push": "read", "conv_id": conv_id, "read_seq": read_seq}).to_string()
}

/// To the other members (PROTOCOL v1.2): `user_id` is whose cursor moved.
pub fn push_member_read(conv_id: &str, user_id: &str, read_seq: i64) -> String {
    json!({"push": "read", "conv_id": conv_id, "user_id": user_id, "read_seq": read_seq}).to_string()
}

pub fn push_typing(conv_id: &str, user_id: &str, on: bool) -> String {
    json!({"push": "typing", "conv_id": conv_id, "user_id": user_id, "on": on}).to_string()
}

/// `last_seen`: when the user's last device went away (`null` while online).
pub fn push_presence(user_id: &str, online: bool, last_seen: Option<String>) -> String {
    json!({"push": "presence", "user_id": user_id, "online": online, "last_seen": last_seen}).to_string()
}

/// `reason`: `replaced` | `token_revoked` | `shutdown`.
pub fn push_kicked(reason: &str) -> String {
    json!({"push": "kicked", "reason": reason}).to_string()
}

#[derive(Serialize)]
pub struct WireAck {
    seq: i64,
    message_id: uuid::Uuid,
    dup: bool,
    created_at: String,
}

/// PROTOCOL §5 `send` result.
pub fn send_ack(ack: &SendAck) -> WireAck {
    WireAck { seq: ack.seq, message_id: ack.message_id, dup: ack.dup, created_at: format_time(ack.created_at) }
}

#[derive(Serialize)]
pub struct WireSyncPage<'a> {
    events: Vec<PageEventJson<'a>>,
    head: i64,
    min_seq: i64,
    epoch: i32,
    next_after: i64,
    has_more: bool,
    truncated: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    next_before: Option<i64>,
}

/// An event of a page: its shared encoding, or encoded for this page alone
/// (with the caller's reactions, or if it could not be kept).
#[derive(Serialize)]
#[serde(untagged)]
enum PageEventJson<'a> {
    Encoded(&'a RawValue),
    Fresh(Box<WireEvent<'a>>),
}

/// PROTOCOL §5 `sync` result, encoded straight from the events (a sync page
/// is the largest reply: no JSON tree is built for it). An event without
/// reactions is encoded once and kept with it (`SyncEvent`): every page of a
/// tail ring that shows it reuses that encoding.
pub fn sync_page(page: &SyncPage) -> WireSyncPage<'_> {
    WireSyncPage {
        events: page.events.iter().map(|e| page_event_json(page, e)).collect(),
        head: page.head,
        min_seq: page.min_seq,
        epoch: page.epoch,
        next_after: page.next_after,
        has_more: page.has_more,
        truncated: page.truncated,
        next_before: page.next_before,
    }
}

fn page_event_json<'a>(page: &'a SyncPage, e: &'a SyncEvent) -> PageEventJson<'a> {
    if let Some(reactions) = page.reactions.get(&e.seq) {
        return PageEventJson::Fresh(Box::new(WireEvent { reactions: Some(reactions), ..wire_event(e) }));
    }
    if let Some(encoded) = e.encoded.get() {
        return PageEventJson::Encoded(encoded);
    }
    match serde_json::value::to_raw_value(&wire_event(e)) {
        Ok(encoded) => PageEventJson::Encoded(e.encoded.get_or_init(|| encoded)),
        Err(_) => PageEventJson::Fresh(Box::new(wire_event(e))),
    }
}

/// A reply frame (PROTOCOL §4): `id` (absent when the request had none),
/// `ok`, and either the fields of the result object, given as its JSON text,
/// or `error`.
pub fn reply_frame(id: Option<&Value>, result: Result<&str, &WireError>) -> String {
    let id = id.map(|id| format!(r#""id":{id},"#)).unwrap_or_default();
    match result {
        Ok(object) => match object.strip_prefix('{').map(str::trim_start) {
            Some("}") => format!(r#"{{{id}"ok":true}}"#),
            Some(fields) => format!(r#"{{{id}"ok":true,{fields}"#),
            None => format!(r#"{{{id}"ok":true,"result":{object}}}"#),
        },
        Err(e) => {
            let error = serde_json::to_string(e).unwrap_or_default();
            format!(r#"{{{id}"ok":false,"error":{error}}}"#)
        }
    }
}

/// PROTOCOL §5 conversation object.
pub fn conversation_json(c: &ConversationInfo) -> Value {
    json!({
        "conv_id": c.conv_id,
        "kind": c.kind,
        "name": c.name,
        "owner": c.owner,
        "delivery_mode": c.delivery_mode.as_str(),
        "delivery_setting": c.delivery_setting.as_str(),
        "join_mode": c.join_mode.as_str(),
        "max_member": c.max_member,
        "member_count": c.member_count,
        "mute_all": c.mute_all,
        "status": c.status.as_str(),
        "head": c.head,
        "min_seq": c.min_seq,
        "epoch": c.epoch,
        "recall_window_ms": c.recall_window_ms,
        "retention_ms": c.retention_ms,
        "edit_window_ms": c.edit_window_ms,
        "created_at": format_time(c.created_at),
    })
}

/// PROTOCOL §5 inbox item: the conversation with the caller's `read_seq`,
/// `unread` and `last_event`.
pub fn inbox_item_json(item: &InboxItem) -> Value {
    let mut c = conversation_json(&item.conversation);
    if let Value::Object(m) = &mut c {
        m.insert("read_seq".into(), item.read_seq.into());
        m.insert("unread".into(), item.unread.into());
        m.insert("unread_mentions".into(), item.unread_mentions.into());
        m.insert("last_event".into(), item.last_event.as_ref().map_or(Value::Null, event_json));
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::EventKind;
    use imcore_actors::{ConvId, UserId};

    #[test]
    fn spliced_frames_are_the_json_of_the_protocol_pushes() {
        let user = UserId::parse("u-a").expect("id");
        let at = chrono::Utc::now();
        let e = |seq| Event {
            conv_id: ConvId::parse("g-1").expect("id"),
            seq,
            created_at: at,
            kind: EventKind::Join { subject: user.clone(), actor: user.clone() },
        };
        let (a, b) = (encode_event(&e(1)), encode_event(&e(2)));
        let one: Value = serde_json::from_str(&push_encoded_events("g-1", &[&a])).expect("json");
        assert_eq!(one, json!({"push": "event", "conv_id": "g-1", "event": event_json(&e(1))}));
        let two: Value = serde_json::from_str(&push_encoded_events("g-1", &[&a, &b])).expect("json");
        assert_eq!(two, json!({"push": "events", "conv_id": "g-1", "events": [event_json(&e(1)), event_json(&e(2))]}));
    }

    #[test]
    fn reply_frames_carry_the_id_ok_and_the_result_fields_or_the_error() {
        let parse = |frame: String| serde_json::from_str::<Value>(&frame).expect("json");
        let id = json!(7);
        let result = r#"{"seq":3,"dup":false}"#;
        assert_eq!(parse(reply_frame(Some(&id), Ok(result))), json!({"id": 7, "ok": true, "seq": 3, "dup": false}));
        assert_eq!(parse(reply_frame(Some(&id), Ok("{}"))), json!({"id": 7, "ok": true}));
        assert_eq!(parse(reply_frame(None, Ok(result))), json!({"ok": true, "seq": 3, "dup": false}));
        assert_eq!(parse(reply_frame(Some(&id), Ok("[1]"))), json!({"id": 7, "ok": true, "result": [1]}));
        let e = WireError::new(super::super::ErrorCode::NotMember, "no");
        assert_eq!(
            parse(reply_frame(Some(&id), Err(&e))),
            json!({"id": 7, "ok": false, "error": {"code": "NOT_MEMBER", "message": "no"}})
        );
    }
}
