//! The whole server in-process on port 0, and protocol-level clients: a tiny
//! HTTP/1.1 client over raw TCP and a WebSocket client (tokio-tungstenite)
//! that pairs replies by `id` and keeps pushes aside.

use std::collections::VecDeque;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use imcore::config::Config;
use imcore::startup::{Application, ShutdownTrigger};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use crate::harness::TestDb;

pub const ADMIN: &str = "test-admin-token";
const WAIT: Duration = Duration::from_secs(10);

pub struct TestServer {
    pub port: u16,
    pub db: TestDb,
    pub trigger: ShutdownTrigger,
    pub running: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl TestServer {
    pub async fn start() -> Self {
        Self::with(|_| {}).await
    }

    /// Starts on a fresh database; `tweak` adjusts the configuration.
    pub async fn with(tweak: impl FnOnce(&mut Config)) -> Self {
        let db = TestDb::with_pool(4).await;
        let mut config = Config::for_database(db.url.clone());
        config.admin_token = Some(ADMIN.into());
        config.engine.write.arbiters = 1;
        config.workers = 1;
        config.store.pool_size = 8;
        tweak(&mut config);
        let app = Application::build(config).await.expect("build the server");
        let (port, trigger) = (app.port(), app.shutdown_trigger());
        let running = actix_web::rt::spawn(app.run_until_stopped());
        Self { port, db, trigger, running }
    }

    pub async fn http(&self, method: &str, path: &str, token: Option<&str>, body: Option<&Value>) -> (u16, Value) {
        let body = body.map(|b| b.to_string());
        http_raw(self.port, method, path, token, body.as_deref()).await
    }

    pub async fn admin(&self, path: &str, body: Value) -> (u16, Value) {
        self.http("POST", path, Some(ADMIN), Some(&body)).await
    }

    /// Creates `user` and returns a token for its device `d1`.
    pub async fn user(&self, user: &str) -> String {
        let (status, _) = self.admin("/v1/admin/users", json!({"user_id": user})).await;
        assert_eq!(status, 201, "create user {user}");
        self.device(user, "d1").await
    }

    /// Issues (or rotates) the token of `user`'s `device`.
    pub async fn device(&self, user: &str, device: &str) -> String {
        let (status, v) = self.admin(&format!("/v1/admin/users/{user}/devices"), json!({"device_id": device})).await;
        assert_eq!(status, 201, "issue device {user}/{device}: {v}");
        v["token"].as_str().expect("token").to_owned()
    }

    /// A connection, routed by the time this returns (a ping was answered,
    /// and the session registers before it reads any frame).
    pub async fn ws(&self, token: &str) -> Ws {
        let mut ws = Ws::connect(self.port, Some(token)).await.expect("websocket upgrade");
        ws.request("ping", json!({})).await;
        ws
    }

    /// A direct chat created by `a`'s token with `b`; its conv_id.
    pub async fn direct(&self, token: &str, other: &str) -> String {
        let (status, v) = self
            .http("POST", "/v1/conversations", Some(token), Some(&json!({"kind": "direct", "members": [other]})))
            .await;
        assert!(status == 201 || status == 200, "create direct: {status} {v}");
        v["conv_id"].as_str().expect("conv_id").to_owned()
    }
}

/// One HTTP/1.1 request on a fresh connection (`Connection: close`).
pub async fn http_raw(port: u16, method: &str, path: &str, token: Option<&str>, body: Option<&str>) -> (u16, Value) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n");
    if let Some(t) = token {
        req.push_str(&format!("Authorization: Bearer {t}\r\n"));
    }
    let body = body.unwrap_or("");
    req.push_str(&format!("Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()));
    s.write_all(req.as_bytes()).await.expect("write request");
    let mut raw = Vec::new();
    tokio::time::timeout(WAIT, s.read_to_end(&mut raw)).await.expect("response in time").expect("read response");
    let text = String::from_utf8_lossy(&raw);
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status: u16 = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let chunked = head.to_ascii_lowercase().contains("transfer-encoding: chunked");
    let payload = if chunked { dechunk(rest) } else { rest.to_owned() };
    (status, serde_json::from_str(&payload).unwrap_or(Value::String(payload)))
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

type Stream = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// How a connection ended, as the client saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct Closed {
    pub code: Option<u16>,
    /// Pushes received before the close.
    pub pushes: Vec<Value>,
}

pub struct Ws {
    stream: Stream,
    next_id: u64,
    pushes: VecDeque<Value>,
    replies: Vec<Value>,
}

impl Ws {
    /// `Err(status)` when the upgrade is refused.
    pub async fn connect(port: u16, token: Option<&str>) -> Result<Self, u16> {
        let mut req = format!("ws://127.0.0.1:{port}/v1/ws").into_client_request().expect("request");
        if let Some(t) = token {
            req.headers_mut().insert("Authorization", format!("Bearer {t}").parse().expect("header"));
        }
        Self::connect_request(req).await
    }

    pub async fn connect_url(url: &str) -> Result<Self, u16> {
        Self::connect_request(url.into_client_request().expect("request")).await
    }

    async fn connect_request(req: tokio_tungstenite::tungstenite::handshake::client::Request) -> Result<Self, u16> {
        match tokio_tungstenite::connect_async(req).await {
            Ok((stream, _)) => Ok(Self { stream, next_id: 1, pushes: VecDeque::new(), replies: vec![] }),
            Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => Err(resp.status().as_u16()),
            Err(e) => panic!("websocket connect: {e}"),
        }
    }

    pub async fn send_text(&mut self, text: String) {
        self.stream.send(Message::Text(text)).await.expect("send frame");
    }

    /// Sends `{"id", "op", ...fields}` without waiting; returns the id.
    pub async fn start(&mut self, op: &str, fields: Value) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        let mut frame = fields;
        frame["id"] = json!(id);
        frame["op"] = json!(op);
        self.send_text(frame.to_string()).await;
        id
    }

    /// The reply with this id (pushes arriving meanwhile are kept).
    pub async fn reply(&mut self, id: u64) -> Value {
        loop {
            if let Some(i) = self.replies.iter().position(|r| r["id"] == json!(id)) {
                return self.replies.remove(i);
            }
            let v = self.read().await.unwrap_or_else(|c| panic!("closed waiting for reply {id}: {c:?}"));
            self.file(v);
        }
    }

    pub async fn request(&mut self, op: &str, fields: Value) -> Value {
        let id = self.start(op, fields).await;
        self.reply(id).await
    }

    /// The next frame that is not a reply to a request.
    pub async fn reply_without_id(&mut self) -> Value {
        loop {
            let v = self.read().await.expect("open");
            if v.get("push").is_none() && v.get("id").is_none() {
                return v;
            }
            self.file(v);
        }
    }

    fn file(&mut self, v: Value) {
        if v.get("push").is_some() {
            self.pushes.push_back(v);
        } else {
            self.replies.push(v);
        }
    }

    /// The next push, if one comes within `wait`.
    pub async fn push_within(&mut self, wait: Duration) -> Option<Value> {
        if let Some(p) = self.pushes.pop_front() {
            return Some(p);
        }
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            match tokio::time::timeout_at(deadline, self.read()).await {
                Ok(Ok(v)) if v.get("push").is_some() => return Some(v),
                Ok(Ok(v)) => self.replies.push(v),
                Ok(Err(_)) | Err(_) => return None,
            }
        }
    }

    pub async fn push(&mut self) -> Value {
        self.push_within(WAIT).await.expect("a push")
    }

    /// No push pending once a ping round trip is answered (pushes sent
    /// before the ping's answer would have arrived first).
    pub async fn no_push_pending(&mut self) -> bool {
        self.request("ping", json!({})).await;
        self.pushes.is_empty()
    }

    /// Reads until the server closes; the close code and the pushes seen.
    pub async fn closed(&mut self) -> Closed {
        let mut pushes: Vec<Value> = self.pushes.drain(..).collect();
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            match tokio::time::timeout_at(deadline, self.read()).await {
                Ok(Ok(v)) if v.get("push").is_some() => pushes.push(v),
                Ok(Ok(_)) => {}
                Ok(Err(code)) => return Closed { code, pushes },
                Err(_) => panic!("the server did not close the connection in time"),
            }
        }
    }

    /// The next JSON text frame, or the close code when the connection ends.
    async fn read(&mut self) -> Result<Value, Option<u16>> {
        loop {
            match self.stream.next().await {
                Some(Ok(Message::Text(t))) => return Ok(serde_json::from_str(&t).expect("server frames are JSON")),
                Some(Ok(Message::Close(frame))) => return Err(frame.map(|f| u16::from(f.code))),
                Some(Ok(_)) => {}
                Some(Err(_)) | None => return Err(None),
            }
        }
    }

    pub async fn close(mut self) {
        let _ = self.stream.close(None).await;
    }
}
