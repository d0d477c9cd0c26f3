//! Two nodes (ARCHITECTURE §5 "Offline notifications", several nodes): real
//! `imcore` processes and `nats-server`, sends made through both nodes; only
//! the conversation's home sees its batch, so the gateway gets each due
//! notification once, and a device connected on either node gets none.

use std::collections::HashMap;
use std::time::Duration;

use serde_json::{json, Value};

use super::gateway::Gateway;
use super::{event_ids, SUITE, WAIT};
use crate::cluster_harness::Cluster;
use crate::evidence::Check;
use crate::server::http_raw;

/// Short intervals (as `fast`); a lease short enough for recovery scans to
/// run several times while the test watches for duplicates.
const ENV: [(&str, &str); 4] = [
    ("IMCORE_NOTIFY_COALESCE_MS", "100"),
    ("IMCORE_NOTIFY_BACKOFF_MS", "100"),
    ("IMCORE_NOTIFY_FLUSH_MS", "200"),
    ("IMCORE_NOTIFY_LEASE_MS", "1500"),
];
const GROUPS: [&str; 4] = ["g1", "g2", "g3", "g4"];

#[actix_web::test]
async fn with_two_nodes_each_due_notification_is_sent_once_and_devices_connected_on_either_node_get_none() {
    let check = Check::start(
        SUITE,
        "28-two-nodes-once",
        "2 nodes (homes on), 4 groups, 24 messages sent one at a time through both nodes, 3 leases of recovery scans",
        "the offline member gets every due event_id exactly once; the devices connected on node 1 and node 2 get none",
    );
    let gw = Gateway::start(Duration::ZERO);
    let c = Cluster::start_with_env(2, &ENV).await;
    let mut tokens = HashMap::new();
    for u in ["s0", "s1", "ann", "on0", "on1"] {
        tokens.insert(u, c.user(u).await);
    }
    for u in ["ann", "on0", "on1"] {
        let body = json!({"app_id": "im.test", "pushkey": format!("{u}-k"), "url": gw.url}).to_string();
        let (status, v) = http_raw(c.nodes[0].port, "POST", "/v1/pushers", Some(&tokens[u]), Some(&body)).await;
        assert_eq!(status, 200, "set_pusher: {v}");
    }
    let _on0 = c.nodes[0].ws(&tokens["on0"]).await;
    let _on1 = c.nodes[1].ws(&tokens["on1"]).await;
    let mut senders = [c.nodes[0].ws(&tokens["s0"]).await, c.nodes[1].ws(&tokens["s1"]).await];
    // The other node learns of a route over the bus, a moment after the connection.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for g in GROUPS {
        c.group(&tokens["s0"], g, &["s1", "ann", "on0", "on1"]).await;
    }
    let mut due = Vec::new();
    for round in 0..3 {
        for g in GROUPS {
            for (i, ws) in senders.iter_mut().enumerate() {
                let f = json!({"conv_id": g, "client_msg_id": format!("m{round}-{i}"), "body": {"text": "hi"}});
                let ack = ws.request("send", f).await;
                let id = format!("{g}:{}", ack["seq"].as_i64().unwrap_or_else(|| panic!("send: {ack}")));
                // One at a time, so no notice coalesces into the next: each is due on its own.
                let until = tokio::time::Instant::now() + WAIT;
                while !event_ids(&gw.delivered("ann-k")).contains(&id) && tokio::time::Instant::now() < until {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                due.push(id);
            }
        }
    }
    // Recovery scans run every half lease: three leases long, a second sender would show.
    tokio::time::sleep(Duration::from_millis(4500)).await;
    let got = event_ids(&gw.delivered("ann-k"));
    let mut times: HashMap<&str, usize> = HashMap::new();
    for id in &got {
        *times.entry(id.as_str()).or_default() += 1;
    }
    let twice: Vec<&&str> = times.iter().filter(|(_, n)| **n > 1).map(|(id, _)| id).collect();
    let missing: Vec<&String> = due.iter().filter(|id| !times.contains_key(id.as_str())).collect();
    let connected = gw.attempts("on0-k").len() + gw.attempts("on1-k").len();
    let mut sent = Vec::new();
    for node in &c.nodes {
        sent.push(node.metric("imcore_notifications_total{outcome=\"sent\"}").await);
    }
    let pass = twice.is_empty() && missing.is_empty() && connected == 0 && !got.is_empty();
    let observed = json!({
        "due_msgs": due.len(), "delivered": got.len(), "distinct": times.len(), "twice": twice,
        "missing": missing, "to_connected_devices": connected, "sent_per_node": sent,
        "types": gw.delivered("ann-k").iter().map(|n| n["type"].clone()).collect::<Value>(),
    });
    let pass = check.resolve(observed, pass);
    assert!(pass);
}
