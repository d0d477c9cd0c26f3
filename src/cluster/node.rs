//! A node's name in the cluster (ARCHITECTURE §7). Below every other module
//! of the cluster: the bus, the homes and the forwarded writes all name nodes.

use serde::{Deserialize, Serialize};

/// This process's name in the cluster: random per start, so a restarted node
/// is a new one.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct NodeId(String);

impl NodeId {
    pub(super) fn random() -> Self {
        Self(format!("imcore-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]))
    }

    /// A name read off a signed message (`seal`), already bounded in length.
    pub(super) fn signed(name: &str) -> Self {
        Self(name.to_owned())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    #[cfg(test)]
    pub fn named(name: &str) -> Self {
        Self(name.to_owned())
    }
}
