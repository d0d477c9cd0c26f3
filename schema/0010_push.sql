-- Offline notifications (PROTOCOL v1.3, ARCHITECTURE §5 "Offline notifications").

-- A device's registration with a push gateway (Matrix Push Gateway API). One
-- (app_id, pushkey) names one phone app install: registering it again, from any
-- account, moves it. A device's pushers go with its token (rotation) and its row.
CREATE TABLE pushers (
    app_id     text NOT NULL CHECK (length(app_id) BETWEEN 1 AND 64),
    pushkey    text NOT NULL CHECK (length(pushkey) BETWEEN 1 AND 512),
    user_id    text NOT NULL,
    device_id  text NOT NULL,
    url        text NOT NULL CHECK (length(url) BETWEEN 1 AND 512),
    lang       text CHECK (length(lang) <= 16),
    data       jsonb,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (app_id, pushkey),
    FOREIGN KEY (user_id, device_id) REFERENCES devices ON DELETE CASCADE
);
CREATE INDEX pushers_by_device ON pushers (user_id, device_id);

-- Conversations × users who hold a pusher and were seen joining: the only members
-- a batch's "who is due" read looks at, so a big group costs what its members with
-- pushers cost. Kept by the notifier (join/leave events it follows) and by
-- set_pusher / remove_pusher, never by the send transaction; a row may be stale
-- (the membership period is checked), never missing for a member with a pusher.
CREATE TABLE push_targets (
    conv_id text NOT NULL,
    user_id text NOT NULL,
    PRIMARY KEY (conv_id, user_id)
);
CREATE INDEX push_targets_by_user ON push_targets (user_id);

-- A user's notification level in one conversation; no row: the default by size.
CREATE TABLE notify_levels (
    user_id text NOT NULL,
    conv_id text NOT NULL,
    level   text NOT NULL CHECK (level IN ('all', 'mentions', 'none')),
    PRIMARY KEY (user_id, conv_id)
);

-- The notifier's durable progress: every event of conv_id up to done_seq is
-- handled (sent, given up, or not due). Written by the node holding the lease,
-- after the work; a row whose lease ran out is another node's to take over.
CREATE TABLE notify_progress (
    conv_id     text PRIMARY KEY,
    done_seq    bigint NOT NULL CHECK (done_seq >= 0),
    node        text NOT NULL,
    lease_until timestamptz NOT NULL
);
