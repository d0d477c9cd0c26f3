//! Reading a group's roster and its pending applications, a page at a time
//! (PROTOCOL §5 `members`, `applications`). There is no call that returns
//! every member: a 100,000-member group is paged or searched.
//!
//! Each of the three orders is an index range scan that stops at the page's
//! end, its cursor the key of that index: join order (`joined_seq`), activity
//! (`last_active_seq`, `user_id`), a search (the matched key, `user_id`). A
//! member who keeps its place is returned once per paging; a send moves it
//! only forward (past an `active` cursor).

use chrono::{DateTime, Utc};
use imcore_actors::{ConvId, UserId};
use tokio_postgres::types::{ToSql, Type};

use super::error::decoded;
use super::{Store, StoreError};
use crate::domain::{Rejection, Role};

pub const MEMBERS_DEFAULT_LIMIT: i64 = 50;
pub const MEMBERS_MAX_LIMIT: i64 = 200;
/// Longest search key in a cursor: an alias (`members.alias`, ≤ 64 characters).
const MAX_CURSOR_KEY_CHARS: usize = 64;

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
    /// The seq of its last message during this membership; 0: none.
    pub last_active_seq: i64,
}

/// Which members a page holds, in which order, and where it starts.
#[derive(Debug, Clone, PartialEq)]
pub enum MemberQuery {
    /// Join order, after this `joined_seq` (0: from the start).
    Joined { after: i64 },
    /// Newest `last_active_seq` first, then `user_id` descending; after this pair.
    Active { after: Option<(i64, UserId)> },
    /// `q` a prefix of `user_id` or `alias`, by (the key that matched, `user_id`), byte-wise.
    Search { q: String, after: Option<(String, UserId)> },
}

/// `next` of a page: a `joined_seq` in join order, else a cursor string.
#[derive(Debug, Clone, PartialEq)]
pub enum MemberNext {
    Joined(i64),
    Cursor(String),
}

#[derive(Debug, Clone, PartialEq)]
pub struct MemberPage {
    pub members: Vec<MemberInfo>,
    /// `after` for the next page; `None` at the end.
    pub next: Option<MemberNext>,
    pub member_count: i32,
}

/// Longest cursor string accepted (hex of an id, a separator and a key).
const MAX_CURSOR_CHARS: usize = 1024;
/// `~` separates a cursor's parts: not an id character.
const CURSOR_SEP: char = '~';

/// A cursor is opaque to clients: hex of its parts, so any alias in it
/// travels in a URL as it is.
fn decode(cursor: &str) -> Option<String> {
    (cursor.len() <= MAX_CURSOR_CHARS).then(|| String::from_utf8(hex::decode(cursor).ok()?).ok())?
}

impl MemberQuery {
    /// An `order=active` cursor (`next`) as the pair it stands for.
    pub fn active_after(cursor: &str) -> Option<(i64, UserId)> {
        let raw = decode(cursor)?;
        let (seq, user) = raw.split_once(CURSOR_SEP)?;
        let seq = seq.parse().ok().filter(|s| *s >= 0)?;
        Some((seq, UserId::parse(user).ok()?))
    }

    /// A search cursor (`next`) as the pair it stands for.
    pub fn search_after(cursor: &str) -> Option<(String, UserId)> {
        let raw = decode(cursor)?;
        let (user, key) = raw.split_once(CURSOR_SEP)?;
        let key_ok = key.chars().count() <= MAX_CURSOR_KEY_CHARS && !key.chars().any(char::is_control);
        key_ok.then(|| Some((key.to_owned(), UserId::parse(user).ok()?))).flatten()
    }
}

fn active_cursor(m: &MemberInfo) -> String {
    hex::encode(format!("{}{CURSOR_SEP}{}", m.last_active_seq, m.user_id))
}

fn search_cursor(key: &str, m: &MemberInfo) -> String {
    hex::encode(format!("{}{CURSOR_SEP}{key}", m.user_id))
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

/// The columns of a member, in `MemberInfo`'s order.
macro_rules! member_columns {
    () => {
        "user_id, CASE WHEN role = 'admin' AND role_until <= now() THEN 'member' ELSE role END,
       CASE WHEN role_until > now() THEN role_until END, extra_perms, alias, mute_until, joined_seq,
       last_active_seq"
    };
}

/// A page in join order: `$1` conversation, `$2` after this `joined_seq`, `$3` rows.
pub const MEMBERS_PAGE: &str = concat!(
    "SELECT ",
    member_columns!(),
    " FROM members WHERE conv_id = $1 AND joined_seq > $2 ORDER BY joined_seq LIMIT $3"
);

/// A page by activity, newest first: `$1` conversation, after the pair
/// (`$2` seq, `$3` user id), `$4` rows; one backward scan of `members_by_activity`.
pub const MEMBERS_ACTIVE: &str = concat!(
    "SELECT ",
    member_columns!(),
    " FROM members WHERE conv_id = $1 AND (last_active_seq, user_id COLLATE \"C\") < ($2, $3)
 ORDER BY last_active_seq DESC, user_id COLLATE \"C\" DESC LIMIT $4"
);

/// A page of a search: `$1` conversation, `$2` the prefix and `$3` the first
/// string past every key it starts ([`past_prefix`]), after the pair (`$4`
/// key, `$5` user id), `$6` rows. One range of each prefix index, each in the
/// page's order: members whose `user_id` matches (key `user_id`), then those
/// matched by `alias` alone (key `alias`), merged. Plain "C" comparisons, not
/// LIKE: LIKE lets the planner take `members_by_user` where the database's
/// collation is C and sort every match of a broad prefix.
pub const MEMBERS_SEARCH: &str = concat!(
    "SELECT * FROM ((SELECT ",
    member_columns!(),
    ", user_id AS key FROM members
  WHERE conv_id = $1 AND user_id COLLATE \"C\" >= $2 AND user_id COLLATE \"C\" < $3
    AND user_id COLLATE \"C\" >= $4 AND (user_id COLLATE \"C\" > $4 OR user_id COLLATE \"C\" > $5)
  ORDER BY user_id COLLATE \"C\" LIMIT $6)
UNION ALL
(SELECT ",
    member_columns!(),
    ", alias AS key FROM members
  WHERE conv_id = $1 AND alias COLLATE \"C\" >= $2 AND alias COLLATE \"C\" < $3 AND NOT starts_with(user_id, $2)
    AND (alias COLLATE \"C\", user_id COLLATE \"C\") > ($4, $5)
  ORDER BY alias COLLATE \"C\", user_id COLLATE \"C\" LIMIT $6)) AS found
 ORDER BY key COLLATE \"C\", user_id COLLATE \"C\" LIMIT $6"
);

const APPLICATIONS: &str = "
SELECT user_id, requested_by, created_at FROM group_applications
 WHERE conv_id = $1 AND user_id > $2 ORDER BY user_id LIMIT $3";

impl Store {
    /// A page of the roster of `conv` for a current member.
    pub async fn members(
        &self,
        conv: &ConvId,
        caller: &UserId,
        query: &MemberQuery,
        limit: i64,
    ) -> Result<MemberPage, StoreError> {
        let c = self.pool.get().await?;
        let (_, member_count) = caller_role(&**c, conv, caller).await?;
        let rows = limit + 1;
        let conv = conv.as_str();
        let rows = match query {
            MemberQuery::Joined { after } => {
                let params: [(&(dyn ToSql + Sync), Type); 3] =
                    [(&conv, Type::TEXT), (after, Type::INT8), (&rows, Type::INT8)];
                c.query_prepared(MEMBERS_PAGE, &params).await?
            }
            MemberQuery::Active { after } => {
                let (seq, user) = after.as_ref().map_or((i64::MAX, ""), |(s, u)| (*s, u.as_str()));
                let params: [(&(dyn ToSql + Sync), Type); 4] =
                    [(&conv, Type::TEXT), (&seq, Type::INT8), (&user, Type::TEXT), (&rows, Type::INT8)];
                c.query_prepared(MEMBERS_ACTIVE, &params).await?
            }
            MemberQuery::Search { q, after } => {
                let past = past_prefix(q);
                let (key, user) = after.as_ref().map_or(("", ""), |(k, u)| (k.as_str(), u.as_str()));
                let params: [(&(dyn ToSql + Sync), Type); 6] = [
                    (&conv, Type::TEXT),
                    (q, Type::TEXT),
                    (&past, Type::TEXT),
                    (&key, Type::TEXT),
                    (&user, Type::TEXT),
                    (&rows, Type::INT8),
                ];
                c.query_prepared(MEMBERS_SEARCH, &params).await?
            }
        };
        let mut members = vec![];
        let mut keys = vec![];
        for r in &rows {
            members.push(MemberInfo {
                user_id: decoded(UserId::parse(r.get(0)), "user_id")?,
                role: decoded(r.get::<_, &str>(1).parse(), "role")?,
                role_until: r.get(2),
                extra_perms: r.get::<_, i32>(3).max(0) as u32,
                alias: r.get(4),
                mute_until: r.get(5),
                joined_seq: r.get(6),
                last_active_seq: r.get(7),
            });
            if matches!(query, MemberQuery::Search { .. }) {
                keys.push(r.get::<_, Option<String>>(8).unwrap_or_default());
            }
        }
        let more = members.len() as i64 > limit;
        members.truncate(limit as usize);
        keys.truncate(limit as usize);
        let next = members.last().filter(|_| more).map(|m| match query {
            MemberQuery::Joined { .. } => MemberNext::Joined(m.joined_seq),
            MemberQuery::Active { .. } => MemberNext::Cursor(active_cursor(m)),
            MemberQuery::Search { .. } => MemberNext::Cursor(search_cursor(keys.last().map_or("", String::as_str), m)),
        });
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
            .query_prepared(
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

/// The least string greater than every key that starts with `q`, byte-wise
/// (= code point order in UTF-8): `q` with its last character moved on one
/// code point, after dropping trailing U+10FFFF. A `q` of U+10FFFF only has
/// none; then `q` and 64 more of it, past every key (at most 64 characters).
pub fn past_prefix(q: &str) -> String {
    let mut chars: Vec<char> = q.chars().collect();
    while let Some(last) = chars.pop() {
        let next = (last as u32 + 1..=char::MAX as u32).find_map(char::from_u32);
        if let Some(next) = next {
            chars.push(next);
            return chars.into_iter().collect();
        }
    }
    format!("{q}{}", char::MAX.to_string().repeat(MAX_CURSOR_KEY_CHARS))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_their_position_and_refuse_anything_else() {
        let m = |user: &str, seq: i64| MemberInfo {
            user_id: UserId::parse(user).expect("id"),
            role: Role::Member,
            role_until: None,
            extra_perms: 0,
            alias: None,
            mute_until: None,
            joined_seq: 1,
            last_active_seq: seq,
        };
        let who = m("u:a.b", 42);
        assert_eq!(MemberQuery::active_after(&active_cursor(&who)), Some((42, who.user_id.clone())));
        let key = "Zoë ~ 🐈 & ?";
        assert_eq!(MemberQuery::search_after(&search_cursor(key, &who)), Some((key.to_owned(), who.user_id.clone())));
        let long_key = "k".repeat(MAX_CURSOR_KEY_CHARS + 1);
        for bad in [
            "",
            "zz",
            "u-a",
            &hex::encode("-1~u-a"),
            &hex::encode("x~u-a"),
            &hex::encode("7~bad id"),
            &hex::encode("7"),
            &"ab".repeat(MAX_CURSOR_CHARS),
        ] {
            assert_eq!(MemberQuery::active_after(bad), None, "{bad}");
        }
        for bad in ["", "zz", &hex::encode("u-a"), &hex::encode(format!("u-a~{long_key}")), &hex::encode("u-a~a\nb")] {
            assert_eq!(MemberQuery::search_after(bad), None, "{bad}");
        }
    }

    #[test]
    fn past_a_prefix_comes_right_after_every_string_that_starts_with_it() {
        assert_eq!(past_prefix("u-big-09"), "u-big-0:");
        assert_eq!(past_prefix("a%_"), "a%`", "no pattern characters: every character is literal");
        assert_eq!(past_prefix("z\u{d7ff}"), "z\u{e000}", "surrogates skipped");
        assert_eq!(past_prefix("b\u{10ffff}"), "c");
        let past = past_prefix("\u{10ffff}");
        for key in ["\u{10ffff}", "\u{10ffff}x", &"\u{10ffff}".repeat(MAX_CURSOR_KEY_CHARS)] {
            assert!(key < past.as_str() && key.starts_with('\u{10ffff}'));
        }
        for (q, inside, outside) in [("Zo", "Zoë 🐈", "Zp"), ("é", "éa", "ê"), ("🐈", "🐈🐈", "🐉")] {
            let past = past_prefix(q);
            assert!(q <= inside && inside < past.as_str(), "{q}: {inside}");
            assert!(outside >= past.as_str(), "{q}: {outside}");
        }
    }
}
