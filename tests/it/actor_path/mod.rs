//! The conversation-actor write path against a real PostgreSQL: issue order
//! (P6), two writers on one log in small batches (and a control without the
//! row lock), joins and leaves racing through two writers (P3, P4), a backend
//! killed mid-batch, overload shedding, idle eviction racing sends, and the
//! commit stage merging many conversations, and an actor's warm cache (its
//! one-round-trip sends) meeting another writer's changes.
//! Each check runs with one transaction per conversation batch and, where
//! the commit stage changes what happens, with the merged commit stage too;
//! each writes its record to evidence/im-04.

mod eviction;
mod faults;
mod membership;
mod merging;
mod ordering;
mod warm_cache;

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use futures_util::future::join_all;
use imcore::config::{EngineSettings, WriteSettings};
use imcore::store::{CreateConversation, GroupSettings, SendAck, Store, Written};
use imcore::writer::{Engine, WriteFailure, Writer};
use imcore_actors::ConvId;
use serde_json::json;
use uuid::Uuid;

use crate::env::{cid, send_op, text, uid, Path};
use crate::evidence::record;
use crate::harness::TestDb;

const SUITE: &str = "im-04";

/// The evidence variant of an actor writer with `workers` commit-stage workers.
fn variant(workers: usize) -> &'static str {
    if workers == 0 {
        "actor"
    } else {
        "actor+commit-stage"
    }
}

/// A writer over `store`, built as the server builds its own.
fn writer(store: Store, write: WriteSettings) -> Writer {
    Engine::start(store, &EngineSettings { write, ..EngineSettings::default() }).writer
}

/// The server's actor path with `workers` commit-stage workers (0: one
/// transaction per conversation batch) on `arbiters` arbiters.
fn actor_path(workers: usize, arbiters: usize) -> WriteSettings {
    WriteSettings { commit_workers: workers, arbiters, ..WriteSettings::on(Path::Actor) }
}

/// Creates `users` and a group of them, created by the first.
async fn group(store: &Store, id: &str, users: &[&str]) -> ConvId {
    for u in users {
        store.create_user(&uid(u), None).await.expect("create user");
    }
    create_group(store, id, users).await
}

/// A group of existing `users`, created by the first.
async fn create_group(store: &Store, id: &str, users: &[&str]) -> ConvId {
    store
        .create_conversation(&CreateConversation::Group {
            creator: uid(users[0]),
            conv_id: Some(cid(id)),
            name: id.into(),
            members: users[1..].iter().map(|m| uid(m)).collect(),
            settings: GroupSettings::default(),
        })
        .await
        .expect("create group")
        .info
        .conv_id
}

fn ack(r: &Result<Written, WriteFailure>) -> Option<&SendAck> {
    match r {
        Ok(Written::Sent(a)) => Some(a),
        _ => None,
    }
}

/// A stored message as a caller's ack describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Row {
    seq: i64,
    message_id: Uuid,
    created_at: DateTime<Utc>,
}

impl Row {
    fn of(a: &SendAck) -> Self {
        Self { seq: a.seq, message_id: a.message_id, created_at: a.created_at }
    }
}

/// `(conv_id, sender_user, client_msg_id)`.
type Key = (String, String, String);

fn key(conv: &ConvId, user: &str, k: &str) -> Key {
    (conv.to_string(), user.to_owned(), k.to_owned())
}

/// Every stored message of the database, by request key, and how many rows
/// there are (more rows than keys would be a duplicate).
async fn stored_messages(c: &tokio_postgres::Client) -> (HashMap<Key, Row>, usize) {
    let rows = c
        .query(
            "SELECT conv_id, sender_user, client_msg_id, seq, message_id, created_at FROM events WHERE kind = 'msg'",
            &[],
        )
        .await
        .expect("stored messages");
    let n = rows.len();
    let map = rows
        .iter()
        .map(|r| {
            let k = (r.get(0), r.get(1), r.get(2));
            (k, Row { seq: r.get(3), message_id: r.get(4), created_at: r.get(5) })
        })
        .collect();
    (map, n)
}

/// `(count, max(seq), next_seq)` of one conversation's log.
async fn log_stats(c: &tokio_postgres::Client, conv: &ConvId) -> (i64, i64, i64) {
    let r = c
        .query_one(
            "SELECT count(e.seq), coalesce(max(e.seq), 0), (SELECT next_seq FROM conversations WHERE conv_id = $1)
               FROM events e WHERE e.conv_id = $1",
            &[&conv.as_str()],
        )
        .await
        .expect("log stats");
    (r.get(0), r.get(1), r.get(2))
}

fn gapless((count, max, next_seq): (i64, i64, i64)) -> bool {
    count == max && next_seq == max + 1
}

/// Waits until a backend of this database other than `c`'s own matches
/// `condition` (a `pg_stat_activity` predicate) and returns its pid.
async fn stalled_backend(c: &tokio_postgres::Client, condition: &str) -> Option<i32> {
    let sql = format!(
        "SELECT pid FROM pg_stat_activity
          WHERE datname = current_database() AND pid <> pg_backend_pid() AND {condition}"
    );
    let deadline = Instant::now() + Duration::from_secs(4);
    while Instant::now() < deadline {
        if let Some(r) = c.query_opt(&sql, &[]).await.expect("pg_stat_activity") {
            return Some(r.get(0));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    None
}

/// The writer's transaction waiting for a conversation row lock.
/// (A row lock is waited for as the holder's transaction id or the tuple; the
/// query text is no help: `pg_stat_activity` cuts long statements short.)
const WAITING_FOR_ROW_LOCK: &str = "wait_event_type = 'Lock' AND wait_event IN ('transactionid', 'tuple')";

use eviction::eviction_races;
use faults::{killed_mid_batch, overload_sheds, Stall};
use membership::joins_and_leaves_race;
use ordering::{issue_order, two_writers_one_log, RowLock};
use warm_cache::another_writers_changes_reach_a_warm_cache;

macro_rules! on_both_commit_modes {
    ($($name:ident => $check:ident($($arg:expr),*);)*) => {
        /// One transaction per conversation batch.
        mod one_transaction_per_batch {
            use super::*;
            $(
                #[actix_web::test]
                async fn $name() {
                    $check($($arg,)* 0).await
                }
            )*
        }

        /// Batches merged across conversations by two commit-stage workers.
        mod merged_commit_stage {
            use super::*;
            $(
                #[actix_web::test]
                async fn $name() {
                    $check($($arg,)* 2).await
                }
            )*
        }
    };
}

// The last argument of each check is its number of commit-stage workers.
on_both_commit_modes! {
    one_clients_sends_get_strictly_increasing_seqs_in_issue_order => issue_order();
    two_hubs_sending_every_key_write_one_gapless_log_and_agree_on_every_ack =>
        two_writers_one_log(Path::Actor, RowLock::Held);
    control_two_hubs_without_the_row_lock_fail_the_same_check =>
        two_writers_one_log(Path::Actor, RowLock::TakenAway);
    an_actor_and_a_direct_writer_sending_every_key_write_one_gapless_log_and_agree_on_every_ack =>
        two_writers_one_log(Path::Direct, RowLock::Held);
    joins_and_leaves_of_one_user_racing_through_two_hubs_keep_periods_and_events_in_step =>
        joins_and_leaves_race(Path::Actor);
    joins_and_leaves_racing_through_an_actor_and_a_direct_writer_keep_periods_and_events_in_step =>
        joins_and_leaves_race(Path::Direct);
    a_batch_killed_while_waiting_for_the_row_lock_fails_as_a_whole_and_retries_once_each =>
        killed_mid_batch(Stall::RowLock);
    a_batch_killed_during_commit_fails_as_a_whole_and_retries_once_each => killed_mid_batch(Stall::AtCommit);
    a_flood_against_a_stalled_batch_is_shed_with_overloaded_and_loses_nothing_acked => overload_sheds();
    sends_racing_idle_eviction_are_all_answered_in_order_and_stored_once => eviction_races();
    a_warm_actor_cache_answers_by_changes_made_elsewhere => another_writers_changes_reach_a_warm_cache();
}
