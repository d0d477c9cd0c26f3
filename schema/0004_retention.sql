-- Recall and retention (PROTOCOL §5 `recall`, §6 retention; ARCHITECTURE §2 P9).

-- The recall of a target, found without scanning the conversation's log.
CREATE INDEX events_recall_target ON events (conv_id, target_seq) WHERE kind = 'recall';

-- Conversations with a retention setting, oldest first: what a purge run visits.
CREATE INDEX conversations_retention ON conversations (conv_id) WHERE retention_ms IS NOT NULL;

-- Tombstones past the configured horizon go in `purged_at` order.
CREATE INDEX idem_tombstones_purged_at ON idem_tombstones (purged_at);
