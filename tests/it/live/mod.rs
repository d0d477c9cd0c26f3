//! Live signals and blocking (PROTOCOL v1.2) on the wire: `block`/`unblock`/
//! `blocks` and every path a block closes, `reads` and read pushes to other
//! members, `typing` (throttle, mute, `pull`), `presence` (who may see it, the
//! grace period). The caller's ops go over WebSocket or over HTTP (the
//! variant); pushes are watched on WebSocket connections. Each check writes
//! its record to evidence/im-14. Two-node checks are in `live_cluster`.

use std::time::{Duration, Instant};

use imcore::config::WritePath;
use serde_json::{json, Value};

use crate::evidence::Check;
use crate::server::{TestServer, Ws};

pub const SUITE: &str = "im-14";
/// Long enough for a push that is coming to arrive.
const QUIET: Duration = Duration::from_millis(400);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Via {
    Ws,
    Http,
}

impl Via {
    pub fn name(self) -> &'static str {
        match self {
            Via::Ws => "ws",
            Via::Http => "http",
        }
    }
}

/// The HTTP route of a v1.2 op (or one the tests use beside them): method,
/// path, body.
fn route(op: &str, f: &Value) -> (&'static str, String, Value) {
    let conv = f["conv_id"].as_str().unwrap_or_default();
    let user = f["user_id"].as_str().unwrap_or_default();
    // Path parameters win over body fields, so the body may keep them.
    let body = f.clone();
    let query = |names: &[&str]| {
        let q: Vec<String> = names
            .iter()
            .filter_map(|n| f.get(*n).map(|v| format!("{n}={}", v.as_str().map_or(v.to_string(), str::to_owned))))
            .collect();
        if q.is_empty() {
            String::new()
        } else {
            format!("?{}", q.join("&"))
        }
    };
    match op {
        "block" => ("POST", "/v1/blocks".into(), body),
        "unblock" => ("DELETE", format!("/v1/blocks/{user}"), json!({})),
        "blocks" => ("GET", "/v1/blocks".into(), json!({})),
        "reads" => ("GET", format!("/v1/conversations/{conv}/reads{}", query(&["after", "limit"])), json!({})),
        "typing" => ("POST", format!("/v1/conversations/{conv}/typing"), body),
        "presence" => ("POST", "/v1/presence".into(), body),
        "send" => ("POST", format!("/v1/conversations/{conv}/messages"), body),
        "read" => ("POST", format!("/v1/conversations/{conv}/read"), body),
        "invite" => ("POST", format!("/v1/conversations/{conv}/members"), body),
        "create_conversation" => ("POST", "/v1/conversations".into(), body),
        "get_conversation" => ("GET", format!("/v1/conversations/{conv}"), json!({})),
        other => panic!("no route for {other}"),
    }
}

/// A user as a test drives it: a token, and a connection for pushes (and
/// for its ops over WebSocket).
pub struct Client {
    pub user: &'static str,
    pub token: String,
    pub ws: Ws,
    port: u16,
}

impl Client {
    pub async fn new(s: &TestServer, user: &'static str) -> Self {
        let token = s.user(user).await;
        let ws = s.ws(&token).await;
        Self { user, token, ws, port: s.port }
    }

    /// `op` over `via`: the result as over HTTP (an error as `{"error": CODE}`).
    pub async fn call(&mut self, via: Via, op: &str, fields: Value) -> Value {
        match via {
            Via::Ws => {
                let mut reply = self.ws.request(op, fields).await;
                if reply["ok"] == false {
                    return json!({"error": reply["error"]["code"]});
                }
                let Value::Object(m) = &mut reply else { panic!("reply {reply}") };
                m.remove("id");
                m.remove("ok");
                m.remove("result").unwrap_or(reply)
            }
            Via::Http => {
                let (method, path, body) = route(op, &fields);
                let body = (method != "GET" && method != "DELETE").then(|| body.to_string());
                let (_, v) =
                    crate::server::http_raw(self.port, method, &path, Some(&self.token), body.as_deref()).await;
                match v["error"]["code"].as_str() {
                    Some(code) => json!({"error": code}),
                    None => v,
                }
            }
        }
    }

    /// The pushes of `kind` (`"*"`: any) that arrive within `wait` (others are dropped).
    pub async fn pushes(&mut self, kind: &str, wait: Duration) -> Vec<Value> {
        let until = Instant::now() + wait;
        let mut got = vec![];
        while let Some(left) = until.checked_duration_since(Instant::now()) {
            match self.ws.live_push_within(left).await {
                Some(p) if kind == "*" || p["push"] == kind => got.push(p),
                Some(_) => {}
                None => break,
            }
        }
        got
    }

    pub async fn send(&mut self, via: Via, conv: &str, key: &str) -> Value {
        self.call(via, "send", json!({"conv_id": conv, "client_msg_id": key, "body": {"type": "text", "text": key}}))
            .await
    }
}

fn code(v: &Value) -> &str {
    v["error"].as_str().unwrap_or("ok")
}

/// A direct chat created by `a` with `b`.
async fn direct(a: &mut Client, b: &Client) -> String {
    let v = a.call(Via::Http, "create_conversation", json!({"kind": "direct", "members": [b.user]})).await;
    v["conv_id"].as_str().unwrap_or_else(|| panic!("direct: {v}")).to_owned()
}

/// A group `id` created by `owner` with `members`, with extra `settings`.
async fn group(owner: &mut Client, id: &str, members: &[&str], settings: Value) -> Value {
    let mut f = json!({"kind": "group", "conv_id": id, "name": id, "members": members});
    f.as_object_mut().expect("object").extend(settings.as_object().cloned().unwrap_or_default());
    owner.call(Via::Http, "create_conversation", f).await
}

mod blocking;
mod signals;
