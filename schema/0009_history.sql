-- History beyond messages (PROTOCOL v1.2; ARCHITECTURE §2): edits, reactions,
-- replies and mentions. Each is an event of the gapless log; what a message
-- shows now (its latest body, its reaction counts) is kept beside it, written
-- in the same transaction, so no read sums events.

-- `edit_window_ms`: how long after a message its sender may edit it.
ALTER TABLE conversations
    ADD COLUMN edit_window_ms bigint NOT NULL DEFAULT 86400000 CHECK (edit_window_ms >= 0);

-- `reply_to`, `mentions`, `mention_all`: of a `msg`. `edited_at`: the time of
-- the latest `edit` of a `msg`, whose `body` that edit set. An `edit` carries
-- its request key, its `target_seq` and the new `body` (erased with its target
-- by a recall); a `reaction` its `target_seq`, `emoji` and `reaction_on`.
ALTER TABLE events
    ADD COLUMN reply_to    bigint,
    ADD COLUMN mentions    text[],
    ADD COLUMN mention_all boolean,
    ADD COLUMN edited_at   timestamptz,
    ADD COLUMN emoji       text CHECK (octet_length(emoji) BETWEEN 1 AND 32),
    ADD COLUMN reaction_on boolean,
    DROP CONSTRAINT events_kind_check,
    ADD CONSTRAINT events_kind_check CHECK (kind IN ('msg', 'recall', 'join', 'leave', 'group', 'edit', 'reaction')),
    -- Was: kind = 'msg' OR (client_msg_id IS NULL AND NOT recalled).
    DROP CONSTRAINT events_check1,
    ADD CONSTRAINT events_request_key_kinds CHECK (kind IN ('msg', 'edit') OR client_msg_id IS NULL),
    ADD CONSTRAINT events_recalled_msg CHECK (kind = 'msg' OR NOT recalled),
    ADD CONSTRAINT events_msg_fields CHECK (kind = 'msg' OR (reply_to IS NULL AND mentions IS NULL
                                                            AND mention_all IS NULL AND edited_at IS NULL)),
    ADD CONSTRAINT events_reply_before CHECK (reply_to IS NULL OR reply_to < seq),
    ADD CONSTRAINT events_edit CHECK (kind <> 'edit' OR (sender_user IS NOT NULL AND sender_device IS NOT NULL
                                                        AND client_msg_id IS NOT NULL AND request_hash IS NOT NULL
                                                        AND target_seq IS NOT NULL AND target_seq < seq)),
    ADD CONSTRAINT events_reaction CHECK ((kind = 'reaction') = (emoji IS NOT NULL AND reaction_on IS NOT NULL)
                                          AND (kind <> 'reaction' OR (sender_user IS NOT NULL
                                                                      AND target_seq IS NOT NULL
                                                                      AND target_seq < seq)));

-- The edits of a target, which its recall erases.
CREATE INDEX events_edit_target ON events (conv_id, target_seq) WHERE kind = 'edit';

-- Who has which emoji on which message now: the set the `reaction` events
-- built (turning on what is on appends nothing). `seq`: the event that set it.
CREATE TABLE reactions (
    conv_id    text NOT NULL,
    target_seq bigint NOT NULL,
    user_id    text NOT NULL,
    emoji      text NOT NULL,
    seq        bigint NOT NULL,
    PRIMARY KEY (conv_id, target_seq, user_id, emoji)
);

-- Per message and emoji, how many users have it on (rows at 0 stay: an upsert
-- cannot delete), and the seq of its first reaction, which orders the list.
-- No CHECK on `count`: an upsert checks the row it would insert (a batch's
-- change, -1 for a removal) before it meets the row it updates; a batch
-- removes only reactions it read as on, under the conversation's row lock.
CREATE TABLE reaction_counts (
    conv_id    text NOT NULL,
    target_seq bigint NOT NULL,
    emoji      text NOT NULL,
    count      integer NOT NULL,
    first_seq  bigint NOT NULL,
    PRIMARY KEY (conv_id, target_seq, emoji)
);
