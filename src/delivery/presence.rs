//! What one delivery lane knows about its online users' conversations
//! (ARCHITECTURE §5): the recipients of a batch are found here, never in a
//! conversation's member list. Owned by its lane's thread, so no locks.
//!
//! Per online user and conversation: the open period's start (if any) and
//! the head that knowledge reflects. It starts from a snapshot the user's
//! connection loads from the database and is kept current by applying every
//! batch in seq order; a batch that does not follow on what a user knows (a
//! gap) makes that knowledge untrustworthy, and the user resyncs.

use std::collections::{HashMap, HashSet};

use imcore_actors::registry::ConnId;
use imcore_actors::{ConvId, UserId};

use crate::domain::{Event, EventKind};
use crate::store::Membership;

/// A user's knowledge of one conversation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Period {
    /// Member since this seq; `None`: not a member now.
    open_from: Option<i64>,
    /// The conversation's head this knowledge reflects.
    seen_up_to: i64,
}

enum Knowledge<B> {
    /// Subscribed; the snapshot is being read. What the lane saw meanwhile,
    /// in order, to apply on top of it; `None` once over the bound (the user
    /// resyncs when the snapshot comes).
    Loading(Option<Vec<B>>),
    Live(HashMap<ConvId, Period>),
}

struct User<B> {
    /// The connections subscribed; the state goes with the last one.
    conns: Vec<ConnId>,
    knowledge: Knowledge<B>,
}

/// A committed batch of one conversation: its events, ascending seq.
pub struct Batch<'a> {
    pub conv: &'a ConvId,
    pub events: &'a [Event],
}

/// What a user gets of a batch.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    /// Nothing: not a member, or not tracked.
    Nothing,
    /// The indices of the events it sees (possibly none).
    Visible(Vec<usize>),
    /// Its knowledge was dropped: the caller closes its connections.
    Resync,
}

/// What [`Presence::load`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum Loaded<B> {
    /// Not a subscribed connection, or the user's state is live already.
    Ignored,
    /// The state is live; apply these (seen while loading) for the user, in order.
    Replay(Vec<B>),
    /// Too much was seen while loading: the state was dropped; resync.
    Resync,
}

/// The lane's online users and what they know (`B`: what the lane saw while
/// a user's snapshot was loading).
pub struct Presence<B> {
    users: HashMap<UserId, User<B>>,
    /// Users whose snapshot is loading: they see every batch, buffered.
    loading: HashSet<UserId>,
    /// Conversation → lane users tracking it (a period, open or not).
    trackers: HashMap<ConvId, HashSet<UserId>>,
    /// (user, conversation) pairs tracked, for the gauges.
    periods: usize,
    max_buffered: usize,
}

impl<B: Clone> Presence<B> {
    /// A user loading its snapshot buffers up to `max_buffered` batches.
    pub fn new(max_buffered: usize) -> Self {
        Self { users: HashMap::new(), loading: HashSet::new(), trackers: HashMap::new(), periods: 0, max_buffered }
    }

    /// Online users and their tracked (user, conversation) pairs.
    pub fn size(&self) -> (usize, usize) {
        (self.users.len(), self.periods)
    }

    /// Whether `user`'s state is loaded and kept current.
    pub fn is_live(&self, user: &UserId) -> bool {
        matches!(self.users.get(user), Some(User { knowledge: Knowledge::Live(_), .. }))
    }

    /// Connection `conn` of `user` comes online; its snapshot is read after
    /// this. A user already known keeps its state (a second device).
    pub fn subscribe(&mut self, user: &UserId, conn: ConnId) {
        let entry = self.users.entry(user.clone()).or_insert_with(|| {
            self.loading.insert(user.clone());
            User { conns: Vec::new(), knowledge: Knowledge::Loading(Some(Vec::new())) }
        });
        if !entry.conns.contains(&conn) {
            entry.conns.push(conn);
        }
    }

    /// Connection `conn` of `user` is gone; the user's state goes with its
    /// last connection. Unknown connections are ignored.
    pub fn unsubscribe(&mut self, user: &UserId, conn: ConnId) {
        let Some(entry) = self.users.get_mut(user) else { return };
        entry.conns.retain(|c| *c != conn);
        if entry.conns.is_empty() {
            self.remove(user);
        }
    }

    /// Keeps `seen` for every user whose snapshot is loading.
    pub fn buffer(&mut self, seen: &B) {
        for user in &self.loading {
            if let Some(User { knowledge: Knowledge::Loading(buffered), .. }) = self.users.get_mut(user) {
                match buffered {
                    Some(b) if b.len() < self.max_buffered => b.push(seen.clone()),
                    _ => *buffered = None,
                }
            }
        }
    }

    /// The snapshot `conn` read for `user`: applied if that connection is
    /// subscribed and the user's state is still loading.
    pub fn load(&mut self, user: &UserId, conn: ConnId, snapshot: Vec<Membership>) -> Loaded<B> {
        let Some(entry) = self.users.get_mut(user).filter(|u| u.conns.contains(&conn)) else {
            return Loaded::Ignored;
        };
        let Knowledge::Loading(buffered) = &mut entry.knowledge else {
            return Loaded::Ignored;
        };
        let Some(buffered) = buffered.take() else {
            self.remove(user);
            return Loaded::Resync;
        };
        let mut convs = HashMap::with_capacity(snapshot.len());
        for m in snapshot {
            self.trackers.entry(m.conv_id.clone()).or_default().insert(user.clone());
            convs.insert(m.conv_id, Period { open_from: m.open_from, seen_up_to: m.head });
        }
        self.periods += convs.len();
        entry.knowledge = Knowledge::Live(convs);
        self.loading.remove(user);
        Loaded::Replay(buffered)
    }

    /// Applies `batch` for every live user it concerns: those tracking its
    /// conversation and those it makes members. Users to resync are dropped.
    pub fn apply(&mut self, batch: &Batch<'_>) -> Vec<(UserId, Step)> {
        let mut concerned: Vec<UserId> =
            self.trackers.get(batch.conv).map(|t| t.iter().cloned().collect()).unwrap_or_default();
        for e in batch.events {
            if let EventKind::Join { subject, .. } = &e.kind {
                if self.users.contains_key(subject) && !concerned.contains(subject) {
                    concerned.push(subject.clone());
                }
            }
        }
        concerned
            .into_iter()
            .map(|user| {
                let step = self.apply_for(&user, batch);
                (user, step)
            })
            .collect()
    }

    /// Applies `batch` for `user` alone (its state is live).
    pub fn apply_for(&mut self, user: &UserId, batch: &Batch<'_>) -> Step {
        let (Some(first), Some(last)) = (batch.events.first(), batch.events.last()) else {
            return Step::Nothing;
        };
        let (first, last) = (first.seq, last.seq);
        let Some(User { knowledge: Knowledge::Live(convs), .. }) = self.users.get_mut(user) else {
            return Step::Nothing;
        };
        let known = convs.get(batch.conv).copied();
        let mut period = match known {
            // Already reflected (in the snapshot): nothing changes.
            Some(p) if last <= p.seen_up_to => return Step::Visible(visible_unchanged(&p, batch.events)),
            // A batch it never saw: what it knows of the conversation may be wrong.
            Some(p) if first > p.seen_up_to + 1 => {
                self.remove(user);
                return Step::Resync;
            }
            Some(p) => p,
            // Newer than its snapshot: only a join makes it a member.
            None if batch.events.iter().any(|e| joins(e, user)) => Period { open_from: None, seen_up_to: first - 1 },
            None => return Step::Nothing,
        };
        let mut visible = Vec::new();
        for (i, e) in batch.events.iter().enumerate() {
            if e.seq <= period.seen_up_to {
                if period.open_from.is_some_and(|from| e.seq >= from) {
                    visible.push(i);
                }
                continue;
            }
            if joins(e, user) {
                period.open_from = Some(e.seq);
            }
            if period.open_from.is_some() {
                visible.push(i);
            }
            let leaves = matches!(&e.kind, EventKind::Leave { subject, .. } if subject == user);
            if leaves || e.kind.dismisses() {
                period.open_from = None;
            }
        }
        period.seen_up_to = period.seen_up_to.max(last);
        // In place when known: no clone of the batch's id, which every lane shares.
        match convs.get_mut(batch.conv) {
            Some(known) => *known = period,
            None => {
                convs.insert(batch.conv.clone(), period);
            }
        }
        if known.is_none() {
            self.periods += 1;
            self.trackers.entry(batch.conv.clone()).or_default().insert(user.clone());
        }
        Step::Visible(visible)
    }

    /// A batch of `conv` with head `head` that the lane never got, whose
    /// joins and leaves were of `subjects`: who must resync (dropped here).
    /// A user whose knowledge already reflects `head` is not concerned.
    pub fn missed(&mut self, conv: &ConvId, head: i64, subjects: &[UserId]) -> Vec<UserId> {
        let mut concerned: Vec<UserId> =
            self.trackers.get(conv).map(|t| t.iter().cloned().collect()).unwrap_or_default();
        concerned.extend(subjects.iter().filter(|s| self.users.contains_key(*s)).cloned());
        concerned.sort();
        concerned.dedup();
        concerned.retain(|user| self.missed_for(user, conv, head, subjects));
        concerned
    }

    /// Whether `user` (its state live) must resync for a missed batch; if
    /// so its state is dropped.
    pub fn missed_for(&mut self, user: &UserId, conv: &ConvId, head: i64, subjects: &[UserId]) -> bool {
        let Some(User { knowledge: Knowledge::Live(convs), .. }) = self.users.get(user) else {
            return false;
        };
        let reflected = convs.get(conv).is_some_and(|p| p.seen_up_to >= head);
        let concerned = convs.contains_key(conv) || subjects.contains(user);
        if reflected || !concerned {
            return false;
        }
        self.remove(user);
        true
    }

    /// The live users of this lane that are members of `conv` now (as far
    /// as the batches applied so far say).
    pub fn members_of(&self, conv: &ConvId) -> Vec<UserId> {
        let Some(trackers) = self.trackers.get(conv) else { return Vec::new() };
        trackers
            .iter()
            .filter(|user| match self.users.get(*user) {
                Some(User { knowledge: Knowledge::Live(convs), .. }) => {
                    convs.get(conv).is_some_and(|p| p.open_from.is_some())
                }
                _ => false,
            })
            .cloned()
            .collect()
    }

    /// Drops every user's state; returns the users (their connections are
    /// being closed).
    pub fn clear(&mut self) -> Vec<UserId> {
        self.loading.clear();
        self.trackers.clear();
        self.periods = 0;
        self.users.drain().map(|(user, _)| user).collect()
    }

    /// Drops `user`'s state (its connections are being closed).
    pub fn remove(&mut self, user: &UserId) {
        let Some(gone) = self.users.remove(user) else { return };
        self.loading.remove(user);
        if let Knowledge::Live(convs) = gone.knowledge {
            self.periods -= convs.len();
            for conv in convs.keys() {
                if let Some(t) = self.trackers.get_mut(conv) {
                    t.remove(user);
                    if t.is_empty() {
                        self.trackers.remove(conv);
                    }
                }
            }
        }
    }
}

fn joins(e: &Event, user: &UserId) -> bool {
    matches!(&e.kind, EventKind::Join { subject, .. } if subject == user)
}

/// The indices of `events` inside the open period of `p`, which they do not change.
fn visible_unchanged(p: &Period, events: &[Event]) -> Vec<usize> {
    let Some(from) = p.open_from else { return Vec::new() };
    events.iter().enumerate().filter(|(_, e)| e.seq >= from).map(|(i, _)| i).collect()
}

#[cfg(test)]
mod tests {
    use chrono::Utc;
    use imcore_actors::registry::RouteRegistry;

    use super::*;
    use crate::domain::LeaveReason;

    fn user(u: &str) -> UserId {
        UserId::parse(u).expect("user id")
    }

    fn conv() -> ConvId {
        ConvId::parse("g-1").expect("conv id")
    }

    fn conns(n: usize) -> Vec<ConnId> {
        let routes = RouteRegistry::<()>::new();
        (0..n).map(|_| routes.next_conn_id()).collect()
    }

    fn event(seq: i64, kind: EventKind) -> Event {
        Event { conv_id: conv(), seq, created_at: Utc::now(), kind }
    }

    fn group(seq: i64, change: &str) -> Event {
        event(seq, EventKind::Group { actor: Some(user("owner")), change: change.into() })
    }

    fn msg(seq: i64) -> Event {
        group(seq, r#"{"name":"x"}"#)
    }

    fn join(seq: i64, u: &str) -> Event {
        event(seq, EventKind::Join { subject: user(u), actor: user("owner") })
    }

    fn leave(seq: i64, u: &str) -> Event {
        event(seq, EventKind::Leave { subject: user(u), actor: user(u), reason: LeaveReason::Left })
    }

    fn membership(open_from: Option<i64>, head: i64) -> Membership {
        Membership { conv_id: conv(), open_from, head }
    }

    /// `u` online with `snapshot`, nothing seen while loading.
    fn online(p: &mut Presence<u32>, u: &str, conn: ConnId, snapshot: Vec<Membership>) {
        p.subscribe(&user(u), conn);
        assert_eq!(p.load(&user(u), conn, snapshot), Loaded::Replay(vec![]));
    }

    fn apply(p: &mut Presence<u32>, events: &[Event]) -> Vec<(UserId, Step)> {
        let c = conv();
        let mut steps = p.apply(&Batch { conv: &c, events });
        steps.sort_by(|a, b| a.0.cmp(&b.0));
        steps
    }

    fn visible(u: &str, indices: &[usize]) -> (UserId, Step) {
        (user(u), Step::Visible(indices.to_vec()))
    }

    #[test]
    fn a_batch_the_snapshot_reflects_changes_nothing_and_the_next_one_applies() {
        let [a, b] = conns(2)[..] else { unreachable!() };
        let mut p = Presence::new(8);
        online(&mut p, "ann", a, vec![membership(Some(3), 5)]);
        online(&mut p, "bob", b, vec![membership(None, 5)]);
        // Seqs 4..=5 are in both snapshots: ann sees them from her join, bob (gone) nothing.
        assert_eq!(
            apply(&mut p, &[msg(2), msg(3), leave(4, "bob"), msg(5)]),
            [visible("ann", &[1, 2, 3]), visible("bob", &[])]
        );
        assert_eq!(apply(&mut p, &[msg(6)]), [visible("ann", &[0]), visible("bob", &[])]);
        assert_eq!(p.size(), (2, 2));
    }

    #[test]
    fn joins_and_leaves_in_one_batch_give_each_user_its_own_period() {
        let [a, b, c] = conns(3)[..] else { unreachable!() };
        let mut p = Presence::new(8);
        online(&mut p, "ann", a, vec![membership(Some(1), 1)]);
        online(&mut p, "bob", b, vec![]);
        online(&mut p, "cid", c, vec![]);
        let batch = [msg(2), join(3, "bob"), msg(4), leave(5, "ann"), msg(6), join(7, "dan")];
        // dan is not online in this lane: nothing of him is kept.
        assert_eq!(apply(&mut p, &batch), [visible("ann", &[0, 1, 2, 3]), visible("bob", &[1, 2, 3, 4, 5])]);
        assert_eq!(apply(&mut p, &[msg(8)]), [visible("ann", &[]), visible("bob", &[0])]);
        assert_eq!(p.size(), (3, 2), "cid tracks nothing");
    }

    #[test]
    fn a_leave_then_a_rejoin_shows_both_ends_and_nothing_in_between() {
        let [a] = conns(1)[..] else { unreachable!() };
        let mut p = Presence::new(8);
        online(&mut p, "ann", a, vec![membership(Some(1), 1)]);
        let batch = [leave(2, "ann"), msg(3), join(4, "ann"), msg(5)];
        assert_eq!(apply(&mut p, &batch), [visible("ann", &[0, 2, 3])]);
        assert_eq!(apply(&mut p, &[leave(6, "ann")]), [visible("ann", &[0])]);
        assert_eq!(apply(&mut p, &[join(7, "ann"), msg(8)]), [visible("ann", &[0, 1])]);
    }

    #[test]
    fn a_dismissal_is_seen_by_every_member_and_closes_every_period() {
        let [a, b] = conns(2)[..] else { unreachable!() };
        let mut p = Presence::new(8);
        online(&mut p, "ann", a, vec![membership(Some(1), 2)]);
        online(&mut p, "bob", b, vec![membership(Some(2), 2)]);
        let batch = [msg(3), group(4, crate::domain::DISMISSED_CHANGE)];
        assert_eq!(apply(&mut p, &batch), [visible("ann", &[0, 1]), visible("bob", &[0, 1])]);
        assert_eq!(apply(&mut p, &[msg(5)]), [visible("ann", &[]), visible("bob", &[])]);
    }

    #[test]
    fn a_gap_drops_the_knowledge_of_every_user_tracking_the_conversation() {
        let [a, b, c] = conns(3)[..] else { unreachable!() };
        let mut p = Presence::new(8);
        online(&mut p, "ann", a, vec![membership(Some(1), 4)]);
        online(&mut p, "bob", b, vec![membership(None, 4)]);
        online(&mut p, "cid", c, vec![membership(Some(1), 6)]);
        // 5..=6 never came: ann and bob resync (bob may have rejoined in them); cid's snapshot has them.
        let steps = apply(&mut p, &[msg(7)]);
        assert_eq!(steps, [(user("ann"), Step::Resync), (user("bob"), Step::Resync), visible("cid", &[0])]);
        assert_eq!(p.size(), (1, 1));
        // A missed batch resyncs whoever tracks it without reflecting it, and its online subjects.
        online(&mut p, "dan", a, vec![]);
        let mut resynced = p.missed(&conv(), 8, &[user("dan"), user("eve")]);
        resynced.sort();
        assert_eq!(resynced, [user("cid"), user("dan")]);
        assert_eq!(p.size(), (0, 0));
    }

    #[test]
    fn members_of_names_the_live_users_with_an_open_period() {
        let [a, b, c] = conns(3)[..] else { unreachable!() };
        let mut p = Presence::<u32>::new(8);
        online(&mut p, "ann", a, vec![membership(Some(1), 2)]);
        online(&mut p, "bob", b, vec![membership(None, 2)]);
        p.subscribe(&user("cid"), c);
        assert_eq!(p.members_of(&conv()), [user("ann")]);
        apply(&mut p, &[join(3, "bob"), leave(4, "ann")]);
        assert_eq!(p.members_of(&conv()), [user("bob")]);
    }

    #[test]
    fn a_second_device_keeps_the_state_and_it_goes_with_the_last_connection() {
        let [a, b] = conns(2)[..] else { unreachable!() };
        let mut p = Presence::new(8);
        online(&mut p, "ann", a, vec![membership(Some(1), 1)]);
        p.subscribe(&user("ann"), b);
        assert_eq!(apply(&mut p, &[join(2, "bob")]), [visible("ann", &[0])]);
        // The second device's snapshot (older or newer) never replaces the live state.
        assert_eq!(p.load(&user("ann"), b, vec![]), Loaded::Ignored);
        assert_eq!(apply(&mut p, &[msg(3)]), [visible("ann", &[0])]);
        p.unsubscribe(&user("ann"), a);
        assert_eq!(p.size(), (1, 1));
        p.unsubscribe(&user("ann"), b);
        assert_eq!(p.size(), (0, 0));
        assert!(p.trackers.is_empty());
    }

    #[test]
    fn an_unsubscribe_before_the_snapshot_or_the_subscribe_leaves_nothing() {
        let [a, b] = conns(2)[..] else { unreachable!() };
        let mut p = Presence::<u32>::new(8);
        p.subscribe(&user("ann"), a);
        p.unsubscribe(&user("ann"), a);
        assert_eq!(p.load(&user("ann"), a, vec![membership(Some(1), 1)]), Loaded::Ignored);
        p.unsubscribe(&user("bob"), b);
        assert_eq!(p.load(&user("bob"), b, vec![membership(Some(1), 1)]), Loaded::Ignored);
        assert_eq!(p.size(), (0, 0));
        assert!(p.trackers.is_empty() && p.loading.is_empty());
    }

    #[test]
    fn clearing_drops_every_user_loading_or_live_and_names_them() {
        let [a, b] = conns(2)[..] else { unreachable!() };
        let mut p = Presence::<u32>::new(8);
        online(&mut p, "ann", a, vec![membership(Some(1), 1)]);
        p.subscribe(&user("bob"), b);
        let mut cleared = p.clear();
        cleared.sort();
        assert_eq!(cleared, [user("ann"), user("bob")]);
        assert_eq!(p.size(), (0, 0));
        assert!(p.trackers.is_empty() && p.loading.is_empty());
        assert_eq!(apply(&mut p, &[msg(2)]), []);
    }

    #[test]
    fn batches_seen_while_loading_are_replayed_and_too_many_resync() {
        let [a, b] = conns(2)[..] else { unreachable!() };
        let mut p = Presence::new(2);
        p.subscribe(&user("ann"), a);
        p.buffer(&1);
        p.buffer(&2);
        assert_eq!(p.load(&user("ann"), a, vec![]), Loaded::Replay(vec![1, 2]));
        p.subscribe(&user("bob"), b);
        (1..=3).for_each(|n| p.buffer(&n));
        assert_eq!(p.load(&user("bob"), b, vec![]), Loaded::Resync);
        assert_eq!(p.size(), (1, 0));
    }
}
