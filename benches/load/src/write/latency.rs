//! `imcore-load write --scenario latency`: a lone sender's cost. One hot
//! group at C = 1, 2, 8 closed-loop senders (one op in flight each), the
//! `actor` and `direct` paths of the same run side by side, with the mean
//! time of each transaction phase. Writes `evidence/bench/latency.json`.

use serde_json::{json, Value};

use imcore::config::WritePath;
use imcore::store::{GroupSettings, Store};
use imcore_actors::UserId;

use super::{hot_group, Args};
use crate::environment::{durability, git_rev, machine, write_json, BoxError};
use crate::senders::{group, path_name, Run};

/// The runs that did not verify.
pub(super) async fn run(store: &Store, args: &Args, users: &[UserId], run_id: &str) -> Result<Vec<String>, BoxError> {
    let mut runs = vec![];
    for &senders in &args.latency_senders {
        for path in [WritePath::Actor, WritePath::Direct] {
            let id = format!("lat-{run_id}-{}-{senders}", path_name(path));
            let conv = group(store, users, &id, GroupSettings::default()).await?;
            let mut r = hot_group(store, path, users, &conv, senders, args, None).await?;
            r.scenario = "latency";
            eprintln!("{}", line(&r));
            runs.push(r);
        }
    }
    let runs: Vec<Value> = runs.iter().map(Run::json).collect();
    let failed = crate::verdict::unverified(&runs);
    let doc = json!({
        "machine": machine(store).await?,
        "date": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        "git_rev": git_rev(),
        "durability": durability(store).await?,
        "runs": runs,
        "command": std::env::args().collect::<Vec<_>>().join(" "),
    });
    write_json(&args.latency_out, &doc)?;
    Ok(failed)
}

/// The summary line with sub-millisecond resolution.
fn line(r: &Run) -> String {
    let ack = r.ack_ms.json();
    let ms = |k: &str| ack[k].as_f64().map_or_else(|| "n/a".to_owned(), |v| format!("{v:.2}"));
    let phases: Vec<String> = r.phase_ms.iter().filter_map(|(p, ms)| ms.map(|ms| format!("{p} {ms:.2}"))).collect();
    format!(
        "latency {:<6} C={:<2} msgs={:<6} {:>6.0} acked/s  ack p50 {} p99 {} p99.9 {} ms  verified {}  txn ms: {}",
        r.write_path,
        r.senders,
        r.messages,
        r.acked_per_s,
        ms("p50"),
        ms("p99"),
        ms("p999"),
        r.verified,
        phases.join(", ")
    )
}
