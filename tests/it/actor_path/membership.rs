//! P3 and P4 through the write path: joins and leaves of one user racing
//! through two writers, in small batches.

use super::*;
use imcore::domain::{LeaveReason, Role};
use imcore::store::{JoinOp, LeaveOp, WriteOp};

use super::ordering::SMALL_BATCH;

/// A join or leave of u-cai, as its caller saw it.
struct Change {
    join: bool,
    outcome: Result<Written, WriteFailure>,
}

fn change_of_cai(join: bool) -> WriteOp {
    if join {
        WriteOp::Join(JoinOp { user: uid("u-cai"), actor: uid("u-ana"), role: Role::Member })
    } else {
        WriteOp::Leave(LeaveOp { user: uid("u-cai"), actor: uid("u-cai"), reason: LeaveReason::Left })
    }
}

/// `(from_seq, to_seq)` of u-cai's periods, and the seqs of its join and
/// leave events, ascending.
async fn periods_and_events(
    c: &tokio_postgres::Client,
    conv: &ConvId,
) -> (Vec<(i64, Option<i64>)>, Vec<i64>, Vec<i64>) {
    let periods = c
        .query(
            "SELECT from_seq, to_seq FROM membership_periods WHERE conv_id = $1 AND user_id = 'u-cai' ORDER BY from_seq",
            &[&conv.as_str()],
        )
        .await
        .expect("periods")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let events = |kind: &'static str| async move {
        c.query(
            "SELECT seq FROM events WHERE conv_id = $1 AND kind = $2 AND subject_user = 'u-cai' ORDER BY seq",
            &[&conv.as_str(), &kind],
        )
        .await
        .expect("membership events")
        .iter()
        .map(|r| r.get(0))
        .collect::<Vec<i64>>()
    };
    (periods, events("join").await, events("leave").await)
}

pub(super) async fn joins_and_leaves_race(second: Path, workers: usize) {
    const TASKS: usize = 8;
    const ROUNDS: usize = 10;
    let db = TestDb::with_pool(16).await;
    let conv = group(&db.store, "g-p3p4", &["u-ana", "u-ben", "u-cai"]).await;
    let c = db.client().await;
    // u-cai's join at the group's creation is not one of the race's.
    let joins_before = periods_and_events(&c, &conv).await.1.len();
    let other = Store::connect(&db.url, 16).await.expect("second store");
    let small = WriteSettings { max_batch: SMALL_BATCH, ..actor_path(workers, 2) };
    let writers = [writer(db.store.clone(), small.clone()), writer(other, WriteSettings { path: second, ..small })];
    // Every task alternates joins and leaves of u-cai through one writer,
    // half starting with a leave: most meet a state another writer just changed.
    let changes: Vec<Change> = join_all((0..TASKS).map(|t| {
        let (w, conv) = (writers[t % 2].clone(), conv.clone());
        async move {
            let mut done = vec![];
            for r in 0..ROUNDS {
                let join = (t + r) % 2 == 1;
                done.push(Change { join, outcome: w.write(conv.clone(), change_of_cai(join)).await });
            }
            done
        }
    }))
    .await
    .into_iter()
    .flatten()
    .collect();
    let (periods, joins, leaves) = periods_and_events(&c, &conv).await;
    let stats = log_stats(&c, &conv).await;
    let member_now: bool = c
        .query_one("SELECT EXISTS (SELECT 1 FROM members WHERE conv_id = $1 AND user_id = 'u-cai')", &[&conv.as_str()])
        .await
        .expect("members")
        .get(0);
    let failures: Vec<String> = changes
        .iter()
        .filter_map(|ch| match &ch.outcome {
            Err(WriteFailure::Rejected(_)) | Ok(_) => None,
            Err(e) => Some(format!("{e:?}").chars().take(200).collect()),
        })
        .collect();
    let acked = |join: bool| -> Vec<i64> {
        let mut seqs: Vec<i64> = changes
            .iter()
            .filter(|ch| ch.join == join)
            .filter_map(|ch| match ch.outcome {
                Ok(Written::Joined { seq }) | Ok(Written::Left { seq }) => Some(seq),
                _ => None,
            })
            .collect();
        seqs.sort_unstable();
        seqs
    };
    // P3: periods never overlap, only the last may be open. P4: each period
    // opens at one of u-cai's join events and closes at one of its leave
    // events, and every acked change is that event.
    let no_overlap = periods.windows(2).all(|p| p[0].1.is_some_and(|to| to < p[1].0));
    let opened_by_joins = periods.iter().map(|p| p.0).collect::<Vec<_>>() == joins;
    let closed_by_leaves = periods.iter().filter_map(|p| p.1).collect::<Vec<_>>() == leaves;
    let open_is_member = periods.last().is_some_and(|p| p.1.is_none()) == member_now;
    let pass = failures.is_empty()
        && no_overlap
        && opened_by_joins
        && closed_by_leaves
        && open_is_member
        && acked(true) == joins[joins_before..]
        && acked(false) == leaves
        && !leaves.is_empty()
        && gapless(stats);
    let second_name = if second == Path::Direct { "+direct" } else { "" };
    record(
        SUITE,
        "actor-p3-p4-joins-and-leaves-race",
        &format!("{}{second_name}", variant(workers)),
        &format!(
            "{TASKS} tasks alternate {ROUNDS} joins and leaves of one user through two writers (actor batches of at \
             most {SMALL_BATCH}): no failures; the user's periods never overlap and only the last may be open (P3); \
             each opens at one of its join events and closes at one of its leave events, which are exactly the acked \
             changes (P4); members agrees with the open period; log gapless"
        ),
        json!({"changes": changes.len(), "failures": failures.len(), "first_failures": &failures[..failures.len().min(2)],
               "periods": periods.len(), "join_events": joins.len(), "leave_events": leaves.len(),
               "no_overlap": no_overlap, "opened_by_joins": opened_by_joins, "closed_by_leaves": closed_by_leaves,
               "open_is_member": open_is_member, "log": {"count": stats.0, "max": stats.1, "next_seq": stats.2}}),
        pass,
    );
    assert!(pass);
}
