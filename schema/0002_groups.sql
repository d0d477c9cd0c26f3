-- Group management (PROTOCOL §5, ARCHITECTURE §9): temporary admins, extra
-- permission bits, and the indexes of member paging and search.

-- `role_until`: an admin role that ends by itself at that time (judged when
-- a decision is taken, no job). `extra_perms`: bits added to the role's.
ALTER TABLE members
    ADD COLUMN role_until  timestamptz,
    ADD COLUMN extra_perms integer NOT NULL DEFAULT 0 CHECK (extra_perms >= 0),
    ADD CONSTRAINT members_role_until_is_admin CHECK (role_until IS NULL OR role = 'admin');

-- `members?q=`: a prefix of user_id or alias, one index each; `text_pattern_ops`
-- so that `LIKE 'q%'` uses them whatever the database's collation.
CREATE INDEX members_user_prefix ON members (conv_id, user_id text_pattern_ops);
CREATE INDEX members_alias_prefix ON members (conv_id, alias text_pattern_ops) WHERE alias IS NOT NULL;
