//! Every message a node publishes on the bus is sealed: signed with the key
//! the cluster's nodes share (HMAC-SHA256 over its subject, reply subject,
//! sender, time, counter and payload), and every message a node takes from
//! the bus is opened — checked — before any of it is decoded. One that is
//! unsigned, wrongly signed, stale or seen before (a replay) is dropped and
//! counted, never acted on.
//! Why a key on top of NATS's own permissions: ARCHITECTURE §7.
//!
//! Sealed: `"imc1"`, sender length (1 byte), sender, unix ms (8), counter (8),
//! MAC (32), payload.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
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
/// How far out of counter order a sender's messages may be taken (several
/// subscriptions, each buffering up to 65,536) and still be told from a
/// replay: 64 KiB of bits per sender.
const REPLAY_WINDOW: u64 = 1 << 19;

/// Why a message from the bus was dropped (the metric's `reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    Unsigned,
    BadSignature,
    Stale,
    /// Authentic, and taken before (or signed with this node's own name,
    /// which it never hears).
    Replayed,
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
            Refused::Replayed => "replayed",
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
    /// The counters taken of each sender lately.
    seen: Mutex<HashMap<NodeId, Seen>>,
}

impl Seal {
    /// `None` for a key shorter than [`MIN_KEY_BYTES`].
    pub fn new(key: &str, node: NodeId, max_age: Duration) -> Option<Self> {
        if key.len() < MIN_KEY_BYTES {
            return None;
        }
        let mac = Hmac::<Sha256>::new_from_slice(key.as_bytes()).ok()?;
        Some(Self { mac, node, counter: AtomicU64::new(0), max_age, seen: Mutex::new(HashMap::new()) })
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
        let word = |at: usize| {
            let mut bytes = [0u8; 8];
            bytes.copy_from_slice(&signed[at..at + 8]);
            u64::from_be_bytes(bytes)
        };
        let (at, counter, now) = (word(1 + usize::from(len)), word(9 + usize::from(len)), unix_ms(now));
        let max_age = u64::try_from(self.max_age.as_millis()).unwrap_or(u64::MAX);
        if at.abs_diff(now) > max_age {
            return Err(Refused::Stale);
        }
        let sender = NodeId::signed(name);
        if sender == self.node || !self.first_time(&sender, counter, now, max_age) {
            return Err(Refused::Replayed);
        }
        Ok(Opened { sender, payload })
    }

    /// Whether `sender`'s `counter` is taken for the first time. A sender
    /// silent for twice the age limit is forgotten: whatever it sealed
    /// before is stale by then.
    fn first_time(&self, sender: &NodeId, counter: u64, now: u64, max_age: u64) -> bool {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        if !seen.contains_key(sender) {
            seen.retain(|_, s| now.saturating_sub(s.last_ms) <= max_age.saturating_mul(2));
        }
        let window = seen.entry(sender.clone()).or_insert_with(Seen::new);
        window.last_ms = now;
        window.first_time(counter)
    }

    fn tag(&self, subject: &str, reply: Option<&str>, signed: &[u8], payload: &[u8]) -> [u8; MAC_BYTES] {
        let mut mac = self.mac.clone();
        feed(&mut mac, subject, reply, signed, payload);
        mac.finalize().into_bytes().into()
    }
}

/// The counters taken of one sender: a ring of bits over the
/// [`REPLAY_WINDOW`] up to the highest.
struct Seen {
    highest: Option<u64>,
    bits: Vec<u64>,
    last_ms: u64,
}

impl Seen {
    fn new() -> Self {
        Self { highest: None, bits: vec![0; (REPLAY_WINDOW / 64) as usize], last_ms: 0 }
    }

    fn bit(counter: u64) -> (usize, u64) {
        let at = counter % REPLAY_WINDOW;
        ((at / 64) as usize, 1 << (at % 64))
    }

    /// Marks `counter` taken; `false` if it was already, or is too far
    /// behind the highest to tell.
    fn first_time(&mut self, counter: u64) -> bool {
        match self.highest {
            Some(highest) if counter <= highest && highest - counter >= REPLAY_WINDOW => return false,
            Some(highest) if counter <= highest => {}
            Some(highest) if counter - highest >= REPLAY_WINDOW => self.bits.fill(0),
            Some(highest) => {
                for c in highest + 1..counter {
                    let (word, mask) = Self::bit(c);
                    self.bits[word] &= !mask;
                }
                let (word, mask) = Self::bit(counter);
                self.bits[word] &= !mask;
            }
            None => {}
        }
        self.highest = Some(self.highest.map_or(counter, |h| h.max(counter)));
        let (word, mask) = Self::bit(counter);
        let first = self.bits[word] & mask == 0;
        self.bits[word] |= mask;
        first
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
        let c = Seal::new(KEY, NodeId::named("imcore-c"), Duration::from_secs(30)).expect("key");
        let sealed = a.seal("imcore.route", None, b"payload");
        let now = SystemTime::now();
        let opened = c.open("imcore.route", None, &sealed, now).expect("opens");
        assert_eq!((opened.sender.as_str(), &opened.payload[..]), ("imcore-a", &b"payload"[..]));
        assert_eq!(b.open("imcore.route", None, &sealed, now).err(), Some(Refused::BadSignature));
        assert_eq!(c.open("imcore.revoke", None, &sealed, now).err(), Some(Refused::BadSignature));
        assert_eq!(c.open("imcore.route", Some("x"), &sealed, now).err(), Some(Refused::BadSignature));
        let late = now + Duration::from_secs(31);
        assert_eq!(c.open("imcore.route", None, &sealed, late).err(), Some(Refused::Stale));
        for cut in 0..sealed.len() {
            assert!(c.open("imcore.route", None, &sealed.slice(..cut), now).is_err(), "cut at {cut}");
        }
        let mut flipped = sealed.to_vec();
        for i in 0..flipped.len() {
            flipped[i] ^= 1;
            assert!(c.open("imcore.route", None, &Bytes::from(flipped.clone()), now).is_err(), "bit flip at {i}");
            flipped[i] ^= 1;
        }
        assert_eq!(c.open("imcore.route", None, &Bytes::from_static(b"{}"), now).err(), Some(Refused::Unsigned));
    }

    #[test]
    fn a_message_opens_once_and_never_as_its_own_node() {
        let (a, b) = (seal(KEY), Seal::new(KEY, NodeId::named("imcore-b"), Duration::from_secs(30)).expect("key"));
        let now = SystemTime::now();
        let sealed: Vec<Bytes> = (0..3).map(|_| a.seal("imcore.lost", None, b"")).collect();
        // Out of order, then each again.
        for i in [2, 0, 1] {
            assert!(b.open("imcore.lost", None, &sealed[i], now).is_ok(), "first time {i}");
        }
        for s in &sealed {
            assert_eq!(b.open("imcore.lost", None, s, now).err(), Some(Refused::Replayed));
        }
        assert_eq!(a.open("imcore.lost", None, &sealed[0], now).err(), Some(Refused::Replayed), "its own");
    }

    #[test]
    fn the_replay_window_tells_new_from_seen_across_its_ring() {
        let mut seen = Seen::new();
        assert!(seen.first_time(5));
        assert!(!seen.first_time(5));
        assert!(seen.first_time(5 + REPLAY_WINDOW - 1));
        assert!(!seen.first_time(5), "still in the window");
        assert!(seen.first_time(5 + REPLAY_WINDOW + 3), "the ring wraps: its bit was cleared");
        assert!(!seen.first_time(5 + REPLAY_WINDOW - 1));
        assert!(!seen.first_time(4), "too far behind to tell");
        assert!(seen.first_time(10 * REPLAY_WINDOW));
        assert!(seen.first_time(10 * REPLAY_WINDOW - 1));
    }

    #[test]
    fn a_short_key_is_refused() {
        assert!(Seal::new(&KEY[..31], NodeId::named("imcore-a"), Duration::from_secs(1)).is_none());
    }
}
