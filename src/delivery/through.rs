//! A push written by its lane straight to an idle connection's socket
//! (ARCHITECTURE §5, "A push's write path"): when nothing of the connection
//! is queued or being written, the frame goes out in one non-blocking
//! `sendmsg` from the lane's thread, and the connection's task is not woken.
//! What the socket does not take is queued as raw bytes for the task.

use std::io::IoSlice;
use std::os::fd::RawFd;

/// The WebSocket header of an unmasked, final text frame of `len` bytes
/// (RFC 6455 §5.2: a server's frames are not masked); its bytes are the
/// first `.1` of `.0`.
pub(super) fn text_header(len: usize) -> ([u8; 10], usize) {
    let mut h = [0u8; 10];
    h[0] = 0x81;
    if len < 126 {
        h[1] = len as u8;
        (h, 2)
    } else if let Ok(len) = u16::try_from(len) {
        h[1] = 126;
        h[2..4].copy_from_slice(&len.to_be_bytes());
        (h, 4)
    } else {
        h[1] = 127;
        h[2..10].copy_from_slice(&(len as u64).to_be_bytes());
        (h, 10)
    }
}

/// Writes the text frame of `payload` to `fd` without waiting; returns how
/// many of the frame's bytes (header included) the socket took (0 when it
/// would block or failed: the connection's task then writes it, or sees the
/// failure itself).
pub(super) fn write_text(fd: RawFd, payload: &[u8]) -> usize {
    let (header, n) = text_header(payload.len());
    let parts = [IoSlice::new(&header[..n]), IoSlice::new(payload)];
    // SAFETY: `fd` is the connection's socket, open for as long as it is
    // attached to the outbox, and the caller holds the outbox's lock, which
    // detaching takes first; `msg` points at two live slices of the lengths given.
    let sent = unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = parts.as_ptr() as *mut libc::iovec;
        msg.msg_iovlen = parts.len();
        libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL)
    };
    usize::try_from(sent).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use actix_http::ws::{OpCode, Parser};
    use bytes::BytesMut;

    use super::*;

    #[test]
    fn headers_are_the_codecs_for_every_length_class() {
        for len in [0, 1, 125, 126, 127, 65_535, 65_536, 200_000] {
            let payload = vec![b'x'; len];
            let mut theirs = BytesMut::new();
            Parser::write_message(&mut theirs, &payload[..], OpCode::Text, true, false);
            let (h, n) = text_header(len);
            assert_eq!(&theirs[..n], &h[..n], "length {len}");
            assert_eq!(theirs.len(), n + len);
        }
    }
}
