//! A benchmark whose run did not verify has not measured the system it
//! claims to: the command says so on stderr and exits non-zero (after
//! writing its evidence, which records `"verified": false`).

use std::process::ExitCode;

use serde_json::Value;

/// Names of the runs whose `verified` is not `true`.
pub fn unverified(runs: &[Value]) -> Vec<String> {
    runs.iter().filter(|r| r["verified"] != true).map(name).collect()
}

/// What identifies a run in its scenario's table.
fn name(run: &Value) -> String {
    ["scenario", "write_path", "delivery_mode", "senders", "members", "connections"]
        .iter()
        .filter_map(|k| match &run[*k] {
            Value::Null => None,
            Value::String(s) => Some(format!("{k}={s}")),
            v => Some(format!("{k}={v}")),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Success when every run verified; otherwise each failed run on stderr and failure.
pub fn exit_code(command: &str, failed: &[String]) -> ExitCode {
    if failed.is_empty() {
        return ExitCode::SUCCESS;
    }
    eprintln!("\n{command}: VERIFICATION FAILED in {} run(s); their figures do not count:", failed.len());
    for f in failed {
        eprintln!("  NOT VERIFIED: {f}");
    }
    ExitCode::FAILURE
}
