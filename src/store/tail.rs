//! The tail cache (ARCHITECTURE §4, "The tail in memory"): per conversation,
//! the last events before a snapshot of its members' periods and those
//! committed since, so that a forward `sync` inside that tail is answered
//! without PostgreSQL, with the same visibility, budget and paging as the SQL path.
//!
//! Invariant: a ring holds every event from `base + 1` to `head`, each in its
//! stored form, or the seq is marked `changed` (a later recall, edit or
//! reaction altered it, or it had reactions when loaded) and a page that
//! would show it reads PostgreSQL. A
//! gap, a `group` event, an epoch bump or a purge drops the ring. Bounded in
//! bytes (`IMCORE_SYNC_TAIL_BYTES`; at the cap the least recently read rings
//! go); a ring is made by the first `sync` that misses, loaded once (single
//! flight) while later misses wait for it; a `sync` whose load fails reads
//! PostgreSQL, never loads again.

use dashmap::mapref::entry::Entry;
use dashmap::DashMap;
use imcore_actors::{ConvId, UserId};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::sync::watch;

use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::IsolationLevel;

use super::error::decoded;
use super::sync::{event_from_row, forward_page, SyncEvent, SyncPage, SyncRequest, EVENT_COLUMN_COUNT};
use super::write::Appended;
use super::{Store, StoreError};
use crate::domain::{Event, EventKind, Rejection};

/// A member's periods, `(from_seq, to_seq)` by ascending `from_seq`; an open one last.
type Periods = Vec<(i64, Option<i64>)>;

/// Bytes a member's entry costs besides its id (map slot, vector, one period).
const PERIODS_OVERHEAD: usize = 96;
/// Bytes an event costs besides its body, its PROTOCOL encoding's fixed
/// fields included (ids, seq, times: kept with it once a page shows it).
const EVENT_OVERHEAD: usize = 416;

pub struct Tail {
    rings: DashMap<ConvId, Slot>,
    /// Most bytes all rings together may hold; 0 turns the cache off.
    cap: usize,
    /// Set once this node joined a cluster (see [`Tail::disable`]).
    off: AtomicBool,
    used: AtomicUsize,
    /// Ticks once per page served or ring loaded: `read_at` orders rings by their last read.
    clock: AtomicU64,
    /// An eviction is running (one at a time; other misses read PostgreSQL meanwhile).
    evicting: AtomicBool,
    pub counts: TailCounts,
}

/// What the cache did, for metrics and tests.
#[derive(Default)]
pub struct TailCounts {
    /// `sync`s answered from a ring.
    pub hits: AtomicU64,
    /// Ring loads started (snapshot statements), whether they succeed or not.
    pub loads: AtomicU64,
    /// `sync`s that waited for a load another one started (coalesced).
    pub coalesced: AtomicU64,
    /// Rings dropped at the cap to make room, least recently read first.
    pub evicted: AtomicU64,
}

enum Slot {
    /// A load is running; batches committed meanwhile wait here.
    Loading {
        /// Which load: one that [`Tail::forget`] dropped must not fill a later one's slot.
        load: u64,
        waiting: Vec<Vec<Event>>,
        done: watch::Sender<()>,
    },
    Ready(Ring),
}

/// What the loading `sync` read, in one snapshot.
pub(super) struct Snapshot {
    pub head: i64,
    pub min_seq: i64,
    pub epoch: i32,
    pub periods: HashMap<UserId, Periods>,
    /// The last events up to `head` (at most [`TAIL_PRELOAD`], none below
    /// `min_seq`), ascending and gapless, each with whether its message has
    /// reactions (a page showing it reads PostgreSQL, as for a `changed` one).
    pub recent: Vec<(Event, bool)>,
}

/// Events a ring starts with below the head it is loaded at: the devices
/// that went online shortly before find their first `sync` in it too.
const TAIL_PRELOAD: i64 = 256;

struct Ring {
    base: i64,
    head: i64,
    min_seq: i64,
    epoch: i32,
    /// Seqs `base + 1 ..= head`, each shared with the pages that show it.
    events: VecDeque<Arc<SyncEvent>>,
    changed: HashSet<i64>,
    periods: HashMap<UserId, Periods>,
    bytes: usize,
    /// [`Tail::clock`] when a page last came from it (or it was loaded).
    read_at: AtomicU64,
}

/// The snapshot a tail ring starts from (one statement): the head, `min_seq`,
/// epoch and every member's periods, by user and `from_seq`.
const TAIL_SNAPSHOT: &str = "
SELECT c.next_seq - 1, c.min_seq, c.epoch, p.users, p.froms, p.tos
  FROM conversations c
 CROSS JOIN LATERAL (
   SELECT array_agg(p.user_id ORDER BY p.user_id, p.from_seq) AS users,
          array_agg(p.from_seq ORDER BY p.user_id, p.from_seq) AS froms,
          array_agg(p.to_seq ORDER BY p.user_id, p.from_seq) AS tos
     FROM membership_periods p WHERE p.conv_id = c.conv_id) p
 WHERE c.conv_id = $1";

/// The events of `$1` after `$2` up to `$3`, ascending, each with whether its
/// message has reactions.
const TAIL_RECENT: &str = concat!(
    "SELECT ",
    event_columns!(),
    ", e.kind = 'msg' AND EXISTS (SELECT 1 FROM reaction_counts rc
                                   WHERE rc.conv_id = e.conv_id AND rc.target_seq = e.seq AND rc.count > 0)
  FROM events e
 WHERE e.conv_id = $1 AND e.seq > $2 AND e.seq <= $3
 ORDER BY e.seq"
);

impl Store {
    /// A page from the conversation's tail in memory when it lies inside it
    /// ([`Tail`](super::tail::Tail)), else from PostgreSQL.
    ///
    /// A request waits for or runs at most one load: a load that fails (no
    /// such conversation, a database error, a batch the ring cannot follow)
    /// leaves no ring, and the request then reads PostgreSQL instead of
    /// loading again.
    pub async fn sync(&self, req: &SyncRequest) -> Result<SyncPage, StoreError> {
        match self.tail.lookup(req, true) {
            Lookup::Page(page) => return page,
            Lookup::Sql => return self.sync_sql(req).await,
            // Err: the load ended and dropped the sender; either way, look again.
            Lookup::Wait(mut done) => while done.changed().await.is_ok() {},
            Lookup::Load(load) => {
                let loading = Loading { tail: &self.tail, conv: &req.conv, load };
                let snapshot = self.tail_snapshot(&req.conv).await;
                loading.end(snapshot.ok().flatten());
            }
        }
        match self.tail.lookup(req, false) {
            Lookup::Page(page) => page,
            _ => self.sync_sql(req).await,
        }
    }

    /// The snapshot and the events before its head, read in one transaction
    /// (repeatable read: both at the same point of the log).
    async fn tail_snapshot(&self, conv: &ConvId) -> Result<Option<Snapshot>, StoreError> {
        let mut conn = self.pool.get().await?;
        let tx =
            conn.build_transaction().isolation_level(IsolationLevel::RepeatableRead).read_only(true).start().await?;
        let Some(row) = tx.query_typed_opt(TAIL_SNAPSHOT, &[(&conv.as_str(), Type::TEXT)]).await? else {
            return Ok(None);
        };
        let (head, min_seq): (i64, i64) = (row.get(0), row.get(1));
        let from = (head - TAIL_PRELOAD).max(min_seq - 1);
        let params = [(&conv.as_str() as &(dyn ToSql + Sync), Type::TEXT), (&from, Type::INT8), (&head, Type::INT8)];
        let rows = tx.query_typed(TAIL_RECENT, &params).await?;
        tx.commit().await?;
        drop(conn);
        let recent = rows
            .iter()
            .map(|r| Ok((event_from_row(conv, r)?, r.get::<_, bool>(EVENT_COLUMN_COUNT))))
            .collect::<Result<Vec<_>, StoreError>>()?;
        // The log is gapless from `min_seq` (P1): one row per seq of the
        // range, or no ring.
        if recent.len() as i64 != head - from {
            return Err(StoreError::Invariant("the events before a tail's head are not gapless"));
        }
        let users: Vec<&str> = row.get::<_, Option<_>>(3).unwrap_or_default();
        let froms: Vec<i64> = row.get::<_, Option<_>>(4).unwrap_or_default();
        let tos: Vec<Option<i64>> = row.get::<_, Option<_>>(5).unwrap_or_default();
        let mut periods: HashMap<UserId, Vec<(i64, Option<i64>)>> = HashMap::new();
        for ((user, from), to) in users.into_iter().zip(froms).zip(tos) {
            let user = decoded(UserId::parse(user), "member user_id")?;
            periods.entry(user).or_default().push((from, to));
        }
        Ok(Some(Snapshot { head, min_seq, epoch: row.get(2), periods, recent }))
    }
}

/// A ring load in progress; dropped unfinished (the request was cancelled),
/// it ends the load as failed so that nobody waits for it forever.
struct Loading<'a> {
    tail: &'a Tail,
    conv: &'a ConvId,
    load: u64,
}

impl Loading<'_> {
    fn end(self, snapshot: Option<Snapshot>) {
        self.tail.loaded(self.conv, self.load, snapshot);
        std::mem::forget(self);
    }
}

impl Drop for Loading<'_> {
    fn drop(&mut self) {
        self.tail.loaded(self.conv, self.load, None);
    }
}

/// What [`Tail::lookup`] found.
pub(super) enum Lookup {
    Page(Result<SyncPage, StoreError>),
    /// Wait for the load in progress (the sender goes when it ends), then look again.
    Wait(watch::Receiver<()>),
    /// The caller runs this load of the ring ([`Tail::loaded`] after, whatever happened).
    Load(u64),
    /// Read PostgreSQL.
    Sql,
}

impl Tail {
    pub fn new(cap: usize) -> Self {
        Self {
            rings: DashMap::new(),
            cap,
            off: AtomicBool::new(false),
            used: AtomicUsize::new(0),
            clock: AtomicU64::new(0),
            evicting: AtomicBool::new(false),
            counts: TailCounts::default(),
        }
    }

    /// Bytes all rings hold now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// For the metrics: bytes held, the cap, and the running totals of
    /// `sync`s answered from memory, ring loads, `sync`s that waited for
    /// another's load, and rings dropped at the cap.
    pub fn sample(&self) -> [(&'static str, u64); 6] {
        let c = &self.counts;
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        [
            ("bytes", self.used() as u64),
            ("cap", self.cap as u64),
            ("hits_total", n(&c.hits)),
            ("loads_total", n(&c.loads)),
            ("coalesced_total", n(&c.coalesced)),
            ("evicted_total", n(&c.evicted)),
        ]
    }

    /// Answers `req` from its conversation's ring if the page lies inside it;
    /// without one, waits for or starts a load only if `may_load`.
    pub(super) fn lookup(&self, req: &SyncRequest, may_load: bool) -> Lookup {
        if self.cap == 0 || req.before_seq.is_some() || self.off.load(Ordering::Relaxed) {
            return Lookup::Sql;
        }
        if let Some(slot) = self.rings.get(&req.conv) {
            return match &*slot {
                Slot::Ready(ring) => match ring.page(req) {
                    Some(page) => {
                        self.counts.hits.fetch_add(1, Ordering::Relaxed);
                        ring.read_at.store(self.tick(), Ordering::Relaxed);
                        Lookup::Page(page)
                    }
                    None => Lookup::Sql,
                },
                Slot::Loading { done, .. } if may_load => {
                    self.counts.coalesced.fetch_add(1, Ordering::Relaxed);
                    Lookup::Wait(done.subscribe())
                }
                Slot::Loading { .. } => Lookup::Sql,
            };
        }
        if !may_load || (self.used() >= self.cap && !self.evict_least_read()) {
            return Lookup::Sql;
        }
        match self.rings.entry(req.conv.clone()) {
            Entry::Vacant(e) => {
                let load = self.counts.loads.fetch_add(1, Ordering::Relaxed);
                e.insert(Slot::Loading { load, waiting: vec![], done: watch::channel(()).0 });
                Lookup::Load(load)
            }
            Entry::Occupied(_) => Lookup::Sql,
        }
    }

    /// The load of `conv`'s ring ended with `snapshot` (`None`: it failed):
    /// the batches that waited are applied past the snapshot's head, and the
    /// `sync`s that waited wake (the slot's sender is dropped).
    pub(super) fn loaded(&self, conv: &ConvId, load: u64, snapshot: Option<Snapshot>) {
        let Some(mut slot) = self.rings.get_mut(conv) else { return };
        let Slot::Loading { load: running, waiting, .. } = &mut *slot else { return };
        if *running != load {
            return;
        }
        let waiting = std::mem::take(waiting);
        let now = self.tick();
        let ring = snapshot.map(|s| Ring::new(s, now)).and_then(|mut ring| {
            let ok = waiting.iter().all(|events| ring.apply(events));
            ring.evict(self.ring_cap());
            ok.then_some(ring)
        });
        match ring {
            Some(ring) => {
                self.used.fetch_add(ring.bytes, Ordering::Relaxed);
                *slot = Slot::Ready(ring);
                drop(slot);
            }
            None => {
                drop(slot);
                self.rings.remove(conv);
            }
        }
    }

    /// A batch committed (by the store, before its acks; a batch seen twice
    /// is ignored): appended to its ring, if any.
    pub fn committed(&self, appended: &Appended) {
        let Some(mut slot) = self.rings.get_mut(&appended.conv_id) else { return };
        match &mut *slot {
            Slot::Loading { waiting, .. } => waiting.push(appended.events.clone()),
            Slot::Ready(ring) => {
                let before = ring.bytes;
                let kept = ring.apply(&appended.events);
                let after = if kept { ring.evict(self.ring_cap()) } else { 0 };
                self.used.fetch_add(after, Ordering::Relaxed);
                self.used.fetch_sub(before, Ordering::Relaxed);
                if !kept {
                    drop(slot);
                    self.rings.remove(&appended.conv_id);
                }
            }
        }
    }

    /// `conv`'s stored log or epoch changed outside a batch (epoch bump,
    /// retention purge): its ring goes, and so does a load in progress,
    /// whose snapshot may predate the change.
    pub fn forget(&self, conv: &ConvId) {
        if let Some((_, Slot::Ready(ring))) = self.rings.remove(conv) {
            self.used.fetch_sub(ring.bytes, Ordering::Relaxed);
        }
    }

    /// From now on every `sync` reads PostgreSQL: with several nodes, an epoch
    /// bump or a purge on another would not reach this node's rings.
    pub fn disable(&self) {
        self.off.store(true, Ordering::Relaxed);
        self.rings.clear();
        self.used.store(0, Ordering::Relaxed);
    }

    /// The next reading of [`Tail::clock`].
    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// At the cap: drops the rings read least recently until an eighth of the
    /// cap is free (a conversation synced once long ago must not keep a hot
    /// one out). False when another eviction is running or nothing could go.
    fn evict_least_read(&self) -> bool {
        if self.evicting.swap(true, Ordering::Acquire) {
            return false;
        }
        let mut ready: Vec<(u64, ConvId)> = self
            .rings
            .iter()
            .filter_map(|e| match e.value() {
                Slot::Ready(ring) => Some((ring.read_at.load(Ordering::Relaxed), e.key().clone())),
                Slot::Loading { .. } => None,
            })
            .collect();
        ready.sort_unstable_by_key(|(read_at, _)| *read_at);
        let goal = self.cap - self.cap / 8;
        for (_, conv) in ready {
            if self.used() <= goal {
                break;
            }
            self.forget(&conv);
            self.counts.evicted.fetch_add(1, Ordering::Relaxed);
        }
        self.evicting.store(false, Ordering::Release);
        self.used() < self.cap
    }

    /// One ring may hold a quarter of the cap, so several hot conversations fit.
    fn ring_cap(&self) -> usize {
        self.cap / 4
    }
}

impl Ring {
    fn new(s: Snapshot, now: u64) -> Self {
        let periods: usize = s.periods.iter().map(|(u, p)| PERIODS_OVERHEAD + u.as_str().len() + 16 * p.len()).sum();
        let bytes = periods + s.recent.iter().map(|(e, _)| event_bytes(e)).sum::<usize>();
        let changed = s.recent.iter().filter(|(_, reacted)| *reacted).map(|(e, _)| e.seq).collect();
        Self {
            base: s.head - s.recent.len() as i64,
            head: s.head,
            min_seq: s.min_seq,
            epoch: s.epoch,
            events: s.recent.into_iter().map(|(e, _)| SyncEvent::shared(e)).collect(),
            changed,
            periods: s.periods,
            bytes,
            read_at: AtomicU64::new(now),
        }
    }

    /// Appends `appended`'s events; false when the ring cannot follow it (a
    /// gap, a `group` event, periods it does not know): the ring goes.
    fn apply(&mut self, events: &[Event]) -> bool {
        let Some(last) = events.last() else { return true };
        if last.seq <= self.head {
            return true;
        }
        for event in events {
            if event.seq <= self.head {
                continue;
            }
            if event.seq != self.head + 1 || !self.follow(event) {
                return false;
            }
            self.bytes += event_bytes(event);
            self.events.push_back(SyncEvent::shared(event.clone()));
            self.head = event.seq;
        }
        true
    }

    /// What `event` changes of the ring's knowledge; false when it cannot tell.
    fn follow(&mut self, event: &Event) -> bool {
        match &event.kind {
            EventKind::Msg { .. } => {}
            EventKind::Edit { target_seq, .. } | EventKind::Reaction { target_seq, .. } => {
                self.changed.insert(*target_seq);
            }
            EventKind::Recall { target_seq, .. } => {
                // The message's body and its edits' bodies are erased.
                self.changed.insert(*target_seq);
                let edits = self
                    .events
                    .iter()
                    .filter(|e| matches!(e.kind, EventKind::Edit { target_seq: t, .. } if t == *target_seq));
                self.changed.extend(edits.map(|e| e.seq).collect::<Vec<_>>());
            }
            EventKind::Join { subject, .. } => {
                let periods = self.periods.entry(subject.clone()).or_default();
                if periods.last().is_some_and(|p| p.1.is_none()) {
                    return false;
                }
                self.bytes += PERIODS_OVERHEAD + subject.as_str().len();
                periods.push((event.seq, None));
            }
            EventKind::Leave { subject, .. } => match self.periods.get_mut(subject).and_then(|p| p.last_mut()) {
                Some(open) if open.1.is_none() => open.1 = Some(event.seq),
                _ => return false,
            },
            EventKind::Group { .. } => return false,
        }
        true
    }

    /// Drops the oldest events past `cap` bytes; returns the bytes kept.
    fn evict(&mut self, cap: usize) -> usize {
        while self.bytes > cap {
            let Some(first) = self.events.pop_front() else { break };
            self.bytes -= event_bytes(&first);
            self.changed.remove(&first.seq);
            self.base = first.seq;
        }
        self.bytes
    }

    /// The forward page `req` asks for, exactly as the SQL path pages it, or
    /// `None` when part of it is not in the ring as stored.
    fn page(&self, req: &SyncRequest) -> Option<Result<SyncPage, StoreError>> {
        let Some(periods) = self.periods.get(&req.user) else {
            return Some(Err(Rejection::NotMember.into()));
        };
        // A former member's head is where its last period ended.
        let head = periods.last().and_then(|p| p.1).map_or(self.head, |to| to.min(self.head));
        if req.epoch.is_some_and(|e| e != self.epoch) {
            return Some(Err(Rejection::EpochChanged { epoch: self.epoch, min_seq: self.min_seq }.into()));
        }
        let after = req.after_seq.unwrap_or(0).max(0);
        let bound = after.max(self.min_seq - 1);
        if bound < self.base {
            return None;
        }
        let fetch = req.limit.clamp(1, super::SYNC_MAX_LIMIT) as usize + 1;
        let visible = |seq: i64| periods.iter().any(|&(from, to)| from <= seq && seq <= to.unwrap_or(head).min(head));
        let start = usize::try_from(bound - self.base).ok()?;
        let events: Vec<&Arc<SyncEvent>> = self
            .events
            .iter()
            .skip(start)
            .take_while(|e| e.seq <= head)
            .filter(|e| visible(e.seq))
            .take(fetch)
            .collect();
        if events.iter().any(|e| self.changed.contains(&e.seq)) {
            return None;
        }
        let page =
            forward_page(req, (head, self.min_seq, self.epoch), events.into_iter().map(|e| Ok((Arc::clone(e), None))));
        Some(page)
    }
}

/// Counted in full when the event enters the ring: its body twice, stored
/// and in the encoding the first page that shows it keeps (`SyncEvent`).
fn event_bytes(event: &Event) -> usize {
    EVENT_OVERHEAD + 2 * super::sync::body_bytes(event)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(conv: &ConvId) -> SyncRequest {
        let user = UserId::parse("u-ana").expect("user");
        SyncRequest {
            conv: conv.clone(),
            user,
            after_seq: Some(1),
            before_seq: None,
            limit: 10,
            epoch: None,
            max_bytes: 1 << 20,
        }
    }

    /// Loads `conv`'s ring (u-ana a member since seq 1); whether a load ran.
    fn load(tail: &Tail, conv: &ConvId) -> bool {
        let Lookup::Load(load) = tail.lookup(&request(conv), true) else { return false };
        let periods = HashMap::from([(UserId::parse("u-ana").expect("user"), vec![(1, None)])]);
        tail.loaded(conv, load, Some(Snapshot { head: 1, min_seq: 1, epoch: 1, periods, recent: vec![] }));
        true
    }

    #[test]
    fn at_the_cap_the_rings_read_least_recently_make_room() {
        let convs: Vec<ConvId> = ["a", "b", "c", "d"].iter().map(|c| ConvId::parse(c).expect("conv")).collect();
        let ring = PERIODS_OVERHEAD + "u-ana".len() + 16;
        // Room for three rings before the cap, not for a fourth.
        let tail = Tail::new(3 * ring);
        assert!(load(&tail, &convs[0]) && load(&tail, &convs[1]) && load(&tail, &convs[2]));
        assert_eq!(tail.used(), 3 * ring);
        // `a` is read again: `b` is now the ring read least recently.
        assert!(matches!(tail.lookup(&request(&convs[0]), true), Lookup::Page(Ok(_))));
        assert!(load(&tail, &convs[3]), "the fourth conversation got no ring");
        assert!(tail.rings.contains_key(&convs[0]) && !tail.rings.contains_key(&convs[1]));
        assert!(tail.rings.contains_key(&convs[2]) && tail.rings.contains_key(&convs[3]));
        assert_eq!((tail.used(), tail.counts.evicted.load(Ordering::Relaxed)), (3 * ring, 1));
    }
}
