//! Every message a node publishes on the bus is sealed: signed with the key
//! the cluster's nodes share (HMAC-SHA256 over its subject, reply subject,
//! sender, time, counter and payload), and every message a node takes from
//! the bus is opened — checked — before any of it is decoded. One that is
//! unsigned, wrongly signed or stale is dropped and counted, never acted on.
//! Why a key on top of NATS's own permissions: ARCHITECTURE §7.
//!
//! Sealed: `"imc1"`, sender length (1 byte), sender, unix ms (8), counter (8),
//! MAC (32), payload.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{BufMut, Bytes, BytesMut};
use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::node::NodeId;
use crate::metrics::metrics;

/// The shortest cluster key accepted.
pub const MIN_KEY_BYTES: usize = 32;
const MAGIC: &[u8; 4] = b"imc1";
const MAC_BYTES: usize = 32;
/// Domain separation: this MAC means "a bus message of imcore, version 1".
const CONTEXT: &[u8] = b"imcore bus v1\0";

/// Why a message from the bus was dropped (the metric's `reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    Unsigned,
    BadSignature,
    Stale,
    /// Authentic, but does not decode or is out of range.
    Malformed,
    /// A forwarded op no client can send.
    Op,
}

impl Refused {
    pub fn reason(self) -> &'static str {
        match self {
            Refused::Unsigned => "unsigned",
            Refused::BadSignature => "bad_signature",
            Refused::Stale => "stale",
            Refused::Malformed => "malformed",
            Refused::Op => "refused_op",
        }
    }

    /// Counts the drop, and says so (debug: a flood must not flood the log).
    pub fn count(self, subject: &str) {
        metrics().bus_rejected.with_label_values(&[self.reason()]).inc();
        tracing::debug!(subject, reason = self.reason(), "bus: a message dropped unread");
    }
}

/// A message that opened: who sealed it, and what it says.
pub struct Opened {
    pub sender: NodeId,
    pub payload: Bytes,
}

/// This node's key and name, for sealing and opening.
pub struct Seal {
    mac: Hmac<Sha256>,
    node: NodeId,
    counter: AtomicU64,
    max_age: Duration,
}

impl Seal {
    /// `None` for a key shorter than [`MIN_KEY_BYTES`].
    pub fn new(key: &str, node: NodeId, max_age: Duration) -> Option<Self> {
        if key.len() < MIN_KEY_BYTES {
            return None;
        }
        let mac = Hmac::<Sha256>::new_from_slice(key.as_bytes()).ok()?;
        Some(Self { mac, node, counter: AtomicU64::new(0), max_age })
    }

    /// `payload` sealed for `subject` (and `reply`, for a request), now.
    pub fn seal(&self, subject: &str, reply: Option<&str>, payload: &[u8]) -> Bytes {
        let node = self.node.as_str().as_bytes();
        let mut out = BytesMut::with_capacity(MAGIC.len() + 1 + node.len() + 16 + MAC_BYTES + payload.len());
        out.put_slice(MAGIC);
        // Node names are ours (`NodeId::random`), far below 255 bytes.
        out.put_u8(node.len().min(255) as u8);
        out.put_slice(&node[..node.len().min(255)]);
        out.put_u64(unix_ms(SystemTime::now()));
        out.put_u64(self.counter.fetch_add(1, Ordering::Relaxed));
        let head = out.len();
        let tag = self.tag(subject, reply, &out[MAGIC.len()..head], payload);
        out.put_slice(&tag);
        out.put_slice(payload);
        out.freeze()
    }

    /// Checks `sealed`, which came on `subject` (with `reply`), at `now`.
    pub fn open(&self, subject: &str, reply: Option<&str>, sealed: &Bytes, now: SystemTime) -> Result<Opened, Refused> {
        let rest = sealed.strip_prefix(MAGIC.as_slice()).ok_or(Refused::Unsigned)?;
        let (&len, rest) = rest.split_first().ok_or(Refused::Unsigned)?;
        let header = 1 + usize::from(len) + 16;
        if rest.len() < header - 1 + MAC_BYTES {
            return Err(Refused::Unsigned);
        }
        let signed = &sealed[MAGIC.len()..MAGIC.len() + header];
        let tag = &sealed[MAGIC.len() + header..MAGIC.len() + header + MAC_BYTES];
        let payload = sealed.slice(MAGIC.len() + header + MAC_BYTES..);
        let mut mac = self.mac.clone();
        feed(&mut mac, subject, reply, signed, &payload);
        mac.verify_slice(tag).map_err(|_| Refused::BadSignature)?;
        let name = std::str::from_utf8(&signed[1..1 + usize::from(len)]).map_err(|_| Refused::Malformed)?;
        let mut at = [0u8; 8];
        at.copy_from_slice(&signed[1 + usize::from(len)..9 + usize::from(len)]);
        let (at, now) = (u64::from_be_bytes(at), unix_ms(now));
        if at.abs_diff(now) > u64::try_from(self.max_age.as_millis()).unwrap_or(u64::MAX) {
            return Err(Refused::Stale);
        }
        Ok(Opened { sender: NodeId::signed(name), payload })
    }

    fn tag(&self, subject: &str, reply: Option<&str>, signed: &[u8], payload: &[u8]) -> [u8; MAC_BYTES] {
        let mut mac = self.mac.clone();
        feed(&mut mac, subject, reply, signed, payload);
        mac.finalize().into_bytes().into()
    }
}

/// What the MAC covers, each variable part length-prefixed so no two
/// messages feed the same bytes.
fn feed(mac: &mut Hmac<Sha256>, subject: &str, reply: Option<&str>, signed: &[u8], payload: &[u8]) {
    mac.update(CONTEXT);
    for part in [subject.as_bytes(), reply.unwrap_or("").as_bytes(), signed] {
        mac.update(&(part.len() as u64).to_be_bytes());
        mac.update(part);
    }
    mac.update(payload);
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "0123456789abcdef0123456789abcdef";

    fn seal(key: &str) -> Seal {
        Seal::new(key, NodeId::named("imcore-a"), Duration::from_secs(30)).expect("key long enough")
    }

    #[test]
    fn a_sealed_message_opens_with_the_same_key_only_on_its_own_subject_and_in_time() {
        let (a, b) = (seal(KEY), seal(&KEY.replace('0', "1")));
        let sealed = a.seal("imcore.route", None, b"payload");
        let now = SystemTime::now();
        let opened = a.open("imcore.route", None, &sealed, now).expect("opens");
        assert_eq!((opened.sender.as_str(), &opened.payload[..]), ("imcore-a", &b"payload"[..]));
        assert_eq!(b.open("imcore.route", None, &sealed, now).err(), Some(Refused::BadSignature));
        assert_eq!(a.open("imcore.revoke", None, &sealed, now).err(), Some(Refused::BadSignature));
        assert_eq!(a.open("imcore.route", Some("x"), &sealed, now).err(), Some(Refused::BadSignature));
        let late = now + Duration::from_secs(31);
        assert_eq!(a.open("imcore.route", None, &sealed, late).err(), Some(Refused::Stale));
        for cut in 0..sealed.len() {
            assert!(a.open("imcore.route", None, &sealed.slice(..cut), now).is_err(), "cut at {cut}");
        }
        let mut flipped = sealed.to_vec();
        for i in 0..flipped.len() {
            flipped[i] ^= 1;
            assert!(a.open("imcore.route", None, &Bytes::from(flipped.clone()), now).is_err(), "bit flip at {i}");
            flipped[i] ^= 1;
        }
        assert_eq!(a.open("imcore.route", None, &Bytes::from_static(b"{}"), now).err(), Some(Refused::Unsigned));
    }

    #[test]
    fn a_short_key_is_refused() {
        assert!(Seal::new(&KEY[..31], NodeId::named("imcore-a"), Duration::from_secs(1)).is_none());
    }
}
