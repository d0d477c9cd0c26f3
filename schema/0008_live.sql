-- Blocking (PROTOCOL v1.2, ARCHITECTURE §9): who blocked whom, and in a direct
-- conversation the blocked member's standing, so that the send check reads it
-- under the conversation row lock like a mute (the block bumps `member_version`).

CREATE TABLE blocks (
    blocker    text NOT NULL REFERENCES users,
    blocked    text NOT NULL REFERENCES users,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (blocker, blocked),
    CHECK (blocker <> blocked)
);

-- In a direct conversation: the other member blocked this one (it may not send).
ALTER TABLE members ADD COLUMN blocked boolean NOT NULL DEFAULT false;

-- Presence (PROTOCOL v1.2): when the user's last device went away, written when
-- that is announced (after the grace period).
ALTER TABLE users ADD COLUMN last_seen timestamptz;
