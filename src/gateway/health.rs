use actix_web::{web, HttpResponse};
use serde_json::json;

use super::AppState;

/// The process is alive.
pub async fn healthz() -> HttpResponse {
    HttpResponse::Ok().json(json!({"status": "ok"}))
}

/// The database is reachable and the schema is at this build's version.
pub async fn readyz(state: web::Data<AppState>) -> HttpResponse {
    if state.store.ready().await {
        HttpResponse::Ok().json(json!({"status": "ready"}))
    } else {
        HttpResponse::ServiceUnavailable().json(json!({"status": "unavailable"}))
    }
}
