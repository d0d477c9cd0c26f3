//! The web client in a real browser: headless Chromium driven over WebDriver
//! (Debian's `chromium` and `chromium-driver`), against the real server on
//! port 0. Each test starts its own chromedriver on a free port; each window
//! is a WebDriver session of its own (its own profile, so its own storage).
//! Waits poll the page's DOM with a bound, never sleep. Screenshots of the
//! main views go to `evidence/web/*.png`, records to `evidence/web/result.json`.
//! `chat` is the first round (chatting, recall, restart, groups, paging),
//! `round2` people, standing, phone, keyboard, long chats and v1.2;
//! `serving` checks how the server serves the page and its files.

mod chat;
mod round2;
mod serving;

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::{json, Value};

use crate::server::free_port;

pub const SUITE: &str = "web";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
const CHROMIUM: &str = "/usr/bin/chromium";
/// How long a DOM condition may take to hold (a reconnect after a restart included).
const WAIT: Duration = Duration::from_secs(30);
const POLL: Duration = Duration::from_millis(50);

/// A chromedriver of this test's own, in a process group of its own with
/// the browsers it starts: dropping it kills the group, so a test that
/// panics before closing its windows leaves no browser behind.
pub struct Driver {
    child: Child,
    port: u16,
    /// Browsers keep both cores busy: never beside a test whose verdict is a latency bound.
    _cpu: tokio::sync::MutexGuard<'static, ()>,
}

impl Driver {
    pub async fn start() -> Self {
        for path in [CHROMEDRIVER, CHROMIUM] {
            assert!(
                Path::new(path).exists(),
                "{path} is missing: install Debian's chromium and chromium-driver (.ci/run does)"
            );
        }
        let cpu = crate::harness::alone_with_the_cpu().await;
        let port = free_port();
        let child = Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .expect("start chromedriver");
        let driver = Self { child, port, _cpu: cpu };
        let started = Instant::now();
        while tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_err() {
            assert!(started.elapsed() < WAIT, "chromedriver did not listen within {WAIT:?}");
            tokio::time::sleep(POLL).await;
        }
        driver
    }

    /// A new browser window (session) with the page at `url`.
    pub async fn window(&self, url: &str) -> Window {
        let mut args = vec!["--headless=new", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1100,720"];
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            // Chromium's sandbox refuses to run as root.
            args.push("--no-sandbox");
        }
        let mut caps = serde_json::Map::new();
        caps.insert("goog:chromeOptions".into(), json!({ "binary": CHROMIUM, "args": args }));
        let client = ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
            .capabilities(caps)
            .connect(&format!("http://127.0.0.1:{}", self.port))
            .await
            .expect("a WebDriver session");
        client.goto(url).await.expect("open the page");
        Window { client }
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        // SAFETY: kill(2) of the process group our own child leads (its id is the group's).
        unsafe {
            libc::kill(-(self.child.id() as i32), libc::SIGKILL);
        }
        let _ = self.child.wait();
    }
}

/// The login URL `imcore admin device add` prints.
pub fn login_url(port: u16, token: &str) -> String {
    format!("http://127.0.0.1:{port}/#token={token}")
}

/// One browser window showing the web client.
pub struct Window {
    pub client: Client,
}

impl Window {
    /// The value of a JavaScript expression evaluated in the page.
    pub async fn eval(&self, expression: &str) -> Value {
        self.client
            .execute(&format!("return ({expression});"), vec![])
            .await
            .unwrap_or_else(|e| panic!("{expression}: {e}"))
    }

    /// Polls `expression` until it is truthy (bounded); panics naming `what`.
    pub async fn until(&self, what: &str, expression: &str) {
        let started = Instant::now();
        loop {
            let v = self.eval(expression).await;
            if !matches!(v, Value::Null | Value::Bool(false)) && v != json!(0) && v != json!("") {
                return;
            }
            if started.elapsed() > WAIT {
                let state = self.eval("document.body.innerText").await;
                panic!("waited {WAIT:?} for {what}; the page shows:\n{}", state.as_str().unwrap_or_default());
            }
            tokio::time::sleep(POLL).await;
        }
    }

    pub async fn online(&self) {
        self.until("the connection", "document.querySelector('#status')?.dataset.state === 'open'").await;
    }

    /// Clicks the element `css`; found again if the page redrew it meanwhile.
    pub async fn click(&self, css: &str) {
        let started = Instant::now();
        loop {
            let found = self.client.find(Locator::Css(css)).await.unwrap_or_else(|e| panic!("find {css}: {e}"));
            match found.click().await {
                Ok(()) => return,
                Err(e) if e.is_stale_element_reference() && started.elapsed() < WAIT => continue,
                Err(e) => panic!("click {css}: {e}"),
            }
        }
    }

    /// Clicks the button labelled `label` inside `scope`.
    pub async fn press(&self, scope: &str, label: &str) {
        let find =
            format!("[...document.querySelectorAll(\"{scope} button\")].find(b => b.textContent === {})", json!(label));
        self.until(&format!("a '{label}' button in {scope}"), &find).await;
        self.eval(&format!("document.querySelectorAll('[data-press]').forEach(b => delete b.dataset.press), ({find}).dataset.press = 'yes'"))
            .await;
        self.click("[data-press=yes]").await;
    }

    pub async fn type_into(&self, css: &str, text: &str) {
        let field = self.client.find(Locator::Css(css)).await.unwrap_or_else(|e| panic!("find {css}: {e}"));
        field.clear().await.expect("clear");
        field.send_keys(text).await.expect("type");
    }

    /// Opens the conversation `conv` from the inbox.
    pub async fn open(&self, conv: &str) {
        let item = format!("#inbox li[data-conv='{conv}'] button");
        self.until("the conversation in the inbox", &format!("document.querySelector(\"{item}\")")).await;
        self.click(&item).await;
        self.until("the conversation's log", "document.querySelector('#conv-pane:not([hidden])')").await;
    }

    /// The id of the conversation the window shows, once it shows one.
    pub async fn open_conv(&self) -> String {
        let current = "document.querySelector('#inbox li.current')?.dataset.conv";
        self.until("an open conversation", current).await;
        self.eval(current).await.as_str().expect("conv id").to_owned()
    }

    /// Types `text` into the composer and presses Enter.
    pub async fn say(&self, text: &str) {
        self.type_into("#text", text).await;
        self.enter("#text").await;
    }

    /// Presses Enter in the field `css`.
    pub async fn enter(&self, css: &str) {
        let field = self.client.find(Locator::Css(css)).await.unwrap_or_else(|e| panic!("find {css}: {e}"));
        field.send_keys(&fantoccini::key::Key::Enter.to_string()).await.expect("press Enter");
    }

    /// The messages the open conversation shows: `{seq, text, recalled, pending}` each, in order.
    pub async fn messages(&self) -> Vec<Value> {
        let v = self
            .eval(
                "[...document.querySelectorAll('#events li.msg')].map(li => ({seq: li.dataset.seq ? Number(li.dataset.seq) : \
                 null, text: li.querySelector('.body').textContent, recalled: li.dataset.recalled === 'true', pending: \
                 li.classList.contains('pending')}))",
            )
            .await;
        v.as_array().cloned().unwrap_or_default()
    }

    /// Waits until the open conversation shows, as delivered (not pending), exactly these texts in this order.
    pub async fn shows_exactly(&self, texts: &[&str]) {
        let wanted = serde_json::to_string(texts).expect("json");
        self.until(
            &format!("the messages {wanted}"),
            &format!(
                "JSON.stringify([...document.querySelectorAll('#events li.msg:not(.pending) .body')].map(b => \
                 b.textContent)) === JSON.stringify({wanted}) && !document.querySelector('#events li.pending')"
            ),
        )
        .await;
    }

    /// The unread badge of `conv` in the inbox ("" when none).
    pub async fn badge(&self, conv: &str) -> String {
        let v = self
            .eval(&format!("document.querySelector(\"#inbox li[data-conv='{conv}'] .badge\")?.textContent ?? ''"))
            .await;
        v.as_str().unwrap_or_default().to_owned()
    }

    /// Types `keys` (text and `fantoccini::key::Key`s) into whatever has the focus, as a keyboard would.
    pub async fn keys(&self, keys: &str) {
        let focused = self.client.active_element().await.expect("the focused element");
        focused.send_keys(keys).await.expect("keys");
    }

    /// Presses Tab until the focus is on `css` (at most 40 times); how many presses it took.
    pub async fn tab_to(&self, css: &str) -> usize {
        self.tab_until(css, &fantoccini::key::Key::Tab.to_string()).await
    }

    /// Presses Shift+Tab until the focus is on `css` (at most 40 times); how many presses it took.
    pub async fn tab_back_to(&self, css: &str) -> usize {
        use fantoccini::key::Key;
        self.tab_until(css, &format!("{}{}{}", Key::Shift, Key::Tab, Key::Null)).await
    }

    async fn tab_until(&self, css: &str, key: &str) -> usize {
        let focused = format!("document.activeElement?.matches({})", json!(css));
        for presses in 0..40 {
            if self.eval(&focused).await == json!(true) {
                return presses;
            }
            self.keys(key).await;
        }
        let at = self.eval("document.activeElement?.outerHTML.slice(0, 120)").await;
        panic!("Tab never reached {css}; the focus is on {at}");
    }

    /// Writes a screenshot to `evidence/web/<name>.png`.
    pub async fn screenshot(&self, name: &str) {
        let png = self.client.screenshot().await.expect("screenshot");
        let dir = evidence_dir();
        std::fs::create_dir_all(&dir).expect("create evidence/web");
        std::fs::write(dir.join(format!("{name}.png")), png).expect("write the screenshot");
    }

    pub async fn close(self) {
        let _ = self.client.close().await;
    }
}

fn evidence_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("evidence").join(SUITE)
}
