//! Domain rules that hold whatever the transport or storage: bodies and their
//! fingerprints, roles and permission bits, the rejections a request can meet.

mod body;
mod event;
mod group;
mod rejection;
mod time;

pub use body::{Body, BodyError, DEFAULT_MAX_BODY_BYTES};
pub use event::{Event, EventKind, LeaveReason};
pub use group::{DeliveryMode, JoinMode, Permission, Role};
pub use rejection::Rejection;
pub use time::format_time;
