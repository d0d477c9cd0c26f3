//! Admin endpoints (PROTOCOL §3, §6, "Banned groups"), authenticated with the admin token.

use actix_web::http::Method;
use actix_web::{web, HttpRequest, HttpResponse};
use imcore_actors::{ConvId, DeviceId, UserId};
use serde_json::{json, Map, Value};

use super::error::ApiError;
use super::group::written_json;
use super::http::{fields, resource};
use super::{auth, AppState};
use crate::domain::{check_text, Rejection, MAX_DISPLAY_NAME_CHARS};
use crate::store::{BanOp, Pace, WriteOp};
use crate::writer::WriteFailure;

fn string_field<'a>(fields: &'a Map<String, Value>, name: &str) -> Result<&'a str, ApiError> {
    fields.get(name).and_then(Value::as_str).ok_or_else(|| ApiError::bad_request(format!("missing field `{name}`")))
}

/// An admin write's preamble: the admin token checked, then the request's
/// fields and the `user_id` among them.
async fn admin_user_fields(
    state: &AppState,
    req: &HttpRequest,
    payload: web::Payload,
) -> Result<(UserId, Map<String, Value>), ApiError> {
    auth::admin(state, req)?;
    let fields = fields(req, payload).await?;
    Ok((UserId::parse(string_field(&fields, "user_id")?)?, fields))
}

/// `{"user_id", "display_name"?}` → 201 `{"user_id"}`; 409 `ALREADY_EXISTS`;
/// a `user_id` with a capital letter → `BAD_REQUEST`.
async fn create_user(
    state: web::Data<AppState>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let (user, fields) = admin_user_fields(&state, &req, payload).await?;
    // PROTOCOL §1: `ANA` would be a second `ana` to every reader.
    if user.as_str().bytes().any(|b| b.is_ascii_uppercase()) {
        return Err(ApiError::bad_request("a new user_id may not contain capital letters (A-Z)"));
    }
    let display_name = match fields.get("display_name") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => {
            check_text("display_name", s, MAX_DISPLAY_NAME_CHARS).map_err(|e| ApiError::bad_request(e.to_string()))?;
            Some(s.as_str())
        }
        Some(_) => return Err(ApiError::bad_request("`display_name` must be a string")),
    };
    state.store.create_user(&user, display_name).await?;
    Ok(HttpResponse::Created().json(json!({ "user_id": user.as_str() })))
}

/// `{"device_id"}` → 201 `{"user_id","device_id","token"}`. Issuing again
/// rotates: the old token stops working and the device's live connection is
/// kicked with `token_revoked`, on whichever node it is. A connection that
/// authenticated with the old token just before the rotation re-checks its
/// token once registered (`session.rs`), so it cannot slip past this kick.
async fn issue_device(
    state: web::Data<AppState>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let (user, fields) = admin_user_fields(&state, &req, payload).await?;
    let device = DeviceId::parse(string_field(&fields, "device_id")?)?;
    let issued = state.store.issue_device_token(&user, &device).await?;
    state.delivery.revoke(&user, &device);
    Ok(HttpResponse::Created().json(json!({
        "user_id": issued.user_id.as_str(),
        "device_id": issued.device_id.as_str(),
        "token": issued.token,
    })))
}

/// Bumps the epoch (after a restore) → `{"conv_id","epoch"}`; 404 for an unknown conversation.
async fn bump_epoch(state: web::Data<AppState>, req: HttpRequest) -> Result<HttpResponse, ApiError> {
    auth::admin(&state, &req)?;
    let conv = ConvId::parse(req.match_info().get("conv_id").unwrap_or_default())?;
    let epoch = state.store.bump_epoch(&conv).await?;
    Ok(HttpResponse::Ok().json(json!({ "conv_id": conv.as_str(), "epoch": epoch })))
}

/// Bans (`banned`) or unbans a group through its writer, like any write, so
/// the status changes under the row lock every write checks it under →
/// `{"conv_id","status","changed","seq"}`; 404 for an unknown conversation,
/// 403 for a direct one, 410 for a dismissed group.
async fn set_banned(state: &AppState, req: &HttpRequest, banned: bool) -> Result<HttpResponse, ApiError> {
    auth::admin(state, req)?;
    let conv = ConvId::parse(req.match_info().get("conv_id").unwrap_or_default())?;
    let written = match state.write(conv.clone(), WriteOp::Ban(BanOp { banned })).await {
        // The writer answers a missing conversation as it does a stranger; the operator may know.
        Err(WriteFailure::Rejected(Rejection::NotMember)) => Err(Rejection::NotFound("conversation".into()).into()),
        other => other,
    }?;
    let mut reply = written_json(&written);
    reply["conv_id"] = json!(conv.as_str());
    reply["status"] = json!(if banned { "banned" } else { "active" });
    Ok(HttpResponse::Ok().json(reply))
}

async fn ban(state: web::Data<AppState>, req: HttpRequest) -> Result<HttpResponse, ApiError> {
    set_banned(&state, &req, true).await
}

async fn unban(state: web::Data<AppState>, req: HttpRequest) -> Result<HttpResponse, ApiError> {
    set_banned(&state, &req, false).await
}

/// Runs the retention purge now → `{"conversations","events_purged","tombstones_written"}`.
async fn run_retention(state: web::Data<AppState>, req: HttpRequest) -> Result<HttpResponse, ApiError> {
    auth::admin(&state, &req)?;
    let settings = &state.config.retention;
    let report = state.store.purge_expired(Pace::of(settings), settings.tombstone_horizon()).await?;
    Ok(HttpResponse::Ok().json(json!({
        "conversations": report.conversations,
        "events_purged": report.events_purged,
        "tombstones_written": report.tombstones_written,
        "tombstones_expired": report.tombstones_expired,
    })))
}

pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.service(resource("/v1/admin/users", vec![(Method::POST, web::to(create_user))]))
        .service(resource("/v1/admin/users/{user_id}/devices", vec![(Method::POST, web::to(issue_device))]))
        .service(resource("/v1/admin/conversations/{conv_id}/epoch", vec![(Method::POST, web::to(bump_epoch))]))
        .service(resource("/v1/admin/conversations/{conv_id}/ban", vec![(Method::POST, web::to(ban))]))
        .service(resource("/v1/admin/conversations/{conv_id}/unban", vec![(Method::POST, web::to(unban))]))
        .service(resource("/v1/admin/retention/run", vec![(Method::POST, web::to(run_retention))]));
}
