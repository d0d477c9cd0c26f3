//! PROTOCOL §3: device tokens (`Authorization: Bearer`, or `?token=` on the
//! WebSocket upgrade) and the admin token. Tokens are never logged.

use actix_web::http::header::AUTHORIZATION;
use actix_web::HttpRequest;
use sha2::{Digest, Sha256};

use super::error::ApiError;
use super::AppState;
use crate::store::TokenOwner;

/// The bearer token of the `Authorization` header, if any.
pub fn bearer(req: &HttpRequest) -> Option<&str> {
    let value = req.headers().get(AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim()).filter(|t| !t.is_empty())
}

/// The header's token, else `?token=` (browsers cannot set headers on a WebSocket).
pub fn bearer_or_query(req: &HttpRequest) -> Option<String> {
    if let Some(t) = bearer(req) {
        return Some(t.to_owned());
    }
    let query = actix_web::web::Query::<Vec<(String, String)>>::from_query(req.query_string()).ok()?;
    query.into_inner().into_iter().find(|(k, _)| k == "token").map(|(_, v)| v).filter(|t| !t.is_empty())
}

/// The device a token belongs to; `UNAUTHORIZED` for a missing, unknown or revoked one.
pub async fn device(state: &AppState, token: Option<&str>) -> Result<TokenOwner, ApiError> {
    let token = token.ok_or_else(ApiError::unauthorized)?;
    state.store.resolve_token(token).await?.ok_or_else(ApiError::unauthorized)
}

/// The admin token, compared in constant time (over SHA-256 digests, so the
/// lengths leak nothing either).
pub fn admin(state: &AppState, req: &HttpRequest) -> Result<(), ApiError> {
    let given = bearer(req).ok_or_else(ApiError::unauthorized)?;
    let (a, b) = (Sha256::digest(given.as_bytes()), Sha256::digest(state.admin_token.as_bytes()));
    let diff = a.iter().zip(b.iter()).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    if diff == 0 {
        Ok(())
    } else {
        Err(ApiError::unauthorized())
    }
}
