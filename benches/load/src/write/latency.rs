//! `imcore-load write --scenario latency`: a lone sender's cost. One hot
//! group at C = 1, 2, 8 closed-loop senders (one op in flight each), the
//! `actor` and `direct` paths of the same run side by side, with the mean
//! time of each transaction phase. Writes `evidence/bench/latency.json`.

use serde_json::{json, Value};

use imcore::config::WritePath;
use imcore::store::Store;
use imcore_actors::UserId;

use super::{git_rev, group, hot_group, machine, path_name, setting, Args, Run};

/// The runs that did not verify.
pub(super) async fn run(
    store: &Store,
    args: &Args,
    users: &[UserId],
    run_id: &str,
) -> Result<Vec<String>, Box<dyn std::error::Error>> {
    let mut runs = vec![];
    for &senders in &args.latency_senders {
        for path in [WritePath::Actor, WritePath::Direct] {
            let conv = group(store, users, &format!("lat-{run_id}-{}-{senders}", path_name(path))).await?;
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
        "durability": {"fsync": setting(store, "fsync").await?, "synchronous_commit": setting(store, "synchronous_commit").await?},
        "runs": runs,
        "command": std::env::args().collect::<Vec<_>>().join(" "),
    });
    if let Some(dir) = args.latency_out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&args.latency_out, serde_json::to_string_pretty(&doc)? + "\n")?;
    eprintln!("wrote {}", args.latency_out.display());
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
