//! `groups-churn`: what membership churn costs a group's online devices, in
//! bytes. For each `--churn-modes` entry, a group of `--churn-online` members
//! whose devices are online (each counting the bytes of every frame it
//! reads) gets one `invite` of `--group-invite-batch` users, then is filled
//! by more such invites to `--churn-members`. Run it against two server
//! binaries (`--server-bin`) to compare builds: `default` creates the group
//! without `delivery_mode` (what the build does by itself), `push` and
//! `pull` set it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use imcore::store::Store;
use serde_json::{json, Value};
use tokio::task::JoinSet;

use super::{call, user};
use crate::ws::provision::{self, BoxError};
use crate::ws::Ctx;

/// Devices count as done with a phase once none read a byte for this long.
const QUIET: Duration = Duration::from_secs(2);
/// Longest wait for that, per phase.
const QUIET_LIMIT: Duration = Duration::from_secs(180);

#[derive(Debug, Clone, clap::Args)]
pub struct ChurnArgs {
    /// Groups-churn: members the group is filled to (owner included).
    #[arg(long, default_value_t = 100_000)]
    pub churn_members: usize,
    /// Groups-churn: members whose devices are online from the start.
    #[arg(long, default_value_t = 50)]
    pub churn_online: usize,
    /// Groups-churn: one group per entry: `default` (no `delivery_mode`), `push`, `pull`, `auto`.
    #[arg(long, value_delimiter = ',', default_value = "default,push")]
    pub churn_modes: Vec<String>,
}

/// What the online devices read, all together.
#[derive(Default)]
struct Read {
    bytes: AtomicU64,
    frames: AtomicU64,
    /// Devices whose connection ended (closed by the server, or failed).
    ended: AtomicU64,
}

pub async fn run(ctx: &Ctx) -> Result<Vec<String>, BoxError> {
    let (server, db, db_name) = super::super::start_server(ctx, "groups_churn", "actor").await?;
    let result = async {
        let a = &ctx.args.churn;
        let batch = ctx.args.groups.group_invite_batch.clamp(1, 1000);
        let online = a.churn_online;
        if a.churn_members <= online + 1 {
            return Err::<_, BoxError>("--churn-members must pass --churn-online + 1".into());
        }
        insert_users(&db, a.churn_members).await?;
        let mut devices = vec![(user(0), "churn".to_owned())];
        devices.extend((1..=online).map(|i| (user(i), "churn".to_owned())));
        let mut tokens = provision::issue_tokens(server.port, &server.admin, devices).await?;
        let owner = tokens.remove(0);
        let mut runs = vec![];
        for mode in &a.churn_modes {
            runs.push(group(server.port, &owner, &tokens, mode, a, batch).await?);
        }
        Ok(runs)
    }
    .await;
    super::super::stop_server(ctx, server, db, &db_name).await;
    let runs = result?;
    let extra = json!({
        "run_id": format!("groups-churn-{}", chrono::Utc::now().format("%Y%m%dT%H%M%SZ")),
        "server_bin": ctx.bin.display().to_string(),
        "method": METHOD,
    });
    super::super::write_evidence(ctx, "groups-churn.json", runs, extra)
}

const METHOD: &str = "Users u000000… inserted over SQL; u000001..=online get a device token (admin API) and \
connect over WebSocket before the group exists. Per mode, the owner u000000 creates a group of those members \
(max_member = the fill size; `delivery_mode` as the mode says, none for `default`), then one `invite` of a \
batch of new users, then invites of that size until the fill size, one call in flight, each phase followed by \
waiting until no device read a byte for 2 s. Every device counts the bytes of every text frame it reads. \
bytes per device = the phase's bytes over all online devices / their number.";

async fn insert_users(db: &Store, n: usize) -> Result<(), BoxError> {
    let conn = db.pool().get().await?;
    conn.execute(
        "INSERT INTO users (user_id) SELECT 'u' || lpad(i::text, 6, '0') FROM generate_series(0, $1::int8 - 1) AS i",
        &[&(n as i64)],
    )
    .await?;
    Ok(())
}

/// One mode: the group, its online devices' readers, the two phases.
async fn group(
    port: u16,
    owner: &str,
    tokens: &[String],
    mode: &str,
    a: &ChurnArgs,
    batch: usize,
) -> Result<Value, BoxError> {
    let conv = format!("churn-{mode}");
    let online = tokens.len();
    let mut create = json!({"kind": "group", "conv_id": conv, "name": conv, "max_member": a.churn_members,
                            "members": (1..=online).map(user).collect::<Vec<_>>()});
    if mode != "default" {
        create["delivery_mode"] = json!(mode);
    }
    let read = Arc::new(Read::default());
    let mut readers = JoinSet::new();
    for ws in provision::connect_all(tokens, 1, 1, |_| port, true).await? {
        let read = read.clone();
        readers.spawn(async move {
            let mut ws = ws;
            while let Ok(text) = ws.next_text().await {
                read.bytes.fetch_add(text.len() as u64, Ordering::Relaxed);
                read.frames.fetch_add(1, Ordering::Relaxed);
            }
            read.ended.fetch_add(1, Ordering::Relaxed);
        });
    }
    provision::create_group(port, owner, create).await?;
    settle(&read).await;
    let mut ws = provision::connect_retry(port, provision::source_addr(0, 1), owner).await?;
    let mut id = 0;
    let mut next = online + 1;
    let mut errors = 0;
    let phase = |from: (u64, u64), started: Instant| {
        let (bytes, frames) =
            (read.bytes.load(Ordering::Relaxed) - from.0, read.frames.load(Ordering::Relaxed) - from.1);
        json!({"bytes_per_device": bytes / online as u64, "frames_per_device": frames as f64 / online as f64,
               "seconds": (started.elapsed().as_secs_f64() * 100.0).round() / 100.0})
    };
    let mark = |r: &Read| (r.bytes.load(Ordering::Relaxed), r.frames.load(Ordering::Relaxed));

    let (start, started) = (mark(&read), Instant::now());
    let to = a.churn_members;
    errors += u32::from(!invite(&mut ws, &mut id, &conv, (&mut next, to), batch).await?);
    settle(&read).await;
    let one_invite = phase(start, started);
    while next < to {
        errors += u32::from(!invite(&mut ws, &mut id, &conv, (&mut next, to), batch).await?);
    }
    settle(&read).await;
    let fill = phase(start, started);
    let (c, _) = call(&mut ws, &mut id, "get_conversation", json!({"conv_id": conv})).await?;
    ws.close().await;
    let ended = read.ended.load(Ordering::Relaxed);
    readers.abort_all();
    let verified = errors == 0 && ended == 0 && c["member_count"] == a.churn_members;
    eprintln!("groups churn {mode}: one invite {one_invite}, fill {fill}, ended {ended}, verified {verified}");
    Ok(json!({
        "scenario": "groups-churn",
        "delivery_mode": mode,
        "members": a.churn_members,
        "online_devices": online,
        "invite_batch": batch,
        "one_invite": one_invite,
        "fill": fill,
        "conversation_after": {"delivery_mode": c["delivery_mode"], "delivery_setting": c["delivery_setting"],
                               "member_count": c["member_count"]},
        "devices_closed": ended,
        "call_errors": errors,
        "verified": verified,
    }))
}

/// Invites users `next..` (at most `batch`, not past `to`): whether all joined.
async fn invite(
    ws: &mut imcore_client::Ws,
    id: &mut u64,
    conv: &str,
    (next, to): (&mut usize, usize),
    batch: usize,
) -> Result<bool, BoxError> {
    let n = batch.min(to - *next);
    let ids: Vec<String> = (*next..*next + n).map(user).collect();
    let (r, _) = call(ws, id, "invite", json!({"conv_id": conv, "user_ids": ids})).await?;
    *next += n;
    Ok(r["ok"] == true && r["joined"].as_array().map_or(0, Vec::len) == n)
}

/// Waits until the devices read nothing for [`QUIET`], at most [`QUIET_LIMIT`].
async fn settle(read: &Read) {
    let started = Instant::now();
    let mut last = read.bytes.load(Ordering::Relaxed);
    while started.elapsed() < QUIET_LIMIT {
        tokio::time::sleep(QUIET).await;
        let now = read.bytes.load(Ordering::Relaxed);
        if now == last {
            return;
        }
        last = now;
    }
}
