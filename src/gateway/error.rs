//! The one place inner errors become PROTOCOL §2 codes, for both transports:
//! `{"error": {code, message}}` over HTTP, `{"id", "ok": false, "error"}` over
//! WebSocket. Clients get the code and a clean message; logs get the cause.

use std::error::Error;

use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};
use imcore_actors::InvalidId;
use serde_json::json;

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
                Self::internal()
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
                Self::internal()
            }
        }
    }
}

/// The one log line of a failed request. Written inside the dispatch span, so
/// it names the op, conversation, user and device; it gives the class and
/// SQLSTATE of the store error behind it and the cause chain, never the
/// database's own text (which may carry row contents).
fn log_failure(e: &(dyn Error + 'static)) {
    let store = std::iter::successors(Some(e), |&e| e.source()).find_map(|e| e.downcast_ref::<StoreError>());
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
}
