//! The browser client (`src/web/`), embedded in the binary and served at `/`.
//!
//! `index.html` is always revalidated (`no-cache`, with an ETag); it loads the
//! other files from `/web/<version>/…`, where `<version>` is a digest of all
//! of them, so those are cached for good (`immutable`) and a new build is a
//! new URL. A path outside these files answers 404 in the PROTOCOL §2 shape
//! like any other unknown route.

use std::sync::OnceLock;

use actix_web::http::header::{self, HeaderValue};
use actix_web::http::Method;
use actix_web::{web, HttpRequest, HttpResponse};
use sha2::{Digest, Sha256};

use super::http::{not_found, resource};
use super::ApiError;

/// The files `index.html` loads, by name under `/web/<version>/`.
const ASSETS: &[(&str, &str, &str)] = &[
    ("app.js", "text/javascript; charset=utf-8", include_str!("../web/app.js")),
    ("connection.js", "text/javascript; charset=utf-8", include_str!("../web/connection.js")),
    ("chat.js", "text/javascript; charset=utf-8", include_str!("../web/chat.js")),
    ("view.js", "text/javascript; charset=utf-8", include_str!("../web/view.js")),
    ("log.js", "text/javascript; charset=utf-8", include_str!("../web/log.js")),
    ("signals.js", "text/javascript; charset=utf-8", include_str!("../web/signals.js")),
    ("message.js", "text/javascript; charset=utf-8", include_str!("../web/message.js")),
    ("people.js", "text/javascript; charset=utf-8", include_str!("../web/people.js")),
    ("composer.js", "text/javascript; charset=utf-8", include_str!("../web/composer.js")),
    ("members.js", "text/javascript; charset=utf-8", include_str!("../web/members.js")),
    ("words.js", "text/javascript; charset=utf-8", include_str!("../web/words.js")),
    ("style.css", "text/css; charset=utf-8", include_str!("../web/style.css")),
];

const INDEX: &str = include_str!("../web/index.html");

/// Where `index.html` names the asset directory.
const VERSION_MARK: &str = "{{assets}}";

/// Scripts and styles only from this origin, nothing inline: a message body
/// that somehow reached the DOM as markup still could not run.
const CONTENT_SECURITY_POLICY: &str = "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
     connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

struct Site {
    /// Digest of every asset: the directory they are served under.
    version: String,
    index: String,
    index_etag: String,
}

fn site() -> &'static Site {
    static SITE: OnceLock<Site> = OnceLock::new();
    SITE.get_or_init(|| {
        let mut digest = Sha256::new();
        for (name, _, text) in ASSETS {
            digest.update(name.as_bytes());
            digest.update(text.as_bytes());
        }
        let version = hex::encode(&digest.finalize()[..8]);
        let index = INDEX.replace(VERSION_MARK, &format!("/web/{version}"));
        let index_etag = format!("\"{}\"", hex::encode(&Sha256::digest(index.as_bytes())[..8]));
        Site { version, index, index_etag }
    })
}

/// `GET /`: the page, revalidated on every load (304 when unchanged).
async fn index(req: HttpRequest) -> HttpResponse {
    let site = site();
    let unchanged = req
        .headers()
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|tags| tags.split(',').any(|t| t.trim() == site.index_etag));
    let mut reply = if unchanged { HttpResponse::NotModified() } else { HttpResponse::Ok() };
    reply
        .insert_header((header::CACHE_CONTROL, "no-cache"))
        .insert_header((header::ETAG, site.index_etag.as_str()))
        .insert_header((header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY))
        .insert_header((header::X_CONTENT_TYPE_OPTIONS, "nosniff"))
        .insert_header((header::REFERRER_POLICY, HeaderValue::from_static("no-referrer")));
    if unchanged {
        reply.finish()
    } else {
        reply.content_type("text/html; charset=utf-8").body(site.index.clone())
    }
}

/// `GET /web/{version}/{file}`: an asset of this build, cached for good.
async fn asset(path: web::Path<(String, String)>) -> Result<HttpResponse, ApiError> {
    let (version, file) = path.into_inner();
    let found = ASSETS.iter().find(|(name, _, _)| *name == file);
    match found {
        Some((_, content_type, text)) if version == site().version => Ok(HttpResponse::Ok()
            .content_type(*content_type)
            .insert_header((header::CACHE_CONTROL, "public, max-age=31536000, immutable"))
            .insert_header((header::X_CONTENT_TYPE_OPTIONS, "nosniff"))
            .body(*text)),
        _ => not_found().await,
    }
}

pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.service(resource("/", vec![(Method::GET, web::to(index))]))
        .service(resource("/web/{version}/{file}", vec![(Method::GET, web::to(asset))]));
}
