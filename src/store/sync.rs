//! History reads (PROTOCOL §5 `sync`, ARCHITECTURE §4): a primary-key range scan
//! of `(conv_id, seq)` per membership period of the caller — a member sees
//! exactly the events inside its periods, a former member still reads its own.
//! A page is bounded by `limit` and by a budget of body bytes; the pooled
//! connection is returned before the rows are decoded.

use std::collections::HashMap;
use std::ops::Deref;
use std::sync::{Arc, OnceLock};

use bb8::PooledConnection;
use imcore_actors::{ClientMsgId, ConvId, DeviceId, UserId};
use serde_json::value::RawValue;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Row;

use super::connection::Manager;
use super::error::decoded;
use super::{Store, StoreError};
use crate::config::SYNC_DEFAULT_MAX_BYTES;
use crate::domain::{Emoji, Event, EventKind, LeaveReason, Rejection};

pub const SYNC_DEFAULT_LIMIT: i64 = 100;
pub const SYNC_MAX_LIMIT: i64 = 1000;

#[derive(Debug, Clone)]
pub struct SyncRequest {
    pub conv: ConvId,
    pub user: UserId,
    /// Forward paging: events with `seq > after_seq`.
    pub after_seq: Option<i64>,
    /// Backward paging: the newest events below `before_seq` (wins over `after_seq`).
    pub before_seq: Option<i64>,
    pub limit: i64,
    /// The client's epoch; a different one is `EPOCH_CHANGED`.
    pub epoch: Option<i32>,
    /// Budget of body bytes: the page ends at the event that would exceed it
    /// (its first body always fits), so one reply stays bounded however
    /// large `limit` times the largest body is.
    pub max_bytes: usize,
}

impl SyncRequest {
    pub fn forward(conv: ConvId, user: UserId, after_seq: i64) -> Self {
        Self {
            conv,
            user,
            after_seq: Some(after_seq),
            before_seq: None,
            limit: SYNC_DEFAULT_LIMIT,
            epoch: None,
            max_bytes: SYNC_DEFAULT_MAX_BYTES,
        }
    }
}

#[derive(Debug, Clone)]
pub struct SyncPage {
    /// Ascending seq.
    pub events: Vec<Arc<SyncEvent>>,
    pub head: i64,
    pub min_seq: i64,
    pub epoch: i32,
    /// Where the forward scan stopped: pass it as the next `after_seq`. It can be
    /// past the last returned event when invisible stretches were skipped.
    pub next_after: i64,
    /// Backward paging: pass as the next `before_seq` (the lowest seq scanned).
    pub next_before: Option<i64>,
    /// More visible events follow the page: `limit` or the byte budget ended it.
    pub has_more: bool,
    /// `after_seq` was below the retained log; the page starts at `min_seq`.
    pub truncated: bool,
    /// The reactions of the page's unrecalled messages that have any, by seq.
    pub reactions: HashMap<i64, Vec<ReactionCount>>,
}

/// An event of a page, shared with the tail ring that holds it (every page
/// that shows it holds the same one), with a slot for its PROTOCOL form:
/// filled by the first reply that encodes it (`protocol::wire`) and reused by
/// every reply after, so an event in a ring is encoded once however many
/// devices sync it. The form is the event's own, without the caller's
/// reactions (a page with reactions for it encodes it afresh).
#[derive(Debug)]
pub struct SyncEvent {
    pub event: Event,
    pub encoded: OnceLock<Box<RawValue>>,
}

impl SyncEvent {
    pub fn shared(event: Event) -> Arc<Self> {
        Arc::new(Self { event, encoded: OnceLock::new() })
    }
}

impl Deref for SyncEvent {
    type Target = Event;

    fn deref(&self) -> &Event {
        &self.event
    }
}

/// One emoji on a message: how many users have it on, and whether the
/// caller is one of them.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ReactionCount {
    pub emoji: String,
    pub count: i64,
    pub me: bool,
}

/// A former member's head is where its last period ended: later activity is
/// none of its business (PROTOCOL §5 `get_conversation`).
/// Its fourth column is the conversation's head whoever asks (how far a
/// standby has replayed it).
const HEADER: &str = "
SELECT least(c.next_seq - 1, p.to_seq), c.min_seq, c.epoch, c.next_seq - 1
  FROM conversations c
 CROSS JOIN LATERAL (SELECT to_seq FROM membership_periods p
                      WHERE p.conv_id = c.conv_id AND p.user_id = $2 ORDER BY from_seq DESC LIMIT 1) p
 WHERE c.conv_id = $1";

/// The reactions of an unrecalled `msg` `e` as a JSON array (NULL when none):
/// one `{"emoji", "count", "me"}` per emoji on it, in the order they were first
/// added; `me` for the caller, `$2`. Read from `reaction_counts` and probed in
/// `reactions` by key: no event is summed.
macro_rules! reactions_sql {
    () => {
        "CASE WHEN e.kind = 'msg' AND NOT e.recalled THEN (
           SELECT json_agg(json_build_object('emoji', rc.emoji, 'count', rc.count, 'me', EXISTS (
                    SELECT 1 FROM reactions r WHERE r.conv_id = rc.conv_id AND r.target_seq = rc.target_seq
                       AND r.user_id = $2 AND r.emoji = rc.emoji)) ORDER BY rc.first_seq, rc.emoji)::text
             FROM reaction_counts rc WHERE rc.conv_id = e.conv_id AND rc.target_seq = e.seq AND rc.count > 0)
         END"
    };
}

/// Forward page: $3 after, $4 head (the snapshot bound), $5 limit. The log
/// is gapless from `min_seq` (P1) and `$3 >= min_seq - 1`, so a period holds
/// exactly `least(to_seq, head) - greatest(after, from_seq - 1)` events of
/// the page's range: each period reads only what the periods before it left
/// of the page (`before`), and those past a full page are not read at all,
/// however many periods the user had (ARCHITECTURE §4).
pub const SYNC_FORWARD: &str = concat!(
    "
SELECT e.* FROM (
  SELECT * FROM (
    SELECT p.conv_id, p.from_seq, p.to_seq,
           coalesce(sum(greatest(0, least(p.to_seq, $4) - greatest($3, p.from_seq - 1)))
                      OVER (ORDER BY p.from_seq ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0)::int8 AS before
      FROM membership_periods p
     WHERE p.conv_id = $1 AND p.user_id = $2 AND coalesce(p.to_seq, $4) > $3) w
   WHERE w.before < $5) p
 CROSS JOIN LATERAL (
   SELECT ",
    event_columns!(),
    ", ",
    reactions_sql!(),
    "
     FROM events e
    WHERE e.conv_id = p.conv_id AND e.seq > greatest($3, p.from_seq - 1) AND e.seq <= least(p.to_seq, $4)
    ORDER BY e.seq LIMIT $5 - p.before) e
 ORDER BY e.seq LIMIT $5"
);

/// Backward page: $3 before, $4 head, $5 limit, $6 min_seq.
const SYNC_BACKWARD: &str = concat!(
    "
SELECT e.* FROM membership_periods p
 CROSS JOIN LATERAL (
   SELECT ",
    event_columns!(),
    ", ",
    reactions_sql!(),
    "
     FROM events e
    WHERE e.conv_id = p.conv_id AND e.seq >= greatest(p.from_seq, $6) AND e.seq <= least(p.to_seq, $4)
      AND e.seq < $3
    ORDER BY e.seq DESC LIMIT $5) e
 WHERE p.conv_id = $1 AND p.user_id = $2 AND p.from_seq < $3
 ORDER BY e.seq DESC LIMIT $5"
);

impl Store {
    /// The page from PostgreSQL whatever the tail holds (the reference the
    /// tail's answers are tested against): from the standby when it can
    /// answer it, else from the primary.
    pub async fn sync_sql(&self, req: &SyncRequest) -> Result<SyncPage, StoreError> {
        if let Some(page) = self.sync_on_standby(req).await {
            return Ok(page);
        }
        let (page, _) = read_page(self.pool.get().await?, req).await?;
        Ok(page)
    }
}

/// `req`'s page read on `conn`, and the conversation's head there (how far
/// that server has it).
pub(super) async fn read_page(
    conn: PooledConnection<'_, Manager>,
    req: &SyncRequest,
) -> Result<(SyncPage, i64), StoreError> {
    let (conv, user) = (req.conv.as_str(), req.user.as_str());
    // The header is read first: every event up to this head committed with
    // (or before) the `next_seq` we read, so the page below sees all of them.
    let header = conn
        .query_prepared_opt(HEADER, &[(&conv, Type::TEXT), (&user, Type::TEXT)])
        .await?
        .ok_or(Rejection::NotMember)?;
    let (head, min_seq, epoch): (i64, i64, i32) = (header.get(0), header.get(1), header.get(2));
    let conversation_head: i64 = header.get(3);
    if req.epoch.is_some_and(|e| e != epoch) {
        return Err(Rejection::EpochChanged { epoch, min_seq }.into());
    }
    let fetch = req.limit.clamp(1, SYNC_MAX_LIMIT) + 1;
    // A page forward from `after_seq` or backward below `before_seq`: the
    // same parameters, and backward also takes `$6`, min_seq.
    let (sql, bound, n) = match req.before_seq {
        Some(before) => (SYNC_BACKWARD, before, 6),
        None => (SYNC_FORWARD, req.after_seq.unwrap_or(0).max(0).max(min_seq - 1), 5),
    };
    let params = [
        (&conv as &(dyn ToSql + Sync), Type::TEXT),
        (&user, Type::TEXT),
        (&bound, Type::INT8),
        (&head, Type::INT8),
        (&fetch, Type::INT8),
        (&min_seq, Type::INT8),
    ];
    let rows = conn.query_prepared(sql, &params[..n]).await?;
    drop(conn);
    let decoded = rows.iter().map(|r| {
        let reactions = match r.get::<_, Option<&str>>(REACTIONS_AT) {
            Some(json) => Some(serde_json::from_str(json).map_err(|_| StoreError::Undecodable("reactions"))?),
            None => None,
        };
        Ok((SyncEvent::shared(event_from_row(&req.conv, r)?), reactions))
    });
    if req.before_seq.is_none() {
        return Ok((forward_page(req, (head, min_seq, epoch), decoded)?, conversation_head));
    }
    // Backward rows come newest first, so the budget keeps the events
    // nearest `before_seq`.
    let mut page = empty_page(head, min_seq, epoch);
    let limit = (fetch - 1) as usize;
    let cut = fill_within_budget(&mut page, decoded.take(limit), req.max_bytes)?;
    page.has_more = cut || rows.len() > limit;
    page.events.reverse();
    page.next_before = page.events.first().map(|e| e.seq);
    page.next_after = page.events.last().map_or(bound.min(head + 1) - 1, |e| e.seq);
    Ok((page, conversation_head))
}

/// An event of a page with the reactions of its message, if it has any.
pub(super) type PageEvent = (Arc<SyncEvent>, Option<Vec<ReactionCount>>);

/// A forward page of `events` (the visible ones from the bound on, ascending,
/// at most `limit + 1`), both paths' one paging rule: `(head, min_seq, epoch)`
/// as the header read them.
pub(super) fn forward_page(
    req: &SyncRequest,
    (head, min_seq, epoch): (i64, i64, i32),
    events: impl ExactSizeIterator<Item = Result<PageEvent, StoreError>>,
) -> Result<SyncPage, StoreError> {
    let after = req.after_seq.unwrap_or(0).max(0);
    let bound = after.max(min_seq - 1);
    let limit = req.limit.clamp(1, SYNC_MAX_LIMIT) as usize;
    let mut page = empty_page(head, min_seq, epoch);
    page.truncated = after < min_seq - 1;
    let fetched = events.len();
    let cut = fill_within_budget(&mut page, events.take(limit), req.max_bytes)?;
    page.has_more = cut || fetched > limit;
    page.next_after = match page.events.last() {
        Some(last) if page.has_more => last.seq,
        // Nothing visible remains up to head: the scan covered it all.
        _ => bound.max(head),
    };
    Ok(page)
}

fn empty_page(head: i64, min_seq: i64, epoch: i32) -> SyncPage {
    SyncPage {
        events: vec![],
        head,
        min_seq,
        epoch,
        next_after: 0,
        next_before: None,
        has_more: false,
        truncated: false,
        reactions: HashMap::new(),
    }
}

/// Takes `events` in order into `page` until their bodies would exceed
/// `max_bytes`; the first event with a body is always taken, so paging
/// progresses. True when the budget cut the page short.
fn fill_within_budget(
    page: &mut SyncPage,
    events: impl Iterator<Item = Result<PageEvent, StoreError>>,
    max_bytes: usize,
) -> Result<bool, StoreError> {
    let mut used = 0usize;
    for e in events {
        let (event, reactions) = e?;
        let size = body_bytes(&event);
        if used > 0 && used.saturating_add(size) > max_bytes {
            return Ok(true);
        }
        used = used.saturating_add(size);
        if let Some(reactions) = reactions {
            page.reactions.insert(event.seq, reactions);
        }
        page.events.push(event);
    }
    Ok(false)
}

/// The bytes an event carries beyond its fixed fields.
pub(super) fn body_bytes(event: &Event) -> usize {
    match &event.kind {
        EventKind::Msg { body, .. } | EventKind::Edit { body, .. } => body.as_ref().map_or(0, String::len),
        EventKind::Group { change, .. } => change.len(),
        EventKind::Recall { .. } | EventKind::Join { .. } | EventKind::Leave { .. } | EventKind::Reaction { .. } => 0,
    }
}

/// The column of a sync row with the message's reactions, after the event's.
const REACTIONS_AT: usize = EVENT_COLUMN_COUNT;

/// Columns of an event row (0–19): those of the core log, then of v1.2.
pub(super) const EVENT_COLUMN_COUNT: usize = 20;

/// Decodes a row of the event columns selected by the sync queries; a row
/// the schema's constraints make impossible fails the read (ARCHITECTURE §2).
pub(super) fn event_from_row(conv: &ConvId, r: &Row) -> Result<Event, StoreError> {
    let user = |i: usize| decoded(UserId::parse(r.get::<_, Option<&str>>(i).unwrap_or_default()), "event user_id");
    let device = || decoded(DeviceId::parse(r.get(5)), "event device_id");
    let seq: i64 = r.get(0);
    let kind = match r.get::<_, &str>(1) {
        "msg" => EventKind::Msg {
            message_id: r.get(3),
            sender: user(4)?,
            sender_device: device()?,
            client_msg_id: decoded(ClientMsgId::parse(r.get(6)), "client_msg_id")?,
            body: r.get(7),
            recalled: r.get(13),
            reply_to: r.get(14),
            mentions: r
                .get::<_, Option<Vec<&str>>>(15)
                .unwrap_or_default()
                .into_iter()
                .map(|u| decoded(UserId::parse(u), "mentioned user_id"))
                .collect::<Result<_, _>>()?,
            mention_all: r.get::<_, Option<bool>>(16).unwrap_or(false),
            edited_at: r.get(17),
        },
        "edit" => EventKind::Edit {
            sender: user(4)?,
            sender_device: device()?,
            client_msg_id: decoded(ClientMsgId::parse(r.get(6)), "client_msg_id")?,
            target_seq: r.get(11),
            body: r.get(7),
        },
        "reaction" => EventKind::Reaction {
            sender: user(4)?,
            sender_device: device()?,
            target_seq: r.get(11),
            emoji: decoded(Emoji::parse(r.get::<_, Option<&str>>(18).unwrap_or_default()), "emoji")?,
            on: r.get::<_, Option<bool>>(19).ok_or(StoreError::Undecodable("reaction_on"))?,
        },
        "recall" => EventKind::Recall {
            sender: user(4)?,
            sender_device: decoded(r.get::<_, Option<&str>>(5).map(DeviceId::parse).transpose(), "event device_id")?,
            target_seq: r.get(11),
        },
        "join" => EventKind::Join { subject: user(8)?, actor: user(9)? },
        "leave" => EventKind::Leave {
            subject: user(8)?,
            actor: user(9)?,
            reason: LeaveReason::parse(r.get(10)).ok_or(StoreError::Undecodable("leave reason"))?,
        },
        "group" => EventKind::Group {
            actor: decoded(r.get::<_, Option<&str>>(9).map(UserId::parse).transpose(), "event actor")?,
            change: r.get(12),
        },
        _ => return Err(StoreError::Undecodable("event kind")),
    };
    Ok(Event { conv_id: conv.clone(), seq, created_at: r.get(2), kind })
}
