//! Field access for requests of either transport (PROTOCOL §1): a field map
//! read with the protocol's checks, so every parser refuses malformed input
//! the same way (`BAD_REQUEST`).

use imcore_actors::{ConvId, UserId};
use serde_json::{Map, Value};

use super::error::ApiError;
use crate::domain::parse_time;

/// Field access with PROTOCOL §1 checks. Integers and booleans may come as
/// JSON values (WebSocket, HTTP bodies) or strings (HTTP query parameters).
pub struct Fields<'a>(pub &'a Map<String, Value>);

impl<'a> Fields<'a> {
    pub fn get(&self, name: &str) -> Option<&'a Value> {
        self.0.get(name)
    }

    /// Present, even as `null`.
    pub fn has(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }

    pub fn user_id(&self, name: &str) -> Result<UserId, ApiError> {
        Ok(UserId::parse(self.str(name)?)?)
    }

    /// A PROTOCOL §1 time, or nothing for an absent or null field.
    pub fn opt_time(&self, name: &str) -> Result<Option<chrono::DateTime<chrono::Utc>>, ApiError> {
        self.opt_str(name)?
            .map(|s| parse_time(s).ok_or_else(|| ApiError::bad_request(format!("`{name}` must be an RFC 3339 time"))))
            .transpose()
    }

    pub fn opt_bool(&self, name: &str) -> Result<Option<bool>, ApiError> {
        match self.0.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(Value::String(s)) if s == "true" || s == "false" => Ok(Some(s == "true")),
            Some(_) => Err(ApiError::bad_request(format!("`{name}` must be true or false"))),
        }
    }

    pub fn opt_str(&self, name: &str) -> Result<Option<&'a str>, ApiError> {
        match self.0.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(ApiError::bad_request(format!("`{name}` must be a string"))),
        }
    }

    pub fn str(&self, name: &str) -> Result<&'a str, ApiError> {
        self.opt_str(name)?.ok_or_else(|| ApiError::bad_request(format!("missing field `{name}`")))
    }

    pub fn conv_id(&self) -> Result<ConvId, ApiError> {
        Ok(ConvId::parse(self.str("conv_id")?)?)
    }

    pub fn int_in(&self, name: &str, min: i64, max: i64) -> Result<Option<i64>, ApiError> {
        let n = match self.0.get(name) {
            None | Some(Value::Null) => return Ok(None),
            Some(Value::Number(n)) => n.as_i64(),
            Some(Value::String(s)) => s.parse::<i64>().ok(),
            Some(_) => None,
        };
        match n {
            Some(n) if (min..=max).contains(&n) => Ok(Some(n)),
            _ => Err(ApiError::bad_request(format!("`{name}` must be an integer in {min}..={max}"))),
        }
    }
}
