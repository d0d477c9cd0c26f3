//! PROTOCOL §3: device tokens (`Authorization: Bearer`, or `?token=` on the
//! WebSocket upgrade) and the admin token. Tokens are never logged; failed
//! admin authentications are throttled and logged by `admin_guard`.
//!
//! Refusals are remembered for a short while ([`RefusedTokens`]) so a client
//! retrying with a bad token does not cost a database lookup per request.
//! Acceptances are never remembered: a rotation revokes the old token at
//! once (the lookup runs every time, and the rotation kicks live connections).

use std::time::{Duration, Instant};

use actix_http::RequestHead;
use actix_web::http::header::{HeaderMap, AUTHORIZATION};
use actix_web::HttpRequest;
use dashmap::DashMap;
use sha2::{Digest, Sha256};

use super::error::ApiError;
use super::AppState;
use crate::protocol::ErrorCode;
use crate::store::{token_hash, TokenOwner};

/// How long a refused token is refused without asking the database.
pub const REFUSAL_TTL: Duration = Duration::from_secs(10);
/// Refusals remembered at once.
pub const MAX_REFUSALS: usize = 10_000;

/// Tokens the database did not know, by SHA-256, until a deadline.
///
/// A cached refusal can never refuse a valid token. A device token is 256
/// bits from the OS's CSPRNG, and the entry is keyed by the SHA-256 of the
/// refused string: to be refused, a token issued later would have to equal a
/// string someone presented before it existed (guessing 256 random bits), or
/// its hash collide with that string's (a SHA-256 collision). Both have
/// probability ~2^-256 per pair; the entry also expires after [`REFUSAL_TTL`].
///
/// Bounded: at [`MAX_REFUSALS`] the expired entries are dropped, and if that
/// leaves it over three quarters full it is emptied, so a pass runs at most
/// once per quarter of inserts (a flood of distinct random tokens costs
/// lookups, as it did before, and no more memory than this).
#[derive(Default)]
pub struct RefusedTokens {
    until: DashMap<[u8; 32], Instant>,
}

impl RefusedTokens {
    fn refused(&self, hash: &[u8; 32], now: Instant) -> bool {
        self.until.get(hash).is_some_and(|until| *until > now)
    }

    fn remember(&self, hash: [u8; 32], now: Instant) {
        if self.until.len() >= MAX_REFUSALS {
            self.until.retain(|_, until| *until > now);
            if self.until.len() > MAX_REFUSALS / 4 * 3 {
                self.until.clear();
            }
        }
        self.until.insert(hash, now + REFUSAL_TTL);
    }
}

/// The bearer token of the `Authorization` header, if any.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim()).filter(|t| !t.is_empty())
}

/// The header's token, else `?token=` (browsers cannot set headers on a WebSocket).
pub fn bearer_or_query(head: &RequestHead) -> Option<String> {
    if let Some(t) = bearer(&head.headers) {
        return Some(t.to_owned());
    }
    let query = actix_web::web::Query::<Vec<(String, String)>>::from_query(head.uri.query().unwrap_or("")).ok()?;
    query.into_inner().into_iter().find(|(k, _)| k == "token").map(|(_, v)| v).filter(|t| !t.is_empty())
}

/// The device a token belongs to; `UNAUTHORIZED` for a missing, unknown or
/// revoked one. A token refused within [`REFUSAL_TTL`] is refused again
/// without a lookup; a database failure is not a refusal and is not remembered.
pub async fn device(state: &AppState, token: Option<&str>) -> Result<TokenOwner, ApiError> {
    let token = token.ok_or_else(ApiError::unauthorized)?;
    let hash = token_hash(token);
    if state.refused_tokens.refused(&hash, Instant::now()) {
        return Err(ApiError::unauthorized());
    }
    match state.store.resolve_token(token).await? {
        Some(owner) => Ok(owner),
        None => {
            state.refused_tokens.remember(hash, Instant::now());
            Err(ApiError::unauthorized())
        }
    }
}

/// The admin token, compared in constant time (over SHA-256 digests, so the
/// lengths leak nothing either). A missing or wrong one spends one of the
/// caller's address's failures; an address that spent them all is refused
/// `OVERLOADED` before any comparison ([`AdminGuard`](super::admin_guard::AdminGuard)).
pub fn admin(state: &AppState, req: &HttpRequest) -> Result<(), ApiError> {
    guarded_bearer(state, req, &state.admin_token)
}

/// Who may read `/metrics`: the holder of `IMCORE_METRICS_TOKEN` when it is
/// set (checked as the admin token is), else loopback peers only.
pub fn metrics(state: &AppState, req: &HttpRequest) -> Result<(), ApiError> {
    match &state.config.metrics_token {
        Some(expected) => guarded_bearer(state, req, expected),
        None if req.peer_addr().is_some_and(|peer| peer.ip().is_loopback()) => Ok(()),
        None => Err(ApiError::new(
            ErrorCode::Unauthorized,
            "metrics are served to loopback peers only unless IMCORE_METRICS_TOKEN is set",
        )),
    }
}

fn guarded_bearer(state: &AppState, req: &HttpRequest, expected: &str) -> Result<(), ApiError> {
    let (peer, now) = (req.peer_addr().map(|a| a.ip()), Instant::now());
    if state.admin_guard.blocked(peer, now) {
        return Err(ApiError::new(
            ErrorCode::Overloaded,
            "too many failed admin authentications from this address; retry in a minute",
        ));
    }
    if bearer(req.headers()).is_some_and(|given| same_secret(given, expected)) {
        return Ok(());
    }
    state.admin_guard.failed(peer, now);
    Err(ApiError::unauthorized())
}

fn same_secret(given: &str, expected: &str) -> bool {
    let (a, b) = (Sha256::digest(given.as_bytes()), Sha256::digest(expected.as_bytes()));
    a.iter().zip(b.iter()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_expires_and_the_map_stays_bounded() {
        let refused = RefusedTokens::default();
        let t0 = Instant::now();
        refused.remember(token_hash("bad"), t0);
        assert!(refused.refused(&token_hash("bad"), t0 + REFUSAL_TTL / 2));
        assert!(!refused.refused(&token_hash("bad"), t0 + REFUSAL_TTL));
        assert!(!refused.refused(&token_hash("other"), t0));
        for i in 0..MAX_REFUSALS + 10 {
            refused.remember(token_hash(&i.to_string()), t0);
        }
        assert!(refused.until.len() <= MAX_REFUSALS);
        assert!(refused.refused(&token_hash(&(MAX_REFUSALS + 9).to_string()), t0), "the newest is remembered");
    }
}
