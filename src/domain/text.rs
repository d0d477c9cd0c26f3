//! Free text that names things (a user's display name, a group's name):
//! bounded in characters like the schema's CHECKs, and free of control
//! characters. A NUL would be refused by PostgreSQL itself (SQLSTATE 22021,
//! an internal error a client would retry forever); the other C0/C1 controls
//! would reach every member's screen as they are.

/// `users.display_name` (schema: `length(display_name) <= 128`).
pub const MAX_DISPLAY_NAME_CHARS: usize = 128;
/// `conversations.name` (schema: `length(name) <= 128`).
pub const MAX_GROUP_NAME_CHARS: usize = 128;
/// A member's alias in a group (PROTOCOL §5 `set_alias`: 0–32 characters).
pub const MAX_ALIAS_CHARS: usize = 32;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TextError {
    #[error("`{field}` is over {max} characters")]
    TooLong { field: &'static str, max: usize },
    #[error("`{field}` may not contain control characters (U+0000-U+001F, U+007F-U+009F)")]
    Control { field: &'static str },
}

/// Checks `value` of `field`: at most `max_chars` characters (Unicode scalar
/// values, what PostgreSQL's `length` counts), none of them a control character.
pub fn check_text(field: &'static str, value: &str, max_chars: usize) -> Result<(), TextError> {
    if value.chars().any(char::is_control) {
        return Err(TextError::Control { field });
    }
    if value.chars().count() > max_chars {
        return Err(TextError::TooLong { field, max: max_chars });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_bounded_in_characters_and_free_of_controls() {
        assert_eq!(check_text("name", &"é".repeat(128), 128), Ok(()), "characters, not bytes");
        assert_eq!(check_text("name", "", 128), Ok(()));
        assert_eq!(check_text("name", &"x".repeat(129), 128), Err(TextError::TooLong { field: "name", max: 128 }));
        for bad in ["a\u{0}b", "tab\there", "line\n", "del\u{7f}", "c1\u{85}", "c1\u{9f}"] {
            assert_eq!(check_text("name", bad, 128), Err(TextError::Control { field: "name" }), "{bad:?}");
        }
        assert_eq!(check_text("name", "Zoë 🐈 \u{a0}nbsp", 128), Ok(()), "U+00A0 is past the C1 range");
    }
}
