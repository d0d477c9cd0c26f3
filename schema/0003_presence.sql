-- Delivery loads an online user's memberships when it connects (ARCHITECTURE §5):
-- the latest period of each conversation the user was ever in. Ordered like the
-- query's DISTINCT ON, so it reads the index in order and never sorts.
CREATE INDEX membership_periods_by_user ON membership_periods (user_id, conv_id, from_seq DESC);
