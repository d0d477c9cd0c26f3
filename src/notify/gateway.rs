//! The push gateway client: one notification as the Matrix Push Gateway API
//! v1 `notify` body, POSTed with at most `per_url` requests in flight per
//! URL and a timeout, so a slow or dead gateway only delays its own pushers.
//! The answer is classified once: delivered (and which pushkeys the gateway
//! `rejected`), worth a retry (5xx, 429, timeout, no connection), or failed.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::sync::Semaphore;

use super::due::Notice;
use super::queue::{Outcome, Target};

/// Largest gateway answer read (it is a list of rejected pushkeys).
const MAX_ANSWER_BYTES: usize = 64 * 1024;

/// The gateway's `notification` body for `conv`'s `notice` to `target`, the
/// user having `unread` messages (PROTOCOL v1.3 "What the gateway receives").
pub fn body(conv: &str, notice: &Notice, target: &Target, unread: i64) -> Value {
    let mut device = json!({
        "app_id": target.app_id,
        "pushkey": target.pushkey,
        "pushkey_ts": target.pushkey_ts,
        "tweaks": {},
    });
    if let Some(data) = &target.data {
        device["data"] = data.clone();
    }
    let mut n = json!({
        "event_id": notice.event_id,
        "room_id": conv,
        "type": notice.kind,
        "sender": notice.sender.as_str(),
        "prio": if notice.high { "high" } else { "low" },
        "counts": {"unread": unread},
        "devices": [device],
    });
    if let Some(name) = &notice.sender_name {
        n["sender_display_name"] = json!(name);
    }
    if let Some(name) = &notice.room_name {
        n["room_name"] = json!(name);
    }
    json!({ "notification": n })
}

/// The HTTP client and the per-URL limits; lives on the notifier's thread.
pub struct Gateways {
    client: awc::Client,
    per_url: usize,
    timeout: Duration,
    limits: RefCell<HashMap<String, Rc<Semaphore>>>,
}

/// How a POST ended, and whether the gateway rejected the target's pushkey.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Answer {
    pub outcome: Outcome,
    pub rejected: bool,
}

impl Gateways {
    pub fn new(per_url: usize, timeout: Duration) -> Rc<Self> {
        let connector = match tls_config() {
            Ok(tls) => awc::Connector::new().rustls_0_23(tls),
            Err(e) => {
                tracing::error!(error = %e, "notifier: no TLS; https gateways unreachable");
                awc::Connector::new()
            }
        };
        let client = awc::Client::builder().connector(connector).timeout(timeout).disable_redirects().finish();
        Rc::new(Self { client, per_url: per_url.max(1), timeout, limits: RefCell::new(HashMap::new()) })
    }

    /// POSTs `body` to `target.url` once its URL has a free slot.
    pub async fn post(&self, target: &Target, body: &Value) -> Answer {
        let limit = self
            .limits
            .borrow_mut()
            .entry(target.url.clone())
            .or_insert_with(|| Rc::new(Semaphore::new(self.per_url)))
            .clone();
        let answer = match limit.acquire().await {
            Ok(_permit) => tokio::time::timeout(self.timeout, self.exchange(target, body)).await.unwrap_or(RETRY),
            Err(_) => RETRY,
        };
        // The map keeps only URLs with requests in flight or waiting.
        if Rc::strong_count(&limit) == 2 && limit.available_permits() == self.per_url {
            self.limits.borrow_mut().remove(&target.url);
        }
        answer
    }

    async fn exchange(&self, target: &Target, body: &Value) -> Answer {
        let mut response = match self.client.post(&target.url).send_json(body).await {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!(error = %e, url = %target.url, "push gateway unreachable");
                return RETRY;
            }
        };
        let status = response.status();
        if status.is_server_error() || status.as_u16() == 429 {
            return RETRY;
        }
        if !status.is_success() {
            tracing::warn!(%status, url = %target.url, "push gateway refused a notification");
            return Answer { outcome: Outcome::Failed, rejected: false };
        }
        let rejected = match response.json::<Value>().limit(MAX_ANSWER_BYTES).await {
            Ok(v) => v["rejected"].as_array().is_some_and(|r| r.iter().any(|k| k.as_str() == Some(&target.pushkey))),
            // A 2xx whose body is not the expected JSON still delivered.
            Err(_) => false,
        };
        match rejected {
            true => Answer { outcome: Outcome::Failed, rejected: true },
            false => Answer { outcome: Outcome::Delivered, rejected: false },
        }
    }
}

/// TLS for `https` gateways: rustls on ring, trusting the system's root
/// certificates. Unreadable ones are skipped (logged): with none, every
/// `https` request fails verification and is retried, then given up.
fn tls_config() -> Result<Arc<rustls::ClientConfig>, rustls::Error> {
    let found = rustls_native_certs::load_native_certs();
    for e in &found.errors {
        tracing::warn!(error = %e, "notifier: a system root certificate not loaded");
    }
    let mut roots = rustls::RootCertStore::empty();
    let (added, ignored) = roots.add_parsable_certificates(found.certs);
    if ignored > 0 || added == 0 {
        tracing::warn!(added, ignored, "notifier: system root certificates for https gateways");
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider).with_safe_default_protocol_versions()?;
    Ok(Arc::new(builder.with_root_certificates(roots).with_no_client_auth()))
}

const RETRY: Answer = Answer { outcome: Outcome::Retry, rejected: false };
