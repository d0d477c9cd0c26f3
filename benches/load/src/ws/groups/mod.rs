//! `groups`: large groups (PROTOCOL §5 "Membership and groups"). One group
//! is filled to `--group-members` by `invite` calls of `--group-invite-batch`
//! users over one WebSocket connection (per-call latency as the group grows),
//! then gets messages while `--group-online` member devices are online
//! (`send`), and its roster is searched and paged (`members`). Finally
//! `--rss-groups` groups of `--rss-group-members` each (overlapping member
//! sets) show what a warm conversation actor holds (`rss`).
//!
//! Users are inserted into the benchmark's database over SQL (100,000 admin
//! API calls would dominate the run), and the RSS groups are written by the
//! store; device tokens, the large group and everything measured go through
//! the server's API.

pub mod churn;
mod rss;
mod send;

use std::time::{Duration, Instant};

use imcore::store::Store;
use imcore_client::Ws;
use serde_json::{json, Value};

use super::log_check::verify;
use super::provision::{self, BoxError};
use super::server::Server;
use super::Ctx;
use crate::percentiles::Percentiles;

/// The parts in order, each on the server state it needs: the invites on a
/// first server; send and members on a second one started over the same
/// database (the first may still be delivering the invites' join events for
/// minutes, which part 1 reports); the RSS on a third, started after the RSS
/// groups were written. A part that fails is recorded as an unverified run.
pub async fn run(ctx: &Ctx) -> Result<Vec<String>, BoxError> {
    let (mut server, db, db_name) = super::start_server(ctx, "groups", "actor").await?;
    let result = parts(ctx, &mut server, &db, &db_name).await;
    super::stop_server(ctx, server, db, &db_name).await;
    let (runs, provisioning) = result?;
    let extra = json!({
        "run_id": format!("groups-{}", chrono::Utc::now().format("%Y%m%dT%H%M%SZ")),
        "method": METHOD,
        "provisioning": provisioning,
        "parameters": parameters(&ctx.args.groups),
    });
    super::write_evidence(ctx, "groups.json", runs, extra)
}

async fn parts(ctx: &Ctx, server: &mut Server, db: &Store, db_name: &str) -> Result<(Vec<Value>, Value), BoxError> {
    let a = &ctx.args.groups;
    let or_failed = |name: &str, r: Result<Value, BoxError>| r.unwrap_or_else(|e| failed(name, &e));
    let (big, provisioning) = setup(server, db, a).await?;
    let mut runs = vec![or_failed("groups-invite", invite(server, db, &big, a).await)];
    restart(ctx, server, db_name, "groups-2").await?;
    let p = send::Params {
        online: a.group_online,
        messages: a.group_messages,
        burst: a.group_burst.min(64),
        source_addrs: ctx.args.source_addrs,
    };
    runs.push(or_failed("groups-send", send::run(server, &ctx.pg, db, &big, &p).await));
    runs.push(or_failed("groups-members", search(server, db, &big, a).await));
    if a.rss_groups > 0 {
        let measured = async {
            let set = rss::create_groups(server, db, big.members, a).await?;
            restart(ctx, server, db_name, "groups-3").await?;
            rss::measure(server, db, &set, &big, a).await
        }
        .await;
        runs.push(or_failed("groups-rss", measured));
    }
    Ok((runs, provisioning))
}

/// Stops `server` and starts a fresh one over the same database.
async fn restart(ctx: &Ctx, server: &mut Server, db_name: &str, label: &str) -> Result<(), BoxError> {
    server.stop();
    let log = ctx.args.data_dir.join(format!("server-{label}.log"));
    *server = Server::start(&ctx.bin, "actor", &ctx.pg.url_of(db_name), &log, &ctx.env).await?;
    eprintln!("server {label}: pid {}, port {}, over the same database", server.pid, server.port);
    Ok(())
}

/// How the scenario provisions and measures, for the evidence.
const METHOD: &str = "Users u000000… are inserted into the benchmark database over SQL (one INSERT … \
generate_series; the admin API per user is too slow for 100,000); device tokens come from the admin API, groups \
from create_conversation (max_member set at creation). invite: one WebSocket connection of the owner, closed loop \
(one call in flight), per-call latency by the member count the call ended at; then the time the server kept \
using CPU (delivering the join events), up to a limit. The server is then restarted over the same database (no \
backlog, cold actors) for send and members. send: the owner's second device \
sends over WebSocket, first closed loop (one send in flight), then a burst (all sends written at once); online \
member devices connect from 127.0.0.x; push latency is arrival minus the send time in the body (one clock), per \
(message, device). members: closed loop on the owner's connection, limit as given; `matching` counts the members \
whose user_id has the prefix (SQL). rss: groups written by the store directly (one creation transaction each, as the fanout scenario \
does for large groups), each with its own owner; a server is then started on that database, so `rss_before` \
holds no conversation actor; each group gets a few sends over HTTP from its owner (no member device online) and \
`rss_after` is read 1 s later.";

#[derive(Debug, Clone, clap::Args)]
pub struct GroupArgs {
    /// Groups: members of the large group (owner included).
    #[arg(long, default_value_t = 100_000)]
    pub group_members: usize,
    /// Groups: users per `invite` call.
    #[arg(long, default_value_t = 1000)]
    pub group_invite_batch: usize,
    /// Groups: member devices online while the large group gets messages.
    #[arg(long, default_value_t = 1000)]
    pub group_online: usize,
    /// Groups: closed-loop sends to the large group (one in flight).
    #[arg(long, default_value_t = 200)]
    pub group_messages: usize,
    /// Groups: then a burst of this many sends written at once (≤ 64, the in-flight limit).
    #[arg(long, default_value_t = 50)]
    pub group_burst: usize,
    /// Groups: `members` search prefixes (`q`), each timed `--group-queries` times.
    #[arg(long, value_delimiter = ',', default_value = "u012345,u0123,u01,zz")]
    pub group_search: Vec<String>,
    /// Groups: timed calls per `members` search and per paging depth.
    #[arg(long, default_value_t = 100)]
    pub group_queries: usize,
    /// Groups: `members` page size.
    #[arg(long, default_value_t = 50)]
    pub group_page: usize,
    /// Groups: longest wait, seconds, for the server to go quiet after the
    /// invites (delivering their join events); the next parts run on a
    /// restarted server either way.
    #[arg(long, default_value_t = 60.0)]
    pub group_quiet_s: f64,
    /// Groups: groups of the RSS measurement (0: skip it).
    #[arg(long, default_value_t = 100)]
    pub rss_groups: usize,
    /// Groups: members of each RSS group (a window of the large group's users).
    #[arg(long, default_value_t = 10_000)]
    pub rss_group_members: usize,
    /// Groups: sends to each RSS group to warm its actor.
    #[arg(long, default_value_t = 3)]
    pub rss_messages: usize,
}

/// The sizes of this run, for the evidence.
fn parameters(a: &GroupArgs) -> Value {
    json!({
        "group_members": a.group_members,
        "invite_batch": a.group_invite_batch,
        "online_devices": a.group_online,
        "closed_loop_messages": a.group_messages,
        "burst": a.group_burst.min(64),
        "search_prefixes": a.group_search,
        "calls_per_query": a.group_queries,
        "members_page": a.group_page,
        "quiet_wait_limit_s": a.group_quiet_s,
        "rss_groups": a.rss_groups,
        "rss_group_members": a.rss_group_members,
        "rss_messages_per_group": a.rss_messages,
    })
}

/// The id of user `i`: six digits, so prefixes select 1, 10, 100, … users.
pub fn user(i: usize) -> String {
    format!("u{i:06}")
}

/// The large group and the devices of its owner.
pub struct Big {
    pub conv: String,
    pub members: usize,
    /// Owner `u000000`: invites and searches (`owner`), sends (`sender`).
    pub owner_token: String,
    pub sender_token: String,
    /// Devices `d0` of users 1..=online.
    pub online_tokens: Vec<String>,
}

/// Users `u000000..` in the database, the owner's and the online members' tokens, the group (owner only).
async fn setup(server: &Server, db: &Store, a: &GroupArgs) -> Result<(Big, Value), BoxError> {
    let n = a.group_members;
    if !(2..=1_000_000).contains(&n) || a.group_online >= n || a.rss_group_members > n {
        return Err("--group-members 2..=1000000, above --group-online and --rss-group-members".into());
    }
    let started = Instant::now();
    let conn = db.pool().get().await?;
    conn.execute(
        "INSERT INTO users (user_id) SELECT 'u' || lpad(i::text, 6, '0') FROM generate_series(0, $1::int8 - 1) AS i",
        &[&(n as i64)],
    )
    .await?;
    let users_s = started.elapsed().as_secs_f64();
    let mut devices = vec![(user(0), "owner".to_owned()), (user(0), "sender".to_owned())];
    devices.extend((1..=a.group_online).map(|i| (user(i), "d0".to_owned())));
    let started = Instant::now();
    let mut tokens = provision::issue_tokens(server.port, &server.admin, devices).await?.into_iter();
    let tokens_s = started.elapsed().as_secs_f64();
    let (Some(owner_token), Some(sender_token)) = (tokens.next(), tokens.next()) else {
        return Err("no owner tokens".into());
    };
    let conv = "big".to_owned();
    provision::create_group(
        server.port,
        &owner_token,
        // `push` set: the send part measures pushes (an `auto` group this size delivers in `pull`).
        json!({"kind": "group", "conv_id": conv, "name": "big", "members": [], "max_member": n, "delivery_mode": "push"}),
    )
    .await?;
    let provisioning = json!({"users": n, "users_sql_s": round2(users_s),
                              "tokens": a.group_online + 2, "tokens_admin_api_s": round2(tokens_s)});
    Ok((Big { conv, members: n, owner_token, sender_token, online_tokens: tokens.collect() }, provisioning))
}

/// Part 1: invites users 1.. into the group, `batch` per call, one call in
/// flight; then how long the server keeps working after the last ack
/// (delivering the join events), up to `--group-quiet-s`.
async fn invite(server: &Server, db: &Store, big: &Big, a: &GroupArgs) -> Result<Value, BoxError> {
    let batch = a.group_invite_batch;
    let mut ws = provision::connect_retry(server.port, provision::source_addr(0, 1), &big.owner_token).await?;
    let mut id = 0;
    // (member count before and after the call, ms)
    let mut calls: Vec<(usize, usize, f64)> = vec![];
    let mut errors = 0u64;
    let started = Instant::now();
    let mut members = 1;
    for chunk in (1..big.members).collect::<Vec<_>>().chunks(batch.clamp(1, 1000)) {
        let ids: Vec<String> = chunk.iter().map(|&i| user(i)).collect();
        let (r, ms) = call(&mut ws, &mut id, "invite", json!({"conv_id": big.conv, "user_ids": ids})).await?;
        let joined = r["joined"].as_array().map_or(0, Vec::len);
        if r["ok"] != true || joined != chunk.len() {
            errors += 1;
        }
        calls.push((members, members + joined, ms));
        members += joined;
    }
    let total_s = started.elapsed().as_secs_f64();
    let (page, _) = call(&mut ws, &mut id, "members", json!({"conv_id": big.conv, "limit": 1})).await?;
    // Closed before waiting: a connection that does not answer pings is dropped after 45 s.
    ws.close().await;
    let (busy_s, quiet) = quiet(server, Duration::from_secs_f64(a.group_quiet_s)).await;
    eprintln!("groups invite: server busy {busy_s:.0} s after the last ack (quiet: {quiet})");
    let member_count = page["member_count"].as_u64().unwrap_or(0) as usize;
    let (log_ok, detail) = verify(db, &big.conv, &[]).await?;
    let bands = bands(&calls, big.members);
    let invited = members - 1;
    let per_s = (invited as f64 / total_s.max(1e-9)).round();
    let all = Percentiles::of(calls.iter().map(|c| c.2).collect());
    let verified = errors == 0 && member_count == big.members && log_ok && detail["head"] == big.members;
    eprintln!(
        "groups invite: {invited} users in {} calls of {batch}, {total_s:.1} s = {per_s} members/s, call {}; \
         member_count {member_count}  verified {verified}",
        calls.len(),
        all.text()
    );
    for b in bands.iter() {
        let text = b["call_ms_text"].as_str().unwrap_or_default();
        eprintln!("  up to {:>6} members: call {text}, {} members/s", b["members_up_to"], b["members_per_s"]);
    }
    let bands: Vec<Value> = bands
        .into_iter()
        .map(|mut b| {
            if let Value::Object(o) = &mut b {
                o.remove("call_ms_text");
            }
            b
        })
        .collect();
    Ok(json!({
        "scenario": "groups-invite",
        "members": big.members,
        "invite_batch": batch,
        "calls": calls.len(),
        "invited": invited,
        "seconds": round2(total_s),
        "members_per_s": per_s,
        "call_ms": all.json(),
        "by_group_size": bands,
        // CPU the server kept using after the last ack: the join events' delivery.
        "server_busy_after_s": round2(busy_s),
        "server_quiet": quiet,
        "call_errors": errors,
        "member_count": member_count,
        "verified": verified,
        "verification": detail,
    }))
}

/// Per tenth of the final size: the calls that ended in it, their latency and rate.
fn bands(calls: &[(usize, usize, f64)], members: usize) -> Vec<Value> {
    let step = members.div_ceil(10).max(1);
    (1..=10)
        .map(|k| (step * (k - 1), (step * k).min(members)))
        .map(|(lo, hi)| (hi, calls.iter().filter(|c| c.1 > lo && c.1 <= hi).collect::<Vec<_>>()))
        .filter(|(_, inside)| !inside.is_empty())
        .map(|(hi, inside)| {
            let ms: f64 = inside.iter().map(|c| c.2).sum();
            let added: usize = inside.iter().map(|c| c.1 - c.0).sum();
            let p = Percentiles::of(inside.iter().map(|c| c.2).collect());
            json!({"members_up_to": hi, "calls": inside.len(), "call_ms": p.json(), "call_ms_text": p.text(),
                   "members_per_s": (added as f64 / (ms / 1000.0).max(1e-9)).round()})
        })
        .collect()
}

/// Part 3: `members` searches by prefix and pages at depth, one call in flight.
async fn search(server: &Server, db: &Store, big: &Big, a: &GroupArgs) -> Result<Value, BoxError> {
    let mut ws = provision::connect_retry(server.port, provision::source_addr(0, 1), &big.owner_token).await?;
    let mut id = 0;
    let conn = db.pool().get().await?;
    let mut searches = vec![];
    let mut wrong = 0u64;
    for q in &a.group_search {
        let matching: i64 = conn
            .query_one("SELECT count(*) FROM members WHERE conv_id = $1 AND user_id LIKE $2 || '%'", &[&big.conv, &q])
            .await?
            .get(0);
        let mut ms = vec![];
        let mut returned = 0;
        for _ in 0..a.group_queries {
            let fields = json!({"conv_id": big.conv, "q": q, "limit": a.group_page});
            let (r, t) = call(&mut ws, &mut id, "members", fields).await?;
            let page = r["members"].as_array().cloned().unwrap_or_default();
            returned = page.len();
            let expected = (matching as usize).min(a.group_page);
            let off = page.iter().any(|m| !m["user_id"].as_str().is_some_and(|u| u.starts_with(q.as_str())));
            if r["ok"] != true || off || returned != expected {
                wrong += 1;
            }
            ms.push(t);
        }
        let p = Percentiles::of(ms);
        eprintln!("groups members q={q:<8} matching {matching:>6}: {}", p.text());
        searches.push(json!({"q": q, "matching": matching, "returned": returned, "ms": p.json()}));
    }
    let mut pages = vec![];
    for depth in [0.0, 0.5, 0.9] {
        let after = (big.members as f64 * depth) as i64;
        let mut ms = vec![];
        for _ in 0..a.group_queries {
            let (r, t) =
                call(&mut ws, &mut id, "members", json!({"conv_id": big.conv, "after": after, "limit": a.group_page}))
                    .await?;
            let page = r["members"].as_array().cloned().unwrap_or_default();
            let first = page.first().and_then(|m| m["joined_seq"].as_i64()).unwrap_or(0);
            if r["ok"] != true || page.len() != a.group_page.min(big.members - after as usize) || first != after + 1 {
                wrong += 1;
            }
            ms.push(t);
        }
        let p = Percentiles::of(ms);
        eprintln!("groups members after={after:<6}: {}", p.text());
        pages.push(json!({"after": after, "ms": p.json()}));
    }
    ws.close().await;
    Ok(json!({
        "scenario": "groups-members",
        "members": big.members,
        "limit": a.group_page,
        "calls_each": a.group_queries,
        "search": searches,
        "paging": pages,
        "wrong_answers": wrong,
        "verified": wrong == 0,
    }))
}

/// Waits until the server used under 5% of a core for a second, at most
/// `limit`: the seconds waited and whether it went quiet.
async fn quiet(server: &Server, limit: Duration) -> (f64, bool) {
    let started = Instant::now();
    let mut cpu = server.cpu_s();
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = server.cpu_s();
        let waited = started.elapsed();
        if now - cpu < 0.05 || waited > limit {
            // The last second was the quiet one, not part of the busy time.
            return (waited.as_secs_f64() - 1.0, now - cpu < 0.05);
        }
        cpu = now;
    }
}

/// A part that failed: a run that did not verify, with the error.
fn failed(scenario: &str, e: &BoxError) -> Value {
    eprintln!("groups {scenario}: {e}");
    json!({"scenario": scenario, "error": e.to_string(), "verified": false})
}

/// One request on `ws`, one in flight: its reply and latency in ms. Pushes
/// arriving meanwhile are dropped.
pub async fn call(ws: &mut Ws, id: &mut u64, op: &str, mut fields: Value) -> Result<(Value, f64), BoxError> {
    *id += 1;
    fields["id"] = json!(*id);
    fields["op"] = json!(op);
    let started = Instant::now();
    ws.send_text(fields.to_string()).await?;
    let reply = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let v: Value = serde_json::from_str(&ws.next_text().await?)?;
            if v["id"] == json!(*id) {
                return Ok::<_, BoxError>(v);
            }
        }
    })
    .await
    .map_err(|_| format!("{op}: no reply in 60 s"))??;
    Ok((reply, started.elapsed().as_secs_f64() * 1000.0))
}

pub fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}
