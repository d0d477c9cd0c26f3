-- imcore core data model (ARCHITECTURE §2: tables, invariants P1–P9 and what enforces each; §9: groups).
-- Identifiers have the form of PROTOCOL §1 (1–64 chars of A-Z a-z 0-9 . _ : @ -),
-- checked where they are born (users, devices, conversations, client_msg_id);
-- everything else references those rows.

CREATE TABLE users (
    user_id      text PRIMARY KEY CHECK (user_id ~ '^[A-Za-z0-9._:@-]{1,64}$'),
    display_name text CHECK (length(display_name) <= 128),
    created_at   timestamptz NOT NULL DEFAULT now()
);

-- One bearer token per device, stored as SHA-256; issuing again rotates it.
CREATE TABLE devices (
    user_id    text NOT NULL REFERENCES users,
    device_id  text NOT NULL CHECK (device_id ~ '^[A-Za-z0-9._:@-]{1,64}$'),
    token_hash bytea NOT NULL UNIQUE CHECK (length(token_hash) = 32),
    created_at timestamptz NOT NULL DEFAULT now(),
    rotated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (user_id, device_id)
);

-- head = next_seq - 1. Rows are never deleted (dismiss is a status), which is why
-- events carry no foreign key to this table: every event is inserted while this
-- row is locked (FOR NO KEY UPDATE) by the inserting transaction.
CREATE TABLE conversations (
    conv_id          text PRIMARY KEY CHECK (conv_id ~ '^[A-Za-z0-9._:@-]{1,64}$'),
    kind             text NOT NULL CHECK (kind IN ('direct', 'group')),
    delivery_mode    text NOT NULL DEFAULT 'push' CHECK (delivery_mode IN ('push', 'pull')),
    name             text CHECK (length(name) <= 128),
    owner            text REFERENCES users,
    join_mode        text NOT NULL DEFAULT 'invite' CHECK (join_mode IN ('invite', 'approval', 'free')),
    max_member       integer NOT NULL DEFAULT 500 CHECK (max_member BETWEEN 1 AND 1000000),
    mute_all         boolean NOT NULL DEFAULT false,
    status           text NOT NULL DEFAULT 'active' CHECK (status IN ('active', 'dismissed')),
    recall_window_ms bigint NOT NULL DEFAULT 120000 CHECK (recall_window_ms >= 0),
    retention_ms     bigint CHECK (retention_ms IS NULL OR retention_ms > 0),
    epoch            integer NOT NULL DEFAULT 1 CHECK (epoch >= 1),
    min_seq          bigint NOT NULL DEFAULT 1 CHECK (min_seq >= 1),
    next_seq         bigint NOT NULL DEFAULT 1 CHECK (next_seq >= 1),
    -- Bumped by every membership or role/mute change; conversation actors cache
    -- membership keyed by it and revalidate under the row lock.
    member_version   bigint NOT NULL DEFAULT 0 CHECK (member_version >= 0),
    member_count     integer NOT NULL DEFAULT 0 CHECK (member_count >= 0),
    created_at       timestamptz NOT NULL DEFAULT now(),
    last_event_at    timestamptz NOT NULL DEFAULT now(),
    CHECK (min_seq <= next_seq),
    CHECK (kind = 'group' OR (owner IS NULL AND name IS NULL))
);

-- The only truth of who could see what (P3, P4): [from_seq, to_seq], to_seq NULL = open.
CREATE EXTENSION IF NOT EXISTS btree_gist;
CREATE TABLE membership_periods (
    conv_id  text NOT NULL REFERENCES conversations,
    user_id  text NOT NULL REFERENCES users,
    from_seq bigint NOT NULL CHECK (from_seq >= 1),
    to_seq   bigint,
    PRIMARY KEY (conv_id, user_id, from_seq),
    CHECK (to_seq IS NULL OR to_seq >= from_seq),
    -- P3 in the database itself: periods of one user never overlap.
    CONSTRAINT membership_periods_no_overlap EXCLUDE USING gist (
        conv_id WITH =, user_id WITH =, int8range(from_seq, to_seq, '[]') WITH &&)
);
-- P3: at most one open period per user and conversation.
CREATE UNIQUE INDEX membership_periods_one_open ON membership_periods (conv_id, user_id) WHERE to_seq IS NULL;

-- Attributes of current members, written with the period that opens or closes.
CREATE TABLE members (
    conv_id    text NOT NULL,
    user_id    text NOT NULL,
    role       text NOT NULL DEFAULT 'member' CHECK (role IN ('owner', 'admin', 'member')),
    alias      text CHECK (length(alias) <= 64),
    mute_until timestamptz,
    joined_seq bigint NOT NULL,
    PRIMARY KEY (conv_id, user_id),
    FOREIGN KEY (conv_id, user_id, joined_seq) REFERENCES membership_periods (conv_id, user_id, from_seq)
);
CREATE INDEX members_by_user ON members (user_id);
CREATE UNIQUE INDEX members_join_order ON members (conv_id, joined_seq);

-- The per-conversation log (P1, P4). PK (conv_id, seq) serves every history read.
-- Ids here are checked at the edge and by membership under the row lock; only the
-- client-chosen client_msg_id is checked again (one regex per row, not five).
CREATE TABLE events (
    conv_id       text NOT NULL,
    seq           bigint NOT NULL CHECK (seq >= 1),
    kind          text NOT NULL CHECK (kind IN ('msg', 'recall', 'join', 'leave', 'group')),
    message_id    uuid,
    sender_user   text,
    sender_device text,
    client_msg_id text CHECK (client_msg_id ~ '^[A-Za-z0-9._:@-]{1,64}$'),
    request_hash  bytea CHECK (length(request_hash) = 32),
    body          text,
    subject_user  text,
    actor         text,
    reason        text CHECK (reason IN ('left', 'kicked', 'dismissed')),
    target_seq    bigint,
    change        text,
    recalled      boolean NOT NULL DEFAULT false,
    created_at    timestamptz NOT NULL,
    PRIMARY KEY (conv_id, seq),
    CHECK (kind <> 'msg' OR (message_id IS NOT NULL AND sender_user IS NOT NULL AND sender_device IS NOT NULL
                             AND client_msg_id IS NOT NULL AND request_hash IS NOT NULL
                             AND (recalled OR body IS NOT NULL))),
    CHECK (kind = 'msg' OR (client_msg_id IS NULL AND NOT recalled)),
    CHECK (kind NOT IN ('join', 'leave') OR (subject_user IS NOT NULL AND actor IS NOT NULL)),
    CHECK ((kind = 'leave') = (reason IS NOT NULL)),
    CHECK (kind <> 'recall' OR (sender_user IS NOT NULL AND target_seq IS NOT NULL AND target_seq < seq)),
    CHECK (kind <> 'group' OR (actor IS NOT NULL AND change IS NOT NULL))
);
-- P2: one request key, at most one event.
CREATE UNIQUE INDEX events_request_key ON events (conv_id, sender_user, client_msg_id)
    WHERE client_msg_id IS NOT NULL;

-- P9: request keys of purged events, so a late retry is answered, never re-appended.
CREATE TABLE idem_tombstones (
    conv_id       text NOT NULL,
    sender_user   text NOT NULL,
    client_msg_id text NOT NULL,
    request_hash  bytea NOT NULL CHECK (length(request_hash) = 32),
    seq           bigint NOT NULL,
    purged_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (conv_id, sender_user, client_msg_id)
);

-- P8: monotonic, capped at head by the writer.
CREATE TABLE read_cursors (
    user_id  text NOT NULL,
    conv_id  text NOT NULL,
    read_seq bigint NOT NULL CHECK (read_seq >= 0),
    PRIMARY KEY (user_id, conv_id)
);

-- Pending joins in approval groups.
CREATE TABLE group_applications (
    conv_id      text NOT NULL REFERENCES conversations,
    user_id      text NOT NULL REFERENCES users,
    requested_by text NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (conv_id, user_id)
);
