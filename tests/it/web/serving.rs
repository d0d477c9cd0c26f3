//! How the server serves the web client: the page revalidated on every load,
//! its files cached for good under a versioned path, and every other path
//! still answering in the PROTOCOL §2 error shape.

use awc::http::header;
use serde_json::{json, Value};

use super::SUITE;
use crate::evidence::Check;
use crate::server::{http_raw, TestServer};

#[actix_web::test]
async fn the_page_and_its_files_are_served_with_their_types_and_cache_rules_and_other_paths_keep_the_error_shape() {
    let check = Check::start(
        SUITE,
        "web-serving",
        "GET / and the files it names, a stale version, an unknown file, POST /, /v1/nope, If-None-Match",
        "/ is text/html, no-cache, with an ETag and a script-src 'self' CSP (304 on a matching If-None-Match); each \
         file it names is served under /web/<version>/ with its type and immutable caching; another version or file \
         is 404 NOT_FOUND and POST / 405 BAD_REQUEST, in the §2 shape; /v1/nope stays 404 NOT_FOUND",
    );
    let s = TestServer::start().await;
    let base = format!("http://127.0.0.1:{}", s.port);
    let http = awc::Client::default();
    let header_of = |r: &awc::ClientResponse<_>, name: header::HeaderName| {
        r.headers().get(name).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned()
    };

    let mut page = http.get(format!("{base}/")).send().await.expect("GET /");
    let html = String::from_utf8(page.body().await.expect("page").to_vec()).expect("utf-8");
    let etag = header_of(&page, header::ETAG);
    let index = json!({
        "status": page.status().as_u16(), "type": header_of(&page, header::CONTENT_TYPE),
        "cache": header_of(&page, header::CACHE_CONTROL), "csp": header_of(&page, header::CONTENT_SECURITY_POLICY),
    });
    let again = http.get(format!("{base}/")).insert_header((header::IF_NONE_MATCH, etag.as_str())).send().await;
    let revalidated = again.expect("GET / again").status().as_u16();

    let named: Vec<String> =
        html.split(['"', '\'']).filter(|part| part.starts_with("/web/")).map(str::to_owned).collect();
    let mut files = vec![];
    for path in &named {
        let r = http.get(format!("{base}{path}")).send().await.expect("GET a file");
        files.push(json!({"path": path, "status": r.status().as_u16(), "type": header_of(&r, header::CONTENT_TYPE),
                          "cache": header_of(&r, header::CACHE_CONTROL)}));
    }
    let version = named.first().and_then(|p| p.split('/').nth(2)).unwrap_or_default().to_owned();
    let refused = [
        ("GET", "/web/0000000000000000/app.js".to_owned()),
        ("GET", format!("/web/{version}/nope.js")),
        ("POST", "/".to_owned()),
        ("GET", "/v1/nope".to_owned()),
    ];
    let mut refusals = vec![];
    for (method, path) in &refused {
        let (status, body) = http_raw(s.port, method, path, None, None).await;
        refusals.push(json!({"path": path, "status": status, "code": body["error"]["code"]}));
    }

    let script_types_ok = files.iter().all(|f| {
        let t = f["type"].as_str().unwrap_or_default();
        let p = f["path"].as_str().unwrap_or_default();
        f["status"] == 200
            && f["cache"].as_str().unwrap_or_default().contains("immutable")
            && (p.ends_with(".js") && t.starts_with("text/javascript")
                || p.ends_with(".css") && t.starts_with("text/css"))
    });
    let codes: Vec<(Value, Value)> = refusals.iter().map(|r| (r["status"].clone(), r["code"].clone())).collect();
    let pass = index["status"] == 200
        && index["type"].as_str().unwrap_or_default().starts_with("text/html")
        && index["cache"] == "no-cache"
        && index["csp"].as_str().unwrap_or_default().contains("script-src 'self'")
        && revalidated == 304
        && named.len() == 2
        && script_types_ok
        && codes
            == [
                (json!(404), json!("NOT_FOUND")),
                (json!(404), json!("NOT_FOUND")),
                (json!(405), json!("BAD_REQUEST")),
                (json!(404), json!("NOT_FOUND")),
            ];
    let observed = json!({"index": index, "revalidated": revalidated, "files": files, "refusals": refusals});
    assert!(check.resolve(observed.clone(), pass), "{observed:#}");
}
