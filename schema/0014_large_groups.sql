-- Large groups by themselves (ARCHITECTURE §9 "Large groups"). `delivery_mode`
-- stays what the group delivers in now (`push` or `pull`, read by every write
-- and by delivery); `delivery_setting` is what its admins chose: `auto` (the
-- mode follows the member count, with hysteresis) or a fixed `push`/`pull`.
-- A group set to `pull` before this existed was set so by an admin; `push`
-- was the default, so those groups become `auto`.
ALTER TABLE conversations
    ADD COLUMN delivery_setting text NOT NULL DEFAULT 'auto'
        CHECK (delivery_setting IN ('auto', 'push', 'pull'));

UPDATE conversations SET delivery_setting = 'pull' WHERE delivery_mode = 'pull';
