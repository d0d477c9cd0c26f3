//! A device's request, parsed: a WebSocket frame and an HTTP request both
//! become `(op name, field map)`, parsed here into a [`Request`] with every id,
//! body and number checked at the edge (PROTOCOL §1, §5); malformed input is
//! `BAD_REQUEST` (or `PAYLOAD_TOO_LARGE`) before anything runs.
//!
//! Group ops slot in as new [`Request`] variants with a parse arm here and a
//! run arm in `ops`; the transports need no change beyond an HTTP route
//! naming the op.

use imcore_actors::{ClientMsgId, ConvId, UserId};
use serde_json::{Map, Value};

use super::error::ApiError;
use super::fields::Fields;
use super::group;
use super::push::PushOp;
use crate::domain::{
    check_text, Body, DeliverySetting, Emoji, JoinMode, MAX_DURATION_MS, MAX_GROUP_NAME_CHARS, MAX_GROUP_SIZE,
    MAX_MENTIONS,
};
use crate::store::{
    GroupChange, GroupSettings, MemberQuery, INBOX_DEFAULT_LIMIT, INBOX_MAX_LIMIT, SYNC_DEFAULT_LIMIT, SYNC_MAX_LIMIT,
};

/// Most users named in one `presence`.
pub const MAX_PRESENCE_USERS: usize = 100;

/// `search_users`: results when no `limit` is given, and the most a `limit` may ask.
pub const SEARCH_USERS_DEFAULT_LIMIT: i64 = 10;
pub const SEARCH_USERS_MAX_LIMIT: i64 = 50;

/// Most members named in one `create_conversation`.
pub const MAX_CREATE_MEMBERS: usize = 1000;
/// Longest inbox cursor accepted: ours are the hex of `<µs>:<conv_id>`, at
/// most 170 characters.
const MAX_CURSOR_CHARS: usize = 256;

/// A parsed, checked request of a device.
#[derive(Debug, Clone)]
pub enum Request {
    CreateConversation(NewConversation),
    GetConversation {
        conv: ConvId,
    },
    Conversations {
        limit: i64,
        cursor: Option<String>,
    },
    /// `conversations` with `since` (PROTOCOL §7).
    ConversationsSince {
        since: String,
    },
    Send {
        conv: ConvId,
        client_msg_id: ClientMsgId,
        body: Body,
        reply_to: Option<i64>,
        /// Distinct, at most [`MAX_MENTIONS`].
        mentions: Vec<UserId>,
    },
    Edit {
        conv: ConvId,
        client_msg_id: ClientMsgId,
        target_seq: i64,
        body: Body,
    },
    React {
        conv: ConvId,
        target_seq: i64,
        emoji: Emoji,
        on: bool,
    },
    Sync(SyncParams),
    Read {
        conv: ConvId,
        seq: i64,
    },
    Recall {
        conv: ConvId,
        target_seq: i64,
    },
    /// A group op that changes the conversation (PROTOCOL §5 table).
    Group {
        conv: ConvId,
        change: GroupChange,
    },
    Members {
        conv: ConvId,
        query: MemberQuery,
        limit: i64,
    },
    Applications {
        conv: ConvId,
        after: Option<UserId>,
        limit: i64,
    },
    Ping,
    /// Who the caller's token belongs to (a client shows it and tells its own messages apart).
    WhoAmI,
    /// The members' read cursors, paged like `members` (PROTOCOL v1.2).
    Reads {
        conv: ConvId,
        after: i64,
        limit: i64,
    },
    /// An ephemeral typing signal (PROTOCOL v1.2): never stored.
    Typing {
        conv: ConvId,
        on: bool,
    },
    /// Who of these users is online (PROTOCOL v1.2); distinct, at most [`MAX_PRESENCE_USERS`].
    Presence {
        users: Vec<UserId>,
    },
    Block {
        user: UserId,
    },
    Unblock {
        user: UserId,
    },
    Blocks,
    /// `set_pusher`, `remove_pusher`, `set_notify` (PROTOCOL v1.3).
    Push(PushOp),
    /// The people picker (PROTOCOL v1.2): `prefix` has the form of a user id.
    SearchUsers {
        prefix: String,
        limit: i64,
    },
}

#[derive(Debug, Clone)]
pub enum NewConversation {
    Direct { other: UserId },
    Group { conv_id: Option<ConvId>, name: String, members: Vec<UserId>, settings: GroupSettings },
}

#[derive(Debug, Clone)]
pub struct SyncParams {
    pub conv: ConvId,
    pub after_seq: Option<i64>,
    pub before_seq: Option<i64>,
    pub limit: i64,
    pub epoch: Option<i32>,
}

impl Request {
    /// The op name, for metrics and logs.
    pub fn op(&self) -> &'static str {
        match self {
            Request::CreateConversation(_) => "create_conversation",
            Request::GetConversation { .. } => "get_conversation",
            Request::Conversations { .. } | Request::ConversationsSince { .. } => "conversations",
            Request::Send { .. } => "send",
            Request::Sync(_) => "sync",
            Request::Read { .. } => "read",
            Request::Group { change, .. } => change.op(),
            Request::Recall { .. } => "recall",
            Request::Edit { .. } => "edit",
            Request::React { .. } => "react",
            Request::Members { .. } => "members",
            Request::Applications { .. } => "applications",
            Request::Ping => "ping",
            Request::WhoAmI => "whoami",
            Request::Reads { .. } => "reads",
            Request::Typing { .. } => "typing",
            Request::Presence { .. } => "presence",
            Request::Block { .. } => "block",
            Request::Unblock { .. } => "unblock",
            Request::Blocks => "blocks",
            Request::Push(op) => op.name(),
            Request::SearchUsers { .. } => "search_users",
        }
    }

    /// A read: changes nothing, so its reply (which may be large) can be
    /// refused `OVERLOADED` and asked again at no cost (ARCHITECTURE §5).
    pub fn is_read(&self) -> bool {
        matches!(
            self,
            Request::Sync(_)
                | Request::GetConversation { .. }
                | Request::Conversations { .. }
                | Request::ConversationsSince { .. }
                | Request::Members { .. }
                | Request::Applications { .. }
                | Request::SearchUsers { .. }
        )
    }

    /// The conversation the request is about, if one.
    pub fn conv(&self) -> Option<&ConvId> {
        match self {
            Request::GetConversation { conv }
            | Request::Send { conv, .. }
            | Request::Read { conv, .. }
            | Request::Group { conv, .. }
            | Request::Recall { conv, .. }
            | Request::Edit { conv, .. }
            | Request::React { conv, .. }
            | Request::Members { conv, .. }
            | Request::Applications { conv, .. }
            | Request::Reads { conv, .. }
            | Request::Typing { conv, .. }
            | Request::Push(PushOp::Level { conv, .. }) => Some(conv),
            Request::Sync(p) => Some(&p.conv),
            Request::CreateConversation(_)
            | Request::Conversations { .. }
            | Request::ConversationsSince { .. }
            | Request::Ping
            | Request::WhoAmI
            | Request::Presence { .. }
            | Request::Block { .. }
            | Request::Unblock { .. }
            | Request::Blocks
            | Request::Push(_)
            | Request::SearchUsers { .. } => None,
        }
    }

    /// Parses `op` with its fields. Unknown op, missing or malformed field →
    /// `BAD_REQUEST`; a body over `max_body_bytes` → `PAYLOAD_TOO_LARGE`.
    pub fn parse(op: &str, fields: &Map<String, Value>, max_body_bytes: usize) -> Result<Self, ApiError> {
        let f = Fields(fields);
        Ok(match op {
            "create_conversation" => Request::CreateConversation(parse_new_conversation(&f)?),
            "get_conversation" => Request::GetConversation { conv: f.conv_id()? },
            "conversations" => match f.opt_str("since")? {
                Some(since) => Request::ConversationsSince { since: checked_since(&f, since)? },
                None => Request::Conversations {
                    limit: f.int_in("limit", 1, INBOX_MAX_LIMIT)?.unwrap_or(INBOX_DEFAULT_LIMIT),
                    cursor: f.opt_str("cursor")?.map(checked_cursor).transpose()?,
                },
            },
            "send" => Request::Send {
                conv: f.conv_id()?,
                client_msg_id: ClientMsgId::parse(f.str("client_msg_id")?)?,
                body: parse_body(&f, max_body_bytes)?,
                reply_to: f.int_in("reply_to", 1, i64::MAX)?,
                mentions: parse_mentions(&f)?,
            },
            "edit" => Request::Edit {
                conv: f.conv_id()?,
                client_msg_id: ClientMsgId::parse(f.str("client_msg_id")?)?,
                target_seq: required_seq(&f, "target_seq")?,
                body: parse_body(&f, max_body_bytes)?,
            },
            "react" => Request::React {
                conv: f.conv_id()?,
                target_seq: required_seq(&f, "target_seq")?,
                emoji: Emoji::parse(f.str("emoji")?).map_err(|e| ApiError::bad_request(e.to_string()))?,
                on: f.opt_bool("on")?.ok_or_else(|| ApiError::bad_request("missing field `on`"))?,
            },
            "sync" => {
                let before_seq = f.int_in("before_seq", 1, i64::MAX)?;
                let after_seq = f.int_in("after_seq", 0, i64::MAX)?;
                if before_seq.is_some() && after_seq.is_some() {
                    return Err(ApiError::bad_request("give `after_seq` or `before_seq`, not both"));
                }
                Request::Sync(SyncParams {
                    conv: f.conv_id()?,
                    after_seq,
                    before_seq,
                    // Over the maximum is clamped (PROTOCOL: "max 1000"); below 1 is refused.
                    limit: f.int_in("limit", 1, i64::MAX)?.map_or(SYNC_DEFAULT_LIMIT, |l| l.min(SYNC_MAX_LIMIT)),
                    epoch: f.int_in("epoch", 1, i32::MAX.into())?.map(|e| e as i32),
                })
            }
            "read" => Request::Read {
                conv: f.conv_id()?,
                seq: f.int_in("seq", 0, i64::MAX)?.ok_or_else(|| ApiError::bad_request("missing field `seq`"))?,
            },
            "ping" => Request::Ping,
            "whoami" => Request::WhoAmI,
            "recall" => Request::Recall { conv: f.conv_id()?, target_seq: required_seq(&f, "target_seq")? },
            "members" => {
                let (query, limit) = group::parse_members(&f)?;
                Request::Members { conv: f.conv_id()?, query, limit }
            }
            "reads" => {
                let (after, limit) = group::parse_reads(&f)?;
                Request::Reads { conv: f.conv_id()?, after, limit }
            }
            "typing" => Request::Typing {
                conv: f.conv_id()?,
                on: f.opt_bool("on")?.ok_or_else(|| ApiError::bad_request("missing field `on`"))?,
            },
            "presence" => Request::Presence { users: parse_presence_users(&f)? },
            "block" => Request::Block { user: f.user_id("user_id")? },
            "unblock" => Request::Unblock { user: f.user_id("user_id")? },
            "blocks" => Request::Blocks,
            "search_users" => Request::SearchUsers {
                prefix: UserId::parse(f.str("prefix")?)
                    .map_err(|_| ApiError::bad_request("`prefix` must be 1-64 characters of A-Z a-z 0-9 . _ : @ -"))?
                    .as_str()
                    .to_owned(),
                limit: f.int_in("limit", 1, SEARCH_USERS_MAX_LIMIT)?.unwrap_or(SEARCH_USERS_DEFAULT_LIMIT),
            },
            "applications" => {
                let (after, limit) = group::parse_applications(&f)?;
                Request::Applications { conv: f.conv_id()?, after, limit }
            }
            other => match (group::parse_change(other, &f)?, PushOp::parse(other, &f)?) {
                (Some(change), _) => Request::Group { conv: f.conv_id()?, change },
                (None, Some(push)) => Request::Push(push),
                (None, None) => return Err(ApiError::bad_request(format!("unknown op `{}`", truncate(other, 64)))),
            },
        })
    }
}

fn parse_new_conversation(f: &Fields<'_>) -> Result<NewConversation, ApiError> {
    let members: Vec<UserId> = match f.0.get("members") {
        Some(Value::Array(items)) if items.len() <= MAX_CREATE_MEMBERS => items
            .iter()
            .map(|v| match v {
                Value::String(s) => UserId::parse(s).map_err(ApiError::from),
                _ => Err(ApiError::bad_request("`members` must be user ids")),
            })
            .collect::<Result<_, _>>()?,
        Some(Value::Array(_)) => {
            return Err(ApiError::bad_request(format!("at most {MAX_CREATE_MEMBERS} members at creation")))
        }
        None => vec![],
        Some(_) => return Err(ApiError::bad_request("`members` must be an array of user ids")),
    };
    match f.str("kind")? {
        "direct" => match <[UserId; 1]>::try_from(members) {
            Ok([other]) => Ok(NewConversation::Direct { other }),
            Err(_) => Err(ApiError::bad_request("a direct conversation names exactly one other member")),
        },
        "group" => {
            let name = f.str("name")?;
            check_text("name", name, MAX_GROUP_NAME_CHARS).map_err(|e| ApiError::bad_request(e.to_string()))?;
            let mut settings = GroupSettings::default();
            if let Some(m) = f.opt_str("delivery_mode")? {
                settings.delivery_mode =
                    m.parse::<DeliverySetting>().map_err(|()| ApiError::bad_request(group::DELIVERY_MODES))?;
            }
            if let Some(m) = f.opt_str("join_mode")? {
                settings.join_mode = m
                    .parse::<JoinMode>()
                    .map_err(|()| ApiError::bad_request("`join_mode` is `invite`, `approval` or `free`"))?;
            }
            if let Some(n) = f.int_in("max_member", 1, MAX_GROUP_SIZE)? {
                settings.max_member = n as i32;
            }
            if let Some(ms) = f.int_in("recall_window_ms", 0, MAX_DURATION_MS)? {
                settings.recall_window_ms = ms;
            }
            if let Some(ms) = f.int_in("edit_window_ms", 0, MAX_DURATION_MS)? {
                settings.edit_window_ms = ms;
            }
            settings.retention_ms = f.int_in("retention_ms", 1, MAX_DURATION_MS)?;
            let conv_id = f.opt_str("conv_id")?.map(ConvId::parse).transpose()?;
            Ok(NewConversation::Group { conv_id, name: name.to_owned(), members, settings })
        }
        _ => Err(ApiError::bad_request("`kind` is `direct` or `group`")),
    }
}

/// `presence`'s `user_ids`: 0–100 user ids, repeats dropped (the first kept).
fn parse_presence_users(f: &Fields<'_>) -> Result<Vec<UserId>, ApiError> {
    let Some(Value::Array(items)) = f.get("user_ids") else {
        return Err(ApiError::bad_request("`user_ids` must be an array of user ids"));
    };
    if items.len() > MAX_PRESENCE_USERS {
        return Err(ApiError::bad_request(format!("at most {MAX_PRESENCE_USERS} user ids")));
    }
    let mut users: Vec<UserId> = Vec::with_capacity(items.len());
    for item in items {
        let Value::String(s) = item else {
            return Err(ApiError::bad_request("`user_ids` must be user ids"));
        };
        let user = UserId::parse(s)?;
        if !users.contains(&user) {
            users.push(user);
        }
    }
    Ok(users)
}

/// A message body (`send`, `edit`): any JSON value but null.
fn parse_body(f: &Fields<'_>, max_body_bytes: usize) -> Result<Body, ApiError> {
    match f.get("body") {
        None => Err(ApiError::bad_request("missing field `body`")),
        // A null body is how a recalled message syncs: a message never has one.
        Some(Value::Null) => Err(ApiError::bad_request("`body` may not be null")),
        Some(body) => Ok(Body::parse(body, max_body_bytes)?),
    }
}

/// A required seq of the log (≥ 1).
fn required_seq(f: &Fields<'_>, name: &str) -> Result<i64, ApiError> {
    f.int_in(name, 1, i64::MAX)?.ok_or_else(|| ApiError::bad_request(format!("missing field `{name}`")))
}

/// `mentions`: at most [`MAX_MENTIONS`] user ids; a repeat counts once.
fn parse_mentions(f: &Fields<'_>) -> Result<Vec<UserId>, ApiError> {
    let items = match f.get("mentions") {
        None | Some(Value::Null) => return Ok(vec![]),
        Some(Value::Array(items)) if items.len() <= MAX_MENTIONS => items,
        Some(Value::Array(_)) => return Err(ApiError::bad_request(format!("at most {MAX_MENTIONS} mentions"))),
        Some(_) => return Err(ApiError::bad_request("`mentions` must be an array of user ids")),
    };
    let mut mentions: Vec<UserId> = Vec::with_capacity(items.len());
    for v in items {
        let Value::String(s) = v else { return Err(ApiError::bad_request("`mentions` must be user ids")) };
        let user = UserId::parse(s)?;
        if !mentions.contains(&user) {
            mentions.push(user);
        }
    }
    Ok(mentions)
}

/// A `since` token is opaque: any string of bounded length is taken (one that
/// is not a token of ours answers `reset`), alone (no `cursor`, no `limit`).
fn checked_since(f: &Fields<'_>, since: &str) -> Result<String, ApiError> {
    if f.0.contains_key("cursor") || f.0.contains_key("limit") {
        return Err(ApiError::bad_request("`since` takes neither `cursor` nor `limit`"));
    }
    if since.len() > MAX_CURSOR_CHARS {
        return Err(ApiError::bad_request("malformed since: pass a `since` as it was given"));
    }
    Ok(since.to_owned())
}

/// An inbox cursor is opaque, but it is always hex of bounded length: anything
/// else cannot be one of ours and is refused before the store sees it.
fn checked_cursor(cursor: &str) -> Result<String, ApiError> {
    if cursor.is_empty() || cursor.len() > MAX_CURSOR_CHARS || !cursor.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(ApiError::bad_request("malformed cursor: pass a `next_cursor` as it was given"));
    }
    Ok(cursor.to_owned())
}

fn truncate(s: &str, max: usize) -> &str {
    match s.char_indices().nth(max) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::protocol::ErrorCode;

    fn parse(op: &str, v: Value) -> Result<Request, ApiError> {
        let Value::Object(m) = v else { panic!("object") };
        Request::parse(op, &m, 100)
    }

    #[test]
    fn fields_are_checked_at_the_edge() {
        let code = |r: Result<Request, ApiError>| r.err().map(|e| e.code());
        assert_eq!(code(parse("nope", json!({}))), Some(ErrorCode::BadRequest));
        assert_eq!(
            code(parse("send", json!({"conv_id": "c 1", "client_msg_id": "m", "body": 1}))),
            Some(ErrorCode::BadRequest)
        );
        assert_eq!(code(parse("send", json!({"conv_id": "c1", "client_msg_id": "m"}))), Some(ErrorCode::BadRequest));
        assert_eq!(
            code(parse("send", json!({"conv_id": "c1", "client_msg_id": "m", "body": "x".repeat(200)}))),
            Some(ErrorCode::PayloadTooLarge)
        );
        assert_eq!(code(parse("sync", json!({"conv_id": "c1", "limit": 0}))), Some(ErrorCode::BadRequest));
        assert!(
            matches!(parse("sync", json!({"conv_id": "c1", "after_seq": "7"})), Ok(Request::Sync(p)) if p.after_seq == Some(7))
        );
        assert_eq!(
            code(parse("create_conversation", json!({"kind": "direct", "members": []}))),
            Some(ErrorCode::BadRequest)
        );
        assert!(parse("create_conversation", json!({"kind": "group", "name": "g", "members": ["a"]})).is_ok());
        for extra in [json!({"name": "a\u{0}"}), json!({"name": "x".repeat(129)}), json!({"retention_ms": i64::MAX})] {
            let mut f = json!({"kind": "group", "name": "g"});
            f.as_object_mut().expect("object").extend(extra.as_object().expect("object").clone());
            assert_eq!(code(parse("create_conversation", f)), Some(ErrorCode::BadRequest), "{extra}");
        }
        assert_eq!(
            code(parse("send", json!({"conv_id": "c1", "client_msg_id": "m", "body": null}))),
            Some(ErrorCode::BadRequest)
        );
        for cursor in ["", "xyz", &"a".repeat(MAX_CURSOR_CHARS + 1)] {
            assert_eq!(
                code(parse("conversations", json!({"cursor": cursor}))),
                Some(ErrorCode::BadRequest),
                "{cursor}"
            );
        }
        for fields in [
            json!({"since": 12}),
            json!({"since": "ab", "cursor": "ab"}),
            json!({"since": "ab", "limit": 10}),
            json!({"since": "a".repeat(MAX_CURSOR_CHARS + 1)}),
        ] {
            assert_eq!(code(parse("conversations", fields.clone())), Some(ErrorCode::BadRequest), "{fields}");
        }
        let ids = |n: usize| json!({"user_ids": (0..n).map(|i| format!("u{i}")).collect::<Vec<_>>()});
        assert!(matches!(parse("presence", ids(100)), Ok(Request::Presence { users }) if users.len() == 100));
        for fields in [ids(101), json!({"user_ids": "u1"}), json!({"user_ids": [1]}), json!({})] {
            assert_eq!(code(parse("presence", fields.clone())), Some(ErrorCode::BadRequest), "{fields}");
        }
        assert_eq!(code(parse("typing", json!({"conv_id": "c1"}))), Some(ErrorCode::BadRequest));
        assert_eq!(code(parse("block", json!({"user_id": "a b"}))), Some(ErrorCode::BadRequest));
        // Any other string is a token to look at: not ours answers `reset`, not an error.
        assert!(matches!(parse("conversations", json!({"since": "not ours"})), Ok(Request::ConversationsSince { .. })));
    }
}
