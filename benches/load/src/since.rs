//! `imcore-load since`: the reconnect delta (PROTOCOL §7) of a user in many
//! conversations, in process against a real PostgreSQL. The user is in
//! `--conversations` groups; after its inbox token, `--changed` of them
//! change (half by a message from another member, half by the user's read
//! cursor moving, as its other device reading would); then the delta is asked
//! for `--rounds` times, each from that same token. Reports the delta's
//! server time (p50/p99/p99.9), its reply size against a full inbox paging,
//! and verifies that each delta lists exactly the changed conversations.
//! Writes `evidence/bench/since.json`.

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::Instant;

use imcore::config::StoreSettings;
use imcore::protocol::inbox_item_json;
use imcore::store::{ConvCache, GroupSettings, InboxDelta, SendOp, Store, WriteOp, INBOX_MAX_LIMIT};
use imcore_actors::{ClientMsgId, ConvId, DeviceId};
use serde_json::{json, Value};

use crate::environment::{self, BoxError};
use crate::percentiles::Percentiles;
use crate::senders::{body, group, uid};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// PostgreSQL to load. Unset: an embedded PostgreSQL in --data-dir.
    #[arg(long, env = "DATABASE_URL")]
    database_url: Option<String>,
    #[arg(long, default_value = "./var/bench-since")]
    data_dir: PathBuf,
    /// Conversations the user is in.
    #[arg(long, default_value_t = 10_000)]
    conversations: usize,
    /// Of those, how many change after the token.
    #[arg(long, default_value_t = 10)]
    changed: usize,
    /// Deltas asked for, each from the same token.
    #[arg(long, default_value_t = 300)]
    rounds: usize,
    #[arg(long, default_value = "evidence/bench/since.json")]
    out: PathBuf,
}

pub fn main(args: Args) -> std::process::ExitCode {
    crate::verdict::run_in_process("imcore-load since", run(args))
}

async fn run(args: Args) -> Result<Vec<String>, BoxError> {
    let (_pg, store) =
        environment::database(args.database_url.as_deref(), &args.data_dir, &StoreSettings::pool(4)).await?;
    let run_id = format!("{:x}", std::process::id());
    let (ana, ben) = (uid(&format!("s{run_id}-ana")), uid(&format!("s{run_id}-ben")));
    for u in [&ana, &ben] {
        store.create_user(u, None).await?;
    }
    let started = Instant::now();
    let mut convs = Vec::with_capacity(args.conversations);
    for i in 0..args.conversations {
        let id = format!("g-s{run_id}-{i}");
        convs.push(group(&store, &[ben.clone(), ana.clone()], &id, GroupSettings::default()).await?);
    }
    eprintln!("since: {} conversations in {:.0} s", convs.len(), started.elapsed().as_secs_f64());
    // Statistics as autovacuum would have them by now on a live server (it
    // analyses a table after 10% of its rows changed, within a minute):
    // without them the planner takes the new tables for empty.
    store.pool().get().await?.batch_execute("ANALYZE").await?;

    let (full_pages, full_bytes, token) = full_paging(&store, &ana).await?;
    // Spread over the list: not only the most recently active.
    let step = (convs.len() / args.changed.max(1)).max(1);
    let changed: Vec<&ConvId> = convs.iter().step_by(step).take(args.changed).collect();
    for (i, conv) in changed.iter().enumerate() {
        if i % 2 == 0 {
            let op = SendOp {
                sender: ben.clone(),
                device: DeviceId::parse("d0")?,
                client_msg_id: ClientMsgId::parse(&format!("c{i}"))?,
                body: body(i as u64),
                reply_to: None,
                mentions: Vec::new(),
            };
            store.write_batch(conv, ConvCache::default(), vec![WriteOp::Send(op)]).await?;
        } else {
            store.mark_read(conv, &ana, 2).await?;
        }
    }
    let want: HashSet<String> = changed.iter().map(|c| c.to_string()).collect();

    let (mut ms, mut exact, mut reply_bytes) = (Vec::with_capacity(args.rounds), 0, 0);
    for _ in 0..args.rounds {
        let t = Instant::now();
        let delta = store.inbox_since(&ana, &token).await?;
        ms.push(t.elapsed().as_secs_f64() * 1000.0);
        if let InboxDelta::Changed { items, left, .. } = &delta {
            let got: HashSet<String> = items.iter().map(|i| i.conversation.conv_id.to_string()).collect();
            exact += usize::from(got == want && left.is_empty());
            reply_bytes = json_bytes(items.iter().map(inbox_item_json).collect());
        }
    }
    let latency = Percentiles::of(ms);
    let verified = exact == args.rounds;
    eprintln!(
        "since: {} conversations, {} changed: delta {}, {reply_bytes} bytes (full paging: {full_pages} pages, \
         {full_bytes} bytes), exact {exact}/{}",
        args.conversations,
        args.changed,
        latency.text(),
        args.rounds
    );
    let run = json!({
        "scenario": "since", "conversations": args.conversations, "changed": args.changed,
        "rounds": args.rounds, "delta_ms": latency.json(), "delta_reply_bytes": reply_bytes,
        "full_paging": {"pages": full_pages, "reply_bytes": full_bytes, "page_size": INBOX_MAX_LIMIT},
        "exact_deltas": exact, "verified": verified,
        "what": "server time of Store::inbox_since (one pooled connection: the token and the two reads, \
                 pipelined), from the token of the full paging taken before the changes; half the changes \
                 are a message from another member, half the user's read cursor moving; the database \
                 analysed after the set-up",
    });
    let doc = json!({
        "machine": environment::machine(&store).await?,
        "durability": environment::durability(&store).await?,
        "date": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        "git_rev": environment::git_rev(),
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "runs": [run.clone()],
    });
    environment::write_json(&args.out, &doc)?;
    Ok(crate::verdict::unverified(&[run]))
}

/// Pages the whole inbox as a client with no token would: pages, reply
/// bytes, and the first page's token.
async fn full_paging(store: &Store, user: &imcore_actors::UserId) -> Result<(usize, usize, String), BoxError> {
    let (mut pages, mut bytes, mut cursor, mut token) = (0, 0, None, None);
    loop {
        let page = store.inbox(user, INBOX_MAX_LIMIT, cursor.as_deref()).await?;
        pages += 1;
        bytes += json_bytes(page.items.iter().map(inbox_item_json).collect());
        token.get_or_insert(page.since);
        match page.next_cursor {
            Some(next) => cursor = Some(next),
            None => return Ok((pages, bytes, token.unwrap_or_default())),
        }
    }
}

fn json_bytes(items: Vec<Value>) -> usize {
    Value::Array(items).to_string().len()
}
