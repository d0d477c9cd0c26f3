-- `members` orders (PROTOCOL §5 "members: orders and cursors", ARCHITECTURE §9).
--
-- `last_active_seq`: the seq of the member's last message in this conversation
-- during its current membership (0: none yet). The append sets it once per
-- sender per transaction, in the statement that inserts the messages, without
-- a write of its own per message (and at most once per resolution, below). Its index serves
-- `order=active` (newest first) and that order's cursor.
ALTER TABLE members ADD COLUMN last_active_seq bigint NOT NULL DEFAULT 0 CHECK (last_active_seq >= 0);
-- When `last_active_seq` was last moved: it moves again only once this is
-- `IMCORE_ACTIVITY_RESOLUTION_MS` old, so a steady sender costs a row write
-- per resolution, not per batch.
ALTER TABLE members ADD COLUMN last_active_at timestamptz;
CREATE INDEX members_by_activity ON members (conv_id, last_active_seq, user_id COLLATE "C");

-- `members?q=`: results ordered by the key that matched (user_id, else alias)
-- and user_id, byte-wise. In collation "C" a LIKE prefix is a range of these
-- indexes and that order theirs, so a search of any breadth reads one index
-- range per key and stops at the page's end.
DROP INDEX members_user_prefix;
DROP INDEX members_alias_prefix;
CREATE INDEX members_user_prefix ON members (conv_id, user_id COLLATE "C");
CREATE INDEX members_alias_prefix ON members (conv_id, alias COLLATE "C", user_id COLLATE "C") WHERE alias IS NOT NULL;
