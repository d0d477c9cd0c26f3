//! imcore-client: one protocol-level client of the imcore server (PROTOCOL
//! §3–6), used by the tests and by the load generator. It speaks JSON
//! (`serde_json::Value`) and knows nothing of the server's types, so it
//! depends on no imcore crate.
//!
//! * [`Http`] — a minimal keep-alive HTTP/1.1 client (admin API,
//!   conversations, probes).
//! * [`Ws`] — a WebSocket connection that numbers requests, pairs replies by
//!   `id` and keeps pushes aside; raw text frames for load loops.
//! * [`free_port`] — a loopback port nobody listens on.

mod http;
mod ws;

use std::time::Duration;

pub use http::Http;
pub use ws::{Closed, Ws};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("websocket: {0}")]
    WebSocket(Box<tokio_tungstenite::tungstenite::Error>),
    /// The server answered the upgrade with this HTTP status instead of 101.
    #[error("websocket upgrade refused: HTTP {0}")]
    Refused(u16),
    #[error("invalid request: {0}")]
    Request(String),
    #[error("malformed HTTP response: {0}")]
    Response(&'static str),
    #[error("frame is not JSON: {0}")]
    NotJson(#[from] serde_json::Error),
    /// The connection ended; the close code when the server sent one.
    #[error("connection closed (code {code:?})")]
    Closed { code: Option<u16> },
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

impl From<tokio_tungstenite::tungstenite::Error> for ClientError {
    fn from(e: tokio_tungstenite::tungstenite::Error) -> Self {
        Self::WebSocket(Box::new(e))
    }
}

/// A loopback port that was free a moment ago (bind to port 0, release it).
pub fn free_port() -> Result<u16, ClientError> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}
