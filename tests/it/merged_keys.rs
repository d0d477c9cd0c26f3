//! A merged commit-stage round leaves its request keys to the INSERT's
//! unique index, and runs again reading them when it meets a used key,
//! refuses a send, or finds a purged log (ARCHITECTURE §3, "Request keys of
//! a merged round"). Through the server's engine on a real PostgreSQL, each
//! kind of replay, alone among new sends of many conversations at once, is
//! answered as if read under the lock. Writes its record to evidence/im-10.

use std::time::Duration;

use futures_util::future::join_all;
use imcore::domain::{LeaveReason, Rejection};
use imcore::store::{LeaveOp, Pace, SendAck, WriteOp};
use imcore_actors::ConvId;
use serde_json::json;

use crate::env::{text, uid, Env, Path, WriteErr};
use crate::evidence::Check;
use crate::retention::{age_all, hour_group_of, log_shape};

const GROUPS: usize = 36;

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    /// Its log was purged since `a1` and `b1`: both are tombstones.
    Purged,
    /// `u-ben` left since sending `b1`.
    Left,
    Plain,
}

/// One send of each `(group, user, key)` at once, while a share lock on
/// `events` holds the rounds that start first: the batches behind them wait
/// in the stage and meet in merged rounds once it is released. The answers,
/// and how many transactions appended the `fresh` keys.
async fn at_once(env: &Env, sends: &[(&ConvId, &str, &str)], fresh: &str) -> (Vec<Result<SendAck, WriteErr>>, i64) {
    let blocker = env.db.client().await;
    blocker.batch_execute("BEGIN; LOCK TABLE events IN SHARE MODE").await.expect("lock events");
    let all = join_all(sends.iter().map(|(g, user, key)| env.send(g, user, key, text(key))));
    let release = async {
        tokio::time::sleep(Duration::from_millis(800)).await;
        blocker.batch_execute("COMMIT").await.expect("release events");
    };
    let (answers, ()) = tokio::join!(all, release);
    // Rows one transaction inserted share its xmin.
    let transactions = blocker
        .query_one("SELECT count(DISTINCT xmin::text) FROM events WHERE client_msg_id = $1", &[&fresh])
        .await
        .expect("transactions")
        .get(0);
    (answers, transactions)
}

fn dup_of(got: &Result<SendAck, WriteErr>, first: &SendAck) -> bool {
    matches!(got, Ok(ack) if ack.dup && ack.seq == first.seq && ack.message_id == first.message_id)
}

#[actix_web::test]
async fn replays_in_merged_rounds_are_answered_from_the_log_from_tombstones_and_for_past_members() {
    let check = Check::start(
        "im-10",
        "33-merged-round-replays",
        "actor",
        "36 groups of u-ana and u-ben, each with a1 (u-ana) and b1 (u-ben); a third purged since (a1, b1 \
         tombstones), in a third u-ben left since. Three times every group sends at once, one replay kind among \
         new sends of the others: a1 in the purged groups answers IDEMPOTENCY_KEY_EXPIRED and is not appended; b1 \
         of u-ben who left answers dup with its first seq and message id; a1 and b1 in the plain groups answer \
         dup; every new send appends, each round of sends in at most 18 transactions (merged rounds); every \
         log gapless",
    );
    let env = Env::new(Path::Actor).await;
    let c = env.db.client().await;
    env.users(&["u-ana", "u-ben"]).await;
    let mut groups = Vec::with_capacity(GROUPS);
    for i in 0..GROUPS {
        let g = hour_group_of(&env, &format!("g-mk-{i:02}"), &["u-ben"]).await;
        let kind = [Kind::Purged, Kind::Left, Kind::Plain][i % 3];
        let a1 = env.send(&g, "u-ana", "a1", text("a1")).await.expect("a1");
        let b1 = env.send(&g, "u-ben", "b1", text("b1")).await.expect("b1");
        if kind == Kind::Purged {
            age_all(&c, &g).await;
            env.send(&g, "u-ana", "a2", text("a2")).await.expect("a2");
            env.store().purge_conversation(&g, Pace::chunk(100)).await.expect("purge");
        }
        if kind == Kind::Left {
            let leave = LeaveOp { user: uid("u-ben"), actor: uid("u-ben"), reason: LeaveReason::Left };
            env.write(&g, WriteOp::Leave(leave)).await.expect("leave");
        }
        groups.push((g, kind, a1, b1));
    }

    let mut wrong = Vec::new();
    let mut transactions = Vec::new();
    for (replaying, fresh) in [(Kind::Purged, "n1"), (Kind::Left, "n2"), (Kind::Plain, "n3")] {
        let mut sends = Vec::new();
        for (g, kind, ..) in &groups {
            match *kind == replaying {
                true if replaying == Kind::Left => sends.push((g, "u-ben", "b1")),
                true => sends.extend([(g, "u-ana", "a1"), (g, "u-ben", "b1")]),
                false => sends.push((g, "u-ana", fresh)),
            }
        }
        let (answers, appended_by) = at_once(&env, &sends, fresh).await;
        transactions.push(appended_by);
        for ((g, _, key), got) in sends.iter().zip(&answers) {
            let (_, kind, a1, b1) = groups.iter().find(|(x, ..)| x == *g).expect("group");
            let first = if *key == "a1" { a1 } else { b1 };
            let ok = match (*key, kind) {
                (k, _) if k == fresh => matches!(got, Ok(ack) if !ack.dup),
                (_, Kind::Purged) => matches!(got, Err(WriteErr::Rejected(Rejection::IdempotencyKeyExpired))),
                _ => dup_of(got, first),
            };
            if !ok {
                wrong.push(format!("{g} {key}: {got:?}"));
            }
        }
    }
    for (g, kind, ..) in &groups {
        let (_, _, _, gapless) = log_shape(&c, g).await;
        let old: i64 = c
            .query_one(
                "SELECT count(*) FROM events WHERE conv_id = $1 AND client_msg_id IN ('a1', 'b1')",
                &[&g.as_str()],
            )
            .await
            .expect("rows of a1 and b1")
            .get(0);
        if !gapless || old != if *kind == Kind::Purged { 0 } else { 2 } {
            wrong.push(format!("{g}: gapless {gapless}, rows of a1 and b1 {old}"));
        }
    }
    let merged = transactions.iter().all(|t| *t <= GROUPS as i64 / 2);
    let pass = wrong.is_empty() && merged;
    let pass =
        check.resolve(json!({"groups": GROUPS, "transactions_per_round_of_sends": transactions, "wrong": wrong}), pass);
    assert!(pass);
}
