//! HTTP routes of PROTOCOL §5: each becomes `(op, fields)` — the JSON body,
//! then the query parameters, then the path parameters (which win, so a body
//! cannot redirect a request to another conversation) — and goes through the
//! same [`ops::dispatch`] as a WebSocket frame.

use std::convert::Infallible;
use std::time::Duration;

use actix_web::body::SizedStream;
use actix_web::http::header::ContentType;
use actix_web::http::{header, Method, StatusCode};
use actix_web::web::Bytes;
use actix_web::{web, HttpRequest, HttpResponse, Resource, Route};
use futures_util::StreamExt;
use serde_json::{json, Map, Value};

use super::error::ApiError;
use super::group;
use super::ops;
use super::outbound::{Outbound, Written};
use super::request::Request;
use super::{auth, AppState};
use crate::protocol::ErrorCode;
use crate::store::TokenOwner;

/// Largest HTTP request body read (a 16 KiB message body plus its envelope,
/// like the WebSocket frame limit).
pub const MAX_HTTP_BODY_BYTES: usize = 64 * 1024;

/// Reads a JSON object body (empty body: no fields) within `timeout`. Over
/// the limit → `PAYLOAD_TOO_LARGE`; not a JSON object → `BAD_REQUEST`; not
/// all there in time → `REQUEST_TIMEOUT` (and the connection is closed).
pub async fn json_object(payload: web::Payload, timeout: Option<Duration>) -> Result<Map<String, Value>, ApiError> {
    let bytes = match timeout {
        None => read_body(payload).await?,
        Some(t) => tokio::time::timeout(t, read_body(payload)).await.map_err(|_| {
            ApiError::new(
                ErrorCode::RequestTimeout,
                format!("the request body did not arrive within {} ms", t.as_millis()),
            )
        })??,
    };
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(Map::new());
    }
    match serde_json::from_slice::<Value>(&bytes) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ApiError::bad_request("the body must be a JSON object")),
        Err(e) => Err(ApiError::bad_request(format!("malformed JSON: {e}"))),
    }
}

async fn read_body(mut payload: web::Payload) -> Result<web::BytesMut, ApiError> {
    let mut bytes = web::BytesMut::new();
    while let Some(chunk) = payload.next().await {
        let chunk = chunk.map_err(|e| ApiError::bad_request(format!("reading the body: {e}")))?;
        if bytes.len() + chunk.len() > MAX_HTTP_BODY_BYTES {
            return Err(ApiError::new(
                ErrorCode::PayloadTooLarge,
                format!("request body over {MAX_HTTP_BODY_BYTES} bytes"),
            ));
        }
        bytes.extend_from_slice(&chunk);
    }
    Ok(bytes)
}

/// Body fields, then query parameters, then path parameters.
pub async fn fields(req: &HttpRequest, payload: web::Payload) -> Result<Map<String, Value>, ApiError> {
    let timeout = req.app_data::<web::Data<AppState>>().and_then(|s| s.config.limits.body_timeout());
    let mut fields = json_object(payload, timeout).await?;
    let query = web::Query::<Vec<(String, String)>>::from_query(req.query_string())
        .map_err(|e| ApiError::bad_request(format!("query string: {e}")))?;
    for (k, v) in query.into_inner() {
        fields.insert(k, Value::String(v));
    }
    for (k, v) in req.match_info().iter() {
        fields.insert(k.to_owned(), Value::String(v.to_owned()));
    }
    Ok(fields)
}

/// One device op over HTTP.
async fn call(op: &'static str, req: HttpRequest, payload: web::Payload) -> Result<HttpResponse, ApiError> {
    call_with(req, payload, |_, _| Ok(op)).await
}

/// `PATCH /v1/conversations/{conv_id}/members/{user_id}`: the op is named by
/// the field given (see [`group::member_patch_op`]); an alias is only ever
/// the caller's own.
async fn patch_member(req: HttpRequest, payload: web::Payload) -> Result<HttpResponse, ApiError> {
    call_with(req, payload, |fields, caller| {
        let op = group::member_patch_op(fields)?;
        if op == "set_alias" && fields.get("user_id").and_then(Value::as_str) != Some(caller.user_id.as_str()) {
            return Err(ApiError::new(ErrorCode::Forbidden, "an alias is set by its member only"));
        }
        Ok(op)
    })
    .await
}

/// Authenticates, gathers the fields and runs the op `op_of` names for them.
async fn call_with(
    req: HttpRequest,
    payload: web::Payload,
    op_of: impl FnOnce(&Map<String, Value>, &TokenOwner) -> Result<&'static str, ApiError>,
) -> Result<HttpResponse, ApiError> {
    let state = req.app_data::<web::Data<AppState>>().cloned().ok_or_else(ApiError::internal)?;
    let caller = auth::device(&state, auth::bearer(req.headers())).await?;
    let fields = fields(&req, payload).await?;
    let op = op_of(&fields, &caller)?;
    let parsed = Request::parse(op, &fields, state.config.max_body_bytes)?;
    let read = parsed.is_read();
    let reply = ops::dispatch(&state, &caller, parsed, "http").await?;
    let status = if reply.created { StatusCode::CREATED } else { StatusCode::OK };
    let mut response = HttpResponse::build(status);
    response.content_type(ContentType::json());
    if !read {
        return Ok(response.body(reply.json));
    }
    // As over WebSocket, a read's reply holds its bytes of the memory budget
    // until the socket writer has taken them (a client that does not read).
    let len = reply.json.len();
    let outbound = Outbound::new(0, &state.budget);
    if !outbound.answered(len) {
        return Err(ApiError::budget_exhausted());
    }
    outbound.handed(len);
    let body = Written::new(futures_util::stream::iter([Ok::<_, Infallible>(Bytes::from(reply.json))]), outbound);
    Ok(response.body(SizedStream::new(len as u64, body)))
}

/// A resource answering `routes`; any other method gets 405 with `Allow` and
/// the PROTOCOL §2 error shape (`BAD_REQUEST`), never actix's empty 405.
pub fn resource(path: &str, routes: Vec<(Method, Route)>) -> Resource {
    let allow: Vec<Method> = routes.iter().map(|(m, _)| m.clone()).collect();
    let resource = routes.into_iter().fold(web::resource(path), |r, (m, route)| r.route(route.method(m)));
    resource.default_service(web::to(move || method_not_allowed(allow.clone())))
}

pub(super) async fn method_not_allowed(allow: Vec<Method>) -> HttpResponse {
    let e = ApiError::bad_request("this route does not take that method (see Allow)");
    e.count();
    HttpResponse::MethodNotAllowed().insert_header(header::Allow(allow)).json(json!({ "error": e.0 }))
}

/// Any path no route knows: 404 `NOT_FOUND` in the PROTOCOL §2 shape.
pub async fn not_found() -> Result<HttpResponse, ApiError> {
    Err(ApiError::new(ErrorCode::NotFound, "no such route"))
}

macro_rules! op {
    ($op:literal) => {
        web::to(|req: HttpRequest, payload: web::Payload| call($op, req, payload))
    };
}

pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.service(resource(
        "/v1/conversations",
        vec![(Method::POST, op!("create_conversation")), (Method::GET, op!("conversations"))],
    ))
    .service(resource(
        "/v1/conversations/{conv_id}",
        vec![
            (Method::GET, op!("get_conversation")),
            (Method::PATCH, op!("update_group")),
            (Method::DELETE, op!("dismiss")),
        ],
    ))
    .service(resource("/v1/conversations/{conv_id}/messages", vec![(Method::POST, op!("send"))]))
    .service(resource("/v1/conversations/{conv_id}/events", vec![(Method::GET, op!("sync"))]))
    .service(resource("/v1/conversations/{conv_id}/read", vec![(Method::POST, op!("read"))]))
    .service(resource("/v1/conversations/{conv_id}/recall", vec![(Method::POST, op!("recall"))]))
    .service(resource("/v1/conversations/{conv_id}/edit", vec![(Method::POST, op!("edit"))]))
    .service(resource("/v1/conversations/{conv_id}/react", vec![(Method::POST, op!("react"))]))
    .service(resource(
        "/v1/conversations/{conv_id}/members",
        vec![(Method::POST, op!("invite")), (Method::GET, op!("members"))],
    ))
    .service(resource(
        "/v1/conversations/{conv_id}/members/{user_id}",
        vec![(Method::DELETE, op!("kick")), (Method::PATCH, web::to(patch_member))],
    ))
    .service(resource("/v1/conversations/{conv_id}/join", vec![(Method::POST, op!("join"))]))
    .service(resource("/v1/conversations/{conv_id}/leave", vec![(Method::POST, op!("leave"))]))
    .service(resource("/v1/conversations/{conv_id}/owner", vec![(Method::POST, op!("transfer_owner"))]))
    .service(resource("/v1/conversations/{conv_id}/applications", vec![(Method::GET, op!("applications"))]))
    .service(resource(
        "/v1/conversations/{conv_id}/applications/{user_id}/approve",
        vec![(Method::POST, op!("approve"))],
    ))
    .service(resource("/v1/conversations/{conv_id}/applications/{user_id}/reject", vec![(Method::POST, op!("reject"))]))
    .service(resource("/v1/conversations/{conv_id}/reads", vec![(Method::GET, op!("reads"))]))
    .service(resource("/v1/conversations/{conv_id}/typing", vec![(Method::POST, op!("typing"))]))
    .service(resource("/v1/conversations/{conv_id}/notify", vec![(Method::POST, op!("set_notify"))]))
    .service(resource("/v1/pushers", vec![(Method::POST, op!("set_pusher"))]))
    .service(resource("/v1/pushers/remove", vec![(Method::POST, op!("remove_pusher"))]))
    .service(resource("/v1/presence", vec![(Method::POST, op!("presence"))]))
    .service(resource("/v1/blocks", vec![(Method::POST, op!("block")), (Method::GET, op!("blocks"))]))
    .service(resource("/v1/blocks/{user_id}", vec![(Method::DELETE, op!("unblock"))]))
    .service(resource("/v1/users", vec![(Method::GET, op!("search_users"))]))
    .service(resource("/v1/ping", vec![(Method::GET, op!("ping"))]))
    .service(resource("/v1/me", vec![(Method::GET, op!("whoami"))]));
}
