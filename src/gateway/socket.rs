//! An upgraded WebSocket connection's socket, driven by its own loop instead
//! of actix-http's HTTP/1 dispatcher (ARCHITECTURE §5, "An idle connection"):
//! bytes read go to the session's frame decoder, its output and pushes go to
//! the socket. Nothing is buffered here while the connection is idle: a read
//! lands in a buffer on the stack, and a piece being written is the output's
//! own bytes, let go once written.

use std::cell::RefCell;
use std::future::poll_fn;
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use actix_http::error::PayloadError;
use actix_web::web::Bytes;
use futures_util::Stream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// Bytes read per call: a burst of small frames in one read, on the stack.
const READ_CHUNK: usize = 8 * 1024;

/// After the session ended and its last bytes went out, how long the socket
/// reads and drops what the client still sends before closing: closing with
/// unread bytes would answer them with a reset, which can destroy the close
/// frame before the client reads it.
const LINGER: Duration = Duration::from_secs(1);

/// The read side's bytes on their way to the session, one chunk at a time:
/// the socket is read again only once the session took the last chunk, so a
/// session that is not polled (its output is not being written) reads nothing.
#[derive(Default)]
struct Shared {
    chunk: Option<Result<Bytes, PayloadError>>,
    /// The client closed its side (or the socket failed, after that error).
    ended: bool,
    waker: Option<Waker>,
}

/// The session's input: what [`drive`] read from the socket.
pub(super) struct Inbound(Rc<RefCell<Shared>>);

impl Inbound {
    /// The input, and the handle [`drive`] feeds it through.
    pub(super) fn new() -> (Self, Feed) {
        let shared = Rc::new(RefCell::new(Shared::default()));
        (Self(shared.clone()), Feed(shared))
    }
}

impl Stream for Inbound {
    type Item = Result<Bytes, PayloadError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let mut shared = self.0.borrow_mut();
        if let Some(chunk) = shared.chunk.take() {
            return Poll::Ready(Some(chunk));
        }
        if shared.ended {
            return Poll::Ready(None);
        }
        match &shared.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            _ => shared.waker = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}

/// [`drive`]'s side of an [`Inbound`].
pub(super) struct Feed(Rc<RefCell<Shared>>);

impl Feed {
    fn wants(&self) -> bool {
        let shared = self.0.borrow();
        shared.chunk.is_none() && !shared.ended
    }

    fn give(&self, chunk: Result<Bytes, PayloadError>) {
        self.change(|shared| {
            shared.ended |= chunk.is_err();
            shared.chunk = Some(chunk);
        });
    }

    fn end(&self) {
        self.change(|shared| shared.ended = true);
    }

    /// Changes what the session reads next and wakes it if it waits. Its
    /// context runs on this task (polled through the output), so the wake
    /// usually only costs a flag.
    fn change(&self, change: impl FnOnce(&mut Shared)) {
        let waker = {
            let mut shared = self.0.borrow_mut();
            change(&mut shared);
            shared.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }
}

/// Runs the connection until its session's output ends and is written (or
/// the socket fails): `leftover` are bytes the client sent right behind its
/// handshake. The output is polled only once everything it gave before has
/// been written, so a client that stops reading stops its session (and its
/// reads) until it reads again; its pushes pile up in its outbox, which
/// overflows (ARCHITECTURE §5).
pub(super) async fn drive<O>(mut io: TcpStream, leftover: Bytes, feed: Feed, output: O)
where
    O: Stream<Item = Result<Bytes, actix_web::Error>>,
{
    if !leftover.is_empty() {
        feed.give(Ok(leftover));
    }
    let mut output = std::pin::pin!(output);
    let mut pending = Bytes::new();
    let ended = poll_fn(|cx| loop {
        if !pending.is_empty() {
            match Pin::new(&mut io).poll_write(cx, &pending) {
                Poll::Ready(Ok(0)) => return Poll::Ready(false),
                Poll::Ready(Ok(n)) => {
                    drop(pending.split_to(n));
                    continue;
                }
                Poll::Ready(Err(_)) => return Poll::Ready(false),
                Poll::Pending => {}
            }
        } else {
            match output.as_mut().poll_next(cx) {
                Poll::Ready(Some(Ok(piece))) => {
                    pending = piece;
                    continue;
                }
                Poll::Ready(Some(Err(e))) => {
                    tracing::debug!(error = %e, "websocket output failed");
                    return Poll::Ready(false);
                }
                Poll::Ready(None) => return Poll::Ready(true),
                Poll::Pending => {}
            }
        }
        if feed.wants() {
            // Uninitialised: a zeroed 8 KiB per read showed in profiles.
            let mut chunk = [MaybeUninit::<u8>::uninit(); READ_CHUNK];
            let mut buf = ReadBuf::uninit(&mut chunk);
            match Pin::new(&mut io).poll_read(cx, &mut buf) {
                Poll::Ready(Ok(())) if buf.filled().is_empty() => feed.end(),
                Poll::Ready(Ok(())) => feed.give(Ok(Bytes::copy_from_slice(buf.filled()))),
                Poll::Ready(Err(e)) => feed.give(Err(PayloadError::Io(e))),
                Poll::Pending => return Poll::Pending,
            }
            continue;
        }
        return Poll::Pending;
    })
    .await;
    if ended {
        // Boxed: its buffer exists only while it runs.
        Box::pin(linger(&mut io)).await;
    }
}

/// Sends FIN, then reads and drops until the client closes too, at most [`LINGER`].
pub(super) async fn linger(io: &mut TcpStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    if io.shutdown().await.is_err() {
        return;
    }
    let drain = async {
        let mut sink = [0u8; 1024];
        while let Ok(n) = io.read(&mut sink).await {
            if n == 0 {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(LINGER, drain).await;
}
