//! The wire contract: error codes and the JSON shapes of events,
//! conversations and pushes. Inner layers never produce wire text themselves.
//! The contract itself follows.
#![doc = include_str!("PROTOCOL.md")]

#[doc = include_str!("EXAMPLES.md")]
pub mod examples {}
mod error;
mod wire;

pub use error::{ErrorCode, WireError};
pub use wire::{
    conversation_json, encode_event, event_json, inbox_item_json, push_encoded_events, push_head, push_kicked,
    push_member_read, push_members_changed, push_presence, push_read, push_typing, reply_frame, send_ack, sync_page,
};
