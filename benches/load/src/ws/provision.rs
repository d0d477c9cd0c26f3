//! Setting up a server under test through its own API: users and device
//! tokens (admin API, many keep-alive connections at once), groups
//! (`create_conversation`), and WebSocket connections spread over 127.0.0.x
//! source addresses.

use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::{stream, StreamExt};
use imcore_client::{Http, Ws};
use serde_json::{json, Value};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Wall-clock microseconds (send timestamps travel in message bodies; sender
/// and receivers share this machine's clock).
pub fn now_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
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
            let r = http.call("POST", "/v1/admin/users", Some(&admin), Some(&json!({"user_id": *user}))).await;
            let r = match r {
                Ok((201 | 409, _)) => Ok(()),
                Ok((s, v)) => Err(format!("create user {user}: {s} {v}").into()),
                Err(e) => Err(e.into()),
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
            let r = match http.call("POST", &path, Some(&admin), Some(&json!({"device_id": d.1}))).await {
                Ok((201, v)) => v["token"].as_str().map(str::to_owned).ok_or_else(|| "no token".into()),
                Ok((s, v)) => Err(format!("issue {}/{}: {s} {v}", d.0, d.1).into()),
                Err(e) => Err(e.into()),
            };
            (http, r)
        }
    })
    .await
}

/// Creates a group through `create_conversation` (HTTP) as the owner of `token`.
pub async fn create_group(port: u16, token: &str, body: Value) -> Result<Value, BoxError> {
    let mut http = Http::new(port);
    match http.call("POST", "/v1/conversations", Some(token), Some(&body)).await? {
        (201 | 200, v) => Ok(v),
        (s, v) => Err(format!("create group: {s} {v}").into()),
    }
}

/// Source addresses 127.0.0.1 … 127.0.0.n: each has its own ephemeral ports.
pub fn source_addr(i: usize, n: usize) -> Ipv4Addr {
    Ipv4Addr::new(127, 0, 0, 1 + (i % n.max(1)) as u8)
}

/// Connects with a few retries (a full accept queue refuses for a moment).
pub async fn connect_retry(port: u16, src: Ipv4Addr, token: &str) -> Result<Ws, BoxError> {
    let mut wait = Duration::from_millis(20);
    let mut attempt = 0;
    loop {
        match Ws::connect_from(src, port, Some(token)).await {
            Ok(ws) => return Ok(ws),
            Err(e) if attempt >= 8 => return Err(e.into()),
            Err(_) => {
                tokio::time::sleep(wait).await;
                wait *= 2;
                attempt += 1;
            }
        }
    }
}

/// Connects every token, 256 at a time: token `k` is connection `first + k`,
/// made to `port(first + k)` from its source address among `addrs`. With
/// `routed`, each also answers a ping (the server has registered it) before
/// this returns.
pub async fn connect_all(
    tokens: &[String],
    first: usize,
    addrs: usize,
    port: impl Fn(usize) -> u16,
    routed: bool,
) -> Result<Vec<Ws>, BoxError> {
    stream::iter(tokens.iter().enumerate())
        .map(|(k, token)| {
            let (i, port) = (first + k, port(first + k));
            async move {
                let mut ws = connect_retry(port, source_addr(i, addrs), token).await?;
                if routed {
                    ws.request("ping", json!({})).await?;
                }
                Ok::<_, BoxError>(ws)
            }
        })
        .buffered(256)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect()
}
