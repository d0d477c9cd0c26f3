//! The highest seq this node knows committed, per conversation: from its own
//! commits, the batches other nodes publish, and forwarded writes' answers,
//! each noted before a device can see it. A standby may answer a `sync` only
//! once it has replayed this far (ARCHITECTURE §6, "History reads from a
//! standby"); a conversation not known here reads the primary. Bounded: at
//! the cap the map starts empty again, which only sends reads to the primary.

use dashmap::DashMap;
use imcore_actors::ConvId;

/// Conversations remembered (~100 bytes each).
pub const KNOWN_HEADS_CAP: usize = 100_000;

#[derive(Default)]
pub struct Heads {
    known: DashMap<ConvId, i64>,
}

impl Heads {
    /// `seq` of `conv` is committed.
    pub fn saw(&self, conv: &ConvId, seq: i64) {
        if let Some(mut known) = self.known.get_mut(conv) {
            *known = (*known).max(seq);
            return;
        }
        if self.known.len() >= KNOWN_HEADS_CAP {
            self.known.clear();
        }
        self.known.entry(conv.clone()).and_modify(|k| *k = (*k).max(seq)).or_insert(seq);
    }

    /// Reads of `conv` go to the primary until its next commit is noted.
    pub fn forget(&self, conv: &ConvId) {
        self.known.remove(conv);
    }

    /// The highest seq of `conv` known committed, if any.
    pub fn known(&self, conv: &ConvId) -> Option<i64> {
        self.known.get(conv).map(|k| *k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_highest_and_forgets_all_at_the_cap() {
        let heads = Heads::default();
        let a = ConvId::parse("a").expect("an id");
        heads.saw(&a, 5);
        heads.saw(&a, 3);
        assert_eq!(heads.known(&a), Some(5));
        for i in 0..KNOWN_HEADS_CAP {
            heads.saw(&ConvId::parse(&format!("c{i}")).expect("an id"), 1);
        }
        // The cap was reached with `a` among them: everything went, `a` too.
        assert_eq!(heads.known(&a), None);
        assert!(heads.known.len() <= KNOWN_HEADS_CAP);
    }
}
