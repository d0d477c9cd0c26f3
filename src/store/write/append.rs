//! The one INSERT of every event of a transaction, with the row updates.

use chrono::{DateTime, Utc};
use imcore_actors::{ClientMsgId, UserId};
use tokio_postgres::types::ToSql;
use uuid::Uuid;

use super::batch::BatchBuilder;
use super::prepared::Conn;
use super::Applied;
use crate::domain::{Event, EventKind, ERASED_FINGERPRINT};
use crate::store::StoreError;

/// Column arrays of the events of a transaction, for one multi-row INSERT.
#[derive(Default)]
pub(super) struct EventColumns<'a> {
    convs: Vec<&'a str>,
    seqs: Vec<i64>,
    kinds: Vec<&'static str>,
    message_ids: Vec<Option<Uuid>>,
    senders: Vec<Option<&'a str>>,
    devices: Vec<Option<&'a str>>,
    keys: Vec<Option<&'a str>>,
    hashes: Vec<Option<&'a [u8]>>,
    bodies: Vec<Option<&'a str>>,
    subjects: Vec<Option<&'a str>>,
    actors: Vec<Option<&'a str>>,
    reasons: Vec<Option<&'static str>>,
    changes: Vec<Option<&'a str>>,
    targets: Vec<Option<i64>>,
    recalled: Vec<bool>,
    reply_to: Vec<Option<i64>>,
    /// Space-separated (ids have no spaces): arrays of arrays must be rectangular.
    mentions: Vec<Option<String>>,
    mention_all: Vec<Option<bool>>,
    edited_at: Vec<Option<DateTime<Utc>>>,
    emoji: Vec<Option<&'a str>>,
    reaction_on: Vec<Option<bool>>,
}

impl<'a> EventColumns<'a> {
    /// The events of `b`.
    pub(super) fn push_all(&mut self, b: &'a BatchBuilder) {
        for e in &b.events {
            self.push(b, e);
        }
    }

    /// The 15 arrays, in the order of the INSERT's columns (`$1`..`$15`).
    pub(super) fn params(&self) -> [&(dyn ToSql + Sync); 15] {
        [
            &self.convs,
            &self.seqs,
            &self.kinds,
            &self.message_ids,
            &self.senders,
            &self.devices,
            &self.keys,
            &self.hashes,
            &self.bodies,
            &self.subjects,
            &self.actors,
            &self.reasons,
            &self.changes,
            &self.targets,
            &self.recalled,
        ]
    }

    /// The columns of later kinds and fields (`$23`..`$28` of the full append;
    /// the one-trip append leaves them NULL: it takes plain sends only).
    pub(super) fn history_params(&self) -> [&(dyn ToSql + Sync); 6] {
        [&self.reply_to, &self.mentions, &self.mention_all, &self.edited_at, &self.emoji, &self.reaction_on]
    }

    fn push(&mut self, b: &'a BatchBuilder, e: &'a Event) {
        self.convs.push(b.conv.as_str());
        self.seqs.push(e.seq);
        self.kinds.push(e.kind.name());
        let (mut mid, mut snd, mut dev, mut key, mut hash, mut body, mut subj, mut act, mut reason, mut change) =
            (None, None, None, None, None, None, None, None, None, None);
        let (mut target, mut erased) = (None, false);
        let (mut reply, mut mentioned, mut all, mut edited, mut emoji, mut on) = (None, None, None, None, None, None);
        let hash_of = |sender: &UserId, key: &ClientMsgId| {
            b.appended_keys.get(&(b.conv.clone(), sender.clone(), key.clone())).map(|a| a.hash.as_slice())
        };
        match &e.kind {
            EventKind::Msg {
                message_id,
                sender,
                sender_device,
                client_msg_id,
                body: text,
                recalled,
                reply_to,
                mentions,
                mention_all,
                edited_at,
            } => {
                erased = *recalled;
                mid = Some(*message_id);
                snd = Some(sender.as_str());
                dev = Some(sender_device.as_str());
                key = Some(client_msg_id.as_str());
                // Recalled in this batch: its fingerprint goes with its body.
                hash = if *recalled { Some(ERASED_FINGERPRINT.as_slice()) } else { hash_of(sender, client_msg_id) };
                body = text.as_deref();
                reply = *reply_to;
                mentioned =
                    (!mentions.is_empty()).then(|| mentions.iter().map(UserId::as_str).collect::<Vec<_>>().join(" "));
                all = Some(*mention_all);
                edited = *edited_at;
            }
            EventKind::Edit { sender, sender_device, client_msg_id, target_seq, body: text } => {
                snd = Some(sender.as_str());
                dev = Some(sender_device.as_str());
                key = Some(client_msg_id.as_str());
                // Recalled in this batch: its content goes, fingerprint included.
                hash = match text {
                    Some(_) => hash_of(sender, client_msg_id),
                    None => Some(ERASED_FINGERPRINT.as_slice()),
                };
                body = text.as_deref();
                target = Some(*target_seq);
            }
            EventKind::Reaction { sender, sender_device, target_seq, emoji: e, on: turned_on } => {
                snd = Some(sender.as_str());
                dev = Some(sender_device.as_str());
                target = Some(*target_seq);
                emoji = Some(e.as_str());
                on = Some(*turned_on);
            }
            EventKind::Join { subject, actor } => {
                subj = Some(subject.as_str());
                act = Some(actor.as_str());
            }
            EventKind::Leave { subject, actor, reason: r } => {
                subj = Some(subject.as_str());
                act = Some(actor.as_str());
                reason = Some(r.as_str());
            }
            EventKind::Group { actor, change: c } => {
                act = actor.as_ref().map(UserId::as_str);
                change = Some(c.as_str());
            }
            EventKind::Recall { sender, sender_device, target_seq } => {
                snd = Some(sender.as_str());
                dev = sender_device.as_ref().map(|d| d.as_str());
                target = Some(*target_seq);
            }
        }
        self.message_ids.push(mid);
        self.senders.push(snd);
        self.devices.push(dev);
        self.keys.push(key);
        self.hashes.push(hash);
        self.bodies.push(body);
        self.subjects.push(subj);
        self.actors.push(act);
        self.reasons.push(reason);
        self.changes.push(change);
        self.targets.push(target);
        self.recalled.push(erased);
        self.reply_to.push(reply);
        self.mentions.push(mentioned);
        self.mention_all.push(all);
        self.edited_at.push(edited);
        self.emoji.push(emoji);
        self.reaction_on.push(on);
    }
}

/// The changes to what messages show now: bodies edited, reactions set and
/// counted (`$29`..`$42` of the append).
#[derive(Default)]
struct Shown<'a> {
    edited_convs: Vec<&'a str>,
    edited_seqs: Vec<i64>,
    edited_bodies: Vec<&'a str>,
    set: SetRows<'a>,
    counts: CountRows<'a>,
}

/// `reactions` rows to insert (`on`) or delete.
#[derive(Default)]
struct SetRows<'a> {
    convs: Vec<&'a str>,
    targets: Vec<i64>,
    users: Vec<&'a str>,
    emoji: Vec<&'a str>,
    on: Vec<bool>,
    seqs: Vec<i64>,
}

/// `reaction_counts` changes.
#[derive(Default)]
struct CountRows<'a> {
    convs: Vec<&'a str>,
    targets: Vec<i64>,
    emoji: Vec<&'a str>,
    deltas: Vec<i32>,
    first_seqs: Vec<i64>,
}

impl<'a> Shown<'a> {
    fn push(&mut self, b: &'a BatchBuilder) {
        let conv = b.conv.as_str();
        for (&seq, text) in &b.edited {
            self.edited_convs.push(conv);
            self.edited_seqs.push(seq);
            self.edited_bodies.push(text);
        }
        // Only the net change of each key: one statement writes a row once.
        let set = &mut self.set;
        for ((user, target, emoji), &(on, _, seq)) in b.reacting.own.iter().filter(|(_, (on, before, _))| on != before)
        {
            set.convs.push(conv);
            set.targets.push(*target);
            set.users.push(user.as_str());
            set.emoji.push(emoji.as_str());
            set.on.push(on);
            set.seqs.push(seq);
        }
        let counts = &mut self.counts;
        for ((target, emoji), &(delta, first)) in b.reacting.counts.iter().filter(|(_, (delta, _))| *delta != 0) {
            counts.convs.push(conv);
            counts.targets.push(*target);
            counts.emoji.push(emoji.as_str());
            counts.deltas.push(delta);
            counts.first_seqs.push(first);
        }
    }

    fn params(&self) -> [&(dyn ToSql + Sync); 14] {
        let (r, c) = (&self.set, &self.counts);
        [
            &self.edited_convs,
            &self.edited_seqs,
            &self.edited_bodies,
            &r.convs,
            &r.targets,
            &r.users,
            &r.emoji,
            &r.on,
            &r.seqs,
            &c.convs,
            &c.targets,
            &c.emoji,
            &c.deltas,
            &c.first_seqs,
        ]
    }
}

/// Writes every event the transaction's batches accumulated, what the
/// messages they touch now show, and moves each conversation row on
/// (`next_seq`, `member_version`, `member_count`), at once.
pub(super) async fn append_events(tx: Conn<'_>, applied: &Applied) -> Result<(), StoreError> {
    let builders = &applied.builders;
    let mut cols = EventColumns::default();
    let mut shown = Shown::default();
    let (mut convs, mut next_seqs, mut bumps, mut counts) = (vec![], vec![], vec![], vec![]);
    let (mut erased_convs, mut erased_seqs) = (vec![], vec![]);
    let mut now = None;
    for (_, b) in builders.iter().filter(|(_, b)| !b.events.is_empty()) {
        cols.push_all(b);
        shown.push(b);
        for &seq in &b.erased {
            erased_convs.push(b.conv.as_str());
            erased_seqs.push(seq);
        }
        convs.push(b.conv.as_str());
        next_seqs.push(b.next_seq);
        bumps.push(b.version_bump());
        counts.push(b.member_count);
        now = Some(b.now);
    }
    let Some(now) = now else { return Ok(()) };
    let rest: [&(dyn ToSql + Sync); 7] = [&now, &convs, &next_seqs, &bumps, &counts, &erased_convs, &erased_seqs];
    let params = [&cols.params()[..], &rest, &cols.history_params(), &shown.params(), &[&applied.activity_ms]].concat();
    tx.client.execute(&tx.prepared.append, &params).await?;
    Ok(())
}
