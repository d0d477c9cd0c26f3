//! The cluster scenario (ARCHITECTURE §7), in one invocation so that every
//! multi-node figure has its single-node baseline from the same machine and
//! build: the hot group at each `--cluster-senders` C on one node, then on
//! `--nodes` N nodes with a home node per conversation (the other nodes
//! forward sends to it: `IMCORE_HOME_NODE=on`), then on N nodes each writing
//! locally under the row lock (`off`); fan-out (push, `--cluster-members`)
//! on one node and on N. Connections spread round robin over the nodes, so
//! most deliveries cross nodes. Every set-up gets its own servers and
//! database, and every run is verified as in the single-node scenarios.
//! Result: `<out-dir>/cluster.json`, the runs and each multi-node run against
//! the single-node one (`comparison`).

use serde_json::{json, Value};

use super::provision::BoxError;
use super::{fanout, hot, start_nodes, stop_nodes, write_evidence, Ctx};

/// One set of servers the runs are compared across.
struct Setup {
    label: &'static str,
    nodes: usize,
    /// `IMCORE_HOME_NODE`; unset on one node (no bus, nothing to forward).
    home_node: Option<&'static str>,
}

impl Setup {
    fn env(&self) -> Vec<(String, String)> {
        self.home_node.map(|h| ("IMCORE_HOME_NODE".to_owned(), h.to_owned())).into_iter().collect()
    }

    /// `run` marked with this set-up.
    fn stamp(&self, mut run: Value) -> Value {
        run["setup"] = json!(self.label);
        run["nodes"] = json!(self.nodes);
        run["home_node"] = json!(self.home_node);
        run
    }
}

pub async fn run(ctx: &Ctx) -> Result<Vec<String>, BoxError> {
    let n = usize::from(ctx.args.nodes);
    let single = Setup { label: "single", nodes: 1, home_node: None };
    let home = Setup { label: "home", nodes: n, home_node: Some("on") };
    let local = Setup { label: "local", nodes: n, home_node: Some("off") };
    let mut runs = vec![];
    for s in [&single, &home, &local] {
        runs.extend(hot_group(ctx, s).await?);
    }
    for s in [&single, &home] {
        runs.push(fan_out(ctx, s).await?);
    }
    let comparison = compare(&runs);
    for row in &comparison {
        eprintln!("{}", line(row));
    }
    let extra = json!({"comparison": comparison, "delivery_rule": hot::DELIVERY_RULE});
    write_evidence(ctx, "cluster.json", runs, extra)
}

async fn hot_group(ctx: &Ctx, s: &Setup) -> Result<Vec<Value>, BoxError> {
    let a = &ctx.args;
    let max_c = a.cluster_senders.iter().copied().max().unwrap_or(1);
    let (nodes, db, db_name) =
        start_nodes(ctx, &format!("cluster_hot_{}", s.label), "actor", s.nodes, &s.env()).await?;
    let result = async {
        let setup = hot::setup(nodes.first(), max_c, a.receivers).await?;
        let mut runs = vec![];
        for &c in &a.cluster_senders {
            let p = a.hot_params("cluster-hot", "actor", c, "push");
            runs.push(s.stamp(hot::run(&nodes, &ctx.pg, &db, &setup, &p).await?));
        }
        Ok::<_, BoxError>(runs)
    }
    .await;
    stop_nodes(ctx, nodes, db, &db_name).await;
    result
}

async fn fan_out(ctx: &Ctx, s: &Setup) -> Result<Value, BoxError> {
    let a = &ctx.args;
    let (nodes, db, db_name) =
        start_nodes(ctx, &format!("cluster_fanout_{}", s.label), "actor", s.nodes, &s.env()).await?;
    let p = fanout::Params {
        members: a.cluster_members,
        mode: "push",
        rate: a.fanout_rate,
        messages: a.fanout_messages,
        ack_ms: true,
    };
    let result = async {
        let mut devs = fanout::setup(nodes.first(), p.members, a.source_addrs).await?;
        fanout::create_group(nodes.first(), &db, &devs, &p).await?;
        let run = fanout::run(&nodes, &ctx.pg, &db, &mut devs, &p).await;
        devs.close();
        run
    }
    .await;
    stop_nodes(ctx, nodes, db, &db_name).await;
    Ok(s.stamp(result?))
}

/// Per run, the figures compared, and for a multi-node run their ratios to
/// the single-node run of the same scenario and size (the delivery latency
/// to receivers on another node is set against all of the single node's).
fn compare(runs: &[Value]) -> Vec<Value> {
    let size = |r: &Value| if r["senders"].is_null() { r["members"].clone() } else { r["senders"].clone() };
    runs.iter()
        .map(|r| {
            let mut row = figures(r);
            let base =
                runs.iter().find(|b| b["setup"] == "single" && b["scenario"] == r["scenario"] && size(b) == size(r));
            if let (Some(b), false) = (base, r["setup"] == "single") {
                let b = figures(b);
                let ratio = |this: &str, single: &str| match (
                    row.pointer(this).and_then(Value::as_f64),
                    b.pointer(single).and_then(Value::as_f64),
                ) {
                    (Some(x), Some(y)) if y > 0.0 => json!((x / y * 100.0).round() / 100.0),
                    _ => Value::Null,
                };
                row["over_single"] = json!({
                    "acked_per_s": ratio("/acked_per_s", "/acked_per_s"),
                    "ack_p50": ratio("/ack_ms/p50", "/ack_ms/p50"),
                    "ack_p99": ratio("/ack_ms/p99", "/ack_ms/p99"),
                    "delivery_p50": ratio("/delivery_ms/p50", "/delivery_ms/p50"),
                    "delivery_p99": ratio("/delivery_ms/p99", "/delivery_ms/p99"),
                    "delivery_other_node_p50": ratio("/delivery_ms_other_node/p50", "/delivery_ms/p50"),
                    "delivery_other_node_p99": ratio("/delivery_ms_other_node/p99", "/delivery_ms/p99"),
                });
            }
            row
        })
        .collect()
}

/// What the comparison shows of one run. Delivery: the receivers' end-to-end
/// push latency (hot group; with several nodes also that to receivers on
/// another node than the sending connection's), or the time until the last
/// member had a message (fan-out). Fan-out sends at a fixed rate: its
/// `acked_per_s` is that rate.
fn figures(r: &Value) -> Value {
    let hot = r["scenario"] == "cluster-hot";
    let p50_p99 = |p: &Value| if p.is_null() { Value::Null } else { json!({"p50": p["p50"], "p99": p["p99"]}) };
    let cpu = &r["cpu"];
    let per_node = match &cpu["server_cpu_s_per_node"] {
        Value::Null => json!([cpu["server_cpu_s"]]),
        v => v.clone(),
    };
    json!({
        "scenario": r["scenario"],
        "setup": r["setup"],
        "nodes": r["nodes"],
        "home_node": r["home_node"],
        "senders": r["senders"],
        "members": r["members"],
        "messages": if hot { &r["messages"] } else { &r["acked"] },
        "acked_per_s": if hot { &r["acked_per_s"] } else { &r["rate_per_s"] },
        "ack_ms": p50_p99(&r["ack_ms"]),
        "delivery_ms": p50_p99(if hot { &r["e2e_ms"] } else { &r["last_device_ms"] }),
        "delivery_ms_other_node": p50_p99(&r["e2e_ms_by_node"]["other_node"]),
        "verified": r["verified"],
        "server_cpu_s": cpu["server_cpu_s"],
        "server_cpu_s_per_node": per_node,
        "server_cores": cpu["server_cores"],
        "nats_cores": cpu["nats_cores"],
        "postgres_cores": cpu["postgres_cores"],
        "generator_cores": cpu["generator_cores"],
    })
}

/// A row of the comparison on one line of stderr; `(xR)` is the ratio to one node.
fn line(row: &Value) -> String {
    let num = |v: &Value| if v.is_number() { v.to_string() } else { "n/a".to_owned() };
    let times = |k: &str| row["over_single"][k].as_f64().map_or(String::new(), |x| format!(" (x{x:.2})"));
    let ms = |k: &str, ratio: &str| match &row[k] {
        Value::Null => "n/a".to_owned(),
        p => format!(
            "p50 {}{} p99 {}{} ms",
            num(&p["p50"]),
            times(&format!("{ratio}_p50")),
            num(&p["p99"]),
            times(&format!("{ratio}_p99"))
        ),
    };
    let size = if row["senders"].is_null() { format!("M={}", row["members"]) } else { format!("C={}", row["senders"]) };
    let per_node: Vec<String> = row["server_cpu_s_per_node"].as_array().into_iter().flatten().map(num).collect();
    format!(
        "cluster: {:<11} {:<6} N={} {size:<6} {:>7} acked/s{}  ack {}  delivery {}  other node {}  server cpu {} s \
         [{}]  nats {} cores  generator {} cores  verified {}",
        row["scenario"].as_str().unwrap_or_default(),
        row["setup"].as_str().unwrap_or_default(),
        row["nodes"],
        row["acked_per_s"].as_f64().map_or("n/a".to_owned(), |x| format!("{x:.0}")),
        times("acked_per_s"),
        ms("ack_ms", "ack"),
        ms("delivery_ms", "delivery"),
        ms("delivery_ms_other_node", "delivery_other_node"),
        num(&row["server_cpu_s"]),
        per_node.join(" "),
        num(&row["nats_cores"]),
        num(&row["generator_cores"]),
        row["verified"],
    )
}
