//! A push gateway for the tests: a real HTTP server on port 0 that records
//! every `notify` body it receives, answers 500 to the next `fail` requests,
//! and rejects the pushkeys it is told to.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix_web::{web, App, HttpResponse, HttpServer};
use serde_json::{json, Value};

#[derive(Default)]
pub struct Seen {
    /// Every body, answered 200 or not, with the status it got.
    pub all: Vec<(u16, Value)>,
    pub fail: usize,
    pub reject: HashSet<String>,
}

#[derive(Clone)]
pub struct Gateway {
    pub url: String,
    pub seen: Arc<Mutex<Seen>>,
}

impl Gateway {
    /// Starts one on the current actix runtime; `delay` before each answer.
    pub fn start(delay: Duration) -> Self {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let state = web::Data::new((seen.clone(), delay));
        let server =
            HttpServer::new(move || App::new().app_data(state.clone()).route("/notify", web::post().to(notify)))
                .workers(1)
                .disable_signals()
                .bind(("127.0.0.1", 0))
                .expect("bind the test gateway");
        let port = server.addrs()[0].port();
        actix_web::rt::spawn(server.run());
        Self { url: format!("http://127.0.0.1:{port}/notify"), seen }
    }

    pub fn fail_next(&self, n: usize) {
        self.seen.lock().expect("gateway").fail = n;
    }

    pub fn reject(&self, pushkey: &str) {
        self.seen.lock().expect("gateway").reject.insert(pushkey.to_owned());
    }

    /// The notifications answered 200, for `pushkey`.
    pub fn delivered(&self, pushkey: &str) -> Vec<Value> {
        let seen = self.seen.lock().expect("gateway");
        seen.all
            .iter()
            .filter(|(status, v)| *status == 200 && v["notification"]["devices"][0]["pushkey"] == pushkey)
            .map(|(_, v)| v["notification"].clone())
            .collect()
    }

    /// Every request for `pushkey`, with its status.
    pub fn attempts(&self, pushkey: &str) -> Vec<(u16, Value)> {
        let seen = self.seen.lock().expect("gateway");
        seen.all.iter().filter(|(_, v)| v["notification"]["devices"][0]["pushkey"] == pushkey).cloned().collect()
    }

    /// Waits up to `within` until `pushkey` got `n` notifications delivered.
    pub async fn wait_delivered(&self, pushkey: &str, n: usize, within: Duration) -> Vec<Value> {
        let until = tokio::time::Instant::now() + within;
        loop {
            let got = self.delivered(pushkey);
            if got.len() >= n || tokio::time::Instant::now() > until {
                return got;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

async fn notify(state: web::Data<(Arc<Mutex<Seen>>, Duration)>, body: web::Json<Value>) -> HttpResponse {
    let (seen, delay) = &**state;
    if !delay.is_zero() {
        tokio::time::sleep(*delay).await;
    }
    let mut seen = seen.lock().expect("gateway");
    let pushkey = body["notification"]["devices"][0]["pushkey"].as_str().unwrap_or_default().to_owned();
    if seen.fail > 0 {
        seen.fail -= 1;
        seen.all.push((500, body.into_inner()));
        return HttpResponse::InternalServerError().finish();
    }
    seen.all.push((200, body.into_inner()));
    let rejected: Vec<&str> = if seen.reject.contains(&pushkey) { vec![pushkey.as_str()] } else { vec![] };
    HttpResponse::Ok().json(json!({ "rejected": rejected }))
}
