//! Domain rules that hold whatever the transport or storage: bodies and their
//! fingerprints, roles and permission bits, the forms of names, the rejections
//! a request can meet.

mod body;
mod delivery;
mod emoji;
mod event;
mod group;
mod rejection;
mod text;
mod time;

pub use body::{Body, BodyError, DEFAULT_MAX_BODY_BYTES, ERASED_FINGERPRINT};
pub use delivery::{DeliverySetting, Thresholds};
pub use emoji::{Emoji, EmojiError, MAX_EMOJI_BYTES, MAX_EMOJI_PER_MESSAGE};
pub use event::{Event, EventKind, LeaveReason, BANNED_CHANGE, DISMISSED_CHANGE, UNBANNED_CHANGE};
pub use group::{
    ConvStatus, DeliveryMode, JoinMode, Permission, Role, Standing, ADMIN_BITS, MAX_DURATION_MS, MAX_GROUP_SIZE,
    MAX_INVITE_USERS, MAX_MENTIONS,
};
pub use rejection::Rejection;
pub use text::{check_text, TextError, MAX_ALIAS_CHARS, MAX_DISPLAY_NAME_CHARS, MAX_GROUP_NAME_CHARS};
pub use time::{format_time, parse_time};
