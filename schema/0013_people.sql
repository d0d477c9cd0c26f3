-- The people picker (PROTOCOL v1.2 `search_users`): a case-insensitive prefix
-- of the user ids the caller shares a conversation with (the caller's
-- conversations by `members_by_user`, then each one's matching members in
-- order from this index: C collation, so `LIKE 'q%'` and `ORDER BY` both use
-- it), and a case-insensitive exact id of any user.
CREATE INDEX members_user_lower_prefix ON members (conv_id, (lower(user_id) COLLATE "C"));
CREATE INDEX users_lower_id ON users (lower(user_id));
