//! The one INSERT of every event of a transaction, with the row updates.

use tokio_postgres::types::Type;
use tokio_postgres::Transaction;
use uuid::Uuid;

use super::batch::BatchBuilder;
use crate::domain::{Event, EventKind};
use crate::store::StoreError;

/// Every event of every conversation of the transaction, and every
/// conversation row, in one statement.
const APPEND_EVENTS: &str = "
WITH appended AS (
  INSERT INTO events (conv_id, seq, kind, message_id, sender_user, sender_device, client_msg_id, request_hash,
                      body, subject_user, actor, reason, change, created_at)
  SELECT e.*, $14
    FROM unnest($1::text[], $2::int8[], $3::text[], $4::uuid[], $5::text[], $6::text[], $7::text[], $8::bytea[],
                $9::text[], $10::text[], $11::text[], $12::text[], $13::text[]) AS e)
UPDATE conversations c
   SET next_seq = u.next_seq, member_version = c.member_version + u.bump, member_count = u.members,
       last_event_at = $14
  FROM unnest($15::text[], $16::int8[], $17::int8[], $18::int4[]) AS u(conv, next_seq, bump, members)
 WHERE c.conv_id = u.conv";

/// Column arrays of the events of a transaction, for one multi-row INSERT.
#[derive(Default)]
struct EventColumns<'a> {
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
}

impl<'a> EventColumns<'a> {
    fn push(&mut self, b: &'a BatchBuilder, e: &'a Event) {
        self.convs.push(b.conv.as_str());
        self.seqs.push(e.seq);
        self.kinds.push(e.kind.name());
        let (mut mid, mut snd, mut dev, mut key, mut hash, mut body, mut subj, mut act, mut reason, mut change) =
            (None, None, None, None, None, None, None, None, None, None);
        match &e.kind {
            EventKind::Msg { message_id, sender, sender_device, client_msg_id, body: text, .. } => {
                mid = Some(*message_id);
                snd = Some(sender.as_str());
                dev = Some(sender_device.as_str());
                key = Some(client_msg_id.as_str());
                hash = b
                    .appended_keys
                    .get(&(b.conv.clone(), sender.clone(), client_msg_id.clone()))
                    .map(|a| a.hash.as_slice());
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
            EventKind::Recall { .. } => {}
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
    }
}

/// Writes every event the transaction's batches accumulated and moves each
/// conversation row on (`next_seq`, `member_version`, `member_count`), at once.
pub(super) async fn append_events(tx: &Transaction<'_>, builders: &[(usize, BatchBuilder)]) -> Result<(), StoreError> {
    let mut cols = EventColumns::default();
    let (mut convs, mut next_seqs, mut bumps, mut counts) = (vec![], vec![], vec![], vec![]);
    let mut now = None;
    for (_, b) in builders.iter().filter(|(_, b)| !b.events.is_empty()) {
        for e in &b.events {
            cols.push(b, e);
        }
        convs.push(b.conv.as_str());
        next_seqs.push(b.next_seq);
        bumps.push(b.version_bump());
        counts.push(b.member_count);
        now = Some(b.now);
    }
    let Some(now) = now else { return Ok(()) };
    tx.execute_typed(
        APPEND_EVENTS,
        &[
            (&cols.convs, Type::TEXT_ARRAY),
            (&cols.seqs, Type::INT8_ARRAY),
            (&cols.kinds, Type::TEXT_ARRAY),
            (&cols.message_ids, Type::UUID_ARRAY),
            (&cols.senders, Type::TEXT_ARRAY),
            (&cols.devices, Type::TEXT_ARRAY),
            (&cols.keys, Type::TEXT_ARRAY),
            (&cols.hashes, Type::BYTEA_ARRAY),
            (&cols.bodies, Type::TEXT_ARRAY),
            (&cols.subjects, Type::TEXT_ARRAY),
            (&cols.actors, Type::TEXT_ARRAY),
            (&cols.reasons, Type::TEXT_ARRAY),
            (&cols.changes, Type::TEXT_ARRAY),
            (&now, Type::TIMESTAMPTZ),
            (&convs, Type::TEXT_ARRAY),
            (&next_seqs, Type::INT8_ARRAY),
            (&bumps, Type::INT8_ARRAY),
            (&counts, Type::INT4_ARRAY),
        ],
    )
    .await?;
    Ok(())
}
