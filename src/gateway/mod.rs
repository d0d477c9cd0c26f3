//! The edge: HTTP routes and (later) the WebSocket session. Errors of the
//! inner layers become PROTOCOL §2 codes here and nowhere else.

mod health;

use std::sync::Arc;

use actix_web::web;

use crate::config::Config;
use crate::delivery::Delivery;
use crate::store::Store;
use crate::writer::Writer;

/// Shared by every worker.
pub struct AppState {
    pub store: Store,
    pub writer: Writer,
    /// Owns the route registry (`delivery.routes()`).
    pub delivery: Arc<Delivery>,
    pub admin_token: String,
    pub config: Arc<Config>,
}

pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/healthz", web::get().to(health::healthz)).route("/readyz", web::get().to(health::readyz));
}
