//! A minimal HTTP/1.1 client: one keep-alive connection to the server on
//! loopback, JSON bodies, responses framed by `Content-Length`, chunked
//! encoding, or the connection's end.

use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::ClientError;

/// How long one read of a response may stall.
const READ_TIMEOUT: Duration = Duration::from_secs(60);

/// One keep-alive HTTP/1.1 connection to `127.0.0.1:port`, opened on first use.
pub struct Http {
    port: u16,
    stream: Option<TcpStream>,
    buf: Vec<u8>,
}

impl Http {
    pub fn new(port: u16) -> Self {
        Self { port, stream: None, buf: Vec::with_capacity(4096) }
    }

    /// `(status, body)`: the body as JSON, or as a JSON string when it is not
    /// JSON (e.g. `/metrics`).
    pub async fn call(
        &mut self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<&Value>,
    ) -> Result<(u16, Value), ClientError> {
        let body = body.map(Value::to_string);
        self.request(method, path, token, body.as_deref()).await
    }

    /// Like [`Http::call`] with the body as given, valid JSON or not.
    pub async fn request(
        &mut self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<&str>,
    ) -> Result<(u16, Value), ClientError> {
        let body = body.unwrap_or("");
        let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        // A kept-alive connection the server closed meanwhile fails at once:
        // the request goes once more on a fresh one. A fresh connection's
        // failure is the answer (a request is never sent twice to one that
        // may have received it).
        let reused = self.stream.is_some();
        match self.once(req.as_bytes()).await {
            Err(_) if reused => {
                self.stream = None;
                self.once(req.as_bytes()).await
            }
            r => r,
        }
    }

    async fn once(&mut self, req: &[u8]) -> Result<(u16, Value), ClientError> {
        let result = self.exchange(req).await;
        if result.is_err() {
            self.stream = None;
        }
        result
    }

    async fn exchange(&mut self, req: &[u8]) -> Result<(u16, Value), ClientError> {
        if self.stream.is_none() {
            let s = TcpStream::connect(("127.0.0.1", self.port)).await?;
            s.set_nodelay(true)?;
            self.stream = Some(s);
        }
        let s = self.stream.as_mut().ok_or(ClientError::Closed { code: None })?;
        s.write_all(req).await?;
        self.buf.clear();
        let head_end = loop {
            if let Some(i) = find(&self.buf, b"\r\n\r\n") {
                break i;
            }
            if read_some(s, &mut self.buf).await? == 0 {
                return Err(ClientError::Closed { code: None });
            }
        };
        let head = String::from_utf8_lossy(&self.buf[..head_end]).to_ascii_lowercase();
        let status: u16 =
            head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).ok_or(ClientError::Response("no status"))?;
        let header = |name: &str| head.lines().find_map(|l| l.strip_prefix(name)).map(str::trim);
        let start = head_end + 4;
        let mut close = header("connection:") == Some("close");
        let body = if let Some(len) = header("content-length:") {
            let len: usize = len.parse().map_err(|_| ClientError::Response("bad content-length"))?;
            while self.buf.len() < start + len {
                if read_some(s, &mut self.buf).await? == 0 {
                    return Err(ClientError::Response("connection closed mid-body"));
                }
            }
            self.buf[start..start + len].to_vec()
        } else if header("transfer-encoding:").is_some_and(|v| v.contains("chunked")) {
            loop {
                if let Some(body) = dechunk(&self.buf[start..])? {
                    break body;
                }
                if read_some(s, &mut self.buf).await? == 0 {
                    return Err(ClientError::Response("connection closed mid-body"));
                }
            }
        } else {
            // Neither length nor chunks: the body runs to the connection's end.
            while read_some(s, &mut self.buf).await? > 0 {}
            close = true;
            self.buf[start..].to_vec()
        };
        if close {
            self.stream = None;
        }
        let value =
            serde_json::from_slice(&body).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&body).into()));
        Ok((status, value))
    }
}

async fn read_some(s: &mut TcpStream, buf: &mut Vec<u8>) -> Result<usize, ClientError> {
    let mut chunk = [0u8; 8192];
    let n = tokio::time::timeout(READ_TIMEOUT, s.read(&mut chunk))
        .await
        .map_err(|_| ClientError::Timeout(READ_TIMEOUT))??;
    buf.extend_from_slice(&chunk[..n]);
    Ok(n)
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The payload of a chunked body, or `None` while its last chunk has not arrived.
fn dechunk(mut raw: &[u8]) -> Result<Option<Vec<u8>>, ClientError> {
    let mut out = Vec::new();
    loop {
        let Some(line_end) = find(raw, b"\r\n") else { return Ok(None) };
        let size = std::str::from_utf8(&raw[..line_end]).map_err(|_| ClientError::Response("bad chunk size"))?;
        let size = size.split(';').next().unwrap_or("").trim();
        let n = usize::from_str_radix(size, 16).map_err(|_| ClientError::Response("bad chunk size"))?;
        if n == 0 {
            return Ok(Some(out));
        }
        let data = line_end + 2;
        if raw.len() < data + n + 2 {
            return Ok(None);
        }
        out.extend_from_slice(&raw[data..data + n]);
        raw = &raw[data + n + 2..];
    }
}

#[cfg(test)]
mod tests {
    use super::dechunk;

    #[test]
    fn chunked_bodies_join_once_the_last_chunk_arrived() {
        assert_eq!(dechunk(b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n").ok().flatten(), Some(b"abcde".to_vec()));
        assert_eq!(dechunk(b"3\r\nabc\r\n2\r\nd").ok().flatten(), None);
        assert!(dechunk(b"zz\r\n").is_err());
    }
}
