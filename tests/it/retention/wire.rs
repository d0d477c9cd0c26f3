//! Retention as the server runs it: `POST /v1/admin/retention/run` and the
//! periodic purge.

use serde_json::{json, Value};

use super::{eventually, SUITE};
use crate::evidence::Check;
use crate::server::TestServer;

/// A group of `u-ana` and `u-ben` keeping events an hour, with `sends`
/// messages of `u-ana`, all then made two hours old; its conv_id.
async fn expired_group(s: &TestServer, id: &str, sends: usize) -> String {
    let ana = s.user("u-ana").await;
    s.user("u-ben").await;
    let create = json!({"kind": "group", "conv_id": id, "name": id, "members": ["u-ben"], "retention_ms": 3_600_000});
    let (status, v) = s.http("POST", "/v1/conversations", Some(&ana), Some(&create)).await;
    assert_eq!(status, 201, "create group: {v}");
    for i in 0..sends {
        let body = json!({"client_msg_id": format!("m{i}"), "body": {"type": "text", "text": "old"}});
        let (status, v) = s.http("POST", &format!("/v1/conversations/{id}/messages"), Some(&ana), Some(&body)).await;
        assert_eq!(status, 201, "send: {v}");
    }
    let c = s.db.client().await;
    c.execute("UPDATE events SET created_at = now() - interval '2 hours' WHERE conv_id = $1", &[&id])
        .await
        .expect("age events");
    id.to_owned()
}

#[actix_web::test]
async fn the_admin_endpoint_purges_and_answers_the_counts() {
    let check = Check::start(
        SUITE,
        "11-admin-retention-run",
        "http",
        "POST /v1/admin/retention/run: without a token or with a user's token 401 UNAUTHORIZED and nothing purged; \
         with the admin token 200 {conversations:1, events_purged:7, tombstones_written:5, tombstones_expired:0}; \
         a second run purges nothing",
    );
    let s = TestServer::start().await;
    let conv = expired_group(&s, "g-admin", 5).await;
    let ana = s.device("u-ana", "d2").await;
    let path = "/v1/admin/retention/run";
    let none = s.http("POST", path, None, Some(&json!({}))).await;
    let user = s.http("POST", path, Some(&ana), Some(&json!({}))).await;
    let c = s.db.client().await;
    let min_seq = || async {
        let r = c.query_one("SELECT min_seq FROM conversations WHERE conv_id = $1", &[&conv]).await.expect("min_seq");
        r.get::<_, i64>(0)
    };
    let untouched = min_seq().await;
    let run = s.admin(path, json!({})).await;
    let again = s.admin(path, json!({})).await;
    let after = min_seq().await;
    let unauthorized = |r: &(u16, Value)| r.0 == 401 && r.1["error"]["code"] == "UNAUTHORIZED";
    let pass = unauthorized(&none)
        && unauthorized(&user)
        && untouched == 1
        && run.0 == 200
        && run.1 == json!({"conversations": 1, "events_purged": 7, "tombstones_written": 5, "tombstones_expired": 0})
        && again.1["events_purged"] == 0
        && after == 8;
    let pass = check.resolve(
        json!({"no_token": none, "user_token": user, "min_seq_before": untouched, "run": run,
               "second_run": again, "min_seq_after": after}),
        pass,
    );
    assert!(pass);
}

#[actix_web::test]
async fn the_periodic_purge_runs_without_the_endpoint() {
    let check = Check::start(
        SUITE,
        "11-periodic-purge",
        "interval 200 ms",
        "with IMCORE_RETENTION_INTERVAL_MS=200 the 5 expired sends and 2 joins are purged and tombstoned by the \
         timer alone (polled in the database, 10 s bound)",
    );
    let s = TestServer::with(|c| c.retention.interval_ms = 200).await;
    let conv = expired_group(&s, "g-timer", 5).await;
    let c = s.db.client().await;
    let started = std::time::Instant::now();
    let min_seq = eventually(&c, "SELECT min_seq FROM conversations WHERE conv_id = $1", &conv, |m| m == 8).await;
    let waited_ms = started.elapsed().as_millis() as u64;
    let tombs = eventually(&c, "SELECT count(*) FROM idem_tombstones WHERE conv_id = $1", &conv, |n| n == 5).await;
    let pass = min_seq == Some(8) && tombs == Some(5);
    let pass = check.resolve(json!({"min_seq": min_seq, "tombstones": tombs, "waited_ms": waited_ms}), pass);
    assert!(pass);
}
