//! The people picker (PROTOCOL v1.2 `search_users`): whom a caller may find.
//! Invariant: a prefix only ever matches users who share an active
//! conversation with the caller; any other user is found by its exact id
//! only, so the user table cannot be listed by prefix (ARCHITECTURE §9).

use imcore_actors::UserId;
use tokio_postgres::types::{ToSql, Type};

use super::error::decoded;
use super::{Store, StoreError};

/// `$1` the caller, `$2` a lowercase LIKE prefix pattern, `$3` the typed
/// text (an exact id, any case), `$4` rows. Each of the caller's
/// conversations gives at most `$4` matches, in order, from
/// `members_user_lower_prefix`; the exact id comes from `users_lower_id`.
pub const SEARCH_USERS: &str = r#"
SELECT u.user_id, u.display_name FROM (
  SELECT user_id FROM users WHERE lower(user_id) = lower($3)
  UNION
  SELECT b.user_id FROM members a
    JOIN conversations c ON c.conv_id = a.conv_id AND c.status = 'active'
    CROSS JOIN LATERAL (
      SELECT m.user_id FROM members m
       WHERE m.conv_id = a.conv_id AND lower(m.user_id) COLLATE "C" LIKE $2 AND m.user_id <> $1
       ORDER BY lower(m.user_id) COLLATE "C" LIMIT $4) b
   WHERE a.user_id = $1
) found JOIN users u ON u.user_id = found.user_id
 WHERE u.user_id <> $1
 ORDER BY lower(u.user_id) = lower($3) DESC, lower(u.user_id) COLLATE "C", u.user_id
 LIMIT $4"#;

/// One user a search found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FoundUser {
    pub user_id: UserId,
    pub display_name: Option<String>,
}

impl Store {
    /// Users whose id starts with `prefix` (any case) among those sharing an
    /// active conversation with `caller`, and the user whose id is `prefix`
    /// (any case) first; never the caller; at most `limit`.
    pub async fn search_users(&self, caller: &UserId, prefix: &str, limit: i64) -> Result<Vec<FoundUser>, StoreError> {
        let c = self.pool.get().await?;
        let pattern = format!("{}%", escape_like(&prefix.to_lowercase()));
        let params: [(&(dyn ToSql + Sync), Type); 4] =
            [(&caller.as_str(), Type::TEXT), (&pattern, Type::TEXT), (&prefix, Type::TEXT), (&limit, Type::INT8)];
        let rows = c.query_prepared(SEARCH_USERS, &params).await?;
        rows.iter()
            .map(|r| Ok(FoundUser { user_id: decoded(UserId::parse(r.get(0)), "user_id")?, display_name: r.get(1) }))
            .collect()
    }
}

/// `q` as the literal start of a LIKE pattern (its `%`, `_` and `\` escaped).
fn escape_like(q: &str) -> String {
    let mut out = String::with_capacity(q.len());
    for ch in q.chars() {
        if matches!(ch, '%' | '_' | '\\') {
            out.push('\\');
        }
        out.push(ch);
    }
    out
}
