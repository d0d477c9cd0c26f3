//! What one WebSocket connection has not yet written to its socket: replies
//! answered and waiting in the session's mailbox, and encoded frames the
//! socket writer has not taken. Over `ws.max_unwritten_bytes`, the session
//! refuses read requests `OVERLOADED` before they run; the bytes of their
//! replies are charged to the memory budget until written (ARCHITECTURE §5).
//! An HTTP read's reply is charged the same way, on an uncapped `Outbound`.
//! The writer also drains the connection's pushes from its [`Outbox`].

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::mem;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Context, Poll};

use actix_http::ws::{OpCode, Parser};
use actix_web::web::{Bytes, BytesMut};
use futures_util::Stream;

use crate::budget::{MemoryBudget, Permit};
use crate::delivery::{Out, Outbox, Queued};
use crate::protocol::push_head;

/// The largest piece handed over at once: actix-http's write buffer (its
/// default), which asks for the next piece once less than this is left
/// unwritten; a WebSocket's socket loop asks once the last one is written.
const PIECE: usize = 32 * 1024;

/// One connection's unwritten bytes; shared by its session, its request
/// tasks and its [`Written`] stream, all on the connection's worker thread.
pub struct Outbound {
    max: usize,
    /// Reply bytes answered and not yet handed to the session's context.
    queued: Cell<usize>,
    /// Reply bytes handed to the context since the writer last took a chunk.
    in_context: Cell<usize>,
    /// Encoded bytes taken from the context and not yet written.
    buffered: Cell<usize>,
    /// The memory budget's bytes for the replies counted above.
    charge: RefCell<Permit>,
}

impl Outbound {
    pub fn new(max: usize, budget: &Arc<MemoryBudget>) -> Rc<Self> {
        Rc::new(Self {
            max,
            queued: Cell::new(0),
            in_context: Cell::new(0),
            buffered: Cell::new(0),
            charge: RefCell::new(budget.empty()),
        })
    }

    pub fn unwritten(&self) -> usize {
        self.queued.get() + self.buffered.get()
    }

    /// Over the cap: a read request is refused before it runs (0: no cap).
    pub fn over(&self) -> bool {
        self.max > 0 && self.unwritten() >= self.max
    }

    pub fn max(&self) -> usize {
        self.max
    }

    /// Counts a reply of `n` bytes, charged to the memory budget; false (and
    /// nothing counted) if the budget cannot hold it.
    pub fn answered(&self, n: usize) -> bool {
        let charged = self.charge.borrow_mut().try_grow(n);
        if charged {
            self.queued.set(self.queued.get() + n);
        }
        charged
    }

    /// The reply of `n` bytes went to the session's context (`ctx.text`).
    pub fn handed(&self, n: usize) {
        self.queued.set(self.queued.get().saturating_sub(n));
        self.in_context.set(self.in_context.get() + n);
    }
}

/// The session's encoded output on its way to the socket writer, in pieces
/// of at most [`PIECE`] bytes. Its poller (a WebSocket's socket loop, or
/// actix-http for an HTTP reply) asks for the next piece only once the last
/// is written or within its write buffer, so when polled, what was handed
/// over before has left: a chunk's bytes, and the budget's charge of the
/// replies in it, are let go then. While a chunk is still being handed over,
/// the session is not polled.
pub struct Written<S> {
    inner: Pin<Box<S>>,
    outbound: Rc<Outbound>,
    /// The rest of the chunk being handed over.
    pending: Bytes,
    /// A session chunk that came with pushes, handed over after them.
    later: Bytes,
    /// Bytes of the last piece handed over.
    handed: usize,
    /// Reply bytes charged for the chunk being handed over.
    chunk_replies: usize,
    pushes: Option<Pushes>,
}

/// Queue slots the writer keeps for the next drain (a burst's are let go).
const KEPT_PUSHES: usize = 16;

/// A WebSocket connection's pushes, encoded here as they are taken: before
/// the session is polled, so whatever was queued before a reply is written
/// before it.
struct Pushes {
    outbox: Arc<Outbox>,
    /// Taken from the outbox (swapped: a small allocation is reused).
    taken: VecDeque<Queued>,
}

impl<S> Written<S> {
    pub fn new(inner: S, outbound: Rc<Outbound>) -> Self {
        Self {
            inner: Box::pin(inner),
            outbound,
            pending: Bytes::new(),
            later: Bytes::new(),
            handed: 0,
            chunk_replies: 0,
            pushes: None,
        }
    }

    /// Writes the pushes of `outbox` too, closing it when the writer goes.
    pub fn with_pushes(mut self, outbox: Arc<Outbox>) -> Self {
        self.pushes = Some(Pushes { outbox, taken: VecDeque::new() });
        self
    }
}

impl Pushes {
    /// Every queued push as WebSocket text frames (empty if none); their
    /// budget bytes go back as they are copied. The next push wakes `cx`.
    fn encode(&mut self, cx: &Context<'_>) -> Bytes {
        self.outbox.take(cx.waker(), &mut self.taken);
        let mut encoded = BytesMut::new();
        for (out, _) in self.taken.drain(..) {
            match out {
                Out::Frame(frame) => Parser::write_message(&mut encoded, &*frame, OpCode::Text, true, false),
                Out::Head(conv) => {
                    if let Some(head) = self.outbox.take_head(&conv) {
                        let frame = push_head(conv.as_str(), head);
                        Parser::write_message(&mut encoded, frame, OpCode::Text, true, false);
                    }
                }
            }
        }
        // A burst's queue slots are let go: an idle connection keeps a few.
        if self.taken.capacity() > KEPT_PUSHES {
            self.taken = VecDeque::new();
        }
        encoded.freeze()
    }
}

impl<S> Drop for Written<S> {
    fn drop(&mut self) {
        if let Some(p) = &self.pushes {
            p.outbox.close();
        }
    }
}

impl<S, E> Stream for Written<S>
where
    S: Stream<Item = Result<Bytes, E>>,
{
    type Item = Result<Bytes, E>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        let o = &this.outbound;
        o.buffered.set(o.buffered.get().saturating_sub(this.handed));
        this.handed = 0;
        while this.pending.is_empty() {
            if !this.later.is_empty() {
                this.pending = mem::take(&mut this.later);
                break;
            }
            o.charge.borrow_mut().shrink(this.chunk_replies);
            this.chunk_replies = 0;
            let pushed = this.pushes.as_mut().map(|p| p.encode(cx)).unwrap_or_default();
            o.buffered.set(o.buffered.get() + pushed.len());
            match this.inner.as_mut().poll_next(cx) {
                Poll::Ready(Some(Ok(chunk))) => {
                    this.chunk_replies = o.in_context.replace(0);
                    o.buffered.set(o.buffered.get() + chunk.len());
                    if pushed.is_empty() {
                        this.pending = chunk;
                    } else {
                        (this.pending, this.later) = (pushed, chunk);
                    }
                }
                Poll::Pending if !pushed.is_empty() => this.pending = pushed,
                other => {
                    o.buffered.set(o.buffered.get().saturating_sub(pushed.len()));
                    return other;
                }
            }
        }
        let piece = this.pending.split_to(this.pending.len().min(PIECE));
        this.handed = piece.len();
        Poll::Ready(Some(Ok(piece)))
    }
}

#[cfg(test)]
mod tests {
    use futures_util::StreamExt;

    use super::*;

    #[actix_web::test]
    async fn bytes_count_until_the_writer_asks_again_and_the_charge_follows_them() {
        let budget = MemoryBudget::new(1 << 20);
        let o = Outbound::new(50_000, &budget);
        assert!(o.answered(40_000));
        assert!(!o.over());
        assert!(o.answered(20_000));
        assert!(o.over());
        assert!(!o.answered(2 << 20), "over the budget: refused, nothing counted");
        o.handed(40_000);
        o.handed(20_000);
        let chunk = Bytes::from(vec![b'x'; 60_010]);
        let mut w = Written::new(futures_util::stream::iter([Ok::<_, ()>(chunk)]), o.clone());
        let mut pieces = vec![];
        while let Some(Ok(piece)) = w.next().await {
            pieces.push(piece.len());
            // Before the writer asks again, the piece is still unwritten.
            assert!(o.unwritten() >= piece.len());
            assert_eq!(budget.in_use(), 60_000);
        }
        assert_eq!(pieces, [PIECE, 60_010 - PIECE]);
        assert_eq!((o.unwritten(), budget.in_use()), (0, 0));
    }
}
