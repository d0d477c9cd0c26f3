//! Observable points a test waits on instead of sleeping: a marker event
//! behind what must not be pushed, the server's live connection counts.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::server::{TestServer, Ws};

/// A bound for what should take milliseconds, wide enough for a loaded 2-core machine.
const WAIT: Duration = Duration::from_secs(10);

fn hi(key: &str, conv: &str, text: &str) -> Value {
    json!({"conv_id": conv, "client_msg_id": key, "body": {"type": "text", "text": text}})
}

/// A metric sample from `/metrics` text, 0 when absent.
pub fn sample(metrics: &Value, series: &str) -> f64 {
    metrics
        .as_str()
        .unwrap_or("")
        .lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// Polls `/metrics` until the server has `sessions` open sockets and `routed`
/// routes; `false` if that does not happen within [`WAIT`].
pub async fn wait_for_connections(s: &TestServer, sessions: u32, routed: u32) -> bool {
    let deadline = Instant::now() + WAIT;
    loop {
        let (_, m) = s.http("GET", "/metrics", None, None).await;
        if sample(&m, "imcore_connections{kind=\"sessions\"}") == f64::from(sessions)
            && sample(&m, "imcore_connections{kind=\"routed\"}") == f64::from(routed)
        {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Whether `quiet` had no push pending: `other` sends a marker message to
/// `conv` and the first push `quiet` then gets must be that marker. A
/// connection gets one conversation's events in seq order (and a direct
/// push, like `read`, is queued before the reply that precedes the marker),
/// so anything pushed earlier would have arrived first.
pub async fn no_push_before_marker(quiet: &mut Ws, other: &mut Ws, conv: &str) -> bool {
    let marker = other.request("send", hi(&format!("marker-{}", uuid::Uuid::new_v4()), conv, "marker")).await;
    let first = quiet.push().await;
    let carried = match first["push"].as_str() {
        Some("event") => first["event"]["seq"] == marker["seq"],
        Some("events") => first["events"][0]["seq"] == marker["seq"],
        Some("head") => first["head"] == marker["seq"],
        _ => false,
    };
    first["conv_id"] == conv && carried
}

/// Event seqs of `conv` carried by an `event`/`events` push (none for other pushes).
pub fn pushed_seqs(push: &Value, conv: &str) -> Vec<i64> {
    if push["conv_id"] != conv {
        return vec![];
    }
    match push["push"].as_str() {
        Some("event") => push["event"]["seq"].as_i64().into_iter().collect(),
        Some("events") => push["events"].as_array().into_iter().flatten().filter_map(|e| e["seq"].as_i64()).collect(),
        _ => vec![],
    }
}
