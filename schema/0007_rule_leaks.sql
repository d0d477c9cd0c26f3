-- A recalled message's request fingerprint goes with its body (ARCHITECTURE §3
-- "Recall"): the SHA-256 of the text would confirm a guessed one. Recalls now
-- write 32 zero bytes in its place; this erases those of earlier recalls.
UPDATE events SET request_hash = decode(repeat('00', 32), 'hex') WHERE kind = 'msg' AND recalled;

-- What a member who left or was kicked keeps seeing of the conversation
-- (PROTOCOL §5 `get_conversation`): its settings and member count as of its
-- `leave`. NULL for a period still open, ended by dismissal, or closed before.
ALTER TABLE membership_periods ADD COLUMN left_view jsonb;
