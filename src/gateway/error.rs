//! The one place inner errors become PROTOCOL §2 codes, for both transports:
//! `{"error": {code, message}}` over HTTP, `{"id", "ok": false, "error"}` over
//! WebSocket. Clients get the code and a clean message; logs get the cause.

use std::error::Error;
use std::sync::Arc;

use actix_web::http::{header, StatusCode};
use actix_web::{HttpResponse, ResponseError};
use imcore_actors::InvalidId;
use serde_json::json;

use crate::config::OVERLOADED_RETRY_AFTER_SECS;
use crate::domain::BodyError;
use crate::metrics::metrics;
use crate::protocol::{ErrorCode, WireError};
use crate::store::{ErrorClass, Report, StoreError};
use crate::writer::WriteFailure;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError(pub WireError);

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self(WireError::new(code, message))
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::BadRequest, message)
    }

    pub fn unauthorized() -> Self {
        Self::new(ErrorCode::Unauthorized, "missing, unknown or revoked token")
    }

    /// The memory budget cannot hold what the request needs (`budget.rs`).
    pub fn budget_exhausted() -> Self {
        Self::new(ErrorCode::Overloaded, "the server's memory budget is exhausted; retry later")
    }

    pub fn internal() -> Self {
        Self::new(ErrorCode::Internal, "internal error; the request may or may not have taken effect")
    }

    /// `OVERLOADED` when the database was busy or went away
    /// ([`StoreError::busy`]: a retry with the same key is safe and may well
    /// succeed), `INTERNAL` otherwise.
    fn failed(e: &(dyn Error + 'static)) -> Self {
        if store_error(e).is_some_and(StoreError::busy) {
            return Self::new(ErrorCode::Overloaded, "the database is unavailable; retry with the same client_msg_id");
        }
        Self::internal()
    }

    pub fn code(&self) -> ErrorCode {
        self.0.code
    }

    /// Counts the error by code; called once per error answer, by either transport.
    pub fn count(&self) {
        let code = serde_json::to_value(self.0.code).ok();
        let label = code.as_ref().and_then(|v| v.as_str()).unwrap_or("UNKNOWN");
        metrics().errors.with_label_values(&[label]).inc();
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}: {}", self.0.code, self.0.message)
    }
}

impl From<InvalidId> for ApiError {
    fn from(e: InvalidId) -> Self {
        Self::bad_request(e.to_string())
    }
}

impl From<BodyError> for ApiError {
    fn from(e: BodyError) -> Self {
        Self::new(ErrorCode::PayloadTooLarge, e.to_string())
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Rejected(r) => Self(WireError::from(&r)),
            other => {
                log_failure(&other);
                Self::failed(&other)
            }
        }
    }
}

impl From<WriteFailure> for ApiError {
    fn from(e: WriteFailure) -> Self {
        match e {
            WriteFailure::Rejected(r) => Self(WireError::from(&r)),
            WriteFailure::Overloaded => {
                Self::new(ErrorCode::Overloaded, "the conversation is overloaded; retry with the same client_msg_id")
            }
            WriteFailure::Internal(cause) => {
                log_failure(&*cause);
                Self::failed(&*cause)
            }
        }
    }
}

/// The store error in `e`'s cause chain, if any. An error shared behind an
/// `Arc` (a failed batch's cause, given to each of its callers) shows in a
/// chain as the `Arc`, whose `source` skips the error inside: looked into.
fn store_error<'a>(e: &'a (dyn Error + 'static)) -> Option<&'a StoreError> {
    let mut next = Some(e);
    while let Some(e) = next {
        if let Some(store) = e.downcast_ref::<StoreError>() {
            return Some(store);
        }
        if let Some(store) = e.downcast_ref::<Arc<StoreError>>() {
            return Some(store);
        }
        next = match e.downcast_ref::<Arc<dyn Error + Send + Sync>>() {
            Some(shared) => Some(&**shared),
            None => e.source(),
        };
    }
    None
}

/// The one log line of a failed request. Written inside the dispatch span, so
/// it names the op, conversation, user and device; it gives the class and
/// SQLSTATE of the store error behind it and the cause chain, never the
/// database's own text (which may carry row contents).
fn log_failure(e: &(dyn Error + 'static)) {
    let store = store_error(e);
    let class = store.and_then(StoreError::class).map_or("unknown", ErrorClass::as_str);
    let sqlstate = store.and_then(StoreError::sqlstate);
    tracing::warn!(class, sqlstate, error = %Report(e), "request failed");
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        StatusCode::from_u16(self.0.code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    fn error_response(&self) -> HttpResponse {
        self.count();
        let mut response = HttpResponse::build(self.status_code());
        // A body that never came, or a client over its connection cap: this
        // connection is not kept for another request.
        if matches!(self.0.code, ErrorCode::RequestTimeout | ErrorCode::TooManyConnections) {
            response.force_close();
        }
        // A busy server says when to come back (the WebSocket upgrade included).
        if self.0.code == ErrorCode::Overloaded {
            response.insert_header((header::RETRY_AFTER, OVERLOADED_RETRY_AFTER_SECS.to_string()));
        }
        response.json(json!({ "error": self.0 }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::Rejection;

    #[test]
    fn inner_errors_map_to_protocol_codes() {
        assert_eq!(ApiError::from(WriteFailure::Overloaded).code(), ErrorCode::Overloaded);
        assert!(!ApiError::from(WriteFailure::internal("boom")).0.message.contains("boom"));
        assert_eq!(ApiError::from(WriteFailure::Rejected(Rejection::NotMember)).code(), ErrorCode::NotMember);
        let too_big = ApiError::from(BodyError::TooLarge { size: 20, max: 10 });
        assert_eq!(too_big.code(), ErrorCode::PayloadTooLarge);
        assert_eq!(too_big.status_code(), StatusCode::PAYLOAD_TOO_LARGE);
    }

    #[test]
    fn no_database_connection_is_overloaded_and_a_failed_transaction_internal() {
        let no_connection = || StoreError::Pool(bb8::RunError::TimedOut);
        assert_eq!(ApiError::from(no_connection()).code(), ErrorCode::Overloaded);
        let merged = StoreError::Merged(Arc::new(no_connection()));
        assert_eq!(ApiError::from(WriteFailure::internal(merged)).code(), ErrorCode::Overloaded);
        let response = ApiError::from(no_connection()).error_response();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers().get(header::RETRY_AFTER).and_then(|v| v.to_str().ok()), Some("1"));
        let broken = StoreError::Merged(Arc::new(StoreError::Invariant("x")));
        assert_eq!(ApiError::from(WriteFailure::internal(broken)).code(), ErrorCode::Internal);
    }

    #[actix_web::test]
    async fn a_transaction_cut_off_by_a_lost_connection_is_overloaded() {
        // Nothing listens on port 1: the error of a connection that went away, no SQLSTATE.
        let lost = tokio_postgres::connect("host=127.0.0.1 port=1 user=x connect_timeout=5", tokio_postgres::NoTls)
            .await
            .err()
            .expect("nothing listens on port 1");
        let cut = StoreError::Merged(Arc::new(StoreError::Db(lost)));
        let answer = ApiError::from(WriteFailure::internal(cut));
        assert_eq!(answer.code(), ErrorCode::Overloaded);
        assert!(answer.0.message.contains("same client_msg_id"));
    }

    /// Like the actors' failed-batch error: the store's error shared behind an `Arc`.
    #[derive(Debug, thiserror::Error)]
    #[error("the store failed the batch")]
    struct SharedCause(#[source] Arc<dyn Error + Send + Sync>);

    #[test]
    fn a_store_error_shared_behind_an_arc_is_found() {
        let merged = StoreError::Merged(Arc::new(StoreError::Pool(bb8::RunError::TimedOut)));
        let failure = WriteFailure::internal(SharedCause(Arc::new(merged)));
        assert_eq!(ApiError::from(failure).code(), ErrorCode::Overloaded);
    }
}
