//! Reconnect deltas (PROTOCOL §7 `conversations?since=`) against a real
//! PostgreSQL: a delta lists what changed for the user and nothing else, and
//! deltas chained while writers commit concurrently miss no change. Each
//! check writes its record to evidence/im-09.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;
use imcore::domain::{LeaveReason, Role};
use imcore::store::{GroupChange, GroupOp, InboxDelta, JoinOp, LeaveOp, WriteOp, SINCE_MAX_CHANGED};
use imcore_actors::ConvId;
use serde_json::json;

use crate::env::{text, uid, Env, Path};
use crate::evidence::Check;

const SUITE: &str = "im-09";

fn changed(delta: &InboxDelta) -> (HashSet<String>, HashSet<String>, String) {
    match delta {
        InboxDelta::Changed { items, left, since } => (
            items.iter().map(|i| i.conversation.conv_id.to_string()).collect(),
            left.iter().map(ToString::to_string).collect(),
            since.clone(),
        ),
        InboxDelta::Reset => panic!("unexpected reset"),
    }
}

fn set(ids: &[&str]) -> HashSet<String> {
    ids.iter().map(|s| s.to_string()).collect()
}

#[actix_web::test]
async fn a_delta_lists_exactly_the_conversations_that_changed_for_the_user() {
    let check = Check::start(
        SUITE,
        "07-since-delta-exact",
        "actor",
        "after a full inbox page, a message in g-msg, ana's read cursor in g-read, a new group g-new with \
         ana, ana leaving g-left, ana kicked from g-kick, g-gone dismissed, and a message in g-other without ana: \
         the delta from the page's token lists g-msg, g-read, g-new as inbox items and g-left, g-kick, g-gone as \
         left, nothing else (g-still unchanged); the next delta lists none of the left again and picks up a \
         later message in g-still",
    );
    let env = Env::new(Path::Actor).await;
    env.users(&["u-ana", "u-ben", "u-cy"]).await;
    let mut convs = HashMap::new();
    for id in ["g-msg", "g-read", "g-left", "g-kick", "g-gone", "g-still"] {
        convs.insert(id, env.group(id, "u-ben", &["u-ana"]).await);
    }
    let other = env.group("g-other", "u-ben", &["u-cy"]).await;
    env.send(&convs["g-read"], "u-ben", "r1", text("unread")).await.expect("send");
    let page = env.store().inbox(&uid("u-ana"), 50, None).await.expect("inbox");
    let listed = page.items.len();

    env.send(&convs["g-msg"], "u-ben", "m1", text("hello")).await.expect("send");
    let head = env.head(&convs["g-read"]).await;
    env.store().mark_read(&convs["g-read"], &uid("u-ana"), head).await.expect("read");
    env.group("g-new", "u-ben", &["u-ana"]).await;
    let leave =
        |user: &str, actor: &str, reason| WriteOp::Leave(LeaveOp { user: uid(user), actor: uid(actor), reason });
    env.write(&convs["g-left"], leave("u-ana", "u-ana", LeaveReason::Left)).await.expect("leave");
    env.write(
        &convs["g-kick"],
        WriteOp::Group(GroupOp { actor: uid("u-ben"), change: GroupChange::Kick(uid("u-ana")) }),
    )
    .await
    .expect("kick");
    env.write(&convs["g-gone"], WriteOp::Group(GroupOp { actor: uid("u-ben"), change: GroupChange::Dismiss }))
        .await
        .expect("dismiss");
    env.send(&other, "u-ben", "o1", text("not for ana")).await.expect("send");

    let first = env.store().inbox_since(&uid("u-ana"), &page.since).await.expect("delta");
    let (items, left, since) = changed(&first);
    let exact = items == set(&["g-msg", "g-read", "g-new"]) && left == set(&["g-left", "g-kick", "g-gone"]);

    env.send(&convs["g-still"], "u-ben", "s1", text("later")).await.expect("send");
    let second = env.store().inbox_since(&uid("u-ana"), &since).await.expect("delta");
    let (items2, left2, _) = changed(&second);
    // A change in the token's own millisecond may be reported again (never missed).
    let next_ok = items2.contains("g-still") && items2.is_subset(&set(&["g-still", "g-new"])) && left2.is_empty();
    let pass = listed == 6 && exact && next_ok;
    let pass = check.resolve(
        json!({"first_page_items": listed, "delta_items": sorted(&items), "delta_left": sorted(&left),
               "next_delta_items": sorted(&items2), "next_delta_left": sorted(&left2)}),
        pass,
    );
    assert!(pass);
}

fn sorted(s: &HashSet<String>) -> Vec<&String> {
    let mut v: Vec<&String> = s.iter().collect();
    v.sort();
    v
}

#[actix_web::test]
async fn deltas_chained_while_writers_commit_miss_no_change() {
    const CONVS: usize = 24;
    const WRITERS: usize = 8;
    let check = Check::start(
        SUITE,
        "07-since-chained-under-writes",
        "actor",
        "8 writers send to 24 groups of ana for 3 s (actor path, commit stage: many transactions in flight at \
         every moment) while ana chains deltas, each from the last one's token: for every group, the highest \
         head any delta reported equals its final head — no commit slipped between a token and its snapshot",
    );
    let env = Arc::new(Env::new(Path::Actor).await);
    env.users(&["u-ana", "u-ben"]).await;
    let mut convs: Vec<ConvId> = vec![];
    for i in 0..CONVS {
        convs.push(env.group(&format!("g-c{i}"), "u-ben", &["u-ana"]).await);
    }
    let page = env.store().inbox(&uid("u-ana"), 200, None).await.expect("inbox");
    let mut seen: HashMap<String, i64> =
        page.items.iter().map(|i| (i.conversation.conv_id.to_string(), i.conversation.head)).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let writers = (0..WRITERS).map(|w| {
        let (env, convs, stop) = (env.clone(), convs.clone(), stop.clone());
        async move {
            let mut n = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let conv = &convs[(n * 7 + w * 5) % convs.len()];
                env.send(conv, "u-ben", &format!("w{w}-{n}"), text("x")).await.expect("send");
                n += 1;
            }
            n
        }
    });
    let reader = async {
        let mut token = page.since.clone();
        let mut deltas = 0;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
        while tokio::time::Instant::now() < deadline {
            let delta = env.store().inbox_since(&uid("u-ana"), &token).await.expect("delta");
            let InboxDelta::Changed { items, since, .. } = delta else { panic!("reset") };
            for i in items {
                let e = seen.entry(i.conversation.conv_id.to_string()).or_default();
                *e = (*e).max(i.conversation.head);
            }
            token = since;
            deltas += 1;
        }
        stop.store(true, Ordering::Relaxed);
        (token, deltas)
    };
    let (sent, (token, deltas)) = tokio::join!(join_all(writers), reader);
    // Writers have returned: everything is committed. One more delta.
    let InboxDelta::Changed { items, .. } = env.store().inbox_since(&uid("u-ana"), &token).await.expect("delta") else {
        panic!("reset")
    };
    for i in items {
        let e = seen.entry(i.conversation.conv_id.to_string()).or_default();
        *e = (*e).max(i.conversation.head);
    }
    let mut missed = vec![];
    for conv in &convs {
        let head = env.head(conv).await;
        let got = seen.get(conv.as_str()).copied().unwrap_or(0);
        if got != head {
            missed.push(json!({"conv": conv.as_str(), "final_head": head, "highest_reported": got}));
        }
    }
    let sends: usize = sent.iter().sum();
    let pass = missed.is_empty() && deltas > 10 && sends > CONVS;
    let pass = check.resolve(json!({"sends": sends, "deltas": deltas, "missed": missed}), pass);
    assert!(pass);
}

#[actix_web::test]
async fn a_token_that_is_not_ours_too_old_or_too_fruitful_answers_reset() {
    let check = Check::start(
        SUITE,
        "07-since-reset",
        "direct",
        "a garbage token, a token from 31 days ago, one from the future, and a token after which more than \
         SINCE_MAX_CHANGED (200) of the user's conversations changed each answer reset",
    );
    let env = Env::new(Path::Direct).await;
    env.users(&["u-ana", "u-ben"]).await;
    let ana = uid("u-ana");
    let token_at = |days: i64| hex_millis(chrono::Utc::now() + chrono::TimeDelta::days(days));
    let mut resets = vec![];
    for token in ["", "zz", "not a token", &token_at(-31), &token_at(2)] {
        resets.push(matches!(env.store().inbox_since(&ana, token).await.expect("delta"), InboxDelta::Reset));
    }
    let page = env.store().inbox(&ana, 1, None).await.expect("inbox");
    // Joining creates the change in bulk: one join per conversation.
    for i in 0..=SINCE_MAX_CHANGED {
        let conv = env.group(&format!("g-r{i}"), "u-ben", &[]).await;
        env.write(&conv, WriteOp::Join(JoinOp { user: uid("u-ana"), actor: uid("u-ben"), role: Role::Member }))
            .await
            .expect("join");
    }
    resets.push(matches!(env.store().inbox_since(&ana, &page.since).await.expect("delta"), InboxDelta::Reset));
    let pass = resets.iter().all(|r| *r);
    let pass = check.resolve(json!({"reset": resets}), pass);
    assert!(pass);
}

fn hex_millis(t: chrono::DateTime<chrono::Utc>) -> String {
    hex::encode(t.timestamp_millis().to_string())
}
