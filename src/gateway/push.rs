//! The pusher ops of PROTOCOL v1.3: `set_pusher`, `remove_pusher` and
//! `set_notify`, parsed and checked at the edge (lengths, the URL's scheme,
//! the operator's allow-list of gateway URL prefixes) and run.

use imcore_actors::ConvId;
use serde_json::{json, Value};

use super::error::ApiError;
use super::fields::Fields;
use super::AppState;
use crate::domain::check_text;
use crate::protocol::ErrorCode;
use crate::store::{NewPusher, NotifyLevel, TokenOwner};

/// Longest `app_id`, `pushkey`, `url`, `lang` (characters), and `data` (bytes, as JSON).
pub const MAX_APP_ID_CHARS: usize = 64;
pub const MAX_PUSHKEY_CHARS: usize = 512;
pub const MAX_URL_CHARS: usize = 512;
pub const MAX_LANG_CHARS: usize = 16;
pub const MAX_DATA_BYTES: usize = 4096;

/// A pusher op, parsed.
#[derive(Debug, Clone)]
pub enum PushOp {
    Set(NewPusher),
    Remove { app_id: String, pushkey: String },
    Level { conv: ConvId, level: NotifyLevel },
}

impl PushOp {
    pub fn name(&self) -> &'static str {
        match self {
            PushOp::Set(_) => "set_pusher",
            PushOp::Remove { .. } => "remove_pusher",
            PushOp::Level { .. } => "set_notify",
        }
    }

    /// `op` with its fields, if it is one of these; malformed → `BAD_REQUEST`.
    pub fn parse(op: &str, f: &Fields<'_>) -> Result<Option<Self>, ApiError> {
        Ok(Some(match op {
            "set_pusher" => {
                let url = bounded(f, "url", MAX_URL_CHARS)?;
                if !http_url(&url) {
                    return Err(ApiError::bad_request("`url` must be an http or https URL with a host"));
                }
                let lang = f.opt_str("lang")?.map(|l| checked(l, "lang", MAX_LANG_CHARS)).transpose()?;
                let data = match f.get("data") {
                    None | Some(Value::Null) => None,
                    Some(d @ Value::Object(_)) if d.to_string().len() <= MAX_DATA_BYTES => Some(d.clone()),
                    Some(Value::Object(_)) => {
                        return Err(ApiError::bad_request(format!("`data` is at most {MAX_DATA_BYTES} bytes")))
                    }
                    Some(_) => return Err(ApiError::bad_request("`data` must be an object")),
                };
                PushOp::Set(NewPusher {
                    app_id: bounded(f, "app_id", MAX_APP_ID_CHARS)?,
                    pushkey: bounded(f, "pushkey", MAX_PUSHKEY_CHARS)?,
                    url,
                    lang,
                    data,
                })
            }
            "remove_pusher" => PushOp::Remove {
                app_id: bounded(f, "app_id", MAX_APP_ID_CHARS)?,
                pushkey: bounded(f, "pushkey", MAX_PUSHKEY_CHARS)?,
            },
            "set_notify" => PushOp::Level {
                conv: f.conv_id()?,
                level: NotifyLevel::parse(f.str("level")?)
                    .ok_or_else(|| ApiError::bad_request("`level` is `all`, `mentions` or `none`"))?,
            },
            _ => return Ok(None),
        }))
    }
}

/// Runs `op` for `caller`.
pub async fn run(state: &AppState, caller: &TokenOwner, op: PushOp) -> Result<Value, ApiError> {
    let user = &caller.user_id;
    match op {
        PushOp::Set(pusher) => {
            if !state.config.notify.url_allowed(&pusher.url) {
                return Err(ApiError::new(ErrorCode::Forbidden, "this server does not send to that gateway URL"));
            }
            let max = state.config.notify.max_pushers_per_device;
            state.store.set_pusher(user, &caller.device_id, &pusher, max).await?;
            Ok(json!({}))
        }
        PushOp::Remove { app_id, pushkey } => {
            Ok(json!({ "removed": state.store.remove_pusher(user, &app_id, &pushkey).await? }))
        }
        PushOp::Level { conv, level } => {
            state.store.set_notify_level(user, &conv, level).await?;
            Ok(json!({ "level": level.as_str() }))
        }
    }
}

fn bounded(f: &Fields<'_>, name: &'static str, max: usize) -> Result<String, ApiError> {
    checked(f.str(name)?, name, max)
}

/// 1..=`max` characters of printable text.
fn checked(s: &str, name: &'static str, max: usize) -> Result<String, ApiError> {
    if s.is_empty() {
        return Err(ApiError::bad_request(format!("`{name}` may not be empty")));
    }
    check_text(name, s, max).map_err(|e| ApiError::bad_request(e.to_string()))?;
    Ok(s.to_owned())
}

/// `http://host…` or `https://host…`, no user info, no whitespace.
fn http_url(url: &str) -> bool {
    let Ok(uri) = url.parse::<actix_web::http::Uri>() else { return false };
    let scheme_ok = matches!(uri.scheme_str(), Some("http" | "https"));
    let host_ok = uri.authority().is_some_and(|a| !a.host().is_empty() && !a.as_str().contains('@'));
    scheme_ok && host_ok
}

#[cfg(test)]
mod tests {
    use serde_json::Map;

    use super::*;

    fn parse(op: &str, v: Value) -> Result<Option<PushOp>, ApiError> {
        let Value::Object(m) = v else { panic!("object") };
        let m: Map<String, Value> = m;
        PushOp::parse(op, &Fields(&m))
    }

    #[test]
    fn a_pusher_is_checked_at_the_edge() {
        let ok = json!({"app_id": "a", "pushkey": "k", "url": "https://gw.example/_matrix/push/v1/notify"});
        assert!(matches!(parse("set_pusher", ok.clone()), Ok(Some(PushOp::Set(_)))));
        for bad in [
            json!({"app_id": "a", "pushkey": "k", "url": "ftp://gw/x"}),
            json!({"app_id": "a", "pushkey": "k", "url": "http:///nohost"}),
            json!({"app_id": "a", "pushkey": "k", "url": "http://u:p@gw/x"}),
            json!({"app_id": "a", "pushkey": "k", "url": format!("http://gw/{}", "x".repeat(MAX_URL_CHARS))}),
            json!({"app_id": "", "pushkey": "k", "url": "http://gw/x"}),
            json!({"app_id": "a", "pushkey": "k".repeat(MAX_PUSHKEY_CHARS + 1), "url": "http://gw/x"}),
            json!({"app_id": "a", "pushkey": "k", "url": "http://gw/x", "data": [1]}),
            json!({"app_id": "a", "pushkey": "k", "url": "http://gw/x", "data": {"x": "y".repeat(MAX_DATA_BYTES)}}),
            json!({"pushkey": "k", "url": "http://gw/x"}),
        ] {
            assert!(parse("set_pusher", bad.clone()).is_err(), "{bad}");
        }
        assert!(parse("set_notify", json!({"conv_id": "c", "level": "loud"})).is_err());
        assert!(matches!(parse("send", json!({})), Ok(None)));
    }
}
