//! The group ops of PROTOCOL §5 at the edge: their fields parsed and checked
//! into a [`GroupChange`] (or a roster read), and their results as the
//! protocol's JSON. The rules themselves run under the conversation's row
//! lock in the store.

use std::collections::HashSet;

use imcore_actors::UserId;
use serde_json::{json, Map, Value};

use super::error::ApiError;
use super::fields::Fields;
use crate::domain::{
    check_text, format_time, DeliverySetting, JoinMode, Role, ADMIN_BITS, MAX_ALIAS_CHARS, MAX_DURATION_MS,
    MAX_GROUP_NAME_CHARS, MAX_GROUP_SIZE, MAX_INVITE_USERS,
};
use crate::store::{
    ApplicationPage, GroupChange, Invited, MemberNext, MemberPage, MemberQuery, ProfilePatch, Written,
    MEMBERS_DEFAULT_LIMIT, MEMBERS_MAX_LIMIT,
};

/// The refusal of a `delivery_mode` that is none of the settings.
pub const DELIVERY_MODES: &str = "`delivery_mode` is `auto`, `push` or `pull`";

/// Longest `q` of a member search.
const MAX_QUERY_CHARS: usize = 64;

/// The group ops that change a conversation, by wire name.
pub fn parse_change(op: &str, f: &Fields<'_>) -> Result<Option<GroupChange>, ApiError> {
    Ok(Some(match op {
        "invite" => GroupChange::Invite(user_ids(f)?),
        "join" => GroupChange::Join,
        "approve" => GroupChange::Approve(f.user_id("user_id")?),
        "reject" => GroupChange::Reject(f.user_id("user_id")?),
        "leave" => GroupChange::Leave,
        "kick" => GroupChange::Kick(f.user_id("user_id")?),
        "set_role" => {
            let role = match f.str("role")? {
                "admin" => Role::Admin,
                "member" => Role::Member,
                _ => {
                    return Err(ApiError::bad_request(
                        "`role` is `admin` or `member` (ownership moves by transfer_owner)",
                    ))
                }
            };
            let until = f.opt_time("until")?;
            if until.is_some() && role != Role::Admin {
                return Err(ApiError::bad_request("`until` is for a temporary admin only"));
            }
            GroupChange::SetRole { user: f.user_id("user_id")?, role, until }
        }
        "set_perms" => {
            let bits = f.int_in("extra_perms", 0, i64::from(ADMIN_BITS))?.unwrap_or(-1);
            if bits < 0 || bits as u32 & !ADMIN_BITS != 0 {
                return Err(ApiError::bad_request(format!(
                    "`extra_perms` is a set of the bits an admin may hold (a subset of {ADMIN_BITS})"
                )));
            }
            GroupChange::SetPerms { user: f.user_id("user_id")?, extra_perms: bits as u32 }
        }
        "mute_member" => {
            if !f.has("mute_until") {
                return Err(ApiError::bad_request("missing field `mute_until` (a time, or null to unmute)"));
            }
            GroupChange::Mute { user: f.user_id("user_id")?, until: f.opt_time("mute_until")? }
        }
        "set_alias" => {
            let alias = f.opt_str("alias")?.filter(|a| !a.is_empty());
            if let Some(a) = alias {
                check_text("alias", a, MAX_ALIAS_CHARS).map_err(|e| ApiError::bad_request(e.to_string()))?;
            }
            GroupChange::SetAlias(alias.map(str::to_owned))
        }
        "transfer_owner" => GroupChange::TransferOwner(f.user_id("user_id")?),
        "update_group" => GroupChange::Update(profile_patch(f)?),
        "dismiss" => GroupChange::Dismiss,
        _ => return Ok(None),
    }))
}

/// `invite`'s `user_ids`: 1–1000 user ids, repeats dropped (first kept).
fn user_ids(f: &Fields<'_>) -> Result<Vec<UserId>, ApiError> {
    let Some(Value::Array(items)) = f.get("user_ids") else {
        return Err(ApiError::bad_request("`user_ids` must be an array of user ids"));
    };
    if items.is_empty() || items.len() > MAX_INVITE_USERS {
        return Err(ApiError::bad_request(format!("`user_ids` names 1 to {MAX_INVITE_USERS} users")));
    }
    let mut seen = HashSet::new();
    let mut users = Vec::with_capacity(items.len());
    for item in items {
        let Value::String(s) = item else { return Err(ApiError::bad_request("`user_ids` must be user ids")) };
        let user = UserId::parse(s)?;
        if seen.insert(user.clone()) {
            users.push(user);
        }
    }
    Ok(users)
}

fn profile_patch(f: &Fields<'_>) -> Result<ProfilePatch, ApiError> {
    let mut p = ProfilePatch::default();
    if let Some(name) = f.opt_str("name")? {
        check_text("name", name, MAX_GROUP_NAME_CHARS).map_err(|e| ApiError::bad_request(e.to_string()))?;
        p.name = Some(name.to_owned());
    }
    if let Some(m) = f.opt_str("join_mode")? {
        let mode = m.parse::<JoinMode>();
        p.join_mode = Some(mode.map_err(|()| ApiError::bad_request("`join_mode` is `invite`, `approval` or `free`"))?);
    }
    p.max_member = f.int_in("max_member", 1, MAX_GROUP_SIZE)?.map(|n| n as i32);
    p.mute_all = f.opt_bool("mute_all")?;
    if let Some(m) = f.opt_str("delivery_mode")? {
        let mode = m.parse::<DeliverySetting>();
        p.delivery_mode = Some(mode.map_err(|()| ApiError::bad_request(DELIVERY_MODES))?);
    }
    p.recall_window_ms = f.int_in("recall_window_ms", 0, MAX_DURATION_MS)?;
    p.edit_window_ms = f.int_in("edit_window_ms", 0, MAX_DURATION_MS)?;
    if f.has("retention_ms") {
        p.retention_ms = Some(f.int_in("retention_ms", 1, MAX_DURATION_MS)?);
    }
    if p.is_empty() {
        return Err(ApiError::bad_request("`update_group` names at least one setting to change"));
    }
    Ok(p)
}

/// `reads`: `after` (a `next`, a `joined_seq`), `limit` ≤ 200.
pub fn parse_reads(f: &Fields<'_>) -> Result<(i64, i64), ApiError> {
    let after = f.int_in("after", 0, i64::MAX)?.unwrap_or(0);
    Ok((after, f.int_in("limit", 1, MEMBERS_MAX_LIMIT)?.unwrap_or(MEMBERS_DEFAULT_LIMIT)))
}

/// `members`: `q` a prefix or `order` (`joined`, `active`), `after` the
/// previous page's `next` (a `joined_seq` in join order, else a cursor
/// string), `limit` ≤ 200.
pub fn parse_members(f: &Fields<'_>) -> Result<(MemberQuery, i64), ApiError> {
    let limit = f.int_in("limit", 1, MEMBERS_MAX_LIMIT)?.unwrap_or(MEMBERS_DEFAULT_LIMIT);
    let q = f.opt_str("q")?.filter(|q| !q.is_empty());
    if let Some(q) = q {
        check_text("q", q, MAX_QUERY_CHARS).map_err(|e| ApiError::bad_request(e.to_string()))?;
    }
    let query = match (f.opt_str("order")?, q) {
        (None | Some("joined"), None) => MemberQuery::Joined { after: f.int_in("after", 0, i64::MAX)?.unwrap_or(0) },
        (Some("active"), None) => MemberQuery::Active { after: cursor(f, MemberQuery::active_after)? },
        (None, Some(q)) => MemberQuery::Search { q: q.to_owned(), after: cursor(f, MemberQuery::search_after)? },
        (Some(_), Some(_)) => return Err(ApiError::bad_request("`q` takes no `order`: a search has its own")),
        (Some(_), None) => return Err(ApiError::bad_request("`order` must be `joined` or `active`")),
    };
    Ok((query, limit))
}

/// `after` as a cursor string `parse` reads.
fn cursor<T>(f: &Fields<'_>, parse: fn(&str) -> Option<T>) -> Result<Option<T>, ApiError> {
    let bad = || ApiError::bad_request("`after` must be the `next` of the previous page");
    f.opt_str("after")?.map(|c| parse(c).ok_or_else(bad)).transpose()
}

/// `applications`: `after` (a `next`, a user id), `limit` ≤ 200.
pub fn parse_applications(f: &Fields<'_>) -> Result<(Option<UserId>, i64), ApiError> {
    let after = f.opt_str("after")?.map(UserId::parse).transpose()?;
    Ok((after, f.int_in("limit", 1, MEMBERS_MAX_LIMIT)?.unwrap_or(MEMBERS_DEFAULT_LIMIT)))
}

/// The result object of a group op or recall (PROTOCOL §5 table), or of a ban.
pub fn written_json(written: &Written) -> Value {
    match written {
        Written::Joined { seq } | Written::Left { seq } | Written::Changed { seq } => json!({ "seq": seq }),
        Written::Invited(Invited { joined, pending, skipped, head }) => {
            json!({"joined": joined, "pending": pending, "skipped": skipped, "head": head})
        }
        Written::Pending => json!({"pending": true}),
        Written::Rejected => json!({}),
        Written::Recalled(ack) | Written::Edited(ack) => json!({"seq": ack.seq, "dup": ack.dup}),
        Written::Reacted { seq } | Written::Status { seq } => json!({"changed": seq.is_some(), "seq": seq}),
        Written::Sent(ack) => json!({ "seq": ack.seq }),
    }
}

pub fn members_json(page: &MemberPage) -> Value {
    let members: Vec<Value> = page
        .members
        .iter()
        .map(|m| {
            json!({
                "user_id": m.user_id,
                "role": m.role.as_str(),
                "alias": m.alias,
                "mute_until": m.mute_until.map(format_time),
                "joined_seq": m.joined_seq,
                "role_until": m.role_until.map(format_time),
                "extra_perms": m.extra_perms,
                "last_active_seq": m.last_active_seq,
            })
        })
        .collect();
    let next = match &page.next {
        Some(MemberNext::Joined(seq)) => json!(seq),
        Some(MemberNext::Cursor(c)) => json!(c),
        None => Value::Null,
    };
    json!({"members": members, "next": next, "member_count": page.member_count})
}

pub fn applications_json(page: &ApplicationPage) -> Value {
    let items: Vec<Value> = page
        .applications
        .iter()
        .map(|a| json!({"user_id": a.user_id, "invited_by": a.invited_by, "created_at": format_time(a.created_at)}))
        .collect();
    json!({"applications": items, "next": page.next})
}

/// HTTP `PATCH /v1/conversations/{conv_id}/members/{user_id}` carries one of
/// `role` (`set_role`), `extra_perms` (`set_perms`), `mute_until`
/// (`mute_member`) or `alias` (`set_alias`, the caller's own): which op it is.
pub fn member_patch_op(fields: &Map<String, Value>) -> Result<&'static str, ApiError> {
    let named: Vec<&'static str> =
        [("role", "set_role"), ("extra_perms", "set_perms"), ("mute_until", "mute_member"), ("alias", "set_alias")]
            .into_iter()
            .filter(|(field, _)| fields.contains_key(*field))
            .map(|(_, op)| op)
            .collect();
    match named.as_slice() {
        [op] => Ok(op),
        _ => Err(ApiError::bad_request("give exactly one of `role`, `extra_perms`, `mute_until` or `alias`")),
    }
}
