//! A reaction's emoji (PROTOCOL v1.2 `react`): any short text a client draws
//! as one, checked at the edge — 1–32 bytes of UTF-8, no whitespace and no
//! control character — so one reaction cannot carry a message of its own.

use serde::{Deserialize, Serialize};

/// Most bytes of an emoji (schema: `octet_length(emoji) BETWEEN 1 AND 32`).
pub const MAX_EMOJI_BYTES: usize = 32;
/// Most distinct emoji on one message; a new one beyond is `TOO_MANY_REACTIONS`.
pub const MAX_EMOJI_PER_MESSAGE: usize = 20;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`emoji` must be 1-{MAX_EMOJI_BYTES} bytes with no whitespace or control characters")]
pub struct EmojiError;

/// Between nodes it travels as its text, checked again on arrival.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Emoji(String);

impl Emoji {
    pub fn parse(s: &str) -> Result<Self, EmojiError> {
        let ok = (1..=MAX_EMOJI_BYTES).contains(&s.len()) && !s.chars().any(|c| c.is_whitespace() || c.is_control());
        ok.then(|| Self(s.to_owned())).ok_or(EmojiError)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for Emoji {
    type Error = EmojiError;
    fn try_from(s: String) -> Result<Self, EmojiError> {
        Self::parse(&s)
    }
}

impl From<Emoji> for String {
    fn from(e: Emoji) -> String {
        e.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn emoji_are_short_and_free_of_spaces_and_controls() {
        for good in ["👍", "🏳️‍🌈", "+1", ":party:", &"x".repeat(32)] {
            assert!(Emoji::parse(good).is_ok(), "{good:?}");
        }
        for bad in ["", &"x".repeat(33), "a b", "\u{a0}", "tab\t", "nl\n", "\u{0}", "\u{85}", &"👍".repeat(9)] {
            assert_eq!(Emoji::parse(bad), Err(EmojiError), "{bad:?}");
        }
    }
}
