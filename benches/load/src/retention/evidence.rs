//! The JSON of `evidence/bench/retention.json`: how each part was measured,
//! and the comparisons made within the run.

use serde_json::{json, Value};

use super::fill::Filled;
use super::purge::Purged;
use crate::senders::Run;

/// A purge of `filled`, checked.
pub fn purge(scenario: &str, filled: &Filled, purged: &Purged, verified: bool) -> Value {
    let mut v = json!({"scenario": scenario, "conv_id": filled.conv.as_str(), "events_filled": filled.events});
    extend(&mut v, purged.json());
    extend(&mut v, json!({"verified": verified}));
    v
}

/// A hot-group run during a purge, against the runs just before and after
/// it without one.
pub fn during(run: &Run, (purged, verified): &(Purged, bool), filled: &Filled, around: [&Run; 2], goal: f64) -> Value {
    let throughput = ratio(&[run], &around, rate);
    json!({
        "run": run.json(),
        "purge": purge(&format!("purge-during-{}", run.scenario), filled, purged, *verified),
        "baselines": around.map(Run::json),
        "baseline_acked_per_s": mean(&around, rate),
        "acked_per_s_over_baseline": throughput,
        "meets_goal": throughput.is_some_and(|r| r >= goal),
        "ack_p50_over_baseline": ratio(&[run], &around, ack("p50")),
        "ack_p99_over_baseline": ratio(&[run], &around, ack("p99")),
    })
}

/// The same load without the tombstones and with them, two runs each.
pub fn probe_pair(without: [&Run; 2], with: [&Run; 2]) -> Value {
    let both = |f: &dyn Fn(&Run) -> Option<f64>| json!({"without": mean(&without, f), "with": mean(&with, f)});
    json!({
        "senders": with[0].senders,
        "order": "without, with, with, without",
        "without": without.map(Run::json),
        "with": with.map(Run::json),
        "acked_per_s": both(&rate),
        "ack_p50_ms": both(&ack("p50")),
        "ack_p99_ms": both(&ack("p99")),
        "lookup_phase_ms": both(&lookup_phase),
        "acked_per_s_ratio": ratio(&with, &without, rate),
        "ack_p50_ratio": ratio(&with, &without, ack("p50")),
        "ack_p99_ratio": ratio(&with, &without, ack("p99")),
        "lookup_phase_ratio": ratio(&with, &without, lookup_phase),
    })
}

/// Mean ms of a run's write transactions in their `lookup` phase (the reads
/// under the row lock, the tombstone probe among them): the probe's cost
/// less the noise of the commits' WAL flushes on a shared machine.
fn lookup_phase(r: &Run) -> Option<f64> {
    r.phase_ms.iter().find(|(p, _)| *p == "lookup").and_then(|(_, ms)| *ms)
}

fn rate(r: &Run) -> Option<f64> {
    Some(r.acked_per_s)
}

/// A run's ack percentile `p`, if it had acks.
fn ack(p: &str) -> impl Fn(&Run) -> Option<f64> + '_ {
    move |r| r.ack_ms.json()[p].as_f64()
}

/// The mean of `f` over `runs`; `None` when a run has no figure.
fn mean(runs: &[&Run], f: impl Fn(&Run) -> Option<f64>) -> Option<f64> {
    let figures: Option<Vec<f64>> = runs.iter().map(|r| f(r)).collect();
    figures.filter(|v| !v.is_empty()).map(|v| v.iter().sum::<f64>() / v.len() as f64)
}

/// The mean of `f` over `runs` over its mean over `base`.
fn ratio(runs: &[&Run], base: &[&Run], f: impl Fn(&Run) -> Option<f64>) -> Option<f64> {
    match (mean(runs, &f), mean(base, &f)) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

/// Everything that carries a `verified`: purges and runs.
pub fn checked(rates: &[Value], under_load: &Value, lookup: &Value) -> Vec<Value> {
    let mut all = rates.to_vec();
    let each = |v: &Value| v.as_array().cloned().unwrap_or_default();
    for part in ["purging_other", "purging_itself"] {
        all.push(under_load[part]["run"].clone());
        all.push(under_load[part]["purge"].clone());
        all.extend(each(&under_load[part]["baselines"]));
    }
    for pair in lookup["pairs"].as_array().into_iter().flatten() {
        all.extend(each(&pair["without"]));
        all.extend(each(&pair["with"]));
    }
    all
}

pub fn method(events: i64, tombstones: i64, retention_ms: i64) -> Value {
    json!({
        "fill": format!(
            "Each purged conversation is a group of 64 members created through the store with retention_ms \
             {retention_ms}, its creation events aged a day by UPDATE, then {events} sends appended in one \
             INSERT ... SELECT generate_series straight into events (distinct client_msg_ids, 32-byte request \
             hashes, created_at a day back) with next_seq moved past them: all due. The fill bypasses the write \
             path; the purges and every send measured do not."),
        "purge": "Store::purge_watched, what Store::purge_conversation runs: per chunk, its end read without a \
                  lock, one UPDATE moving min_seq past it (the only statement under the row lock), then one \
                  statement without the lock deleting the range below min_seq and inserting its sends' tombstones; \
                  each chunk followed by a rest of (100 - duty_pct) / duty_pct times what it took (the `duty_pct` of each \
                  purge), timed per chunk from the first statement's pool \
                  checkout to the sweep's commit. Events/s and tombstones/s are over the wall time of the whole \
                  purge, rests included.",
        "hot_group": "The actor write path in process (Engine::start, as imcore-load write): one group of 64 members, \
                      C closed-loop senders, each its own device and key space, after an unrecorded 3 s warm-up run. \
                      A run during a purge shares its duration; the purge stops between chunks when the run's time \
                      is up. Each run during a purge sits between two runs without one (baselines), its ratios over \
                      their mean: beside a purge of another conversation, runs on a fresh group; on the conversation \
                      being purged, runs on that same conversation with its old events in place.",
        "tombstones": format!(
            "Two groups of one shape: created with retention, creation events aged and purged through the store \
             (min_seq > 1, so every send probes idem_tombstones; no tombstones, they were not sends). Then \
             {tombstones} tombstones of the second's members under keys no run sends are written by one \
             INSERT ... SELECT generate_series, and per sender count the runs go without, with, with, without; \
             the ratios are of the means of the two runs each."),
        "settle": "After the fills, VACUUM (ANALYZE) of idem_tombstones (before the tombstone runs) and a CHECKPOINT, \
                   so neither autovacuum of the fresh rows nor a checkpoint they caused lands in a measured run.",
        "verified": "Every run: the log gapless from min_seq with next_seq = head + 1, one row per request key, every \
                     ack equal to its row, the run's rows exactly its acks. Every purge: the log gapless from min_seq, \
                     one tombstone per purged send and no other, every filled send kept or tombstoned, and a purge \
                     that ran to the end left min_seq at the first event not due.",
    })
}

fn extend(v: &mut Value, more: Value) {
    if let (Value::Object(v), Value::Object(more)) = (v, more) {
        v.extend(more);
    }
}
