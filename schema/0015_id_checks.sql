-- The identifier rule of 0001 (1-64 chars of A-Z a-z 0-9 . _ : @ -), written so
-- that it costs a length and a short regular expression. A bounded repetition
-- (`{1,64}`) compiles to 64 copies of its states, and running it took ~3.6 us
-- per value, on every event's `client_msg_id` and every update of a
-- conversation row: in a 128-row INSERT into `events`, more than the table's
-- other checks together (benches/README.md, "Checks that cost less"). The
-- allowed characters are ASCII, so `length` counts what the repetition counted.
--
-- NOT VALID: every existing row holds the same rule in its old form, and
-- validating would scan the whole log under the table's lock; new and updated
-- rows are checked all the same.
ALTER TABLE users
    DROP CONSTRAINT users_user_id_check,
    ADD CONSTRAINT users_user_id_check
        CHECK (length(user_id) BETWEEN 1 AND 64 AND user_id ~ '^[A-Za-z0-9._:@-]+$') NOT VALID;
ALTER TABLE devices
    DROP CONSTRAINT devices_device_id_check,
    ADD CONSTRAINT devices_device_id_check
        CHECK (length(device_id) BETWEEN 1 AND 64 AND device_id ~ '^[A-Za-z0-9._:@-]+$') NOT VALID;
ALTER TABLE conversations
    DROP CONSTRAINT conversations_conv_id_check,
    ADD CONSTRAINT conversations_conv_id_check
        CHECK (length(conv_id) BETWEEN 1 AND 64 AND conv_id ~ '^[A-Za-z0-9._:@-]+$') NOT VALID;
ALTER TABLE events
    DROP CONSTRAINT events_client_msg_id_check,
    ADD CONSTRAINT events_client_msg_id_check
        CHECK (length(client_msg_id) BETWEEN 1 AND 64 AND client_msg_id ~ '^[A-Za-z0-9._:@-]+$') NOT VALID;
