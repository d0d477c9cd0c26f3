//! A token rotated while its device's upgrade is between the token lookup
//! and the route (ARCHITECTURE §7, "Token rotation across nodes"): the rotation's kick
//! finds no route, so the connection must re-read its token once routed.
//! Made deterministic on two nodes, where that stretch waits for the
//! cluster-wide connection id: the test holds its sequence. Records go to
//! evidence/im-13.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::cluster_harness::Cluster;
use crate::evidence::Check;

const SUITE: &str = "im-13";
const WAIT: Duration = Duration::from_secs(30);

#[actix_web::test]
async fn a_token_rotated_between_the_lookup_and_the_route_still_kicks_the_connection() {
    let check = Check::start(
        SUITE,
        "13-token-rotated-mid-upgrade",
        "2 nodes; the connection-id sequence held (ALTER SEQUENCE in an open transaction); a device upgrades on \
         node 1 and waits for its id after its token lookup; its token rotated through node 1; the sequence released",
        "the upgrade completes and the connection is then told `kicked: token_revoked` and closed: the revocation \
         came while it had no route, so it re-read its token once routed",
    );
    let c = Cluster::start(2).await;
    let old = c.user("rm").await;
    let db = c.db.client().await;
    db.batch_execute("BEGIN; ALTER SEQUENCE conn_ids CACHE 1").await.expect("hold the connection-id sequence");
    let node = &c.nodes[0];
    let connecting = node.try_ws(&old);
    let rotating = async {
        // The upgrade waits on the sequence once its token was looked up (in
        // the statement's Parse, which `pg_stat_activity.query` does not show;
        // nothing else here takes a lock), at most the 5 s lock timeout.
        let deadline = Instant::now() + WAIT;
        let waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
                       AND datname = current_database() AND pid <> pg_backend_pid()";
        while db.query_one(waiting, &[]).await.expect("pg_stat_activity").get::<_, i64>(0) == 0 {
            assert!(Instant::now() < deadline, "the upgrade never waited for its connection id");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let (status, issued) = c.admin("/v1/admin/users/rm/devices", json!({"device_id": "d1"})).await;
        assert_eq!(status, 201, "rotate: {issued}");
        db.batch_execute("COMMIT").await.expect("release the sequence");
    };
    let (connected, ()) = tokio::join!(connecting, rotating);
    let (upgraded, kicked, close_code) = match connected {
        Ok(mut ws) => {
            // Panics if the connection stays open.
            let closed = ws.closed().await;
            let kicked = closed.pushes.iter().any(|p| p["push"] == "kicked" && p["reason"] == "token_revoked");
            (true, kicked, Some(closed.code))
        }
        Err(_) => (false, false, None),
    };
    let observed = json!({"upgraded": upgraded, "kicked_token_revoked": kicked, "close_code": close_code});
    assert!(check.resolve(observed.clone(), upgraded && kicked), "{observed}");
}
