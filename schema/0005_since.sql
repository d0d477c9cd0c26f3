-- Reconnect deltas (PROTOCOL §7 `conversations?since=`): when each per-user
-- change happened. New events, membership and profile changes already move
-- `conversations.last_event_at` (every one of them appends an event).

-- A read cursor that moved.
ALTER TABLE read_cursors ADD COLUMN changed_at timestamptz NOT NULL DEFAULT now();

-- A membership period that ended (leave, kick, dismissal).
ALTER TABLE membership_periods ADD COLUMN closed_at timestamptz;
CREATE INDEX membership_periods_closed ON membership_periods (user_id, closed_at) WHERE closed_at IS NOT NULL;
