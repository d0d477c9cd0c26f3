//! Typed identifiers (PROTOCOL §1). Each is parsed once at the edge; past that
//! point the core never sees an unchecked string.

use std::fmt;
use std::sync::Arc;

/// The longest identifier PROTOCOL §1 allows.
pub const MAX_ID_LEN: usize = 64;

/// An identifier outside the form `1–64 chars of A-Z a-z 0-9 . _ : @ -`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind} must be 1-64 characters of A-Z a-z 0-9 . _ : @ -")]
pub struct InvalidId {
    pub kind: &'static str,
}

fn is_id_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b':' | b'@' | b'-')
}

/// Whether `s` has the identifier form of PROTOCOL §1.
pub fn is_valid_id(s: &str) -> bool {
    !s.is_empty() && s.len() <= MAX_ID_LEN && s.bytes().all(is_id_char)
}

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident, $kind:literal) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(Arc<str>);

        impl $name {
            pub fn parse(s: &str) -> Result<Self, InvalidId> {
                if is_valid_id(s) {
                    Ok(Self(Arc::from(s)))
                } else {
                    Err(InvalidId { kind: $kind })
                }
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&*self.0, f)
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl TryFrom<String> for $name {
            type Error = InvalidId;
            fn try_from(s: String) -> Result<Self, InvalidId> {
                Self::parse(&s)
            }
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(&self.0)
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = <std::borrow::Cow<'de, str> as serde::Deserialize>::deserialize(d)?;
                Self::parse(&s).map_err(serde::de::Error::custom)
            }
        }
    };
}

id_type!(
    /// A user account.
    UserId,
    "user_id"
);
id_type!(
    /// One device of a user; at most one live connection each.
    DeviceId,
    "device_id"
);
id_type!(
    /// A direct or group conversation.
    ConvId,
    "conv_id"
);
id_type!(
    /// Chosen by the client, reused on every retry of one send (the request key).
    ClientMsgId,
    "client_msg_id"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_the_protocol_alphabet_up_to_64_chars() {
        assert!(UserId::parse("u-ana.b_c:d@e").is_ok());
        assert!(ConvId::parse(&"x".repeat(64)).is_ok());
    }

    #[test]
    fn refuses_empty_long_and_foreign_characters() {
        for bad in ["", " ", "a b", "ä", "a/b", "a\0", &"x".repeat(65)] {
            assert_eq!(UserId::parse(bad), Err(InvalidId { kind: "user_id" }), "{bad:?}");
        }
    }
}
