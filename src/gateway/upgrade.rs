//! The WebSocket upgrade (`GET /v1/ws`, PROTOCOL §4), taken over from
//! actix-http's HTTP/1 dispatcher at the handshake: a request with
//! `Upgrade: websocket` comes here (actix-http's `upgrade` service) with its
//! socket. It is admitted (the token before anything else), answered `101`
//! or a PROTOCOL §2 error, and the socket is driven by `socket` from then on,
//! without the dispatcher's two 8 KiB buffers or its poll per frame
//! (ARCHITECTURE §5, "An idle connection").

use std::rc::Rc;

use actix_codec::Framed;
use actix_http::ws::{hash_key, verify_handshake};
use actix_http::{h1, Request, RequestHead};
use actix_web::body::to_bytes;
use actix_web::dev::Extensions;
use actix_web::http::header::SEC_WEBSOCKET_KEY;
use actix_web::http::Method;
use actix_web::web::{self, Bytes};
use actix_web::{HttpRequest, HttpResponse, ResponseError};
use imcore_actors::registry::ConnId;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use super::error::ApiError;
use super::session::{self, Admitted};
use super::socket::{self, Inbound};
use super::{auth, caps, http, AppState};
use crate::metrics::metrics;
use crate::protocol::ErrorCode;

const PATH: &str = "/v1/ws";

/// actix-http's `upgrade` service: serves one upgrade request and, if
/// admitted, its connection until it closes.
pub async fn serve(state: web::Data<AppState>, req: Request, framed: Framed<TcpStream, h1::Codec>) {
    // Boxed: what the handshake needs (the request, the token lookup's query)
    // is let go before the connection's long life begins.
    let Some(Upgraded { io, leftover, conn_data, admitted }) = Box::pin(handshake(&state, req, framed)).await else {
        return;
    };
    let (input, feed) = Inbound::new();
    let output = session::open(state, admitted, input);
    socket::drive(io, leftover, feed, output).await;
    drop(conn_data);
}

/// A connection answered `101`.
struct Upgraded {
    io: TcpStream,
    /// Bytes the client sent right behind its handshake.
    leftover: Bytes,
    /// Held while the connection lives: its place under the per-address cap.
    conn_data: Option<Rc<Extensions>>,
    admitted: Admitted,
}

/// Admits the upgrade and answers it: `101`, or a PROTOCOL §2 error and the
/// connection closed. The request (its head holds the dispatcher's 8 KiB
/// read buffer) is dropped when this returns.
async fn handshake(state: &AppState, mut req: Request, framed: Framed<TcpStream, h1::Codec>) -> Option<Upgraded> {
    let conn_data = req.take_conn_data();
    let parts = framed.into_parts();
    let mut io = parts.io;
    let leftover = Bytes::copy_from_slice(&parts.read_buf);
    if conn_data.as_deref().is_some_and(caps::refused) {
        // Answered at accept; nothing of this connection runs.
        return None;
    }
    let admitted = match (req.path(), req.method()) {
        (PATH, &Method::GET) => admit(state, req.head()).await,
        (PATH, _) => {
            answer(&mut io, http::method_not_allowed(vec![Method::GET]).await).await;
            return None;
        }
        _ => Err(ApiError::new(ErrorCode::NotFound, "no such route")),
    };
    let admitted = match admitted {
        Ok(a) => a,
        Err(e) => {
            answer(&mut io, e.error_response()).await;
            return None;
        }
    };
    let key = req.head().headers.get(SEC_WEBSOCKET_KEY)?;
    let mut head = b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\
                     sec-websocket-accept: "
        .to_vec();
    head.extend_from_slice(&hash_key(key.as_bytes()));
    head.extend_from_slice(b"\r\n\r\n");
    io.write_all(&head).await.ok()?;
    metrics().ws_accepted.inc();
    Some(Upgraded { io, leftover, conn_data, admitted })
}

/// `GET /v1/ws` without `Upgrade: websocket`: refused as an upgrade would
/// be, so the token is checked first (401) and then the handshake (400).
pub async fn not_upgraded(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    admit(&state, req.head()).await?;
    // `admit` checks the handshake, which a request without the header fails.
    Err(ApiError::bad_request("not a WebSocket handshake"))
}

/// Admits a device's upgrade: its token (401), the server not shutting down,
/// its user's session cap, the handshake's form; then its connection id,
/// drawn only once admitted (a refused upgrade costs no `nextval`): the id
/// order is the order connections were admitted (P7); with several nodes,
/// the order of the whole cluster's connections.
async fn admit(state: &AppState, head: &RequestHead) -> Result<Admitted, ApiError> {
    let token = auth::bearer_or_query(head);
    let revocations = state.delivery.revocations();
    let owner = auth::device(state, token.as_deref()).await?;
    if state.shutting_down() {
        return Err(ApiError::new(ErrorCode::Overloaded, "the server is shutting down"));
    }
    let user_slot = state.per_user.admit(&owner.user_id, &owner.device_id)?;
    verify_handshake(head).map_err(|e| ApiError::bad_request(format!("not a WebSocket handshake: {e}")))?;
    let conn_id = if state.delivery.clustered() {
        ConnId::from_cluster_sequence(state.store.next_cluster_conn_id().await.map_err(ApiError::from)?)
    } else {
        state.delivery.routes().next_conn_id()
    };
    Ok(Admitted { owner, token: token.unwrap_or_default(), revocations, conn_id, user_slot })
}

/// Writes `response` as the connection's only answer, then closes it.
async fn answer(io: &mut TcpStream, response: HttpResponse) {
    let (response, body) = response.into_parts();
    let body = to_bytes(body).await.unwrap_or_default();
    let mut head = format!("HTTP/1.1 {}\r\n", response.status()).into_bytes();
    for (name, value) in response.headers() {
        head.extend_from_slice(name.as_str().as_bytes());
        head.extend_from_slice(b": ");
        head.extend_from_slice(value.as_bytes());
        head.extend_from_slice(b"\r\n");
    }
    head.extend_from_slice(format!("content-length: {}\r\nconnection: close\r\n\r\n", body.len()).as_bytes());
    head.extend_from_slice(&body);
    if io.write_all(&head).await.is_ok() {
        socket::linger(io).await;
    }
}
