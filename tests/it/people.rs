//! The people picker's op, `search_users` (PROTOCOL v1.2), on the real
//! server and PostgreSQL: a prefix finds only users who share a conversation
//! with the caller, any case; anyone else only by exact id; a creation naming
//! unknown ids names each of them.

use serde_json::{json, Value};

use crate::evidence::Check;
use crate::server::TestServer;

const SUITE: &str = "web";

fn ids_of(reply: &Value) -> Vec<String> {
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
         never ana herself; limit 1 gives one; bad prefix or limit → BAD_REQUEST",
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
        found.insert(prefix.into(), json!(ids_of(&reply)));
    }
    let (http_status, http) = s.http("GET", "/v1/users?prefix=Be&limit=1", Some(&ana), None).await;
    let mut refused = serde_json::Map::new();
    for fields in [json!({}), json!({"prefix": ""}), json!({"prefix": "b c"}), json!({"prefix": "b", "limit": 51})] {
        let reply = ws.request("search_users", fields.clone()).await;
        refused.insert(fields.to_string(), reply["error"]["code"].clone());
    }

    let expected = json!({
        "B": ["ben", "bert"], "b": ["ben", "bert"], "bo": [], "bob": ["bob"], "BOB": ["bob"], "zoe": ["Zoe"],
        "a": [], "ana": [], "c": ["cai"],
    });
    let pass = Value::Object(found.clone()) == expected
        && http_status == 200
        && ids_of(&http) == ["ben"]
        && refused.values().all(|c| c == "BAD_REQUEST");
    assert!(
        check.resolve(json!({"found": found, "http_Be_limit_1": http, "refused": refused}), pass),
        "{found:?} {http} {refused:?}"
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

#[actix_web::test]
async fn a_search_reads_a_few_index_entries_not_the_users_or_a_big_groups_roster() {
    const USERS: i64 = 20_000;
    const MEMBERS: usize = 4_000;
    let check = Check::start(
        SUITE,
        "30-search-users-indexed",
        "20,000 users; ana in a group of 4,000 of them; EXPLAIN ANALYZE of the store's search for 'P-0012' \
         (111 members match) with limit 10, after ANALYZE, planner settings untouched",
        "the members' lowercase-id index and the users' lowercase-id index are read; no sequential scan of users or \
         members; the group gives at most 10 rows; the answer is p-00120 … p-00129",
    );
    let s = TestServer::start().await;
    let ana = s.user("ana").await;
    let c = s.db.client().await;
    c.execute(
        "INSERT INTO users (user_id) SELECT 'p-' || lpad(i::text, 5, '0') FROM generate_series(1, $1::bigint) i",
        &[&USERS],
    )
    .await
    .expect("users");
    let body = json!({"kind": "group", "conv_id": "g-big", "name": "Big", "members": [], "max_member": 10_000});
    assert_eq!(s.http("POST", "/v1/conversations", Some(&ana), Some(&body)).await.0, 201);
    let ids: Vec<String> = (1..=MEMBERS).map(|i| format!("p-{i:05}")).collect();
    for chunk in ids.chunks(1_000) {
        let invite = json!({"user_ids": chunk});
        let (status, v) = s.http("POST", "/v1/conversations/g-big/members", Some(&ana), Some(&invite)).await;
        assert_eq!(status, 200, "invite: {v}");
    }
    c.batch_execute("ANALYZE users; ANALYZE members").await.expect("analyze");
    let plan: Vec<String> = c
        .query(
            &format!("EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF) {}", imcore::store::SEARCH_USERS),
            &[&"ana", &"p-0012%", &"P-0012", &10i64],
        )
        .await
        .expect("explain")
        .iter()
        .map(|r| r.get(0))
        .collect();
    let plan_text = plan.join("\n");
    let (_, found) = s.http("GET", "/v1/users?prefix=P-0012", Some(&ana), None).await;
    let want: Vec<String> = (120..130).map(|i| format!("p-{i:05}")).collect();
    let pass = plan_text.contains("members_user_lower_prefix")
        && plan_text.contains("users_lower_id")
        && !plan_text.contains("Seq Scan on users")
        && !plan_text.contains("Seq Scan on members")
        && ids_of(&found) == want;
    assert!(check.resolve(json!({"plan": plan, "found": found}), pass), "{plan_text}");
}
