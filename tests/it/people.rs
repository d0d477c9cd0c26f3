//! The people picker's op, `search_users` (PROTOCOL v1.2), on the real
//! server and PostgreSQL: a prefix finds only users who share a conversation
//! with the caller, any case; anyone else only by exact id; a creation naming
//! unknown ids names each of them.

use serde_json::{json, Value};

use crate::evidence::Check;
use crate::server::TestServer;

const SUITE: &str = "web";

fn ids(reply: &Value) -> Vec<String> {
    reply["users"].as_array().into_iter().flatten().filter_map(|u| u["user_id"].as_str().map(str::to_owned)).collect()
}

#[actix_web::test]
async fn a_prefix_finds_only_people_who_share_a_conversation_and_an_exact_id_finds_anyone() {
    let check = Check::start(
        SUITE,
        "30-search-users-scope",
        "ana shares a direct chat with ben and a group with bert and cai; bob and old user 'Zoe' (capital, from \
         before the lowercase rule) share nothing with her; searches over WebSocket and HTTP",
        "'B' finds ben, bert (any case), never bob; 'bo' finds nobody; 'bob' and 'BOB' find bob; 'zoe' finds Zoe; \
         never ana herself; limit 1 gives one; bad prefix or limit → BAD_REQUEST; the plan reads the new indexes",
    );
    let s = TestServer::start().await;
    let ana = s.user("ana").await;
    for u in ["ben", "bert", "bob", "cai"] {
        s.user(u).await;
    }
    s.db.client().await.execute("INSERT INTO users (user_id) VALUES ('Zoe')", &[]).await.expect("an old user");
    s.direct(&ana, "ben").await;
    let body = json!({"kind": "group", "name": "Team", "members": ["bert", "cai"]});
    let (status, _) = s.http("POST", "/v1/conversations", Some(&ana), Some(&body)).await;
    assert_eq!(status, 201);

    let mut ws = s.ws(&ana).await;
    let mut found = serde_json::Map::new();
    for prefix in ["B", "b", "bo", "bob", "BOB", "zoe", "a", "ana", "c"] {
        let reply = ws.request("search_users", json!({ "prefix": prefix })).await;
        assert_eq!(reply["ok"], json!(true), "{reply}");
        found.insert(prefix.into(), json!(ids(&reply)));
    }
    let (http_status, http) = s.http("GET", "/v1/users?prefix=Be&limit=1", Some(&ana), None).await;
    let mut refused = serde_json::Map::new();
    for fields in [json!({}), json!({"prefix": ""}), json!({"prefix": "b c"}), json!({"prefix": "b", "limit": 51})] {
        let reply = ws.request("search_users", fields.clone()).await;
        refused.insert(fields.to_string(), reply["error"]["code"].clone());
    }

    let c = s.db.client().await;
    c.batch_execute("ANALYZE; SET enable_seqscan = off").await.expect("analyze");
    let plan: Vec<String> = c
        .query(&format!("EXPLAIN (COSTS OFF) {}", imcore::store::SEARCH_USERS), &[&"ana", &"b%", &"b", &10i64])
        .await
        .expect("explain")
        .iter()
        .map(|r| r.get(0))
        .collect();
    let plan_text = plan.join("\n");
    let indexed = plan_text.contains("members_user_lower_prefix") && plan_text.contains("users_lower_id");

    let expected = json!({
        "B": ["ben", "bert"], "b": ["ben", "bert"], "bo": [], "bob": ["bob"], "BOB": ["bob"], "zoe": ["Zoe"],
        "a": [], "ana": [], "c": ["cai"],
    });
    let pass = Value::Object(found.clone()) == expected
        && http_status == 200
        && ids(&http) == ["ben"]
        && refused.values().all(|c| c == "BAD_REQUEST")
        && indexed;
    assert!(
        check.resolve(json!({"found": found, "http_Be_limit_1": http, "refused": refused, "plan": plan}), pass),
        "{found:?} {http} {refused:?} {plan_text}"
    );
}

#[actix_web::test]
async fn a_creation_or_invite_naming_unknown_ids_names_each_of_them_and_creates_nothing() {
    let check = Check::start(
        SUITE,
        "30-create-names-unknown-ids",
        "ana creates a group of ben, zoe, yan (zoe and yan are no users), then invites zoe and cai into a group",
        "NOT_FOUND whose message names 'zoe, yan' (and then 'zoe'), and ana's inbox gains no group from the first",
    );
    let s = TestServer::start().await;
    let ana = s.user("ana").await;
    s.user("ben").await;
    s.user("cai").await;
    let body = json!({"kind": "group", "name": "Trip", "members": ["ben", "zoe", "yan", "zoe"]});
    let (status, created) = s.http("POST", "/v1/conversations", Some(&ana), Some(&body)).await;
    let (_, inbox) = s.http("GET", "/v1/conversations", Some(&ana), None).await;
    let body = json!({"kind": "group", "conv_id": "g-ok", "name": "Ok", "members": ["ben"]});
    assert_eq!(s.http("POST", "/v1/conversations", Some(&ana), Some(&body)).await.0, 201);
    let (invite_status, invited) =
        s.http("POST", "/v1/conversations/g-ok/members", Some(&ana), Some(&json!({"user_ids": ["zoe", "cai"]}))).await;
    let pass = status == 404
        && created["error"]["code"] == "NOT_FOUND"
        && created["error"]["message"] == "users zoe, yan not found"
        && inbox["conversations"].as_array().is_some_and(Vec::is_empty)
        && invite_status == 404
        && invited["error"]["message"] == "user zoe not found";
    assert!(check.resolve(json!({"create": created, "inbox": inbox, "invite": invited}), pass), "{created} {invited}");
}
