//! A message body: any JSON value, kept in one canonical compact text form so
//! that its fingerprint (SHA-256 of that text) is the same for every retry.

use serde_json::Value;
use sha2::{Digest, Sha256};

/// The fingerprint a recall leaves in place of its message's: with the body
/// gone, the SHA-256 of a guessed text must not be checkable against it. No
/// body hashes to it, and a replay of the key is answered as the same request.
pub const ERASED_FINGERPRINT: [u8; 32] = [0; 32];

/// PROTOCOL §1: at most 16 KiB serialized compactly (configurable).
pub const DEFAULT_MAX_BODY_BYTES: usize = 16 * 1024;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BodyError {
    #[error("body is {size} bytes serialized, over the {max}-byte limit")]
    TooLarge { size: usize, max: usize },
}

/// A checked body: canonical text (object keys sorted, no whitespace) and its fingerprint.
/// Between nodes it travels as its text (a write forwarded to the
/// conversation's home, ARCHITECTURE §7).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(into = "String", try_from = "String")]
pub struct Body {
    text: String,
    fingerprint: [u8; 32],
    mention_all: bool,
}

impl Body {
    pub fn parse(value: &Value, max_bytes: usize) -> Result<Self, BodyError> {
        // serde_json's map is ordered by key (no `preserve_order`), so this
        // serialization is canonical: the same JSON value gives the same text.
        let text = value.to_string();
        if text.len() > max_bytes {
            return Err(BodyError::TooLarge { size: text.len(), max: max_bytes });
        }
        Ok(Self::canonical(text, value))
    }

    /// `text` must be `value`'s canonical serialization.
    fn canonical(text: String, value: &Value) -> Self {
        let fingerprint = Sha256::digest(text.as_bytes()).into();
        let mention_all = value.get("mention_all") == Some(&Value::Bool(true));
        Self { text, fingerprint, mention_all }
    }

    pub fn text(&self) -> &str {
        &self.text
    }

    pub fn fingerprint(&self) -> &[u8; 32] {
        &self.fingerprint
    }

    /// Whether a send of this body replays the one stored with `fingerprint`:
    /// the same body, or any body once the stored one was recalled.
    pub fn replays(&self, fingerprint: &[u8]) -> bool {
        fingerprint == self.fingerprint || fingerprint == ERASED_FINGERPRINT
    }

    /// `body.mention_all == true` needs the `AT_ALL` permission bit.
    pub fn mention_all(&self) -> bool {
        self.mention_all
    }
}

impl From<Body> for String {
    fn from(body: Body) -> String {
        body.text
    }
}

/// A body another node checked (its size limit included); serialized again,
/// so the text is canonical whatever arrived.
impl TryFrom<String> for Body {
    type Error = serde_json::Error;
    fn try_from(text: String) -> Result<Self, Self::Error> {
        let value: Value = serde_json::from_str(&text)?;
        Ok(Self::canonical(value.to_string(), &value))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn key_order_and_whitespace_do_not_change_the_fingerprint() {
        let a: Value = serde_json::from_str(r#"{"type":"text", "text":"hi"}"#).expect("json");
        let b: Value = serde_json::from_str(r#"{ "text" : "hi","type":"text"}"#).expect("json");
        assert_eq!(Body::parse(&a, 100).expect("a").fingerprint(), Body::parse(&b, 100).expect("b").fingerprint());
    }

    #[test]
    fn a_different_body_has_a_different_fingerprint() {
        let a = Body::parse(&json!({"text":"hi"}), 100).expect("a");
        let b = Body::parse(&json!({"text":"ho"}), 100).expect("b");
        assert_ne!(a.fingerprint(), b.fingerprint());
    }

    #[test]
    fn the_limit_counts_the_compact_serialization() {
        let v = json!({"t": "x".repeat(10)});
        let size = v.to_string().len();
        assert!(Body::parse(&v, size).is_ok());
        assert_eq!(Body::parse(&v, size - 1), Err(BodyError::TooLarge { size, max: size - 1 }));
    }
}
