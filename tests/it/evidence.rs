//! Check records written to `evidence/<suite>/result.json` as tests run: id,
//! expected, observed figures, verdict. A run of a subset updates only its own
//! records; the file is the output of real runs, never edited by hand.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;

use serde_json::{json, Value};

static LOCK: Mutex<()> = Mutex::new(());

/// Records a check and returns whether it passed, for the test to assert.
pub fn record(suite: &str, id: &str, variant: &str, expected: &str, observed: Value, pass: bool) -> bool {
    let _guard = LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("evidence").join(suite).join("result.json");
    let key = |c: &Value| format!("{} [{}]", c["id"].as_str().unwrap_or(""), c["variant"].as_str().unwrap_or(""));
    let mut checks: BTreeMap<String, Value> = std::fs::read_to_string(&path)
        .ok()
        .and_then(|s| serde_json::from_str::<Value>(&s).ok())
        .and_then(|v| v["checks"].as_array().cloned())
        .unwrap_or_default()
        .into_iter()
        .map(|c| (key(&c), c))
        .collect();
    checks.insert(
        format!("{id} [{variant}]"),
        json!({
            "id": id,
            "variant": variant,
            "expected": expected,
            "observed": observed,
            "verdict": if pass { "PASS" } else { "FAIL" },
            "recorded_at": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        }),
    );
    let doc = json!({
        "suite": suite,
        "machine": {
            "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
            "os": std::env::consts::OS,
        },
        "checks": checks.values().collect::<Vec<_>>(),
    });
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let _ = std::fs::write(&path, serde_json::to_string_pretty(&doc).unwrap_or_default() + "\n");
    pass
}
