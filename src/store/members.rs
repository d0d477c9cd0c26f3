//! Reading a group's roster and its pending applications, a page at a time
//! (PROTOCOL §5 `members`, `applications`). There is no call that returns
//! every member: a 100,000-member group is paged or searched.
//!
//! Members come in join order (`joined_seq`, unique per conversation), so an
//! `after` cursor is stable while others join (they come later) and leave
//! (they drop out): no member is returned twice or skipped. A search is a
//! prefix of `user_id` or `alias`, served by one index each.

use chrono::{DateTime, Utc};
use imcore_actors::{ConvId, UserId};
use tokio_postgres::types::Type;

use super::error::decoded;
use super::{Store, StoreError};
use crate::domain::{Rejection, Role};

pub const MEMBERS_DEFAULT_LIMIT: i64 = 50;
pub const MEMBERS_MAX_LIMIT: i64 = 200;

#[derive(Debug, Clone, PartialEq)]
pub struct MemberInfo {
    pub user_id: UserId,
    /// The role at the time of reading: a temporary admin past its `until` reads as `member`.
    pub role: Role,
    pub role_until: Option<DateTime<Utc>>,
    pub extra_perms: u32,
    pub alias: Option<String>,
    pub mute_until: Option<DateTime<Utc>>,
    pub joined_seq: i64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct MemberPage {
    pub members: Vec<MemberInfo>,
    /// `after` for the next page; `None` at the end.
    pub next: Option<i64>,
    pub member_count: i32,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Application {
    pub user_id: UserId,
    pub invited_by: UserId,
    pub created_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ApplicationPage {
    pub applications: Vec<Application>,
    /// `after` for the next page (a user id); `None` at the end.
    pub next: Option<UserId>,
}

/// The caller's role at `now()` if it is a current member, and the group's
/// member count. Nothing for a non-member or an unknown conversation.
const CALLER: &str = "
SELECT CASE WHEN m.role = 'admin' AND m.role_until <= now() THEN 'member' ELSE m.role END, c.member_count
  FROM conversations c JOIN members m ON m.conv_id = c.conv_id AND m.user_id = $2
 WHERE c.conv_id = $1";

/// A page of the roster: `$1` conversation, `$2` after this `joined_seq`,
/// `$3` a LIKE prefix pattern or NULL for every member, `$4` rows. The two
/// prefix conditions are OR-ed so each can use its own index.
pub const MEMBERS_PAGE: &str = "
SELECT user_id, CASE WHEN role = 'admin' AND role_until <= now() THEN 'member' ELSE role END,
       CASE WHEN role_until > now() THEN role_until END, extra_perms, alias, mute_until, joined_seq
  FROM members
 WHERE conv_id = $1 AND joined_seq > $2
   AND ($3::text IS NULL OR user_id LIKE $3 OR alias LIKE $3)
 ORDER BY joined_seq
 LIMIT $4";

const APPLICATIONS: &str = "
SELECT user_id, requested_by, created_at FROM group_applications
 WHERE conv_id = $1 AND user_id > $2 ORDER BY user_id LIMIT $3";

impl Store {
    /// A page of the roster of `conv` for a current member; `q` a prefix of
    /// user id or alias.
    pub async fn members(
        &self,
        conv: &ConvId,
        caller: &UserId,
        after: i64,
        limit: i64,
        q: Option<&str>,
    ) -> Result<MemberPage, StoreError> {
        let c = self.pool.get().await?;
        let (_, member_count) = caller_role(&**c, conv, caller).await?;
        let pattern = q.map(|q| format!("{}%", escape_like(q)));
        let rows = c
            .query_typed(
                MEMBERS_PAGE,
                &[
                    (&conv.as_str(), Type::TEXT),
                    (&after, Type::INT8),
                    (&pattern, Type::TEXT),
                    (&(limit + 1), Type::INT8),
                ],
            )
            .await?;
        let mut members: Vec<MemberInfo> = rows
            .iter()
            .map(|r| {
                Ok(MemberInfo {
                    user_id: decoded(UserId::parse(r.get(0)), "user_id")?,
                    role: decoded(r.get::<_, &str>(1).parse(), "role")?,
                    role_until: r.get(2),
                    extra_perms: r.get::<_, i32>(3).max(0) as u32,
                    alias: r.get(4),
                    mute_until: r.get(5),
                    joined_seq: r.get(6),
                })
            })
            .collect::<Result<_, StoreError>>()?;
        let more = members.len() as i64 > limit;
        members.truncate(limit as usize);
        let next = if more { members.last().map(|m| m.joined_seq) } else { None };
        Ok(MemberPage { members, next, member_count })
    }

    /// A page of the pending applications of `conv`, for its owner and admins.
    pub async fn applications(
        &self,
        conv: &ConvId,
        caller: &UserId,
        after: Option<&UserId>,
        limit: i64,
    ) -> Result<ApplicationPage, StoreError> {
        let c = self.pool.get().await?;
        let (role, _) = caller_role(&**c, conv, caller).await?;
        if role == Role::Member {
            return Err(Rejection::Forbidden("only the owner and admins see applications".into()).into());
        }
        let after = after.map_or("", UserId::as_str);
        let rows = c
            .query_typed(
                APPLICATIONS,
                &[(&conv.as_str(), Type::TEXT), (&after, Type::TEXT), (&(limit + 1), Type::INT8)],
            )
            .await?;
        let mut applications: Vec<Application> = rows
            .iter()
            .map(|r| {
                Ok(Application {
                    user_id: decoded(UserId::parse(r.get(0)), "user_id")?,
                    invited_by: decoded(UserId::parse(r.get(1)), "user_id")?,
                    created_at: r.get(2),
                })
            })
            .collect::<Result<_, StoreError>>()?;
        let more = applications.len() as i64 > limit;
        applications.truncate(limit as usize);
        let next = if more { applications.last().map(|a| a.user_id.clone()) } else { None };
        Ok(ApplicationPage { applications, next })
    }
}

async fn caller_role(
    c: &impl tokio_postgres::GenericClient,
    conv: &ConvId,
    caller: &UserId,
) -> Result<(Role, i32), StoreError> {
    let row = c
        .query_typed_opt(CALLER, &[(&conv.as_str(), Type::TEXT), (&caller.as_str(), Type::TEXT)])
        .await?
        .ok_or(Rejection::NotMember)?;
    Ok((decoded(row.get::<_, &str>(0).parse(), "role")?, row.get(1)))
}

/// `q` as the literal start of a LIKE pattern (its `%`, `_` and `\` escaped).
pub(super) fn escape_like(q: &str) -> String {
    let mut out = String::with_capacity(q.len());
    for ch in q.chars() {
        if matches!(ch, '%' | '_' | '\\') {
            out.push('\\');
        }
        out.push(ch);
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_search_is_a_literal_prefix() {
        assert_eq!(super::escape_like("a_b%c\\"), "a\\_b\\%c\\\\");
    }
}
