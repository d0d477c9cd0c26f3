-- The CHECKs of the two tables every send writes, `events` (seventeen) and
-- `conversations` (eighteen; its row's `next_seq` moves with each batch), as
-- one CHECK per table calling a PL/pgSQL function. PostgreSQL 15 reads every
-- CHECK of a table back from its stored node text and plans it again at each
-- statement that writes the table (`ExecRelCheck`): ~31 KB for these
-- thirty-five, about half of a lone send's statement. A PL/pgSQL function is
-- compiled once per connection, and the CHECK is one call over the row's
-- columns (benches/README.md, "The rules of a row as one function").
--
-- The rules are those of the constraints dropped here, unchanged, joined by
-- AND: false when one of them is, as a CHECK fails when one of its rules
-- does. A rule that is null for a row that holds it (a form rule on a column
-- the row leaves null) is written coalesce(..., true), so such a row gets
-- true. A `msg` event, the row a send writes, is checked by the same rules
-- simplified for `kind = 'msg'`; every other kind by all of them. A test
-- compares each table's CHECK with the rules it replaced over a corpus of
-- rows (`tests/it/row_rules.rs`).
--
-- NOT VALID, as in 0015: every existing row holds the same rules in their old
-- form, and validating would scan the whole log under the table's lock; new
-- and updated rows are checked all the same.
CREATE FUNCTION event_rules_hold(
    kind text, seq int8, message_id uuid, sender_user text, sender_device text, client_msg_id text,
    request_hash bytea, body text, subject_user text, actor text, reason text, target_seq int8, change text,
    recalled bool, reply_to int8, mentions text[], mention_all bool, edited_at timestamptz, emoji text,
    reaction_on bool)
RETURNS bool LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $rules$
BEGIN
    IF kind = 'msg' THEN
        RETURN seq >= 1
            AND message_id IS NOT NULL AND sender_user IS NOT NULL AND sender_device IS NOT NULL
            AND client_msg_id IS NOT NULL AND length(client_msg_id) BETWEEN 1 AND 64
            AND client_msg_id ~ '^[A-Za-z0-9._:@-]+$'
            AND request_hash IS NOT NULL AND length(request_hash) = 32
            AND (recalled OR body IS NOT NULL)
            AND reason IS NULL
            AND (emoji IS NULL OR reaction_on IS NULL)
            AND coalesce(octet_length(emoji) BETWEEN 1 AND 32, true)
            AND (reply_to IS NULL OR reply_to < seq);
    END IF;
    RETURN seq >= 1
        AND kind IN ('msg', 'recall', 'join', 'leave', 'group', 'edit', 'reaction')
        AND (kind NOT IN ('join', 'leave') OR (subject_user IS NOT NULL AND actor IS NOT NULL))
        AND ((kind = 'leave') = (reason IS NOT NULL))
        AND (kind <> 'recall' OR (sender_user IS NOT NULL AND target_seq IS NOT NULL AND target_seq < seq))
        AND coalesce(length(client_msg_id) BETWEEN 1 AND 64 AND client_msg_id ~ '^[A-Za-z0-9._:@-]+$', true)
        AND (kind <> 'edit' OR (sender_user IS NOT NULL AND sender_device IS NOT NULL AND client_msg_id IS NOT NULL
                                AND request_hash IS NOT NULL AND target_seq IS NOT NULL AND target_seq < seq))
        AND coalesce(octet_length(emoji) BETWEEN 1 AND 32, true)
        AND (kind <> 'group' OR (change IS NOT NULL
                                 AND (actor IS NOT NULL OR change IN ('{"status":"banned"}', '{"status":"active"}'))))
        AND (reply_to IS NULL AND mentions IS NULL AND mention_all IS NULL AND edited_at IS NULL)
        AND ((kind = 'reaction') = (emoji IS NOT NULL AND reaction_on IS NOT NULL))
        AND (kind <> 'reaction' OR (sender_user IS NOT NULL AND target_seq IS NOT NULL AND target_seq < seq))
        AND coalesce(reason IN ('left', 'kicked', 'dismissed'), true)
        AND NOT recalled
        AND (reply_to IS NULL OR reply_to < seq)
        AND coalesce(length(request_hash) = 32, true)
        AND (kind = 'edit' OR client_msg_id IS NULL);
END
$rules$;

ALTER TABLE events
    DROP CONSTRAINT events_check,
    DROP CONSTRAINT events_check2,
    DROP CONSTRAINT events_check3,
    DROP CONSTRAINT events_check4,
    DROP CONSTRAINT events_client_msg_id_check,
    DROP CONSTRAINT events_edit,
    DROP CONSTRAINT events_emoji_check,
    DROP CONSTRAINT events_group,
    DROP CONSTRAINT events_kind_check,
    DROP CONSTRAINT events_msg_fields,
    DROP CONSTRAINT events_reaction,
    DROP CONSTRAINT events_reason_check,
    DROP CONSTRAINT events_recalled_msg,
    DROP CONSTRAINT events_reply_before,
    DROP CONSTRAINT events_request_hash_check,
    DROP CONSTRAINT events_request_key_kinds,
    DROP CONSTRAINT events_seq_check,
    ADD CONSTRAINT events_rules CHECK (event_rules_hold(
        kind, seq, message_id, sender_user, sender_device, client_msg_id, request_hash, body, subject_user, actor,
        reason, target_seq, change, recalled, reply_to, mentions, mention_all, edited_at, emoji, reaction_on)) NOT VALID;

CREATE FUNCTION conversation_rules_hold(
    conv_id text, kind text, delivery_mode text, delivery_setting text, name text, owner text, join_mode text,
    max_member int4, status text, recall_window_ms int8, edit_window_ms int8, retention_ms int8, epoch int4,
    min_seq int8, next_seq int8, member_version int8, member_count int4)
RETURNS bool LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $rules$
BEGIN
    RETURN min_seq >= 1 AND next_seq >= 1 AND min_seq <= next_seq
        AND kind IN ('direct', 'group')
        AND (kind = 'group' OR (owner IS NULL AND name IS NULL))
        AND length(conv_id) BETWEEN 1 AND 64 AND conv_id ~ '^[A-Za-z0-9._:@-]+$'
        AND delivery_mode IN ('push', 'pull')
        AND delivery_setting IN ('auto', 'push', 'pull')
        AND join_mode IN ('invite', 'approval', 'free')
        AND status IN ('active', 'dismissed', 'banned')
        AND max_member BETWEEN 1 AND 1000000
        AND member_count >= 0 AND member_version >= 0 AND epoch >= 1
        AND recall_window_ms >= 0 AND edit_window_ms >= 0
        AND (retention_ms IS NULL OR retention_ms > 0)
        AND coalesce(length(name) <= 128, true);
END
$rules$;

ALTER TABLE conversations
    DROP CONSTRAINT conversations_check,
    DROP CONSTRAINT conversations_check1,
    DROP CONSTRAINT conversations_conv_id_check,
    DROP CONSTRAINT conversations_delivery_mode_check,
    DROP CONSTRAINT conversations_delivery_setting_check,
    DROP CONSTRAINT conversations_edit_window_ms_check,
    DROP CONSTRAINT conversations_epoch_check,
    DROP CONSTRAINT conversations_join_mode_check,
    DROP CONSTRAINT conversations_kind_check,
    DROP CONSTRAINT conversations_max_member_check,
    DROP CONSTRAINT conversations_member_count_check,
    DROP CONSTRAINT conversations_member_version_check,
    DROP CONSTRAINT conversations_min_seq_check,
    DROP CONSTRAINT conversations_name_check,
    DROP CONSTRAINT conversations_next_seq_check,
    DROP CONSTRAINT conversations_recall_window_ms_check,
    DROP CONSTRAINT conversations_retention_ms_check,
    DROP CONSTRAINT conversations_status_check,
    ADD CONSTRAINT conversations_rules CHECK (conversation_rules_hold(
        conv_id, kind, delivery_mode, delivery_setting, name, owner, join_mode, max_member, status, recall_window_ms,
        edit_window_ms, retention_ms, epoch, min_seq, next_seq, member_version, member_count)) NOT VALID;
