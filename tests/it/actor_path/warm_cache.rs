//! An actor whose cache is warm (its sends go in one round trip) meets
//! changes made elsewhere: a mute by another writer or by SQL with no event,
//! `mute_all`, an append, its own earlier keys. Each must reach the next
//! send's answer.

use imcore::domain::Rejection;
use imcore::store::{GroupChange, GroupOp, WriteOp};

use super::*;
use crate::evidence::Check;

fn group_op(actor: &str, change: GroupChange) -> WriteOp {
    WriteOp::Group(GroupOp { actor: uid(actor), change })
}

pub(super) async fn another_writers_changes_reach_a_warm_cache(workers: usize) {
    let check = Check::start(
        SUITE,
        "actor-warm-cache-sees-other-writers",
        variant(workers),
        "an actor's cache kept warm by sends of u-m (each then goes in one round trip) against changes made \
         elsewhere: u-x muted by SQL before the cache warmed (the roster never saw u-x) → MUTED while u-y, \
         unknown to the roster too, is acked; u-m muted by a second writer on another pool, and (as an operator's SQL would, with no \
         event) muted with member_version moved, and mute_all set → each time the actor's next send of u-m \
         is MUTED; u-m's key m2 again on the warm cache (its one round trip meets the key in the log) → dup \
         with m2's seq, and the next send takes the next seq (the retry took none); the owner's send through the second writer then through the actor → consecutive seqs; \
         u-m's first key again through the actor → dup with its original seq; log gapless",
    );
    let db = TestDb::with_pool(8).await;
    let conv = group(&db.store, "g-warm", &["u-o", "u-m", "u-x", "u-y"]).await;
    let other = Store::connect(&db.url, 4).await.expect("second store");
    let actor = writer(db.store.clone(), actor_path(workers, 1));
    let elsewhere = writer(other, WriteSettings::on(Path::Direct));
    let c = db.client().await;
    let sql = |statement: &'static str| {
        let (c, conv) = (&c, conv.to_string());
        async move { c.execute(statement, &[&conv]).await.expect(statement) }
    };
    let send = |w: &Writer, user: &str, key: &str| w.write(conv.clone(), send_op(user, key, text(key)));
    let change = |change: GroupChange| elsewhere.write(conv.clone(), group_op("u-o", change));
    let an_hour = Utc::now() + chrono::Duration::hours(1);

    // Muted before the actor's cache warms: its roster never learns it.
    sql("UPDATE members SET mute_until = now() + interval '1 hour' WHERE conv_id = $1 AND user_id = 'u-x'").await;
    sql("UPDATE conversations SET member_version = member_version + 1 WHERE conv_id = $1").await;
    let first = send(&actor, "u-m", "m1").await;
    let mut warm = vec![send(&actor, "u-m", "m2").await];
    // Senders the warm roster does not know: a plain member, and the muted one.
    warm.push(send(&actor, "u-y", "y1").await);
    let mut muted = vec![send(&actor, "u-x", "x1").await];
    change(GroupChange::Mute { user: uid("u-m"), until: Some(an_hour) }).await.expect("mute elsewhere");
    muted.push(send(&actor, "u-m", "m3").await);
    change(GroupChange::Mute { user: uid("u-m"), until: None }).await.expect("unmute elsewhere");
    warm.push(send(&actor, "u-m", "m4").await);
    warm.push(send(&actor, "u-m", "m5").await);
    sql("UPDATE members SET mute_until = now() + interval '1 hour' WHERE conv_id = $1 AND user_id = 'u-m'").await;
    sql("UPDATE conversations SET member_version = member_version + 1 WHERE conv_id = $1").await;
    muted.push(send(&actor, "u-m", "m6").await);
    sql("UPDATE members SET mute_until = NULL WHERE conv_id = $1 AND user_id = 'u-m'").await;
    sql("UPDATE conversations SET member_version = member_version + 1 WHERE conv_id = $1").await;
    warm.push(send(&actor, "u-m", "m7").await);
    warm.push(send(&actor, "u-m", "m8").await);
    // A retry the warm cache cannot tell apart: its one round trip meets the key in the log.
    let warm_replay = send(&actor, "u-m", "m2").await;
    let after_replay = send(&actor, "u-m", "m10").await;
    sql("UPDATE conversations SET mute_all = true WHERE conv_id = $1").await;
    muted.push(send(&actor, "u-m", "m9").await);
    let there = send(&elsewhere, "u-o", "o1").await;
    let here = send(&actor, "u-o", "o2").await;
    let replay = send(&actor, "u-m", "m1").await;

    let is_muted = |r: &Result<Written, WriteFailure>| matches!(r, Err(WriteFailure::Rejected(Rejection::Muted)));
    let seq = |r: &Result<Written, WriteFailure>| ack(r).map(|a| a.seq);
    let stats = log_stats(&c, &conv).await;
    let pass = warm.iter().all(|r| ack(r).is_some())
        && muted.iter().all(is_muted)
        && seq(&there).is_some()
        && seq(&here) == seq(&there).map(|s| s + 1)
        && ack(&replay).is_some_and(|r| r.dup && Some(r.seq) == seq(&first))
        && ack(&warm_replay).is_some_and(|r| r.dup && Some(r.seq) == seq(&warm[0]))
        && seq(&after_replay) == seq(&warm[warm.len() - 1]).map(|s| s + 1)
        && gapless(stats);
    let observed = json!({
        "warm_sends": warm.iter().map(|r| format!("{r:?}")).collect::<Vec<_>>(),
        "after_each_mute": muted.iter().map(|r| format!("{r:?}")).collect::<Vec<_>>(),
        "owner_elsewhere": format!("{there:?}"), "owner_through_actor": format!("{here:?}"),
        "first": format!("{first:?}"), "replay_of_first": format!("{replay:?}"),
        "warm_replay_of_m2": format!("{warm_replay:?}"), "after_it": format!("{after_replay:?}"),
        "log": {"count": stats.0, "max": stats.1, "next_seq": stats.2},
    });
    assert!(check.resolve(observed, pass));
}
