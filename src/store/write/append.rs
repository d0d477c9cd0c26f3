//! The one INSERT of every event of a transaction, with the row updates.

use tokio_postgres::types::ToSql;
use uuid::Uuid;

use super::batch::BatchBuilder;
use super::prepared::Conn;
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

    fn push(&mut self, b: &'a BatchBuilder, e: &'a Event) {
        self.convs.push(b.conv.as_str());
        self.seqs.push(e.seq);
        self.kinds.push(e.kind.name());
        let (mut mid, mut snd, mut dev, mut key, mut hash, mut body, mut subj, mut act, mut reason, mut change) =
            (None, None, None, None, None, None, None, None, None, None);
        let (mut target, mut erased) = (None, false);
        match &e.kind {
            EventKind::Msg { message_id, sender, sender_device, client_msg_id, body: text, recalled } => {
                erased = *recalled;
                mid = Some(*message_id);
                snd = Some(sender.as_str());
                dev = Some(sender_device.as_str());
                key = Some(client_msg_id.as_str());
                hash = if *recalled {
                    Some(ERASED_FINGERPRINT.as_slice())
                } else {
                    b.appended_keys
                        .get(&(b.conv.clone(), sender.clone(), client_msg_id.clone()))
                        .map(|a| a.hash.as_slice())
                };
                body = text.as_deref();
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
                act = Some(actor.as_str());
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
    }
}

/// Writes every event the transaction's batches accumulated and moves each
/// conversation row on (`next_seq`, `member_version`, `member_count`), at once.
pub(super) async fn append_events(tx: Conn<'_>, builders: &[(usize, BatchBuilder)]) -> Result<(), StoreError> {
    let mut cols = EventColumns::default();
    let (mut convs, mut next_seqs, mut bumps, mut counts) = (vec![], vec![], vec![], vec![]);
    let (mut erased_convs, mut erased_seqs) = (vec![], vec![]);
    let mut now = None;
    for (_, b) in builders.iter().filter(|(_, b)| !b.events.is_empty()) {
        cols.push_all(b);
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
    let erased: &[u8] = &ERASED_FINGERPRINT;
    let rest: [&(dyn ToSql + Sync); 8] =
        [&now, &convs, &next_seqs, &bumps, &counts, &erased_convs, &erased_seqs, &erased];
    tx.client.execute(&tx.prepared.append, &[&cols.params()[..], &rest].concat()).await?;
    Ok(())
}
