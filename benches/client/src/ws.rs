//! A WebSocket connection to `/v1/ws` (PROTOCOL §4): requests are numbered,
//! replies are paired by `id`, and pushes that arrive meanwhile are kept
//! aside in arrival order. Load loops use the raw text frames instead.

use std::collections::VecDeque;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::net::{TcpSocket, TcpStream};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::handshake::client::Request;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

use crate::ClientError;

/// How a connection ended, as the client saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct Closed {
    pub code: Option<u16>,
    /// Pushes received before the close.
    pub pushes: Vec<Value>,
}

pub struct Ws {
    stream: WebSocketStream<TcpStream>,
    next_id: u64,
    pushes: VecDeque<Value>,
    replies: Vec<Value>,
}

impl Ws {
    /// Connects from 127.0.0.1, the token (if any) in the `Authorization` header.
    pub async fn connect(port: u16, token: Option<&str>) -> Result<Self, ClientError> {
        Self::connect_from(Ipv4Addr::LOCALHOST, port, token).await
    }

    /// Connects from the source address `src` (each 127.0.0.x has its own
    /// ephemeral ports, so many connections need several).
    pub async fn connect_from(src: Ipv4Addr, port: u16, token: Option<&str>) -> Result<Self, ClientError> {
        let mut req = request(&format!("ws://127.0.0.1:{port}/v1/ws"))?;
        if let Some(t) = token {
            let value = format!("Bearer {t}").parse().map_err(|_| ClientError::Request("token".into()))?;
            req.headers_mut().insert("Authorization", value);
        }
        let sock = TcpSocket::new_v4()?;
        sock.bind(SocketAddr::from((src, 0)))?;
        let tcp = sock.connect(SocketAddr::from(([127, 0, 0, 1], port))).await?;
        Self::handshake(req, tcp).await
    }

    /// Connects to a `ws://host:port/…` URL as given (e.g. the token in the query).
    pub async fn connect_url(url: &str) -> Result<Self, ClientError> {
        let req = request(url)?;
        let host = req.uri().host().ok_or_else(|| ClientError::Request(format!("no host in {url}")))?;
        let port = req.uri().port_u16().unwrap_or(80);
        let tcp = TcpStream::connect((host, port)).await?;
        Self::handshake(req, tcp).await
    }

    async fn handshake(req: Request, tcp: TcpStream) -> Result<Self, ClientError> {
        tcp.set_nodelay(true)?;
        match tokio_tungstenite::client_async(req, tcp).await {
            Ok((stream, _)) => Ok(Self { stream, next_id: 1, pushes: VecDeque::new(), replies: vec![] }),
            Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => Err(ClientError::Refused(resp.status().as_u16())),
            Err(e) => Err(e.into()),
        }
    }

    /// Sends one text frame as is.
    pub async fn send_text(&mut self, text: String) -> Result<(), ClientError> {
        Ok(self.stream.send(Message::Text(text)).await?)
    }

    /// Queues one text frame without flushing (several go out in one write).
    pub async fn feed_text(&mut self, text: String) -> Result<(), ClientError> {
        Ok(self.stream.feed(Message::Text(text)).await?)
    }

    pub async fn flush(&mut self) -> Result<(), ClientError> {
        Ok(self.stream.flush().await?)
    }

    /// Sends `{"id", "op", ...fields}` without waiting; returns the id.
    pub async fn start(&mut self, op: &str, fields: Value) -> Result<u64, ClientError> {
        let id = self.next_id;
        self.next_id += 1;
        let mut frame = fields;
        frame["id"] = json!(id);
        frame["op"] = json!(op);
        self.send_text(frame.to_string()).await?;
        Ok(id)
    }

    /// The reply with this id; pushes and other replies arriving meanwhile
    /// are kept. Cancel-safe: nothing read is lost if the wait is dropped.
    pub async fn reply(&mut self, id: u64) -> Result<Value, ClientError> {
        loop {
            if let Some(i) = self.replies.iter().position(|r| r["id"] == json!(id)) {
                return Ok(self.replies.remove(i));
            }
            let v = self.read().await?;
            self.file(v);
        }
    }

    pub async fn request(&mut self, op: &str, fields: Value) -> Result<Value, ClientError> {
        let id = self.start(op, fields).await?;
        self.reply(id).await
    }

    /// The next frame that is neither a push nor a reply to a request (the
    /// server's answer to a frame it could not read an id from).
    pub async fn reply_without_id(&mut self) -> Result<Value, ClientError> {
        loop {
            let v = self.read().await?;
            if v.get("push").is_none() && v.get("id").is_none() {
                return Ok(v);
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

    /// The next push, if one comes within `wait` (`None` also when the
    /// connection ends).
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

    /// Reads until the server closes, at most `wait`: the close code and
    /// every push seen (kept ones first).
    pub async fn closed_within(&mut self, wait: Duration) -> Result<Closed, ClientError> {
        let mut pushes: Vec<Value> = self.pushes.drain(..).collect();
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            match tokio::time::timeout_at(deadline, self.read()).await {
                Ok(Ok(v)) if v.get("push").is_some() => pushes.push(v),
                Ok(Ok(_)) => {}
                Ok(Err(ClientError::Closed { code })) => return Ok(Closed { code, pushes }),
                Ok(Err(e)) => return Err(e),
                Err(_) => return Err(ClientError::Timeout(wait)),
            }
        }
    }

    /// The next JSON frame (kept pushes and replies aside).
    pub async fn read(&mut self) -> Result<Value, ClientError> {
        let text = self.next_text().await?;
        Ok(serde_json::from_str(&text)?)
    }

    /// The next text frame as it came; `Closed` (with the server's close code,
    /// if any) when the connection ends. Cancel-safe.
    pub async fn next_text(&mut self) -> Result<String, ClientError> {
        loop {
            match self.stream.next().await {
                Some(Ok(Message::Text(t))) => return Ok(t),
                Some(Ok(Message::Close(frame))) => {
                    return Err(ClientError::Closed { code: frame.map(|f| u16::from(f.code)) })
                }
                Some(Ok(_)) => {}
                Some(Err(_)) | None => return Err(ClientError::Closed { code: None }),
            }
        }
    }

    /// A close frame to the server (best effort: it may be gone).
    pub async fn close(mut self) {
        let _ = self.stream.close(None).await;
    }
}

fn request(url: &str) -> Result<Request, ClientError> {
    url.into_client_request().map_err(|e| ClientError::Request(format!("{url}: {e}")))
}
