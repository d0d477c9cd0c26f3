//! The WebSocket request byte stream with frame sizes checked as their headers
//! pass (PROTOCOL §4: a frame over the limit closes with 1009, before its
//! payload is buffered).

use std::cell::Cell;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};

use actix_http::error::PayloadError;
use actix_web::web::Bytes;
use futures_util::Stream;

/// Why [`FrameLimit`] failed the byte stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum StreamFault {
    /// A frame header announced more than the limit.
    Oversized,
    /// The connection's payload stream itself failed.
    Payload,
}

/// The request byte stream with frame sizes checked as their headers pass.
///
/// actix-http's decoder checks its `max_size` only once the whole frame is
/// buffered, so a client announcing a huge frame would make the server
/// buffer all of it (or wait for it forever). This reads each frame header
/// as the bytes go by, skips over payloads without holding them, and fails
/// the stream at the first header announcing more than `max` bytes; the
/// session then closes with 1009. Frames earlier in the same read may be
/// dropped with it: the connection is closing anyway.
pub(super) struct FrameLimit<S> {
    inner: S,
    max: usize,
    fault: Rc<Cell<Option<StreamFault>>>,
    /// Bytes of the current frame header seen so far (at most 14).
    header: [u8; 14],
    header_len: usize,
    /// Payload bytes of the current frame still to pass.
    payload_left: u64,
}

impl<S> FrameLimit<S> {
    pub(super) fn new(inner: S, max: usize, fault: Rc<Cell<Option<StreamFault>>>) -> Self {
        Self { inner, max, fault, header: [0; 14], header_len: 0, payload_left: 0 }
    }

    /// Length of the header so far, once complete: its size and the payload length.
    fn parsed_header(&self) -> Option<(usize, u64)> {
        let h = &self.header[..self.header_len];
        if h.len() < 2 {
            return None;
        }
        let mask = if h[1] & 0x80 != 0 { 4 } else { 0 };
        let (ext, len) = match h[1] & 0x7f {
            126 => (2, h.get(2..4).map(|b| u64::from(u16::from_be_bytes([b[0], b[1]])))),
            127 => (8, h.get(2..10).map(|b| u64::from_be_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))),
            n => (0, Some(u64::from(n))),
        };
        let size = 2 + ext + mask;
        match len {
            Some(len) if h.len() >= size => Some((size, len)),
            _ => None,
        }
    }

    /// Walks `chunk`; false at the first oversized frame header.
    fn scan(&mut self, mut chunk: &[u8]) -> bool {
        while !chunk.is_empty() {
            if self.payload_left > 0 {
                let n = usize::try_from(self.payload_left).unwrap_or(usize::MAX).min(chunk.len());
                chunk = &chunk[n..];
                self.payload_left -= n as u64;
                continue;
            }
            self.header[self.header_len] = chunk[0];
            self.header_len += 1;
            chunk = &chunk[1..];
            if let Some((_, len)) = self.parsed_header() {
                if len > self.max as u64 {
                    return false;
                }
                self.header_len = 0;
                self.payload_left = len;
            }
        }
        true
    }
}

impl<S: Stream<Item = Result<Bytes, PayloadError>> + Unpin> Stream for FrameLimit<S> {
    type Item = Result<Bytes, PayloadError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.fault.get() == Some(StreamFault::Oversized) {
            return Poll::Ready(None);
        }
        match Pin::new(&mut self.inner).poll_next(cx) {
            Poll::Ready(Some(Ok(chunk))) => {
                if self.scan(&chunk) {
                    Poll::Ready(Some(Ok(chunk)))
                } else {
                    self.fault.set(Some(StreamFault::Oversized));
                    Poll::Ready(Some(Err(PayloadError::Overflow)))
                }
            }
            Poll::Ready(Some(Err(e))) => {
                self.fault.set(Some(StreamFault::Payload));
                Poll::Ready(Some(Err(e)))
            }
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn masked_header(len: u64) -> Vec<u8> {
        let mut h = vec![0x81];
        match len {
            0..=125 => h.push(0x80 | len as u8),
            126..=0xffff => {
                h.push(0x80 | 126);
                h.extend_from_slice(&(len as u16).to_be_bytes());
            }
            _ => {
                h.push(0x80 | 127);
                h.extend_from_slice(&len.to_be_bytes());
            }
        }
        h.extend_from_slice(&[1, 2, 3, 4]);
        h
    }

    fn limit() -> FrameLimit<futures_util::stream::Empty<Result<Bytes, PayloadError>>> {
        FrameLimit::new(futures_util::stream::empty(), 1000, Rc::default())
    }

    #[test]
    fn frames_within_the_limit_pass_byte_by_byte_and_an_oversized_header_is_caught_before_its_payload() {
        let mut stream: Vec<u8> = vec![];
        for len in [0u64, 5, 125, 126, 1000] {
            stream.extend(masked_header(len));
            stream.extend(std::iter::repeat(b'x').take(len as usize));
        }
        let mut l = limit();
        assert!(stream.iter().all(|b| l.scan(&[*b])), "split anywhere");
        assert!(limit().scan(&stream), "in one piece");
        let mut l = limit();
        assert!(l.scan(&stream));
        assert!(!l.scan(&masked_header(1001)), "16-bit length over the limit");
        assert!(!limit().scan(&masked_header(8 << 30)), "64-bit length, no payload sent");
    }
}
