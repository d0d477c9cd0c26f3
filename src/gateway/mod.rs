//! The edge: HTTP routes, the WebSocket session, admin endpoints, metrics.
//! Errors of the inner layers become PROTOCOL §2 codes here and nowhere else
//! (`error.rs`); both transports run the same op dispatch (`ops.rs`).
//!
//! # Layout
//! * `auth` — device and admin bearer tokens, refusals remembered briefly;
//!   `admin_guard` — the budget of failed admin authentications per address.
//! * `caps` — connections per IP address and WebSocket devices per user.
//! * `create_rate` — the per-user limit on conversations created per minute;
//!   `typing_rate` — the `typing` throttle per device and conversation.
//! * `gate` — write ops of strangers to a conversation refused before its writer.
//! * `request` — a device request parsed and checked at the edge.
//! * `ops` — the one dispatch of parsed requests (WebSocket and HTTP);
//!   `push` — the pusher ops (PROTOCOL v1.3).
//! * `http` — HTTP routes of the ops; `admin` — admin routes.
//! * `upgrade` — the WebSocket handshake, taken over from actix-http's HTTP/1
//!   dispatcher; `socket` — the upgraded connection's socket, driven by its own loop;
//!   `session` — the WebSocket actor (the only user of `actix-web-actors`);
//!   `outbound` — its bytes not yet written, capped and charged to the budget;
//!   `frame_limit` — frame sizes checked as their headers arrive.
//! * `health` — `/healthz`, `/readyz`; `/metrics` is here.
//! * `client` — the web client at `/`, embedded in the binary.
//!
//! # Pushes
//! A push is a text frame without `id`, named by its `"push"` key:
//! `{"push": "event", "conv_id", "event"}`, `{"push": "events", "conv_id", "events"}`,
//! `{"push": "head", "conv_id", "head"}`, `{"push": "read", "conv_id", "read_seq"}` (own devices;
//! another member's with `user_id`),
//! `{"push": "typing", "conv_id", "user_id", "on"}`, `{"push": "presence", "user_id", "online",
//! "last_seen"}`, `{"push": "kicked", "reason"}`.

mod admin;
mod admin_guard;
mod auth;
pub mod caps;
mod client;
mod create_rate;
mod error;
mod fields;
mod frame_limit;
mod gate;
mod group;
mod health;
mod http;
pub mod ops;
mod outbound;
mod push;
mod request;
mod session;
mod socket;
mod typing_rate;
mod upgrade;

use std::any::Any;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix_http::{HttpService, Request};
use actix_service::{fn_service, map_config, IntoServiceFactory, ServiceFactory, ServiceFactoryExt};
use actix_web::dev::AppConfig;
use actix_web::http::Method;
use actix_web::middleware::from_fn;
use actix_web::rt::net::TcpStream;
use actix_web::{web, App, HttpRequest, HttpResponse};
use dashmap::DashMap;
use futures_util::future::Either;
use imcore_actors::registry::ConnId;
use imcore_actors::{ConvId, UserId};

pub use error::ApiError;

use crate::budget::MemoryBudget;
use crate::cluster::{write_at_home, Bus};
use crate::config::Config;
use crate::delivery::{Conn, Delivery};
use crate::metrics::metrics;
use crate::online::Online;
use crate::store::{Store, WriteOp, Written};
use crate::writer::{WriteFailure, Writer};

/// Shared by every worker.
pub struct AppState {
    pub store: Store,
    /// This node's writer; writes go through [`AppState::write`].
    pub writer: Writer,
    /// The cluster bus, when this node is one of several.
    pub bus: Option<Arc<Bus>>,
    /// Owns the route registry (`delivery.routes()`).
    pub delivery: Arc<Delivery>,
    pub admin_token: String,
    pub config: Arc<Config>,
    /// Every open WebSocket session, routed or not: what graceful shutdown
    /// tells to leave. Inserted when a session starts, removed when it stops.
    pub sessions: DashMap<ConnId, Conn>,
    /// Bytes of bodies queued on the writer and of pushes queued for
    /// connections, all clients together (`limits.memory_budget_bytes`).
    pub budget: Arc<MemoryBudget>,
    /// Who is online, and the announcements of changes (PROTOCOL v1.2).
    pub online: Arc<Online>,
    /// TCP connections per peer address, counted from accept (`on_connect`).
    pub per_ip: Arc<caps::PerIp>,
    /// Devices in WebSocket session per user.
    pub per_user: Arc<caps::PerUser>,
    create_rate: create_rate::CreateRate,
    gate: Arc<gate::Gate>,
    typing_rate: typing_rate::TypingRate,
    refused_tokens: auth::RefusedTokens,
    admin_guard: admin_guard::AdminGuard,
    /// Set once graceful shutdown began: upgrades are refused, sessions leave.
    shutting_down: AtomicBool,
}

impl AppState {
    pub fn new(
        store: Store,
        writer: Writer,
        bus: Option<Arc<Bus>>,
        delivery: Arc<Delivery>,
        admin_token: String,
        config: Arc<Config>,
    ) -> Self {
        Self {
            online: Online::new(store.clone(), delivery.clone(), config.live.presence_grace()),
            store,
            writer,
            bus,
            delivery,
            admin_token,
            sessions: DashMap::new(),
            budget: MemoryBudget::new(config.limits.memory_budget_bytes),
            per_ip: caps::PerIp::new(config.limits.max_connections_per_ip),
            per_user: caps::PerUser::new(config.limits.max_connections_per_user),
            create_rate: create_rate::CreateRate::new(config.limits.create_per_minute),
            gate: Arc::new(gate::Gate::new(config.limits.gate_pairs)),
            typing_rate: typing_rate::TypingRate::new(config.live.typing_interval()),
            refused_tokens: auth::RefusedTokens::default(),
            admin_guard: admin_guard::AdminGuard::default(),
            config,
            shutting_down: AtomicBool::new(false),
        }
    }

    /// Writes `op` at `conv`'s home node: here, or forwarded to it
    /// (ARCHITECTURE §7), once the stranger gate let it through (`gate`).
    /// Queued before returning when the gate knows the caller (P6); else
    /// behind the caller's other ops to `conv` waiting for the same check.
    pub fn write(&self, conv: ConvId, op: WriteOp) -> impl Future<Output = Result<Written, WriteFailure>> + 'static {
        let Some(user) = op.caller().cloned() else {
            // The operator's (a ban, from the admin endpoint): nobody to turn away.
            return Either::Left(write_at_home(self.bus.as_deref(), &self.writer, self.store.heads(), conv, op));
        };
        let answer = match self.gate.enter(&conv, &user, op) {
            gate::Entry::Go(op) => {
                return Either::Left(write_at_home(self.bus.as_deref(), &self.writer, self.store.heads(), conv, op))
            }
            gate::Entry::Wait { check, answer } => {
                if check {
                    self.check_access(conv, user);
                }
                answer
            }
        };
        Either::Right(async move {
            answer.await.unwrap_or_else(|_| Err(WriteFailure::internal("a write waiting at the gate was dropped")))
        })
    }

    /// Runs the gate's check of `user` to `conv` in a task of its own.
    fn check_access(&self, conv: ConvId, user: UserId) {
        let (gate, store, bus, writer) = (self.gate.clone(), self.store.clone(), self.bus.clone(), self.writer.clone());
        let heads = store.heads().clone();
        actix_web::rt::spawn(async move {
            let access = |join| {
                let (store, conv, user) = (store.clone(), conv.clone(), user.clone());
                async move { Ok(store.access(&conv, &user, join).await?) }
            };
            let write = |conv, op, tx: tokio::sync::oneshot::Sender<_>| {
                let written = write_at_home(bus.as_deref(), &writer, &heads, conv, op);
                actix_web::rt::spawn(async move {
                    let _ = tx.send(written.await);
                });
            };
            gate.settle(&conv, &user, access, write).await;
        });
    }

    pub fn shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    /// Graceful shutdown, step one: refuse new sessions and tell every open
    /// one to leave (`kicked: shutdown` once its in-flight requests are answered).
    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
        let sessions: Vec<Conn> = self.sessions.iter().map(|e| e.value().clone()).collect();
        for s in sessions {
            s.kick(crate::delivery::KickReason::Shutdown);
        }
    }
}

/// `GET /metrics`: Prometheus text; gauges sampled now.
async fn metrics_text(state: web::Data<AppState>, req: HttpRequest) -> Result<HttpResponse, ApiError> {
    auth::metrics(&state, &req)?;
    let m = metrics();
    m.connections.with_label_values(&["routed"]).set(state.delivery.routes().connection_count() as i64);
    m.connections.with_label_values(&["sessions"]).set(state.sessions.len() as i64);
    if let Writer::Actor(hub) = &state.writer {
        m.live_actors.set(hub.live_actors() as i64);
        m.actors.with_label_values(&["idle"]).set(hub.idle_actors() as i64);
        m.actors.with_label_values(&["started_total"]).set(hub.actors_started() as i64);
        m.actors.with_label_values(&["evicted_total"]).set(hub.evictions() as i64);
    }
    m.memory_budget.with_label_values(&["in_use"]).set(i64::try_from(state.budget.in_use()).unwrap_or(i64::MAX));
    m.memory_budget.with_label_values(&["limit"]).set(i64::try_from(state.budget.limit()).unwrap_or(i64::MAX));
    crate::metrics::sample_pool(state.store.pool().state());
    crate::metrics::sample_tail(&state.store.tail().sample());
    Ok(HttpResponse::Ok().content_type("text/plain; version=0.0.4").body(m.render()))
}

/// Every route; a wrong method answers 405 and an unknown path 404, both in
/// the PROTOCOL §2 error shape (`http::resource`, `http::not_found`).
pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.service(http::resource("/healthz", vec![(Method::GET, web::to(health::healthz))]))
        .service(http::resource("/readyz", vec![(Method::GET, web::to(health::readyz))]))
        .service(http::resource("/metrics", vec![(Method::GET, web::to(metrics_text))]))
        .service(http::resource("/v1/ws", vec![(Method::GET, web::to(upgrade::not_upgraded))]))
        .configure(http::routes)
        .configure(admin::routes)
        .configure(client::routes)
        .default_service(web::to(http::not_found));
}

/// One worker's HTTP service on `addr`: the routes, and WebSocket upgrades
/// taken over at the handshake (`upgrade`). actix-web's `HttpServer` builds
/// the same service but has no way to take an upgraded socket.
pub fn service(
    state: web::Data<AppState>,
    addr: SocketAddr,
) -> impl ServiceFactory<TcpStream, Config = (), Response = (), Error = actix_http::error::DispatchError, InitError = ()>
{
    let app = App::new()
        .wrap(from_fn(caps::refused_connection))
        .app_data(state.clone())
        .configure(routes)
        .into_factory()
        .map_err(|e| e.error_response());
    let per_ip = state.per_ip.clone();
    let upgrade = fn_service(move |(req, framed): (Request, _)| {
        let state = state.clone();
        // Boxed: every connection's task is as large as its largest state.
        Box::pin(async move {
            upgrade::serve(state, req, framed).await;
            Ok::<_, actix_web::Error>(())
        }) as futures_util::future::LocalBoxFuture<'static, _>
    });
    HttpService::build()
        // actix-web's default (the builder's is none).
        .client_disconnect_timeout(Duration::from_secs(1))
        // Small frames (acks, pushes) must not wait out Nagle against the peer's delayed ACK.
        .tcp_nodelay(true)
        .local_addr(addr)
        .on_connect_ext(move |io: &TcpStream, ext| per_ip.on_connect(io as &dyn Any, ext))
        .upgrade(upgrade)
        // The app's configured host and address are read by no route here.
        .finish(map_config(app, |_| AppConfig::default()))
        .tcp()
}
