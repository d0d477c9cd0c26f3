//! The write transaction's hot statements, prepared once per pooled
//! connection (`store::connection`): the lock, the request-key and standing
//! lookups, the append and the one-round-trip append run with no parse or
//! plan of their own.

use tokio_postgres::types::Type;
use tokio_postgres::{Client, Error, Statement};

/// Rows are locked in `conv_id` order, so two transactions that each lock
/// several conversations never deadlock. `NO KEY UPDATE` serialises writers of
/// a conversation just as well (it conflicts with itself) without blocking
/// other transactions' foreign-key checks against the row.
macro_rules! lock_conversations_sql {
    ($wait:literal) => {
        concat!(
            "SELECT conv_id, status, next_seq, member_version, member_count, max_member, mute_all, ",
            "join_mode, delivery_mode, date_trunc('milliseconds', now()), kind = 'group', recall_window_ms, ",
            "retention_ms, name, owner, edit_window_ms, delivery_setting, min_seq FROM conversations WHERE conv_id = ANY($1::text[]) ORDER BY conv_id FOR NO KEY UPDATE",
            $wait
        )
    };
}
const LOCK_CONVERSATIONS: &str = lock_conversations_sql!("");
/// `SKIP LOCKED` rather than `NOWAIT`: `NOWAIT` fails the statement, and with
/// it the transaction, at the first row held elsewhere without naming it;
/// `SKIP LOCKED` returns the rows it took, so the transaction goes on with
/// those and leaves the others out.
const LOCK_CONVERSATIONS_SKIP_LOCKED: &str = lock_conversations_sql!(" SKIP LOCKED");

/// Which of the conversations exist, without locking (a row another
/// transaction holds is still read).
const EXISTING_CONVERSATIONS: &str = "SELECT conv_id FROM conversations WHERE conv_id = ANY($1::text[])";

/// One index probe per key on each unique index (a LATERAL `LIMIT 1`; a plain
/// join against the key list can scan the whole conversation). Tombstones are
/// probed only where retention ever purged (`min_seq > 1`), read from the
/// row itself: the statement runs behind the lock statement, whose result it
/// cannot wait for.
const LOOKUP_REQUEST_KEYS: &str = "
SELECT k.conv, k.u, k.c, e.seq, e.message_id, e.request_hash, e.created_at, t.request_hash
  FROM unnest($1::text[], $2::text[], $3::text[]) AS k(conv, u, c)
  JOIN conversations c ON c.conv_id = k.conv
  LEFT JOIN LATERAL (SELECT seq, message_id, request_hash, created_at FROM events
                      WHERE conv_id = k.conv AND sender_user = k.u AND client_msg_id = k.c LIMIT 1) e ON true
  LEFT JOIN LATERAL (SELECT request_hash FROM idem_tombstones
                      WHERE c.min_seq > 1 AND conv_id = k.conv AND sender_user = k.u AND client_msg_id = k.c) t ON true
 WHERE e.seq IS NOT NULL OR t.request_hash IS NOT NULL";

/// The standings of (conversation, user) pairs, by primary key.
const LOAD_STANDINGS: &str = "
SELECT m.conv_id, m.user_id, m.role, m.mute_until, m.role_until, m.extra_perms, m.blocked FROM members m
  JOIN unnest($1::text[], $2::text[]) AS k(conv, u) ON m.conv_id = k.conv AND m.user_id = k.u";

/// Every event of every conversation of the transaction, each sender's
/// `last_active_seq` (once per sender and conversation: its last `msg` here,
/// unless it joined after it in this batch), the bodies its recalls erase
/// (of the message and of its edits, whose fingerprints go too:
/// `ERASED_FINGERPRINT`, 32 zero bytes), the bodies its edits set,
/// the reactions it sets and counts, and every conversation row, in one
/// statement. Each row is written by one part at most (the batch nets its
/// changes out), as one statement must. `joined_seq + 0` and
/// `last_active_seq + 0` are no index conditions, so a sender's row is found
/// by its primary key: a generic plan otherwise probed `members_join_order`
/// or `members_by_activity` by `conv_id` and a range of seqs, reading every
/// member below the seq, the whole group in a large one.
const APPEND_EVENTS: &str = "
WITH appended AS (
  INSERT INTO events (conv_id, seq, kind, message_id, sender_user, sender_device, client_msg_id, request_hash,
                      body, subject_user, actor, reason, change, target_seq, recalled, created_at,
                      reply_to, mentions, mention_all, edited_at, emoji, reaction_on)
  SELECT e.conv, e.seq, e.kind, e.mid, e.snd, e.dev, e.key, e.hash, e.body, e.subj, e.act, e.reason, e.change,
         e.target, e.recalled, $16, e.reply_to, string_to_array(e.mentions, ' '), e.mention_all, e.edited_at,
         e.emoji, e.reaction_on
    FROM unnest($1::text[], $2::int8[], $3::text[], $4::uuid[], $5::text[], $6::text[], $7::text[], $8::bytea[],
                $9::text[], $10::text[], $11::text[], $12::text[], $13::text[], $14::int8[], $15::bool[],
                $23::int8[], $24::text[], $25::bool[], $26::timestamptz[], $27::text[], $28::bool[])
         AS e(conv, seq, kind, mid, snd, dev, key, hash, body, subj, act, reason, change, target, recalled,
              reply_to, mentions, mention_all, edited_at, emoji, reaction_on)),
erased AS (
  UPDATE events e SET body = NULL, recalled = true, request_hash = decode(repeat('00', 32), 'hex')
    FROM unnest($21::text[], $22::int8[]) AS r(conv, seq)
   WHERE e.conv_id = r.conv AND e.seq = r.seq),
erased_edits AS (
  UPDATE events e SET body = NULL, request_hash = decode(repeat('00', 32), 'hex')
    FROM unnest($21::text[], $22::int8[]) AS r(conv, seq)
   WHERE e.conv_id = r.conv AND e.kind = 'edit' AND e.target_seq = r.seq),
edited AS (
  UPDATE events e SET body = x.body, edited_at = $16
    FROM unnest($29::text[], $30::int8[], $31::text[]) AS x(conv, seq, body)
   WHERE e.conv_id = x.conv AND e.seq = x.seq),
turned_on AS (
  INSERT INTO reactions (conv_id, target_seq, user_id, emoji, seq)
  SELECT x.conv, x.target, x.u, x.emoji, x.seq
    FROM unnest($32::text[], $33::int8[], $34::text[], $35::text[], $36::bool[], $37::int8[])
         AS x(conv, target, u, emoji, turned_on, seq)
   WHERE x.turned_on),
turned_off AS (
  DELETE FROM reactions r
   USING unnest($32::text[], $33::int8[], $34::text[], $35::text[], $36::bool[]) AS x(conv, target, u, emoji, turned_on)
   WHERE NOT x.turned_on AND r.conv_id = x.conv AND r.target_seq = x.target AND r.user_id = x.u
     AND r.emoji = x.emoji),
counted AS (
  INSERT INTO reaction_counts AS rc (conv_id, target_seq, emoji, count, first_seq)
  SELECT * FROM unnest($38::text[], $39::int8[], $40::text[], $41::int4[], $42::int8[])
  ON CONFLICT (conv_id, target_seq, emoji) DO UPDATE SET count = rc.count + excluded.count),
active AS (
  UPDATE members m SET last_active_seq = a.seq, last_active_at = $16
    FROM (SELECT conv, snd, max(seq) AS seq FROM unnest($1::text[], $2::int8[], $3::text[], $5::text[])
            AS e(conv, seq, kind, snd) WHERE kind = 'msg' GROUP BY conv, snd) a
   WHERE m.conv_id = a.conv AND m.user_id = a.snd AND m.joined_seq + 0 < a.seq AND m.last_active_seq + 0 < a.seq
     AND ($43::int8 = 0 OR m.last_active_at IS NULL
          OR m.last_active_at <= $16 - make_interval(secs => $43::int8 / 1000.0)))
UPDATE conversations c
   SET next_seq = u.next_seq, member_version = c.member_version + u.bump, member_count = u.members,
       last_event_at = $16
  FROM unnest($17::text[], $18::int8[], $19::int8[], $20::int4[]) AS u(conv, next_seq, bump, members)
 WHERE c.conv_id = u.conv";

/// `$1`..`$15` are the event columns of the append (`append::EventColumns`);
/// `$16`.. what the one-trip plan expects of its conversation's row. Each
/// sender's `last_active_seq` moves with its messages, as in the full append
/// (and found by its primary key, as there).
macro_rules! append_if_unchanged_sql {
    ($lock:literal) => {
        concat!(
            "WITH unlike AS MATERIALIZED (
  SELECT 1 FROM unnest($25::text[]) AS a(u)
   WHERE NOT coalesce((SELECT role = 'member' AND mute_until IS NULL AND role_until IS NULL AND extra_perms = 0
                                AND NOT blocked
                         FROM members WHERE conv_id = $16 AND user_id = a.u), false)),
conv AS (
  SELECT c.conv_id, date_trunc('milliseconds', now()) AS now
    FROM (SELECT conv_id, next_seq, member_version, status, mute_all, join_mode, delivery_mode, min_seq
            FROM conversations WHERE conv_id = $16 FOR NO KEY UPDATE",
            $lock,
            ") c
   WHERE c.next_seq = $17 AND c.member_version = $19 AND c.status = 'active'
     AND c.mute_all = $20 AND c.join_mode = $21 AND c.delivery_mode = $22
     AND ($23::timestamptz IS NULL OR date_trunc('milliseconds', now()) >= $23)
     AND ($24::timestamptz IS NULL OR date_trunc('milliseconds', now()) < $24)
     AND NOT EXISTS (SELECT 1 FROM unlike)
     AND (c.min_seq = 1 OR NOT EXISTS (
       SELECT 1 FROM unnest($5::text[], $7::text[]) AS k(sender, key), LATERAL (
         SELECT 1 FROM idem_tombstones WHERE conv_id = $16 AND sender_user = k.sender AND client_msg_id = k.key
         UNION ALL
         SELECT 1 FROM events WHERE conv_id = $16 AND sender_user = k.sender AND client_msg_id = k.key
          LIMIT 1) t))),
appended AS (
  INSERT INTO events (conv_id, seq, kind, message_id, sender_user, sender_device, client_msg_id, request_hash,
                      body, subject_user, actor, reason, change, target_seq, recalled, created_at)
  SELECT e.*, conv.now
    FROM conv, unnest($1::text[], $2::int8[], $3::text[], $4::uuid[], $5::text[], $6::text[], $7::text[],
                      $8::bytea[], $9::text[], $10::text[], $11::text[], $12::text[], $13::text[], $14::int8[],
                      $15::bool[]) AS e),
moved AS (
  UPDATE conversations c SET next_seq = $18, last_event_at = conv.now FROM conv
   WHERE c.conv_id = $16 AND conv.conv_id = $16),
active AS (
  UPDATE members m SET last_active_seq = a.seq, last_active_at = conv.now
    FROM conv, (SELECT snd, max(seq) AS seq FROM unnest($2::int8[], $3::text[], $5::text[]) AS e(seq, kind, snd)
                 WHERE kind = 'msg' GROUP BY snd) a
   WHERE m.conv_id = $16 AND conv.conv_id = $16 AND m.user_id = a.snd AND m.last_active_seq + 0 < a.seq
     AND ($26::int8 = 0 OR m.last_active_at IS NULL
          OR m.last_active_at <= conv.now - make_interval(secs => $26::int8 / 1000.0)))
SELECT now FROM conv"
        )
    };
}
const APPEND_IF_UNCHANGED: &str = append_if_unchanged_sql!("");
const APPEND_IF_UNCHANGED_SKIP_LOCKED: &str = append_if_unchanged_sql!(" SKIP LOCKED");

pub struct Prepared {
    pub(super) lock: Statement,
    pub(super) lock_skip_locked: Statement,
    pub(super) existing: Statement,
    pub(super) request_keys: Statement,
    pub(super) standings: Statement,
    pub(super) append: Statement,
    pub(super) append_if_unchanged: Statement,
    pub(super) append_if_unchanged_skip_locked: Statement,
}

impl Prepared {
    /// Prepares every statement in one round trip (the requests of futures
    /// polled together are pipelined).
    pub(in crate::store) async fn prepare(client: &Client) -> Result<Self, Error> {
        use Type as T;
        let texts = [T::TEXT_ARRAY, T::TEXT_ARRAY, T::TEXT_ARRAY];
        let append = [
            T::TEXT_ARRAY,
            T::INT8_ARRAY,
            T::TEXT_ARRAY,
            T::UUID_ARRAY,
            T::TEXT_ARRAY,
            T::TEXT_ARRAY,
            T::TEXT_ARRAY,
            T::BYTEA_ARRAY,
            T::TEXT_ARRAY,
            T::TEXT_ARRAY,
            T::TEXT_ARRAY,
            T::TEXT_ARRAY,
            T::TEXT_ARRAY,
            T::INT8_ARRAY,
            T::BOOL_ARRAY,
            T::TIMESTAMPTZ,
            T::TEXT_ARRAY,
            T::INT8_ARRAY,
            T::INT8_ARRAY,
            T::INT4_ARRAY,
            T::TEXT_ARRAY,
            T::INT8_ARRAY,
            // $23..: `append::EventColumns::history_params`, then `append::Shown`.
            T::INT8_ARRAY,
            T::TEXT_ARRAY,
            T::BOOL_ARRAY,
            T::TIMESTAMPTZ_ARRAY,
            T::TEXT_ARRAY,
            T::BOOL_ARRAY,
            T::TEXT_ARRAY,
            T::INT8_ARRAY,
            T::TEXT_ARRAY,
            T::TEXT_ARRAY,
            T::INT8_ARRAY,
            T::TEXT_ARRAY,
            T::TEXT_ARRAY,
            T::BOOL_ARRAY,
            T::INT8_ARRAY,
            T::TEXT_ARRAY,
            T::INT8_ARRAY,
            T::TEXT_ARRAY,
            T::INT4_ARRAY,
            T::INT8_ARRAY,
        ];
        let expected = [
            T::TEXT,
            T::INT8,
            T::INT8,
            T::INT8,
            T::BOOL,
            T::TEXT,
            T::TEXT,
            T::TIMESTAMPTZ,
            T::TIMESTAMPTZ,
            T::TEXT_ARRAY,
        ];
        let guarded = [&append[..15], &expected].concat();
        // Each statement named once: its field, its text, its parameter types.
        macro_rules! prepare_all {
            ($($name:ident: $sql:expr, $types:expr;)*) => {{
                let ($($name,)*) = futures_util::try_join!($(client.prepare_typed($sql, $types)),*)?;
                Ok(Self { $($name),* })
            }};
        }
        prepare_all! {
            lock: LOCK_CONVERSATIONS, &texts[..1];
            lock_skip_locked: LOCK_CONVERSATIONS_SKIP_LOCKED, &texts[..1];
            existing: EXISTING_CONVERSATIONS, &texts[..1];
            request_keys: LOOKUP_REQUEST_KEYS, &texts;
            standings: LOAD_STANDINGS, &texts[..2];
            append: APPEND_EVENTS, &append;
            append_if_unchanged: APPEND_IF_UNCHANGED, &guarded;
            append_if_unchanged_skip_locked: APPEND_IF_UNCHANGED_SKIP_LOCKED, &guarded;
        }
    }
}

/// The connection a write transaction runs on, with its prepared statements.
#[derive(Clone, Copy)]
pub(super) struct Conn<'a> {
    pub(super) client: &'a Client,
    pub(super) prepared: &'a Prepared,
}
