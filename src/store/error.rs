//! The store's errors, and the one place database failures are classified by
//! SQLSTATE.
//!
//! A tokio-postgres error's text can carry row contents (a constraint's
//! `DETAIL` names the values, message bodies included), so neither its
//! `Display` nor its `Debug` is ever shown: [`StoreError`] shows the class and
//! the SQLSTATE, and [`Report`] walks a cause chain the same way.

use std::error::Error;
use std::fmt;
use std::sync::Arc;

use tokio_postgres::error::SqlState;

use crate::domain::Rejection;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A well-formed request refused by a rule; nothing changed.
    #[error(transparent)]
    Rejected(#[from] Rejection),
    #[error("database error ({}, SQLSTATE {})", classify(.0).as_str(), sqlstate(.0))]
    Db(#[from] tokio_postgres::Error),
    #[error("database connection pool ({})", pool_failure(.0))]
    Pool(#[from] bb8::RunError<tokio_postgres::Error>),
    #[error("invalid DATABASE_URL")]
    InvalidUrl(#[source] tokio_postgres::Error),
    /// Our own code broke a promise it relies on; a bug, not the database.
    #[error("broken invariant: {0}")]
    Invariant(&'static str),
    /// A stored value the schema's constraints make impossible (ARCHITECTURE
    /// §2, "Rows that do not decode"): the read fails, nothing is skipped.
    #[error("a stored {0} does not decode")]
    Undecodable(&'static str),
    /// The merged transaction this batch was part of failed; every batch of
    /// it gets the one cause.
    #[error("merged write transaction failed")]
    Merged(#[source] Arc<StoreError>),
}

/// What kind of failure, for logs and for deciding what a retry can expect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// Lost a wait or a race for a lock (lock or statement timeout,
    /// serialization failure, deadlock): a retry may well succeed.
    Busy,
    /// A constraint refused a write our checks should have kept from it.
    Conflict,
    /// The database could not be reached or went away (connection, pool,
    /// shutdown, terminated backend).
    Unavailable,
    /// A broken internal invariant.
    Invariant,
    /// Anything else the database reported.
    Other,
}

impl ErrorClass {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorClass::Busy => "busy",
            ErrorClass::Conflict => "conflict",
            ErrorClass::Unavailable => "unavailable",
            ErrorClass::Invariant => "invariant",
            ErrorClass::Other => "other",
        }
    }
}

impl StoreError {
    /// `None` for a rejection, which is an answer, not a failure.
    pub fn class(&self) -> Option<ErrorClass> {
        match self {
            StoreError::Rejected(_) => None,
            StoreError::Db(e) => Some(classify(e)),
            StoreError::Pool(_) => Some(ErrorClass::Unavailable),
            StoreError::InvalidUrl(_) => Some(ErrorClass::Other),
            StoreError::Invariant(_) | StoreError::Undecodable(_) => Some(ErrorClass::Invariant),
            StoreError::Merged(e) => e.class(),
        }
    }

    /// No connection could be had (the pool timed out, or no primary answered):
    /// nothing was sent, so nothing took effect.
    pub fn nothing_sent(&self) -> bool {
        match self {
            StoreError::Pool(_) => true,
            StoreError::Merged(e) => e.nothing_sent(),
            _ => false,
        }
    }

    /// The database was busy or went away, and the same request may well
    /// succeed later: no connection could be had, a lock or statement
    /// timeout, serialization failure or deadlock rolled the work back, or the
    /// connection was lost mid-transaction (a failover; its COMMIT may have
    /// landed, which a retry with the same key finds, P2).
    pub fn busy(&self) -> bool {
        self.nothing_sent() || matches!(self.class(), Some(ErrorClass::Busy | ErrorClass::Unavailable))
    }

    /// The SQLSTATE of the database error behind this one, if any.
    pub fn sqlstate(&self) -> Option<&str> {
        match self {
            StoreError::Db(e) => e.code().map(SqlState::code),
            StoreError::Pool(bb8::RunError::User(e)) => e.code().map(SqlState::code),
            StoreError::Merged(e) => e.sqlstate(),
            _ => None,
        }
    }
}

/// A stored `what` parsed by `parsed`: its error is [`StoreError::Undecodable`].
pub(super) fn decoded<T, E>(parsed: Result<T, E>, what: &'static str) -> Result<T, StoreError> {
    parsed.map_err(|_| StoreError::Undecodable(what))
}

/// Classifies a database error once, by SQLSTATE; no code means the
/// connection failed (closed, I/O).
fn classify(e: &tokio_postgres::Error) -> ErrorClass {
    let Some(code) = e.code() else { return ErrorClass::Unavailable };
    let code = code.code();
    match code {
        // lock_not_available (lock_timeout), query_canceled (statement_timeout),
        // serialization_failure, deadlock_detected.
        "55P03" | "57014" | "40001" | "40P01" => ErrorClass::Busy,
        // admin_shutdown (terminated backend), crash_shutdown, cannot_connect_now,
        // too_many_connections, idle_in_transaction_session_timeout.
        "57P01" | "57P02" | "57P03" | "53300" | "25P03" => ErrorClass::Unavailable,
        // Connection exceptions.
        _ if code.starts_with("08") => ErrorClass::Unavailable,
        // Integrity constraint violations (unique, foreign key, exclusion, check, not null).
        _ if code.starts_with("23") => ErrorClass::Conflict,
        _ => ErrorClass::Other,
    }
}

fn sqlstate(e: &tokio_postgres::Error) -> &str {
    e.code().map_or("none", SqlState::code)
}

fn pool_failure(e: &bb8::RunError<tokio_postgres::Error>) -> String {
    match e {
        bb8::RunError::TimedOut => "timed out waiting for a connection".into(),
        bb8::RunError::User(e) => format!("cannot connect: {}, SQLSTATE {}", classify(e).as_str(), sqlstate(e)),
    }
}

/// An error and its causes, one line, safe to log: a tokio-postgres error
/// in the chain shows as its class and SQLSTATE only.
pub struct Report<'a>(pub &'a (dyn Error + 'static));

impl fmt::Display for Report<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(db) = self.0.downcast_ref::<tokio_postgres::Error>() {
            return write!(f, "database error ({}, SQLSTATE {})", classify(db).as_str(), sqlstate(db));
        }
        write!(f, "{}", self.0)?;
        let mut next = self.0.source();
        while let Some(e) = next {
            // Every error of ours that wraps a database error names its class
            // and SQLSTATE already; the database's text stops the chain.
            if e.is::<tokio_postgres::Error>() {
                break;
            }
            write!(f, ": {e}")?;
            next = e.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] StoreError);

    #[test]
    fn a_report_names_every_cause_and_no_database_text() {
        let inner = StoreError::Merged(Arc::new(StoreError::Invariant("a batch without a result")));
        let report = Report(&Outer(inner)).to_string();
        assert_eq!(report, "outer: merged write transaction failed: broken invariant: a batch without a result");
    }
}
