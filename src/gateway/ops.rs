//! The ops of PROTOCOL §5, one dispatch for both transports: a parsed
//! [`Request`] (`request`) is run by [`dispatch`], so a WebSocket frame and
//! an HTTP request give the very same result object and errors.

use std::sync::Arc;
use std::time::Instant;

use actix_web::web;
use futures_util::future::LocalBoxFuture;
use futures_util::FutureExt;
use imcore_actors::{ConvId, UserId};
use serde::Serialize;
use serde_json::{json, Value};
use tracing::Instrument;

use super::error::ApiError;
use super::group::{applications_json, members_json, written_json};
use super::request::{NewConversation, Request};
use super::AppState;
use crate::delivery::{Live, Signal};
use crate::domain::format_time;
use crate::metrics::{metrics, observe_send, Running};
use crate::protocol::{
    conversation_json, inbox_item_json, push_member_read, push_read, push_typing, send_ack, sync_page, ErrorCode,
};
use crate::store::{
    Appended, CreateConversation, EditOp, GroupOp, InboxDelta, ReactOp, RecallOp, SendOp, SyncRequest, TokenOwner,
    WriteOp, Written,
};
use crate::writer::WriteFailure;
/// A successful answer: the PROTOCOL result object as JSON text, encoded
/// once for either transport, and whether it created something (HTTP 201
/// rather than 200).
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    pub created: bool,
    pub json: String,
}

impl Reply {
    fn new(created: bool, result: impl Serialize) -> Result<Self, ApiError> {
        match serde_json::to_string(&result) {
            Ok(json) => Ok(Self { created, json }),
            Err(e) => {
                tracing::error!(error = %e, "a result did not encode");
                Err(ApiError::internal())
            }
        }
    }

    fn ok(result: impl Serialize) -> Result<Self, ApiError> {
        Self::new(false, result)
    }
}

/// Runs `req` for `caller`. Not `async`: a `send` is queued on the writer
/// before this returns, so a connection that dispatches its frames in arrival
/// order gets its sends sequenced in that order (PROTOCOL §4, P6), while the
/// answers are awaited concurrently. Everything it logs, failures included,
/// is in its span, which names the op, conversation, user and device.
pub fn dispatch(
    state: &web::Data<AppState>,
    caller: &TokenOwner,
    req: Request,
    transport: &'static str,
) -> LocalBoxFuture<'static, Result<Reply, ApiError>> {
    metrics().requests.with_label_values(&[req.op(), transport]).inc();
    let span = tracing::info_span!(
        "dispatch",
        op = req.op(),
        transport,
        conv_id = req.conv().map(ConvId::as_str),
        user_id = caller.user_id.as_str(),
        device_id = caller.device_id.as_str(),
    );
    let _queueing = span.enter();
    let running = Running::start();
    let state = state.clone();
    let caller = caller.clone();
    match req {
        Request::Send { conv, client_msg_id, body, reply_to, mentions } => {
            let started = Instant::now();
            // Held until the write is answered (or its caller goes away).
            let Some(permit) = state.budget.try_acquire(body.text().len()) else {
                let e = ApiError::budget_exhausted();
                return async move { Err(e) }.boxed_local();
            };
            let op = WriteOp::Send(SendOp {
                sender: caller.user_id.clone(),
                device: caller.device_id.clone(),
                client_msg_id,
                body,
                reply_to,
                mentions,
            });
            let written = state.write(conv, op);
            async move {
                let (_running, _permit) = (running, permit);
                let result = written.await;
                observe_send(started.elapsed());
                match result? {
                    Written::Sent(ack) => Reply::new(!ack.dup, send_ack(&ack)),
                    other => {
                        tracing::error!(?other, "a send was answered with another outcome");
                        Err(ApiError::internal())
                    }
                }
            }
            .instrument(span.clone())
            .boxed_local()
        }
        // Queued like a send, so one connection's ops keep their order.
        Request::Group { conv, change } => {
            let op = WriteOp::Group(GroupOp { actor: caller.user_id.clone(), change });
            queued(state.write(conv, op), running).instrument(span.clone()).boxed_local()
        }
        Request::Recall { conv, target_seq } => {
            let (actor, device) = (caller.user_id.clone(), caller.device_id.clone());
            let op = WriteOp::Recall(RecallOp { actor, device, target_seq });
            queued(state.write(conv, op), running).instrument(span.clone()).boxed_local()
        }
        Request::Edit { conv, client_msg_id, target_seq, body } => {
            let Some(permit) = state.budget.try_acquire(body.text().len()) else {
                let e = ApiError::new(ErrorCode::Overloaded, "the server's memory budget is exhausted; retry later");
                return async move { Err(e) }.boxed_local();
            };
            let (sender, device) = (caller.user_id.clone(), caller.device_id.clone());
            let op = WriteOp::Edit(EditOp { sender, device, client_msg_id, target_seq, body });
            let written = state.write(conv, op);
            async move {
                let _permit = permit;
                queued(written, running).await
            }
            .instrument(span.clone())
            .boxed_local()
        }
        Request::React { conv, target_seq, emoji, on } => {
            let (actor, device) = (caller.user_id.clone(), caller.device_id.clone());
            let op = WriteOp::React(ReactOp { actor, device, target_seq, emoji, on });
            queued(state.write(conv, op), running).instrument(span.clone()).boxed_local()
        }
        other => async move {
            let _running = running;
            run(&state, &caller, other).await
        }
        .instrument(span.clone())
        .boxed_local(),
    }
}

/// The answer of a queued group op or recall.
async fn queued(
    written: impl std::future::Future<Output = Result<Written, WriteFailure>>,
    running: Running,
) -> Result<Reply, ApiError> {
    let _running = running;
    Reply::ok(written_json(&written.await?))
}

/// The answer to `ping`, with or without an `id`.
pub fn pong() -> Value {
    json!({ "pong": format_time(chrono::Utc::now()) })
}

async fn run(state: &AppState, caller: &TokenOwner, req: Request) -> Result<Reply, ApiError> {
    let user = &caller.user_id;
    match req {
        Request::CreateConversation(new) => create_conversation(state, user, new).await,
        Request::GetConversation { conv } => {
            Reply::ok(conversation_json(&state.store.get_conversation(&conv, user).await?))
        }
        Request::Conversations { limit, cursor } => {
            let page = state.store.inbox(user, limit, cursor.as_deref()).await?;
            let items: Vec<Value> = page.items.iter().map(inbox_item_json).collect();
            Reply::ok(json!({"conversations": items, "next_cursor": page.next_cursor, "since": page.since}))
        }
        Request::ConversationsSince { since } => match state.store.inbox_since(user, &since).await? {
            InboxDelta::Changed { items, left, since } => {
                let items: Vec<Value> = items.iter().map(inbox_item_json).collect();
                Reply::ok(json!({"conversations": items, "left": left, "since": since}))
            }
            InboxDelta::Reset => Reply::ok(json!({"reset": true})),
        },
        Request::Sync(p) => {
            let sync = SyncRequest {
                conv: p.conv,
                user: user.clone(),
                after_seq: p.after_seq,
                before_seq: p.before_seq,
                limit: p.limit,
                epoch: p.epoch,
                max_bytes: state.config.sync_max_bytes,
            };
            let page = state.store.sync(&sync).await?;
            Reply::ok(sync_page(&page))
        }
        Request::Read { conv, seq } => {
            let marked =
                state.store.mark_read_telling(&conv, user, seq, state.config.live.read_push_max_members).await?;
            let own: Arc<str> = push_read(conv.as_str(), marked.read_seq).into();
            state.delivery.to_user(user, &own, Some(&caller.device_id));
            if !marked.tell.is_empty() {
                let frame = push_member_read(conv.as_str(), user.as_str(), marked.read_seq);
                let shared: Arc<str> = frame.as_str().into();
                for other in &marked.tell {
                    state.delivery.to_user(other, &shared, None);
                }
                if state.delivery.clustered() {
                    state.delivery.live(Live::ToUsers { users: marked.tell, frame });
                }
            }
            Reply::ok(json!({ "read_seq": marked.read_seq }))
        }
        Request::Reads { conv, after, limit } => {
            let page = state.store.reads(&conv, user, after, limit).await?;
            let reads: Vec<Value> =
                page.reads.iter().map(|r| json!({"user_id": r.user_id.as_str(), "read_seq": r.read_seq})).collect();
            Reply::ok(json!({"reads": reads, "next": page.next}))
        }
        Request::Typing { conv, on } => typing(state, caller, conv, on).await,
        Request::Presence { users } => {
            let sharing = state.store.sharing(user, &users).await?;
            let known: Vec<UserId> = users.iter().filter(|u| sharing.contains(*u)).cloned().collect();
            let last_seen = state.store.last_seen(&known).await?;
            let answer: Vec<Value> = users
                .iter()
                .map(|u| match sharing.contains(u) {
                    false => json!({"user_id": u.as_str(), "online": null, "last_seen": null}),
                    true => {
                        let online = state.online.is_online(u);
                        let seen = if online { None } else { last_seen.get(u).map(|t| format_time(*t)) };
                        json!({"user_id": u.as_str(), "online": online, "last_seen": seen})
                    }
                })
                .collect();
            Reply::ok(answer)
        }
        Request::Block { user: blocked } => {
            state.store.block(user, &blocked, state.config.live.max_blocks).await?;
            Reply::ok(json!({}))
        }
        Request::Unblock { user: blocked } => {
            state.store.unblock(user, &blocked).await?;
            Reply::ok(json!({}))
        }
        Request::Blocks => {
            let blocks: Vec<Value> = state
                .store
                .blocks(user)
                .await?
                .iter()
                .map(|b| json!({"user_id": b.user_id.as_str(), "created_at": format_time(b.created_at)}))
                .collect();
            Reply::ok(json!({ "blocks": blocks }))
        }
        Request::SearchUsers { prefix, limit } => {
            let found = state.store.search_users(user, &prefix, limit).await?;
            let users: Vec<Value> =
                found.iter().map(|u| json!({"user_id": u.user_id.as_str(), "display_name": u.display_name})).collect();
            Reply::ok(json!({ "users": users }))
        }
        Request::Members { conv, query, limit } => {
            Reply::ok(members_json(&state.store.members(&conv, user, &query, limit).await?))
        }
        Request::Applications { conv, after, limit } => {
            Reply::ok(applications_json(&state.store.applications(&conv, user, after.as_ref(), limit).await?))
        }
        Request::Push(op) => Reply::ok(super::push::run(state, caller, op).await?),
        Request::Ping => Reply::ok(pong()),
        Request::WhoAmI => Reply::ok(json!({ "user_id": user.as_str(), "device_id": caller.device_id.as_str() })),
        // Queued on the writer in `dispatch`.
        Request::Send { .. }
        | Request::Group { .. }
        | Request::Recall { .. }
        | Request::Edit { .. }
        | Request::React { .. } => Err(ApiError::internal()),
    }
}

/// `typing`: answered `{}` whatever happens to it. Forwarded, at most once
/// per device, conversation and interval, to the other members online (on
/// every node) — unless the caller is muted or blocked there, or the
/// conversation is `pull`. A throttled one is dropped before the database
/// is asked; a non-member gets `NOT_MEMBER`.
async fn typing(state: &AppState, caller: &TokenOwner, conv: ConvId, on: bool) -> Result<Reply, ApiError> {
    let key = (caller.user_id.clone(), caller.device_id.clone(), conv.clone());
    if state.typing_rate.throttled(&key) {
        return Reply::ok(json!({}));
    }
    let forward = state.store.typing_forwarded(&conv, &caller.user_id).await?;
    if state.typing_rate.claim(key) && forward {
        let frame = push_typing(conv.as_str(), caller.user_id.as_str(), on);
        let from = caller.user_id.clone();
        state.delivery.live(Live::Signal { conv: conv.clone(), from: from.clone(), frame: frame.clone() });
        state.delivery.signal(Signal { conv, from, frame: frame.into() });
    }
    Reply::ok(json!({}))
}

/// `create_conversation`, within the caller's creation rate (every request
/// counts, one answering an existing direct chat too: it is checked first).
async fn create_conversation(state: &AppState, user: &UserId, new: NewConversation) -> Result<Reply, ApiError> {
    if !state.create_rate.allow(user) {
        let n = state.config.limits.create_per_minute;
        return Err(ApiError::new(
            ErrorCode::Overloaded,
            format!("over {n} conversations created per minute; retry later"),
        ));
    }
    let req = match new {
        NewConversation::Direct { other } => CreateConversation::Direct { creator: user.clone(), other },
        NewConversation::Group { conv_id, name, members, settings } => {
            CreateConversation::Group { creator: user.clone(), conv_id, name, members, settings }
        }
    };
    // Batches of a conversation whose id others know may commit the moment
    // it does: delivery holds them until the creation's events are handed over.
    let hold = state.delivery.hold_creation(req.known_id());
    let created = state.store.create_conversation(&req).await?;
    let info = created.info;
    // Each member sees the events from its own join on.
    hold.release((!created.events.is_empty()).then(|| Appended {
        conv_id: info.conv_id.clone(),
        events: created.events,
        head: info.head,
        delivery_mode: info.delivery_mode,
        members_summary: created.members_summary,
    }))
    .await;
    Reply::new(created.created, conversation_json(&info))
}
