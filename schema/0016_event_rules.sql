-- The seventeen CHECKs of `events` (0001-0015) as one CHECK calling a PL/pgSQL
-- function. PostgreSQL 15 reads every CHECK of a table back from its stored
-- node text and plans it again at each statement that writes the table
-- (`ExecRelCheck`): ~20 KB for these seventeen, about half of a lone send's
-- statement. A PL/pgSQL function is compiled once per connection; the CHECK
-- that calls it is a short text (benches/README.md, "The events rules as one
-- function").
--
-- The rules are those of the constraints dropped here, unchanged. A CHECK
-- fails only on false, so a rule that is null for a row (a form rule on a
-- column the row leaves null) passes, as it did on its own: those four are
-- wrapped in coalesce(..., true). A `msg` row, the one a send writes, is
-- checked by the same rules simplified for `kind = 'msg'`; every other kind
-- by all of them. A test compares the function with the seventeen rules over
-- a corpus of rows (`events-rules-function-is-the-seventeen-rules`).
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
