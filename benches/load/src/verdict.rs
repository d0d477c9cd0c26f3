//! A benchmark whose run did not verify has not measured the system it
//! claims to: the command says so on stderr and exits non-zero (after
//! writing its evidence, which records `"verified": false`).

use std::future::Future;
use std::process::ExitCode;

use serde_json::Value;

use crate::environment::BoxError;

/// Runs an in-process benchmark `run` in an actix system and exits as
/// [`exit_code`] says (or with failure and the error).
pub fn run_in_process(command: &str, run: impl Future<Output = Result<Vec<String>, BoxError>>) -> ExitCode {
    imcore::telemetry::init("warn");
    match actix::System::new().block_on(run) {
        Ok(failed) => exit_code(command, &failed),
        Err(e) => {
            eprintln!("imcore-load: {e:?}");
            ExitCode::FAILURE
        }
    }
}

/// Runs a benchmark `run` that drives servers from outside on a
/// multi-threaded tokio runtime, and exits as [`exit_code`] says (or with
/// failure and the error).
pub fn run_on_runtime<E: std::fmt::Display>(
    command: &str,
    run: impl Future<Output = Result<Vec<String>, E>>,
) -> ExitCode {
    imcore::telemetry::init("warn");
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("{command}: runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run) {
        Ok(failed) => exit_code(command, &failed),
        Err(e) => {
            eprintln!("{command}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Names of the runs whose `verified` is not `true`.
pub fn unverified(runs: &[Value]) -> Vec<String> {
    runs.iter().filter(|r| r["verified"] != true).map(name).collect()
}

/// What identifies a run in its scenario's table.
fn name(run: &Value) -> String {
    ["scenario", "setup", "nodes", "write_path", "delivery_mode", "senders", "members", "connections"]
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
