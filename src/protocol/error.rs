//! PROTOCOL §2: one error shape everywhere, one mapping from inner errors.

use serde::Serialize;

use crate::domain::Rejection;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ErrorCode {
    BadRequest,
    Unauthorized,
    Forbidden,
    NotMember,
    Muted,
    Blocked,
    ConvDismissed,
    ConvBanned,
    AlreadyMember,
    AlreadyExists,
    GroupFull,
    IdempotencyMismatch,
    IdempotencyKeyExpired,
    RecallWindowExpired,
    EditWindowExpired,
    TooManyReactions,
    EpochChanged,
    NotFound,
    PayloadTooLarge,
    RequestTimeout,
    TooManyConnections,
    Overloaded,
    Internal,
}

impl ErrorCode {
    pub fn http_status(self) -> u16 {
        match self {
            ErrorCode::BadRequest => 400,
            ErrorCode::Unauthorized => 401,
            ErrorCode::Forbidden
            | ErrorCode::NotMember
            | ErrorCode::Muted
            | ErrorCode::Blocked
            | ErrorCode::ConvBanned => 403,
            ErrorCode::NotFound => 404,
            ErrorCode::ConvDismissed => 410,
            ErrorCode::AlreadyMember
            | ErrorCode::AlreadyExists
            | ErrorCode::GroupFull
            | ErrorCode::IdempotencyMismatch
            | ErrorCode::IdempotencyKeyExpired
            | ErrorCode::RecallWindowExpired
            | ErrorCode::EditWindowExpired
            | ErrorCode::TooManyReactions
            | ErrorCode::EpochChanged => 409,
            ErrorCode::PayloadTooLarge => 413,
            ErrorCode::RequestTimeout => 408,
            ErrorCode::TooManyConnections => 429,
            ErrorCode::Internal => 500,
            ErrorCode::Overloaded => 503,
        }
    }
}

/// `{"code", "message"}`, plus `epoch` and `min_seq` for `EPOCH_CHANGED`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WireError {
    pub code: ErrorCode,
    pub message: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub epoch: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_seq: Option<i64>,
}

impl WireError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self { code, message: message.into(), epoch: None, min_seq: None }
    }
}

impl From<&Rejection> for WireError {
    fn from(r: &Rejection) -> Self {
        let code = match r {
            Rejection::BadRequest(_) => ErrorCode::BadRequest,
            Rejection::NotMember => ErrorCode::NotMember,
            Rejection::Forbidden(_) => ErrorCode::Forbidden,
            Rejection::Muted => ErrorCode::Muted,
            Rejection::ConvDismissed => ErrorCode::ConvDismissed,
            Rejection::ConvBanned => ErrorCode::ConvBanned,
            Rejection::AlreadyMember => ErrorCode::AlreadyMember,
            Rejection::GroupFull => ErrorCode::GroupFull,
            Rejection::IdempotencyMismatch => ErrorCode::IdempotencyMismatch,
            Rejection::IdempotencyKeyExpired => ErrorCode::IdempotencyKeyExpired,
            Rejection::RecallWindowExpired => ErrorCode::RecallWindowExpired,
            Rejection::EditWindowExpired => ErrorCode::EditWindowExpired,
            Rejection::TooManyReactions(_) => ErrorCode::TooManyReactions,
            Rejection::EpochChanged { .. } => ErrorCode::EpochChanged,
            Rejection::NotFound(_) => ErrorCode::NotFound,
            Rejection::AlreadyExists(_) => ErrorCode::AlreadyExists,
            Rejection::Blocked => ErrorCode::Blocked,
        };
        let mut e = WireError::new(code, r.to_string());
        if let Rejection::EpochChanged { epoch, min_seq } = r {
            e.epoch = Some(*epoch);
            e.min_seq = Some(*min_seq);
        }
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_errors_keep_the_protocol_shape() {
        let e = WireError::from(&Rejection::EpochChanged { epoch: 3, min_seq: 40 });
        assert_eq!(
            serde_json::to_value(&e).expect("json"),
            serde_json::json!({"code": "EPOCH_CHANGED", "message": "the conversation's epoch is now 3", "epoch": 3, "min_seq": 40})
        );
        let e = WireError::from(&Rejection::NotMember);
        assert_eq!(serde_json::to_value(&e).expect("json")["code"], "NOT_MEMBER");
        assert_eq!(ErrorCode::IdempotencyKeyExpired.http_status(), 409);
        assert_eq!(serde_json::to_value(ErrorCode::IdempotencyKeyExpired).expect("json"), "IDEMPOTENCY_KEY_EXPIRED");
        assert_eq!(serde_json::to_value(WireError::from(&Rejection::Blocked)).expect("json")["code"], "BLOCKED");
        assert_eq!(ErrorCode::Blocked.http_status(), 403);
        assert_eq!(serde_json::to_value(WireError::from(&Rejection::ConvBanned)).expect("json")["code"], "CONV_BANNED");
        assert_eq!(ErrorCode::ConvBanned.http_status(), 403);
    }
}
