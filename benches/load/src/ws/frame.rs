//! The frames the generator's devices read — pushes and the answers to
//! their syncs — decoded once, with only the fields the measurements use
//! (serde skips the rest).

use serde::Deserialize;

#[derive(Deserialize)]
pub struct FrameIn {
    pub id: Option<u64>,
    pub ok: Option<bool>,
    pub push: Option<String>,
    pub conv_id: Option<String>,
    pub head: Option<i64>,
    pub event: Option<EventIn>,
    pub events: Option<Vec<EventIn>>,
    pub next_after: Option<i64>,
    pub has_more: Option<bool>,
}

impl FrameIn {
    /// The events it carries: a push's one or several, or a sync page's.
    pub fn into_events(self) -> impl Iterator<Item = EventIn> {
        self.event.into_iter().chain(self.events.unwrap_or_default())
    }
}

#[derive(Deserialize)]
pub struct EventIn {
    pub seq: Option<i64>,
    pub body: Option<BodyIn>,
}

/// The body the generator sends: message number `n` of the run, sent at
/// `ts` µs (through `node`, when there are several).
#[derive(Deserialize)]
pub struct BodyIn {
    pub n: Option<usize>,
    pub ts: Option<u64>,
    pub node: Option<usize>,
}
