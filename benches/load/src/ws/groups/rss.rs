//! Part 4 of `groups`: what warm conversation actors of large groups hold.
//! `--rss-groups` groups, each a window of `--rss-group-members` consecutive
//! users of the large group starting at `k × (large group size / groups)`,
//! so the member sets overlap (with the defaults every user is in 10 groups)
//! and each group has its own owner (the window's first user). They are
//! written by the store directly, as the fan-out scenario does (one creation
//! transaction each, no server involved: inviting them would measure
//! `invite` again, which part 1 does). Then a freshly started server gets a
//! few sends per group: its RSS before and after, per group. Then the large
//! group too.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::{stream, StreamExt, TryStreamExt};
use imcore::store::{CreateConversation, GroupSettings, Store};
use imcore_actors::{ConvId, UserId};
use imcore_client::Http;
use serde_json::{json, Value};

use super::{round2, user, Big, GroupArgs};
use crate::ws::log_check::verify;
use crate::ws::provision::{self, now_us, BoxError};
use crate::ws::server::Server;

/// How long after the last ack RSS is read (delivery has nothing queued: no member device is online).
const QUIET: Duration = Duration::from_secs(1);

/// One group of the measurement: its id and its owner's token.
struct Group {
    conv: String,
    owner_token: String,
}

pub struct RssGroups {
    groups: Vec<Arc<Group>>,
    create_s: f64,
}

/// The owners' tokens through `server`; the groups through `db`, four at a time.
pub async fn create_groups(
    server: &Server,
    db: &Store,
    big_members: usize,
    a: &GroupArgs,
) -> Result<RssGroups, BoxError> {
    let stride = (big_members / a.rss_groups.max(1)).max(1);
    let first = |k: usize| k * stride % big_members;
    let owners = (0..a.rss_groups).map(|k| (user(first(k)), "rss".to_owned())).collect();
    let tokens = provision::issue_tokens(server.port, &server.admin, owners).await?;
    let started = Instant::now();
    let members = a.rss_group_members;
    let settings = GroupSettings { max_member: members as i32, ..GroupSettings::default() };
    stream::iter(0..a.rss_groups)
        .map(|k| {
            let window = (1..members).map(move |j| UserId::parse(&user((first(k) + j) % big_members)));
            let settings = settings.clone();
            async move {
                let req = CreateConversation::Group {
                    creator: UserId::parse(&user(first(k)))?,
                    conv_id: Some(ConvId::parse(&format!("rss-{k}"))?),
                    name: format!("rss-{k}"),
                    members: window.collect::<Result<_, _>>()?,
                    settings,
                };
                db.create_conversation(&req).await?;
                Ok::<_, BoxError>(())
            }
        })
        .buffer_unordered(4)
        .try_collect::<Vec<()>>()
        .await?;
    let create_s = started.elapsed().as_secs_f64();
    eprintln!("groups rss: {} groups of {members} written in {create_s:.1} s", a.rss_groups);
    let groups = tokens
        .into_iter()
        .enumerate()
        .map(|(k, owner_token)| Arc::new(Group { conv: format!("rss-{k}"), owner_token }))
        .collect();
    Ok(RssGroups { groups, create_s })
}

/// `n` sends over HTTP, one at a time: the acks `(seq, client_msg_id)`.
async fn send(http: &mut Http, conv: &str, token: &str, n: usize) -> Result<Vec<(i64, String)>, BoxError> {
    let path = format!("/v1/conversations/{conv}/messages");
    let mut acks = vec![];
    for i in 0..n {
        let key = format!("w{i}");
        let body = json!({"client_msg_id": key, "body": {"type": "text", "text": format!("warm {i}"), "ts": now_us()}});
        match http.call("POST", &path, Some(token), Some(&body)).await? {
            (201, v) => acks.push((v["seq"].as_i64().ok_or("ack without seq")?, key)),
            (s, v) => return Err(format!("send to {conv}: {s} {v}").into()),
        }
    }
    Ok(acks)
}

/// On a freshly started `server` over the same database: RSS before, after
/// every group got `rss_messages` sends, and after the large group got them too.
pub async fn measure(
    server: &Server,
    db: &Store,
    set: &RssGroups,
    big: &Big,
    a: &GroupArgs,
) -> Result<Value, BoxError> {
    tokio::time::sleep(QUIET).await;
    let before = server.rss_kib();
    let n = a.rss_messages;
    let acks =
        provision::parallel(server.port, set.groups.clone(), 8, move |mut http, g: Arc<Arc<Group>>| async move {
            let r = send(&mut http, &g.conv, &g.owner_token, n).await;
            (http, r)
        })
        .await?;
    tokio::time::sleep(QUIET).await;
    let after = server.rss_kib();
    let big_acks = send(&mut Http::new(server.port), &big.conv, &big.owner_token, n).await?;
    tokio::time::sleep(QUIET).await;
    let after_big = server.rss_kib();
    let mut unverified = vec![];
    for (g, acks) in set.groups.iter().zip(&acks) {
        let (ok, detail) = verify(db, &g.conv, acks).await?;
        if !ok || detail["head"] != json!(a.rss_group_members + n) {
            unverified.push(json!({"conv_id": g.conv, "verification": detail}));
        }
    }
    // The large group's log holds the earlier parts' messages too: its acks are checked, not its log.
    let big_ok = big_acks.len() == n;
    let groups = set.groups.len();
    let mib = |kib: u64| round2(kib as f64 / 1024.0);
    let per_group_kib = (after.saturating_sub(before) as f64 / groups.max(1) as f64).round();
    let big_kib = after_big.saturating_sub(after);
    let verified = unverified.is_empty() && groups == a.rss_groups && big_ok;
    eprintln!(
        "groups rss: restarted server {} MB -> {} MB after {n} sends to each of {groups} groups of {}: \
         {per_group_kib} KiB per group; + the {}-member group: {} MB  verified {verified}",
        mib(before),
        mib(after),
        a.rss_group_members,
        big.members,
        mib(after_big),
    );
    Ok(json!({
        "scenario": "groups-rss",
        "groups": groups,
        "members": a.rss_group_members,
        "member_sets": "overlapping windows of the large group's users, one owner each, written by the store",
        "messages_per_group": n,
        "create_s": round2(set.create_s),
        "rss_before_mb": mib(before),
        "rss_after_mb": mib(after),
        "rss_per_group_kib": per_group_kib,
        "large_group": {"members": big.members, "rss_after_mb": mib(after_big), "rss_added_kib": big_kib},
        "vm_hwm_mb": mib(server.hwm_kib()),
        "unverified_groups": unverified,
        "verified": verified,
    }))
}
