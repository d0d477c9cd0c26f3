//! A [`Fanout`] that records what it was handed, in delivery order.

use std::sync::Mutex;

use crate::ids::ConvId;
use crate::store::Fanout;

/// Records every delivery.
pub struct RecordingFanout<C> {
    deliveries: Mutex<Vec<(ConvId, C)>>,
}

impl<C> Default for RecordingFanout<C> {
    fn default() -> Self {
        Self { deliveries: Mutex::new(Vec::new()) }
    }
}

impl<C: Clone> RecordingFanout<C> {
    /// Everything delivered so far, in order.
    pub fn deliveries(&self) -> Vec<(ConvId, C)> {
        self.deliveries.lock().map(|d| d.clone()).unwrap_or_default()
    }
}

impl<C: Send + 'static> Fanout<C> for RecordingFanout<C> {
    fn deliver(&self, conv: &ConvId, committed: C) {
        if let Ok(mut d) = self.deliveries.lock() {
            d.push((conv.clone(), committed));
        }
    }
}
