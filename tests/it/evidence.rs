//! Check records written to `evidence/<suite>/result.json` as tests run: id,
//! expected, observed figures, verdict. The file is the output of real runs,
//! never edited by hand.
//!
//! Each run owns its records: the first write of a run to a suite's file
//! starts it afresh, so a record of an earlier run never survives into this
//! one. A file is stamped with the run (id, git revision and whether the tree
//! had changes, date, machine). A check started with [`Check::start`] is
//! recorded as `FAIL` at once and overwritten when the test resolves it, so a
//! test that panics half-way leaves a `FAIL`, not silence. A check missing from
//! a file was not run by the run that wrote it (filtered out, or the run
//! stopped before it). Failing to write a record panics with the path.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Mutex, OnceLock};

use serde_json::{json, Value};

/// Suites written by this run so far, guarding every file write.
static WRITTEN: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());

/// Records a check and returns whether it passed, for the test to assert.
pub fn record(suite: &str, id: &str, variant: &str, expected: &str, observed: Value, pass: bool) -> bool {
    write(suite, id, variant, expected, observed, if pass { "PASS" } else { "FAIL" });
    pass
}

/// A check in progress, recorded as `FAIL` until [`Check::resolve`] records
/// what the test observed.
#[must_use = "a check left unresolved stays FAIL"]
pub struct Check {
    suite: &'static str,
    id: &'static str,
    variant: String,
    expected: &'static str,
}

impl Check {
    pub fn start(suite: &'static str, id: &'static str, variant: impl Into<String>, expected: &'static str) -> Self {
        let variant = variant.into();
        let unfinished = json!({"unfinished": "the test ended before it recorded what it observed"});
        write(suite, id, &variant, expected, unfinished, "FAIL");
        Self { suite, id, variant, expected }
    }

    /// Records the observation and returns whether it passed, for the test to assert.
    pub fn resolve(self, observed: Value, pass: bool) -> bool {
        record(self.suite, self.id, &self.variant, self.expected, observed, pass)
    }
}

fn write(suite: &str, id: &str, variant: &str, expected: &str, observed: Value, verdict: &str) {
    let mut written = WRITTEN.lock().unwrap_or_else(|p| p.into_inner());
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("evidence").join(suite).join("result.json");
    let key = |c: &Value| format!("{} [{}]", c["id"].as_str().unwrap_or(""), c["variant"].as_str().unwrap_or(""));
    // Records of earlier runs are dropped at this run's first write.
    let earlier: Vec<Value> = if written.insert(suite.to_owned()) {
        vec![]
    } else {
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
        let doc: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("parse {}: {e}", path.display()));
        doc["checks"].as_array().cloned().unwrap_or_default()
    };
    let mut checks: BTreeMap<String, Value> = earlier.into_iter().map(|c| (key(&c), c)).collect();
    checks.insert(
        format!("{id} [{variant}]"),
        json!({
            "id": id,
            "variant": variant,
            "expected": expected,
            "observed": observed,
            "verdict": verdict,
            "recorded_at": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        }),
    );
    let mut doc = json!({"suite": suite, "checks": checks.values().collect::<Vec<_>>()});
    if let (Value::Object(d), Value::Object(stamp)) = (&mut doc, run_stamp().clone()) {
        d.extend(stamp);
    }
    let dir = path.parent().unwrap_or_else(|| panic!("{} has a parent", path.display()));
    std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
    let text = serde_json::to_string_pretty(&doc).unwrap_or_else(|e| panic!("encode {}: {e}", path.display()));
    std::fs::write(&path, text + "\n").unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
}

/// What identifies this run, the same in every file it writes.
fn run_stamp() -> &'static Value {
    static STAMP: OnceLock<Value> = OnceLock::new();
    STAMP.get_or_init(|| {
        let started = chrono::Utc::now();
        json!({
            "run_id": format!("{}-{}", started.format("%Y%m%dT%H%M%SZ"), std::process::id()),
            "date": started.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            "git_rev": git_rev(),
            "machine": {
                "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
                "os": os_name(),
                "kernel": std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim(),
            },
        })
    })
}

/// `HEAD`'s short hash, with `-dirty` when the tree had changes; `unknown` without git.
fn git_rev() -> String {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    let Some(rev) = git(&["rev-parse", "--short", "HEAD"]) else { return "unknown".into() };
    // The records this run writes are not a change of the tree under test.
    match git(&["status", "--porcelain", "--", ".", ":(exclude)evidence"]) {
        Some(s) if !s.is_empty() => format!("{rev}-dirty"),
        _ => rev,
    }
}

fn os_name() -> String {
    std::fs::read_to_string("/etc/os-release")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("PRETTY_NAME=").map(|v| v.trim_matches('"').to_owned())))
        .unwrap_or_else(|| std::env::consts::OS.to_owned())
}
