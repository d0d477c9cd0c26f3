//! Clients of the server under test: a small keep-alive HTTP/1.1 client (admin
//! API, group creation), WebSocket connections bound to chosen 127.0.0.x
//! source addresses, bulk setup helpers, and latency percentiles.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::WebSocketStream;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub type Ws = WebSocketStream<TcpStream>;

/// Wall-clock microseconds (send timestamps travel in message bodies; sender
/// and receivers share this machine's clock).
pub fn now_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

/// One keep-alive HTTP/1.1 connection to the server.
pub struct Http {
    port: u16,
    stream: Option<TcpStream>,
    buf: Vec<u8>,
}

impl Http {
    pub fn new(port: u16) -> Self {
        Self { port, stream: None, buf: Vec::with_capacity(4096) }
    }

    /// `(status, JSON body)`. A request on a keep-alive connection the server
    /// closed meanwhile is sent once more on a fresh one.
    pub async fn call(
        &mut self,
        method: &str,
        path: &str,
        token: &str,
        body: Option<&Value>,
    ) -> Result<(u16, Value), BoxError> {
        let body = body.map(Value::to_string).unwrap_or_default();
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        let mut last = None;
        for _ in 0..2 {
            match self.once(req.as_bytes()).await {
                Ok(r) => return Ok(r),
                Err(e) => {
                    self.stream = None;
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or_else(|| "http: no attempt".into()))
    }

    async fn once(&mut self, req: &[u8]) -> Result<(u16, Value), BoxError> {
        if self.stream.is_none() {
            let s = TcpStream::connect(("127.0.0.1", self.port)).await?;
            s.set_nodelay(true)?;
            self.stream = Some(s);
        }
        let s = self.stream.as_mut().ok_or("no stream")?;
        s.write_all(req).await?;
        self.buf.clear();
        let mut chunk = [0u8; 8192];
        let head_end = loop {
            if let Some(i) = find(&self.buf, b"\r\n\r\n") {
                break i;
            }
            let n = tokio::time::timeout(Duration::from_secs(60), s.read(&mut chunk)).await??;
            if n == 0 {
                return Err("http: connection closed".into());
            }
            self.buf.extend_from_slice(&chunk[..n]);
        };
        let head = String::from_utf8_lossy(&self.buf[..head_end]).to_ascii_lowercase();
        let status: u16 = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).ok_or("http: no status")?;
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse().ok())
            .ok_or("http: response without content-length")?;
        let close = head.contains("connection: close");
        let start = head_end + 4;
        while self.buf.len() < start + len {
            let n = tokio::time::timeout(Duration::from_secs(60), s.read(&mut chunk)).await??;
            if n == 0 {
                return Err("http: connection closed mid-body".into());
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
        let body = &self.buf[start..start + len];
        let value =
            serde_json::from_slice(body).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(body).into()));
        if close {
            self.stream = None;
        }
        Ok((status, value))
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Runs `f` over `items` on `par` concurrent keep-alive connections; results in item order.
pub async fn parallel<T, R, F, Fut>(port: u16, items: Vec<T>, par: usize, f: F) -> Result<Vec<R>, BoxError>
where
    T: Send + Sync + 'static,
    R: Send + 'static,
    F: Fn(Http, Arc<T>) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = (Http, Result<R, BoxError>)> + Send,
{
    let items: Arc<Vec<Arc<T>>> = Arc::new(items.into_iter().map(Arc::new).collect());
    let next = Arc::new(AtomicUsize::new(0));
    let f = Arc::new(f);
    let mut tasks = Vec::new();
    for _ in 0..par.max(1) {
        let (items, next, f) = (items.clone(), next.clone(), f.clone());
        tasks.push(tokio::spawn(async move {
            let mut http = Http::new(port);
            let mut out = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(item) = items.get(i) else { break };
                let (h, r) = f(http, item.clone()).await;
                http = h;
                out.push((i, r?));
            }
            Ok::<_, BoxError>(out)
        }));
    }
    let mut all: Vec<(usize, R)> = Vec::with_capacity(items.len());
    for t in tasks {
        all.extend(t.await??);
    }
    all.sort_by_key(|(i, _)| *i);
    Ok(all.into_iter().map(|(_, r)| r).collect())
}

/// Creates `users` through the admin API (an existing user is fine).
pub async fn create_users(port: u16, admin: &str, users: Vec<String>) -> Result<(), BoxError> {
    let admin = admin.to_owned();
    parallel(port, users, 32, move |mut http, user: Arc<String>| {
        let admin = admin.clone();
        async move {
            let r = http.call("POST", "/v1/admin/users", &admin, Some(&json!({"user_id": *user}))).await;
            let r = match r {
                Ok((201 | 409, _)) => Ok(()),
                Ok((s, v)) => Err(format!("create user {user}: {s} {v}").into()),
                Err(e) => Err(e),
            };
            (http, r)
        }
    })
    .await?;
    Ok(())
}

/// Issues a token for every `(user, device)` through the admin API.
pub async fn issue_tokens(port: u16, admin: &str, devices: Vec<(String, String)>) -> Result<Vec<String>, BoxError> {
    let admin = admin.to_owned();
    parallel(port, devices, 32, move |mut http, d: Arc<(String, String)>| {
        let admin = admin.clone();
        async move {
            let path = format!("/v1/admin/users/{}/devices", d.0);
            let r = match http.call("POST", &path, &admin, Some(&json!({"device_id": d.1}))).await {
                Ok((201, v)) => v["token"].as_str().map(str::to_owned).ok_or_else(|| "no token".into()),
                Ok((s, v)) => Err(format!("issue {}/{}: {s} {v}", d.0, d.1).into()),
                Err(e) => Err(e),
            };
            (http, r)
        }
    })
    .await
}

/// Creates a group through `create_conversation` (HTTP) as the owner of `token`.
pub async fn create_group(port: u16, token: &str, body: Value) -> Result<Value, BoxError> {
    let mut http = Http::new(port);
    match http.call("POST", "/v1/conversations", token, Some(&body)).await? {
        (201 | 200, v) => Ok(v),
        (s, v) => Err(format!("create group: {s} {v}").into()),
    }
}

/// Source addresses 127.0.0.1 … 127.0.0.n: each has its own ephemeral ports.
pub fn source_addr(i: usize, n: usize) -> Ipv4Addr {
    Ipv4Addr::new(127, 0, 0, 1 + (i % n.max(1)) as u8)
}

/// An authenticated WebSocket connection from `src` (token in the header).
pub async fn connect(port: u16, src: Ipv4Addr, token: &str) -> Result<Ws, BoxError> {
    let sock = TcpSocket::new_v4()?;
    sock.bind(SocketAddr::from((src, 0)))?;
    let tcp = sock.connect(SocketAddr::from(([127, 0, 0, 1], port))).await?;
    tcp.set_nodelay(true)?;
    let mut req = format!("ws://127.0.0.1:{port}/v1/ws").into_client_request()?;
    req.headers_mut().insert("Authorization", format!("Bearer {token}").parse()?);
    let (ws, _) = tokio_tungstenite::client_async(req, tcp).await?;
    Ok(ws)
}

/// Connects with a few retries (a full accept queue refuses for a moment).
pub async fn connect_retry(port: u16, src: Ipv4Addr, token: &str) -> Result<Ws, BoxError> {
    let mut wait = Duration::from_millis(20);
    for attempt in 0.. {
        match connect(port, src, token).await {
            Ok(ws) => return Ok(ws),
            Err(e) if attempt >= 8 => return Err(e),
            Err(_) => {
                tokio::time::sleep(wait).await;
                wait *= 2;
            }
        }
    }
    Err("unreachable".into())
}

/// p50/p99/p99.9/max of samples in ms.
#[derive(Debug, Clone, Copy, Default)]
pub struct Percentiles {
    pub n: usize,
    pub p50: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
}

impl Percentiles {
    pub fn of(mut ms: Vec<f64>) -> Self {
        ms.sort_by(f64::total_cmp);
        let at = |q: f64| {
            ms.get(((ms.len() as f64 * q).ceil() as usize).saturating_sub(1).min(ms.len().saturating_sub(1)))
                .copied()
                .unwrap_or(0.0)
        };
        let r = |x: f64| (x * 100.0).round() / 100.0;
        Self {
            n: ms.len(),
            p50: r(at(0.50)),
            p99: r(at(0.99)),
            p999: r(at(0.999)),
            max: r(ms.last().copied().unwrap_or(0.0)),
        }
    }

    pub fn json(&self) -> Value {
        json!({"p50": self.p50, "p99": self.p99, "p999": self.p999, "max": self.max, "samples": self.n})
    }
}
