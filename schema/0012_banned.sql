-- Banned groups (PROTOCOL "Banned groups"): a third status, set and lifted by
-- the operator, and the `group` event that records each change, whose actor is
-- the operator, not a user (NULL).
ALTER TABLE conversations
    DROP CONSTRAINT conversations_status_check,
    ADD CONSTRAINT conversations_status_check CHECK (status IN ('active', 'dismissed', 'banned'));

-- Replaces `CHECK (kind <> 'group' OR (actor IS NOT NULL AND change IS NOT NULL))`.
-- NOT VALID: every existing row holds the stricter check it replaces, and
-- validating would scan the whole log under the table's lock; new rows are
-- checked all the same.
ALTER TABLE events
    DROP CONSTRAINT events_check5,
    ADD CONSTRAINT events_group CHECK (kind <> 'group' OR (change IS NOT NULL AND (actor IS NOT NULL
        OR change IN ('{"status":"banned"}', '{"status":"active"}')))) NOT VALID;
