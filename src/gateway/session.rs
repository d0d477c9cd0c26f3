//! The WebSocket session (PROTOCOL §4): one actor per connection, and the
//! only module that uses `actix-web-actors` (deprecated upstream; replacing
//! it means rewriting this file alone).
//!
//! Invariants: frames are handled in arrival order and a `send` is queued on
//! the writer while its frame is handled (P6); the connection id is drawn once
//! the token is accepted, the route registered when the actor starts and
//! removed by compare-and-remove when it stops (P7).
//! Bounded per connection: requests in flight (`ws.max_inflight`) and doing
//! database work (`ws.max_concurrent`), pushes in the outbox (`ws.mailbox`;
//! overflow closes with 1013) and in the memory budget, unwritten read replies
//! (`ws.max_unwritten_bytes`, `outbound`); a ping every `ws_ping_ms`, silence
//! for `ws_timeout_ms` closes. Why: ARCHITECTURE §5.

use std::cell::Cell;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

use actix::{Actor, ActorContext, ActorFutureExt, AsyncContext, Handler, Message, StreamHandler, WrapFuture};
use actix_web::web::{self, Bytes};
use actix_web_actors::ws::{self, CloseCode, CloseReason, ProtocolError};
use futures_util::Stream;
use imcore_actors::registry::{ConnId, Registered};
use serde_json::Value;
use tokio::sync::Semaphore;

use super::caps::UserSlot;
use super::error::ApiError;
use super::frame_limit::{FrameLimit, StreamFault};
use super::ops::{self, Reply};
use super::outbound::{Outbound, Written};
use super::request::Request;
use super::socket::Inbound;
use super::AppState;
use crate::delivery::{Conn, KickReason, Outbox, Push};
use crate::metrics::metrics;
use crate::protocol::{push_kicked, reply_frame, ErrorCode};
use crate::store::TokenOwner;

/// A device's upgrade once admitted (`upgrade`): who it is and what it
/// holds until its session ends.
pub(super) struct Admitted {
    pub owner: TokenOwner,
    pub token: String,
    /// [`Delivery::revocations`](crate::delivery::Delivery::revocations) before the token was looked up.
    pub revocations: u64,
    pub conn_id: ConnId,
    pub user_slot: UserSlot,
}

/// Starts the session of an admitted connection, reading its frames from
/// `input`: the returned stream is everything it writes to its socket, its
/// pushes included.
pub(super) fn open(
    state: web::Data<AppState>,
    admitted: Admitted,
    input: Inbound,
) -> impl Stream<Item = Result<Bytes, actix_web::Error>> {
    let Admitted { owner, token, revocations, conn_id, user_slot } = admitted;
    let max_frame = state.config.ws.max_frame_bytes;
    let fault = Rc::new(Cell::new(None));
    let stream = FrameLimit::new(input, max_frame, fault.clone());
    let outbound = Outbound::new(state.config.ws.max_unwritten_bytes, &state.budget);
    let outbox = Outbox::new(state.config.ws.mailbox, &state.budget);
    let session = WsSession {
        state: state.clone(),
        owner,
        token,
        revocations,
        conn_id,
        last_heard: Instant::now(),
        inflight: 0,
        turns: Rc::new(Semaphore::new(state.config.ws.max_concurrent.max(1))),
        closing: None,
        fragments: None,
        fault,
        online: false,
        outbound: outbound.clone(),
        outbox: outbox.clone(),
        _user_slot: user_slot,
    };
    let frames = ws::WebsocketContext::with_codec(session, stream, actix_http::ws::Codec::new().max_size(max_frame));
    Written::new(frames, outbound).with_pushes(outbox)
}

pub struct WsSession {
    state: web::Data<AppState>,
    owner: TokenOwner,
    /// Kept only to re-check it once registered (a rotation racing the
    /// upgrade); never logged.
    token: String,
    /// Tokens revoked on this node before the token was looked up
    /// ([`Delivery::revocations`](crate::delivery::Delivery::revocations)).
    revocations: u64,
    conn_id: ConnId,
    last_heard: Instant,
    /// Requests dispatched and not yet answered.
    inflight: usize,
    /// Turns to do database work: `ws.max_concurrent` of them.
    turns: Rc<Semaphore>,
    /// A kick waiting for the in-flight requests to be answered (shutdown).
    closing: Option<KickReason>,
    /// A fragmented text message being reassembled.
    fragments: Option<Vec<u8>>,
    /// Set by [`FrameLimit`] when it failed the byte stream: the error that
    /// follows says why (1009 for an oversized frame).
    fault: Rc<Cell<Option<StreamFault>>>,
    /// Counted online (`AppState::online`): uncounted when it stops.
    online: bool,
    /// What this connection has not yet written to its socket.
    outbound: Rc<Outbound>,
    /// Its pushes, which its socket writer drains without this actor.
    outbox: Arc<Outbox>,
    /// This device's place in its user's session cap, given back when the session ends.
    _user_slot: UserSlot,
}

impl Actor for WsSession {
    type Context = ws::WebsocketContext<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        let routes = self.state.delivery.routes();
        let conn = Conn::new(
            (ctx.address().recipient(), self.outbox.clone()),
            routes,
            (self.owner.user_id.clone(), self.owner.device_id.clone(), self.conn_id),
        );
        self.state.sessions.insert(self.conn_id, conn.clone());
        match routes.register(self.owner.user_id.clone(), self.owner.device_id.clone(), self.conn_id, conn) {
            Registered::New => self.state.delivery.claim(&self.owner.user_id, &self.owner.device_id, self.conn_id),
            Registered::Replaced(prev) => {
                if prev.conn_id != self.conn_id {
                    prev.recipient.kick(KickReason::Replaced);
                }
                self.state.delivery.claim(&self.owner.user_id, &self.owner.device_id, self.conn_id);
            }
            Registered::Stale { .. } => {
                self.kick(KickReason::Replaced, ctx);
                return;
            }
        }
        if self.state.shutting_down() {
            self.kick(KickReason::Shutdown, ctx);
            return;
        }
        // Only a revocation this node heard of since the lookup can have
        // missed the route: otherwise the token needs no second read.
        match self.state.delivery.revocations() == self.revocations {
            true => drop(std::mem::take(&mut self.token)),
            false => self.recheck_token(ctx),
        }
        self.subscribe(ctx);
        self.state.online.connect(&self.owner.user_id);
        self.online = true;
        let (every, timeout) = (self.state.config.ws.ping(), self.state.config.ws.timeout());
        ctx.run_interval(every, move |act, ctx| {
            if act.last_heard.elapsed() >= timeout {
                tracing::debug!(conn = %act.conn_id, "heartbeat timeout");
                metrics().kicks.with_label_values(&["heartbeat_timeout"]).inc();
                ctx.close(Some(CloseReason { code: CloseCode::Away, description: Some("heartbeat timeout".into()) }));
                ctx.stop();
            } else {
                ctx.ping(b"");
            }
        });
    }

    fn stopped(&mut self, _ctx: &mut Self::Context) {
        // In the poll that queued its close frame: no push may follow that.
        self.outbox.close();
        // Compare-and-remove: a newer connection's route stays (P7).
        let delivery = &self.state.delivery;
        if delivery.routes().unregister(&self.owner.user_id, &self.owner.device_id, self.conn_id) {
            // The other nodes' notifiers count the device offline again.
            delivery.unrouted(&self.owner.user_id, &self.owner.device_id, self.conn_id);
        }
        self.state.delivery.unsubscribe(&self.owner.user_id, self.conn_id);
        if std::mem::take(&mut self.online) {
            self.state.online.disconnect(&self.owner.user_id);
        }
        self.state.sessions.remove(&self.conn_id);
    }
}

impl WsSession {
    /// A rotation between this connection's token lookup and its
    /// registration would have found no route to kick: look again now that
    /// the route is in place (when a revocation came in between).
    fn recheck_token(&mut self, ctx: &mut ws::WebsocketContext<Self>) {
        let (store, token) = (self.state.store.clone(), std::mem::take(&mut self.token));
        let owner = self.owner.clone();
        ctx.spawn(async move { store.resolve_token(&token).await }.into_actor(self).map(move |found, act, ctx| {
            match found {
                Ok(Some(o)) if o == owner => {}
                Ok(_) => act.kick(KickReason::TokenRevoked, ctx),
                Err(e) => tracing::warn!(error = %e, "token re-check failed"),
            }
        }));
    }

    /// Delivery starts tracking this user, then gets its memberships
    /// (ARCHITECTURE §5). Loaded on a task of its own: the snapshot reaches
    /// delivery even while this session is not polled. If it cannot be read,
    /// the connection closes like an overflow (1013; the client reconnects).
    fn subscribe(&mut self, ctx: &mut ws::WebsocketContext<Self>) {
        let (delivery, store, owner, conn) =
            (self.state.delivery.clone(), self.state.store.clone(), self.owner.clone(), self.conn_id);
        delivery.subscribe(&owner.user_id, &owner.device_id, conn);
        let session = ctx.address();
        actix::spawn(async move {
            match store.memberships_of(&owner.user_id).await {
                Ok(snapshot) => delivery.load(&owner.user_id, &owner.device_id, conn, snapshot),
                Err(e) => {
                    tracing::warn!(error = %e, %conn, "memberships not loaded: the connection closes");
                    session.do_send(Push::Overflowed);
                }
            }
        });
    }

    fn kick(&mut self, reason: KickReason, ctx: &mut ws::WebsocketContext<Self>) {
        metrics().kicks.with_label_values(&[reason.as_str()]).inc();
        ctx.text(push_kicked(reason.as_str()));
        let code = match reason {
            KickReason::Shutdown => CloseCode::Away,
            KickReason::Replaced => CloseCode::Normal,
            KickReason::TokenRevoked => CloseCode::Policy,
        };
        ctx.close(Some(CloseReason { code, description: Some(reason.as_str().into()) }));
        ctx.stop();
    }

    fn close_oversized(&mut self, max: usize, ctx: &mut ws::WebsocketContext<Self>) {
        ctx.close(Some(CloseReason { code: CloseCode::Size, description: Some(format!("frame over {max} bytes")) }));
        ctx.stop();
    }

    /// RFC 6455 §8.1: a text message that is not UTF-8 fails the connection
    /// (1007), whole or fragmented (PROTOCOL §4).
    fn close_not_utf8(&mut self, ctx: &mut ws::WebsocketContext<Self>) {
        ctx.close(Some(CloseReason { code: CloseCode::Invalid, description: Some("text frame is not UTF-8".into()) }));
        ctx.stop();
    }

    fn reply(ctx: &mut ws::WebsocketContext<Self>, id: Option<&Value>, result: Result<Reply, ApiError>) {
        let frame = match &result {
            Ok(reply) => reply_frame(id, Ok(&reply.json)),
            Err(e) => {
                e.count();
                reply_frame(id, Err(&e.0))
            }
        };
        ctx.text(frame);
    }

    fn on_text(&mut self, text: &str, ctx: &mut ws::WebsocketContext<Self>) {
        let frame = match serde_json::from_str::<Value>(text) {
            Ok(Value::Object(m)) => m,
            Ok(_) => return Self::reply(ctx, None, Err(ApiError::bad_request("a request is a JSON object"))),
            Err(e) => return Self::reply(ctx, None, Err(ApiError::bad_request(format!("malformed JSON: {e}")))),
        };
        let id = match frame.get("id") {
            Some(v @ Value::Number(n)) if n.is_i64() || n.is_u64() => v.clone(),
            // PROTOCOL §4, §7: a keep-alive needs no id, and gets none back.
            None if frame.get("op").and_then(Value::as_str) == Some("ping") => {
                metrics().requests.with_label_values(&["ping", "ws"]).inc();
                return ctx.text(ops::pong().to_string());
            }
            _ => return Self::reply(ctx, None, Err(ApiError::bad_request("`id` must be an integer"))),
        };
        let Some(op) = frame.get("op").and_then(Value::as_str) else {
            return Self::reply(ctx, Some(&id), Err(ApiError::bad_request("`op` must be a string")));
        };
        if self.closing.is_some() {
            let e = ApiError::new(ErrorCode::Overloaded, "the server is shutting down; retry after reconnecting");
            return Self::reply(ctx, Some(&id), Err(e));
        }
        let req = match Request::parse(op, &frame, self.state.config.max_body_bytes) {
            Ok(req) => req,
            Err(e) => return Self::reply(ctx, Some(&id), Err(e)),
        };
        self.dispatch(id, req, ctx);
    }

    /// Runs `req` on a task of its own, so that its database work does not
    /// depend on this session being polled; the answer comes back as [`Answered`].
    fn dispatch(&mut self, id: Value, req: Request, ctx: &mut ws::WebsocketContext<Self>) {
        let max = self.state.config.ws.max_inflight;
        if self.inflight >= max {
            let e = ApiError::new(ErrorCode::Overloaded, format!("over {max} requests in flight on this connection"));
            return Self::reply(ctx, Some(&id), Err(e));
        }
        // A send is queued on the writer before `ops::dispatch` returns, in
        // frame order (P6), and bounded by its conversation's queue and the
        // memory budget: it takes no turn, which would only delay its answer.
        // Other requests start their work when first polled, so they wait
        // for a turn first. A ping or a whoami does no database work.
        let turns = match req {
            Request::Send { .. } | Request::Ping | Request::WhoAmI => None,
            _ => Some(self.turns.clone()),
        };
        // A read's reply can be large and is asked again at no cost: it is
        // refused while this connection's unwritten bytes are over the cap,
        // and charged to the memory budget until written.
        let read = req.is_read();
        let answer = ops::dispatch(&self.state, &self.owner, req, "ws");
        self.inflight += 1;
        let (session, outbound) = (ctx.address(), self.outbound.clone());
        actix::spawn(async move {
            // Never closed, so this always yields a permit, held until answered.
            let _turn = match &turns {
                Some(turns) => Some(turns.acquire().await),
                None => None,
            };
            let (result, bytes) = if read && outbound.over() {
                // Dropped unpolled: the read does no work.
                drop(answer);
                let max = outbound.max();
                (
                    Err(ApiError::new(
                        ErrorCode::Overloaded,
                        format!("over {max} bytes of replies unread on this connection"),
                    )),
                    0,
                )
            } else {
                match answer.await {
                    Ok(reply) if read && !outbound.answered(reply.json.len()) => {
                        let e = ApiError::budget_exhausted();
                        (Err(e), 0)
                    }
                    Ok(reply) => {
                        let bytes = if read { reply.json.len() } else { 0 };
                        (Ok(reply), bytes)
                    }
                    Err(e) => (Err(e), 0),
                }
            };
            // Queued even past the mailbox capacity: at most `inflight` of them.
            session.do_send(Answered { id, result, bytes });
        });
    }
}

/// A request's answer, back from its task.
#[derive(Message)]
#[rtype(result = "()")]
struct Answered {
    id: Value,
    result: Result<Reply, ApiError>,
    /// Counted in [`Outbound`] until handed to the context.
    bytes: usize,
}

impl Handler<Answered> for WsSession {
    type Result = ();

    fn handle(&mut self, answered: Answered, ctx: &mut Self::Context) {
        self.inflight -= 1;
        Self::reply(ctx, Some(&answered.id), answered.result);
        self.outbound.handed(answered.bytes);
        if self.inflight == 0 {
            if let Some(reason) = self.closing {
                self.kick(reason, ctx);
            }
        }
    }
}

impl StreamHandler<Result<ws::Message, ProtocolError>> for WsSession {
    fn handle(&mut self, msg: Result<ws::Message, ProtocolError>, ctx: &mut Self::Context) {
        self.last_heard = Instant::now();
        let max = self.state.config.ws.max_frame_bytes;
        match msg {
            Ok(ws::Message::Text(text)) => self.on_text(&text, ctx),
            Ok(ws::Message::Binary(_)) => {
                Self::reply(ctx, None, Err(ApiError::bad_request("binary frames are not supported; send JSON text")))
            }
            Ok(ws::Message::Continuation(item)) => {
                let (first, chunk, last) = match item {
                    actix_http::ws::Item::FirstText(b) => (true, b, false),
                    actix_http::ws::Item::FirstBinary(b) => (true, b, false),
                    actix_http::ws::Item::Continue(b) => (false, b, false),
                    actix_http::ws::Item::Last(b) => (false, b, true),
                };
                let buf = if first {
                    self.fragments.insert(Vec::new())
                } else {
                    match self.fragments.as_mut() {
                        Some(buf) => buf,
                        None => return,
                    }
                };
                buf.extend_from_slice(&chunk);
                if buf.len() > max {
                    self.fragments = None;
                    ctx.close(Some(CloseReason {
                        code: CloseCode::Size,
                        description: Some("message too large".into()),
                    }));
                    ctx.stop();
                } else if last {
                    let whole = self.fragments.take().unwrap_or_default();
                    match String::from_utf8(whole) {
                        Ok(text) => self.on_text(&text, ctx),
                        Err(_) => self.close_not_utf8(ctx),
                    }
                }
            }
            Ok(ws::Message::Ping(p)) => ctx.pong(&p),
            Ok(ws::Message::Pong(_)) | Ok(ws::Message::Nop) => {}
            Ok(ws::Message::Close(reason)) => {
                ctx.close(reason);
                ctx.stop();
            }
            Err(_) if self.fault.get() == Some(StreamFault::Oversized) => self.close_oversized(max, ctx),
            // The codec's own limit (same size): kept as a second line.
            Err(ProtocolError::Overflow) => self.close_oversized(max, ctx),
            // actix-web-actors makes an `Io` error of two things only: a failed
            // byte stream (which `FrameLimit` saw first) and a text frame that is
            // not UTF-8.
            Err(ProtocolError::Io(_)) if self.fault.get().is_none() => self.close_not_utf8(ctx),
            Err(e) => {
                tracing::debug!(conn = %self.conn_id, error = %e, "websocket protocol error");
                ctx.close(Some(CloseReason { code: CloseCode::Protocol, description: None }));
                ctx.stop();
            }
        }
    }
}

impl Handler<Push> for WsSession {
    type Result = ();

    fn handle(&mut self, push: Push, ctx: &mut Self::Context) {
        match push {
            // Counted, and the route removed, when the overflow was found (`Conn::send`).
            Push::Overflowed => {
                ctx.close(Some(CloseReason {
                    code: CloseCode::Again,
                    description: Some("outbound queue overflowed; resync".into()),
                }));
                ctx.stop();
            }
            // Shutdown: answer what is in flight first, then say goodbye.
            Push::Kick(KickReason::Shutdown) if self.inflight > 0 => self.closing = Some(KickReason::Shutdown),
            Push::Kick(reason) => self.kick(reason, ctx),
        }
    }
}
