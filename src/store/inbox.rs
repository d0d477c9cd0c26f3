//! The inbox (PROTOCOL §5 `conversations`): the conversations a user is a
//! current member of, most recently active first, each with the user's read
//! cursor, its unread count and the newest event the user can see.
//!
//! One statement, so one snapshot: the page of conversations is chosen first
//! (the user's `members` rows by `members_by_user`, each checked against its
//! open period — the truth of visibility — and sorted by
//! `conversations.last_event_at`), and only the rows of that page then probe
//! `events` by its primary key: a backward scan for the last event, and a
//! range scan of at most [`UNREAD_SCAN_ROWS`] seqs after the cursor for the
//! unread count, stopped after [`UNREAD_CAP`] countable rows, and one of the
//! same range for the unread mentions. Nothing scans a conversation's whole log.

use std::sync::LazyLock;

use chrono::{DateTime, Utc};
use imcore_actors::{ConvId, UserId};
use tokio_postgres::types::Type;
use tokio_postgres::Row;

use super::conversations::{conversation_from_row_at, CONVERSATION_COLUMNS, CONVERSATION_COLUMN_COUNT};
use super::since_token::since_token;
use super::sync::{event_from_row, EVENT_COLUMN_COUNT};
use super::{ConversationInfo, Store, StoreError};
use crate::domain::{Event, Rejection};

pub const INBOX_DEFAULT_LIMIT: i64 = 50;
pub const INBOX_MAX_LIMIT: i64 = 200;
/// Unread counts are exact below this; this value itself means "999+".
pub const UNREAD_CAP: i64 = 1000;
/// Unread mention counts are exact below this; this value itself means "99+".
pub const UNREAD_MENTIONS_CAP: i64 = 100;
/// The most seqs after the read cursor the unread count looks at (see
/// [`InboxItem::unread`]).
pub const UNREAD_SCAN_ROWS: i64 = 2 * UNREAD_CAP;

#[derive(Debug, Clone)]
pub struct InboxPage {
    /// Most recently active first (`last_event_at` descending, then `conv_id`).
    pub items: Vec<InboxItem>,
    /// Pass as `cursor` for the next page; `None` on the last page.
    pub next_cursor: Option<String>,
    /// Pass as `since` to learn what changed after this page was read
    /// (PROTOCOL §7; a full paging keeps the first page's).
    pub since: String,
}

#[derive(Debug, Clone)]
pub struct InboxItem {
    pub conversation: ConversationInfo,
    /// 0 when the user never marked anything read.
    pub read_seq: i64,
    /// Visible, unrecalled `msg` events from others among the
    /// [`UNREAD_SCAN_ROWS`] seqs after `read_seq`, at most [`UNREAD_CAP`]
    /// ("999+"): exact when the log ends within them or 1000 of them count, a
    /// lower bound otherwise (say, after thousands of the user's own sends).
    /// Counting further would scan the log of a user who sends and never reads.
    pub unread: i64,
    /// Of the messages `unread` counts (in the same seqs), those that mention
    /// the user or everyone (`mention_all`), at most [`UNREAD_MENTIONS_CAP`] ("99+").
    pub unread_mentions: i64,
    /// The newest event the user can see (`None` only when retention purged
    /// everything of its current period).
    pub last_event: Option<Event>,
}

/// $1 user, $2 cursor time (NULL: first page), $3 cursor conv_id, $4 page rows
/// to fetch. Columns: see [`inbox_items_sql`].
///
/// The keyset mixes directions (time descending, id ascending), so the cursor
/// condition is spelled out rather than a row comparison.
pub static INBOX_PAGE: LazyLock<String> = LazyLock::new(|| {
    inbox_items_sql(
        "
  SELECT m.conv_id, p.from_seq
    FROM members m
    JOIN membership_periods p ON p.conv_id = m.conv_id AND p.user_id = m.user_id AND p.to_seq IS NULL
    JOIN conversations c ON c.conv_id = m.conv_id
   WHERE m.user_id = $1
     AND ($2 IS NULL OR c.last_event_at < $2 OR (c.last_event_at = $2 AND c.conv_id > $3))
   ORDER BY c.last_event_at DESC, c.conv_id
   LIMIT $4",
    )
});

/// The inbox items of the conversations `page` selects (`conv_id`,
/// `from_seq` of the user's open period; `$1` is the user). Columns: the
/// event columns of `sync` (0–19, NULL when there is no visible event), the
/// conversation (20–36), read_seq, unread, last_event_at, unread_mentions.
///
/// The unread count reads a seq range of at most [`UNREAD_SCAN_ROWS`] after
/// the cursor, or after `min_seq` where retention purged past the cursor
/// (seqs are gapless from `min_seq`, P1, so that many rows at most), whatever
/// plan the planner picks: a LIMIT alone bounds only the rows that pass the
/// filter, and the rows the user cannot count (its own messages) would pass
/// unbounded. The LIMIT [`UNREAD_CAP`] then stops the count at "999+".
///
/// `page` ends with a LIMIT, so PostgreSQL cannot flatten it: the LATERALs
/// run only for the rows of the page, never for every conversation of the user.
pub(super) fn inbox_items_sql(page: &str) -> String {
    let unread = unread_count("page", "unread", "", UNREAD_CAP);
    let unread_mentions =
        unread_count("page", "unread_mentions", "AND (e.mention_all OR $1 = ANY(e.mentions))", UNREAD_MENTIONS_CAP);
    format!(
        "
WITH page AS ({page})
SELECT le.seq, le.kind, le.created_at, le.message_id, le.sender_user, le.sender_device, le.client_msg_id,
       le.body, le.subject_user, le.actor, le.reason, le.target_seq, le.change, le.recalled,
       le.reply_to, le.mentions, le.mention_all, le.edited_at, le.emoji, le.reaction_on,
       {CONVERSATION_COLUMNS},
       coalesce(rc.read_seq, 0), u.unread, c.last_event_at, um.unread_mentions
  FROM page
  JOIN conversations c ON c.conv_id = page.conv_id
  LEFT JOIN read_cursors rc ON rc.user_id = $1 AND rc.conv_id = page.conv_id
  LEFT JOIN LATERAL (
    SELECT e.seq, e.kind, e.created_at, e.message_id, e.sender_user, e.sender_device, e.client_msg_id,
           e.body, e.subject_user, e.actor, e.reason, e.target_seq, e.change, e.recalled,
           e.reply_to, e.mentions, e.mention_all, e.edited_at, e.emoji, e.reaction_on
      FROM events e
     WHERE e.conv_id = page.conv_id AND e.seq >= page.from_seq
     ORDER BY e.seq DESC LIMIT 1) le ON true
  CROSS JOIN LATERAL ({unread}) u
  CROSS JOIN LATERAL ({unread_mentions}) um
 ORDER BY c.last_event_at DESC, c.conv_id"
    )
}

/// `count(*) AS <name>` of the messages user `$1` has not read in the
/// conversation of `<period>.conv_id` (a row with `from_seq`, beside `c` the
/// conversation and `rc` the user's read cursor), `filter` narrowing them:
/// the bounded scan described above, capped at `cap`.
pub(super) fn unread_count(period: &str, name: &str, filter: &str, cap: i64) -> String {
    format!(
        "
    SELECT count(*) AS {name} FROM (
      SELECT 1 FROM events e
       WHERE e.conv_id = {period}.conv_id
         AND e.seq > greatest(coalesce(rc.read_seq, 0), {period}.from_seq - 1, c.min_seq - 1)
         AND e.seq <= greatest(coalesce(rc.read_seq, 0), {period}.from_seq - 1, c.min_seq - 1) + {UNREAD_SCAN_ROWS}
         AND e.kind = 'msg' AND NOT e.recalled AND e.sender_user <> $1 {filter}
       LIMIT {cap}) x"
    )
}

/// Column of the conversation in [`INBOX_PAGE`]; the event columns come first.
const CONV_AT: usize = EVENT_COLUMN_COUNT;
/// Column of `read_seq`, after the conversation's.
const CURSOR_AT: usize = CONV_AT + CONVERSATION_COLUMN_COUNT;

impl Store {
    /// One page of `user`'s inbox. `limit` is clamped to 1..=[`INBOX_MAX_LIMIT`]
    /// (callers pass [`INBOX_DEFAULT_LIMIT`] when the client gave none);
    /// `cursor` is a `next_cursor` from an earlier page — anything else is
    /// `BAD_REQUEST`.
    pub async fn inbox(&self, user: &UserId, limit: i64, cursor: Option<&str>) -> Result<InboxPage, StoreError> {
        let limit = limit.clamp(1, INBOX_MAX_LIMIT);
        let (after_time, after_conv) = match cursor {
            Some(c) => {
                let (t, conv) = decode_cursor(c).ok_or_else(|| Rejection::BadRequest("malformed cursor".into()))?;
                (Some(t), Some(conv))
            }
            None => (None, None),
        };
        let fetch = limit + 1;
        let conn = self.pool.get().await?;
        // The token first: its statement runs before the page's snapshot (§7).
        let (user, after_conv) = (user.as_str(), after_conv.as_ref().map(ConvId::as_str));
        let params = [
            (&user as _, Type::TEXT),
            (&after_time as _, Type::TIMESTAMPTZ),
            (&after_conv as _, Type::TEXT),
            (&fetch as _, Type::INT8),
        ];
        let (since, rows) = futures_util::join!(since_token(&conn), conn.query_prepared(&INBOX_PAGE, &params));
        let (since, rows) = (since?, rows?);
        let more = rows.len() as i64 > limit;
        let mut next_cursor = None;
        let mut items = Vec::with_capacity(rows.len().min(limit as usize));
        for r in rows.iter().take(limit as usize) {
            let (item, last_event_at) = inbox_item(r)?;
            if more {
                next_cursor = Some(encode_cursor(last_event_at, &item.conversation.conv_id));
            }
            items.push(item);
        }
        Ok(InboxPage { items, next_cursor, since })
    }
}

/// An item from a row of [`inbox_items_sql`], and its conversation's `last_event_at`.
pub(super) fn inbox_item(r: &Row) -> Result<(InboxItem, DateTime<Utc>), StoreError> {
    let conversation = conversation_from_row_at(r, CONV_AT)?;
    let last_event = match r.get::<_, Option<i64>>(0) {
        Some(_) => Some(event_from_row(&conversation.conv_id, r)?),
        None => None,
    };
    let item = InboxItem {
        read_seq: r.get(CURSOR_AT),
        unread: r.get(CURSOR_AT + 1),
        unread_mentions: r.get(CURSOR_AT + 3),
        last_event,
        conversation,
    };
    Ok((item, r.get(CURSOR_AT + 2)))
}

/// Opaque to clients: hex of `<last_event_at in µs since the epoch>:<conv_id>`
/// (PostgreSQL keeps microseconds, so the position round-trips exactly).
fn encode_cursor(at: DateTime<Utc>, conv: &ConvId) -> String {
    hex::encode(format!("{}:{}", at.timestamp_micros(), conv.as_str()))
}

/// Latest time a cursor may name: 9999-12-31T23:59:59.999999Z. Ours name
/// activity times; a forged one outside PostgreSQL's range would fail the query.
const MAX_CURSOR_MICROS: i64 = 253_402_300_799_999_999;

fn decode_cursor(cursor: &str) -> Option<(DateTime<Utc>, ConvId)> {
    let raw = String::from_utf8(hex::decode(cursor).ok()?).ok()?;
    let (micros, conv) = raw.split_once(':')?;
    let micros = micros.parse().ok().filter(|m| (0..=MAX_CURSOR_MICROS).contains(m))?;
    let at = DateTime::from_timestamp_micros(micros)?;
    Some((at, ConvId::parse(conv).ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cursor_round_trips_its_position() {
        let at = DateTime::from_timestamp_micros(1_790_000_000_123_456).expect("time");
        let conv = ConvId::parse("g-a:b.c@d").expect("conv");
        assert_eq!(decode_cursor(&encode_cursor(at, &conv)), Some((at, conv)));
    }

    #[test]
    fn a_malformed_cursor_decodes_to_nothing() {
        let (before_1970, after_9999) = (hex::encode("-1:g-1"), hex::encode("253402300800000000:g-1"));
        for bad in ["", "zz", "abc", &hex::encode("nocolon"), &hex::encode("x:g-1"), &hex::encode("1:bad id")]
            .into_iter()
            .chain([before_1970.as_str(), after_9999.as_str()])
        {
            assert_eq!(decode_cursor(bad), None, "{bad}");
        }
    }
}
