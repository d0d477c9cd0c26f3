//! Group management (PROTOCOL §5 "Membership and groups") over the real
//! server: the permission matrix of every op and caller standing over both
//! transports, the one check order over every standing and status, banned
//! groups, membership changes racing sends, invites racing each other,
//! roster paging under churn, the orders of `members`, a 100,000-member
//! group, large groups' delivery (`delivery`) and the HTTP routes.
//! Records go to evidence/im-02.

mod banned;
mod churn;
mod delivery;
mod edges;
mod large;
mod matrix;
mod member_order;
mod order;
mod races;
mod routes;

use serde_json::{json, Map, Value};

use crate::server::{http_raw, TestServer, Ws};

const SUITE: &str = "im-02";

/// The transport a request goes over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    Ws,
    Http,
}

/// A server whose users may create conversations without a rate limit.
pub async fn server() -> TestServer {
    TestServer::with(|c| c.limits.create_per_minute = 0).await
}

/// The HTTP status PROTOCOL §2 gives a code.
pub fn status_of(code: &str) -> u16 {
    match code {
        "BAD_REQUEST" => 400,
        "UNAUTHORIZED" => 401,
        "FORBIDDEN" | "NOT_MEMBER" | "MUTED" | "CONV_BANNED" => 403,
        "NOT_FOUND" => 404,
        "CONV_DISMISSED" => 410,
        "ALREADY_MEMBER" | "GROUP_FULL" => 409,
        _ => 500,
    }
}

/// The HTTP route of a §5 op: method, path and body, the path parameters
/// taken out of `fields`.
pub fn route(op: &str, fields: &Value) -> (&'static str, String, Value) {
    let mut body: Map<String, Value> = fields.as_object().cloned().unwrap_or_default();
    let conv = body.remove("conv_id").and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default();
    let c = format!("/v1/conversations/{conv}");
    let mut target = || body.remove("user_id").and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default();
    let (method, path) = match op {
        "send" => ("POST", format!("{c}/messages")),
        "edit" => ("POST", format!("{c}/edit")),
        "react" => ("POST", format!("{c}/react")),
        "recall" => ("POST", format!("{c}/recall")),
        "sync" => ("GET", format!("{c}/events")),
        "invite" => ("POST", format!("{c}/members")),
        "members" => ("GET", format!("{c}/members")),
        "join" => ("POST", format!("{c}/join")),
        "leave" => ("POST", format!("{c}/leave")),
        "applications" => ("GET", format!("{c}/applications")),
        "approve" => ("POST", format!("{c}/applications/{}/approve", target())),
        "reject" => ("POST", format!("{c}/applications/{}/reject", target())),
        "kick" => ("DELETE", format!("{c}/members/{}", target())),
        "set_role" | "set_perms" | "mute_member" | "set_alias" => ("PATCH", format!("{c}/members/{}", target())),
        "transfer_owner" => ("POST", format!("{c}/owner")),
        "update_group" => ("PATCH", c),
        "dismiss" => ("DELETE", c),
        "get_conversation" => ("GET", c),
        other => panic!("no route for {other}"),
    };
    if method == "GET" {
        let query: Vec<String> =
            body.iter().map(|(k, v)| format!("{k}={}", v.as_str().map_or(v.to_string(), str::to_owned))).collect();
        let path = if query.is_empty() { path } else { format!("{path}?{}", query.join("&")) };
        return (method, path, Value::Null);
    }
    (method, path, Value::Object(body))
}

/// `set_alias` over HTTP names its member in the path: the caller.
pub fn with_self(op: &str, fields: Value, me: &str) -> Value {
    let mut fields = fields;
    if op == "set_alias" {
        fields["user_id"] = json!(me);
    }
    fields
}

/// One op over HTTP: `Ok(result)` or `Err(code)`; panics when the status is
/// not the one PROTOCOL §2 gives the code (or 2xx for a result).
pub async fn http_op(port: u16, token: &str, op: &str, fields: &Value) -> Result<Value, String> {
    let (method, path, body) = route(op, fields);
    let body = (!body.is_null()).then(|| body.to_string());
    let (status, v) = http_raw(port, method, &path, Some(token), body.as_deref()).await;
    match v["error"]["code"].as_str() {
        Some(code) => {
            assert_eq!(status, status_of(code), "{method} {path}: {v}");
            Err(code.to_owned())
        }
        None => {
            assert!((200..300).contains(&status), "{method} {path}: {status} {v}");
            Ok(v)
        }
    }
}

/// One op over WebSocket: `Ok(result)` or `Err(code)`.
pub async fn ws_op(ws: &mut Ws, op: &str, fields: Value) -> Result<Value, String> {
    let v = ws.request(op, fields).await;
    if v["ok"] == true {
        Ok(v)
    } else {
        Err(v["error"]["code"].as_str().unwrap_or("?").to_owned())
    }
}

/// `Ok` as the kind of success the row tells apart, or the error code.
pub fn outcome(op: &str, r: &Result<Value, String>) -> String {
    match r {
        Err(code) => code.clone(),
        Ok(v) if op == "invite" && v["pending"].as_array().is_some_and(|p| !p.is_empty()) => "ok:pending".into(),
        Ok(v) if op == "invite" && v["joined"].as_array().is_some_and(|p| !p.is_empty()) => "ok:joined".into(),
        Ok(v) if op == "join" && v["pending"] == true => "ok:pending".into(),
        Ok(_) => "ok".into(),
    }
}

/// A result that must be `Ok`: its body.
pub fn ok(r: Result<Value, String>, what: &str) -> Value {
    r.unwrap_or_else(|code| panic!("{what}: {code}"))
}

/// Every event `ws`'s user sees in `conv` from the start, by `sync` pages.
pub async fn visible_events(ws: &mut Ws, conv: &str) -> Vec<Value> {
    let mut out = vec![];
    let mut after = 0;
    loop {
        let page = ws.request("sync", json!({"conv_id": conv, "after_seq": after, "limit": 1000})).await;
        assert_eq!(page["ok"], true, "sync {conv}: {page}");
        out.extend(page["events"].as_array().cloned().unwrap_or_default());
        after = page["next_after"].as_i64().unwrap_or(after);
        if page["has_more"] != true {
            return out;
        }
    }
}

pub use crate::sync_points::pushed_seqs;
