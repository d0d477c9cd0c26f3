//! The HTTP routes of PROTOCOL §5, one request each in an order where each
//! is meaningful, and a wrong method on each route: 405 in the §2 shape.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use super::{server, SUITE};
use crate::evidence::Check;
use crate::server::http_raw;

/// Who calls, method, path, body, status, code (for a refusal).
type Row = (&'static str, &'static str, &'static str, Option<Value>, u16, Option<&'static str>);

fn rows() -> Vec<Row> {
    vec![
        ("u-own", "POST", "/v1/conversations/g-r/members", Some(json!({"user_ids": ["u-new"]})), 200, None),
        ("u-mem", "GET", "/v1/conversations/g-r/members?limit=10&q=u-", None, 200, None),
        ("u-x", "POST", "/v1/conversations/g-f/join", None, 200, None),
        ("u-app", "POST", "/v1/conversations/g-a/join", None, 200, None),
        ("u-x", "POST", "/v1/conversations/g-a/join", None, 200, None),
        ("u-own", "GET", "/v1/conversations/g-a/applications?limit=5", None, 200, None),
        ("u-own", "POST", "/v1/conversations/g-a/applications/u-app/approve", None, 200, None),
        ("u-own", "POST", "/v1/conversations/g-a/applications/u-x/reject", None, 200, None),
        ("u-own", "POST", "/v1/conversations/g-a/applications/u-x/approve", None, 404, Some("NOT_FOUND")),
        ("u-own", "PATCH", "/v1/conversations/g-r/members/u-mem", Some(json!({"role": "admin"})), 200, None),
        ("u-own", "PATCH", "/v1/conversations/g-r/members/u-mem", Some(json!({"extra_perms": 4})), 200, None),
        ("u-own", "PATCH", "/v1/conversations/g-r/members/u-mem", Some(json!({"mute_until": null})), 200, None),
        ("u-own", "PATCH", "/v1/conversations/g-r/members/u-own", Some(json!({"alias": "boss"})), 200, None),
        ("u-own", "PATCH", "/v1/conversations/g-r/members/u-mem", Some(json!({"alias": "x"})), 403, Some("FORBIDDEN")),
        (
            "u-own",
            "PATCH",
            "/v1/conversations/g-r/members/u-mem",
            Some(json!({"role": "admin", "alias": "x"})),
            400,
            Some("BAD_REQUEST"),
        ),
        ("u-own", "PATCH", "/v1/conversations/g-r/members/u-mem", Some(json!({})), 400, Some("BAD_REQUEST")),
        ("u-own", "DELETE", "/v1/conversations/g-r/members/u-new", None, 200, None),
        ("u-mem", "POST", "/v1/conversations/g-r/leave", None, 200, None),
        ("u-own", "POST", "/v1/conversations/g-r/owner", Some(json!({"user_id": "u-adm"})), 200, None),
        ("u-adm", "PATCH", "/v1/conversations/g-r", Some(json!({"name": "renamed"})), 200, None),
        ("u-adm", "PATCH", "/v1/conversations/g-r", Some(json!({})), 400, Some("BAD_REQUEST")),
        ("u-adm", "PATCH", "/v1/conversations/g-r", Some(json!({"max_member": 1})), 400, Some("BAD_REQUEST")),
        ("u-adm", "DELETE", "/v1/conversations/g-r", None, 200, None),
        ("u-adm", "GET", "/v1/conversations/g-r/members", None, 200, None),
        ("u-adm", "POST", "/v1/conversations/g-r/leave", None, 410, Some("CONV_DISMISSED")),
        ("u-own", "PUT", "/v1/conversations/g-f/members", None, 405, Some("BAD_REQUEST")),
        ("u-own", "GET", "/v1/conversations/g-f/join", None, 405, Some("BAD_REQUEST")),
        ("u-own", "GET", "/v1/conversations/g-f/leave", None, 405, Some("BAD_REQUEST")),
        ("u-own", "DELETE", "/v1/conversations/g-f/owner", None, 405, Some("BAD_REQUEST")),
        ("u-own", "POST", "/v1/conversations/g-f/members/u-x", None, 405, Some("BAD_REQUEST")),
        ("u-own", "POST", "/v1/conversations/g-f/applications", None, 405, Some("BAD_REQUEST")),
        ("u-own", "GET", "/v1/conversations/g-a/applications/u-x/approve", None, 405, Some("BAD_REQUEST")),
        ("u-own", "PUT", "/v1/conversations/g-a/applications/u-x/reject", None, 405, Some("BAD_REQUEST")),
        ("u-own", "POST", "/v1/conversations/g-f", None, 405, Some("BAD_REQUEST")),
        ("u-own", "GET", "/v1/conversations/g-f/nothing", None, 404, Some("NOT_FOUND")),
    ]
}

#[actix_web::test]
async fn every_group_route_answers_and_a_wrong_method_gets_405() {
    let check = Check::start(
        SUITE,
        "02-http-routes",
        "http, 35 requests in order on an invite, an approval and a free group",
        "each §5 route answers its op (invite, members with q, join free/approval, applications, approve, reject, \
         PATCH member with role / extra_perms / mute_until / own alias, kick, leave, owner, PATCH group, DELETE \
         group) with 200, the PATCH member refusals (another's alias 403, two fields or none 400), update_group \
         with nothing or max_member below the count 400, writes after dismiss 410; a method a route does not \
         take answers 405 with the §2 error shape (BAD_REQUEST); an unknown path 404 NOT_FOUND",
    );
    let s = server().await;
    let mut tokens = BTreeMap::new();
    for u in ["u-own", "u-adm", "u-mem", "u-new", "u-x", "u-app"] {
        tokens.insert(u, s.user(u).await);
    }
    for (conv, mode) in [("g-r", "invite"), ("g-a", "approval"), ("g-f", "free")] {
        let body =
            json!({"kind": "group", "conv_id": conv, "name": conv, "members": ["u-adm", "u-mem"], "join_mode": mode});
        let (status, v) = s.http("POST", "/v1/conversations", Some(&tokens["u-own"]), Some(&body)).await;
        assert_eq!(status, 201, "{v}");
    }
    let mut table = vec![];
    let mut all_right = true;
    for (who, method, path, body, want_status, want_code) in rows() {
        let body = body.map(|b| b.to_string());
        let (status, v) = http_raw(s.port, method, path, Some(&tokens[who]), body.as_deref()).await;
        let code = v["error"]["code"].as_str();
        let right = status == want_status && code == want_code;
        all_right &= right;
        table.push(json!({"who": who, "method": method, "path": path, "body": body, "status": status, "code": code,
                          "right": right}));
    }
    let pass = check.resolve(json!({"requests": table}), all_right);
    assert!(pass, "{:#?}", table.iter().filter(|r| r["right"] == false).collect::<Vec<_>>());
}
