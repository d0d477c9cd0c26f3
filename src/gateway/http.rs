//! HTTP routes of PROTOCOL §5: each becomes `(op, fields)` — the JSON body,
//! then the query parameters, then the path parameters (which win, so a body
//! cannot redirect a request to another conversation) — and goes through the
//! same [`ops::dispatch`] as a WebSocket frame.

use actix_web::http::StatusCode;
use actix_web::{web, HttpRequest, HttpResponse};
use futures_util::StreamExt;
use serde_json::{Map, Value};

use super::error::ApiError;
use super::ops::{self, Request};
use super::{auth, AppState};
use crate::protocol::ErrorCode;

/// Largest HTTP request body read (a 16 KiB message body plus its envelope,
/// like the WebSocket frame limit).
pub const MAX_HTTP_BODY_BYTES: usize = 64 * 1024;

/// Reads a JSON object body (empty body: no fields). Over the limit →
/// `PAYLOAD_TOO_LARGE`; not a JSON object → `BAD_REQUEST`.
pub async fn json_object(mut payload: web::Payload) -> Result<Map<String, Value>, ApiError> {
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
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(Map::new());
    }
    match serde_json::from_slice::<Value>(&bytes) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ApiError::bad_request("the body must be a JSON object")),
        Err(e) => Err(ApiError::bad_request(format!("malformed JSON: {e}"))),
    }
}

/// Body fields, then query parameters, then path parameters.
pub async fn fields(req: &HttpRequest, payload: web::Payload) -> Result<Map<String, Value>, ApiError> {
    let mut fields = json_object(payload).await?;
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
    let state = req.app_data::<web::Data<AppState>>().cloned().ok_or_else(ApiError::internal)?;
    let caller = auth::device(&state, auth::bearer(&req)).await?;
    let fields = fields(&req, payload).await?;
    let parsed = Request::parse(op, &fields, state.config.max_body_bytes)?;
    let reply = ops::dispatch(&state, &caller, parsed, "http").await?;
    let status = if reply.created { StatusCode::CREATED } else { StatusCode::OK };
    Ok(HttpResponse::build(status).json(reply.body))
}

macro_rules! op_route {
    ($method:ident, $op:literal) => {
        web::$method().to(|req: HttpRequest, payload: web::Payload| call($op, req, payload))
    };
}

pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.service(
        web::resource("/v1/conversations")
            .route(op_route!(post, "create_conversation"))
            .route(op_route!(get, "conversations")),
    )
    .service(web::resource("/v1/conversations/{conv_id}").route(op_route!(get, "get_conversation")))
    .service(web::resource("/v1/conversations/{conv_id}/messages").route(op_route!(post, "send")))
    .service(web::resource("/v1/conversations/{conv_id}/events").route(op_route!(get, "sync")))
    .service(web::resource("/v1/conversations/{conv_id}/read").route(op_route!(post, "read")))
    .service(web::resource("/v1/ping").route(op_route!(get, "ping")));
}
