//! The rules' leaks closed: a stranger's write costs the same whether the
//! conversation exists or not (the stranger gate), only the owner shortens
//! the retention, a former member sees the conversation as it left it, a
//! recall erases the message's fingerprint, and a user's many membership
//! periods do not make its sync scan all of them. Records go to evidence/im-16.

use std::time::Instant;

use imcore::store::direct_conv_id;
use imcore_actors::UserId;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::evidence::Check;
use crate::harness::alone_with_the_cpu;
use crate::server::{TestServer, Ws};

const SUITE: &str = "im-16";

async fn server() -> TestServer {
    TestServer::with(|c| c.limits.create_per_minute = 0).await
}

/// A request over WebSocket; `Ok(result)` or `Err(error object)`.
async fn call(ws: &mut Ws, op: &str, fields: Value) -> Result<Value, Value> {
    let reply = ws.request(op, fields).await;
    if reply["ok"] == json!(true) {
        Ok(reply)
    } else {
        Err(reply["error"].clone())
    }
}

async fn group(ws: &mut Ws, conv: &str, name: &str, members: &[&str]) {
    let fields = json!({"kind": "group", "conv_id": conv, "name": name, "members": members});
    call(ws, "create_conversation", fields).await.expect("create the group");
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(f64::total_cmp);
    v
}

const BATCHES: usize = 20;
const PER_BATCH: usize = 10;
const ROUNDS: usize = 5;

#[actix_web::test]
async fn a_strangers_send_costs_the_same_whether_the_conversation_exists_or_not() {
    let check = Check::start(
        SUITE,
        "16-leak-timing",
        "direct conversations, a stranger's sends over WebSocket",
        "a stranger's send to a conversation it is not in answers the same NOT_MEMBER error (so do its recall and \
         group ops, on an existing invite-only group and a missing one), and the send's latency \
         does not tell an existing conversation from a missing one: in batches of 10 (5 existing, 5 missing, \
         in a new random order each of 5 rounds, medians ranked) the 5 slowest are the existing ones in at most half the \
         batches (chance: 1 in 252; the unfixed server: 20 of 20)",
    );
    let _alone = alone_with_the_cpu().await;
    let s = server().await;
    let eve = s.user("u-eve").await;
    let mut stranger = s.ws(&eve).await;
    // Per batch, 5 direct chats that exist (their members talk, so their
    // actors are warm) and 5 of pairs that never talked.
    let mut batches = vec![];
    for b in 0..BATCHES {
        let mut targets = vec![];
        for i in 0..PER_BATCH / 2 {
            let (a, z) = (format!("u-a{b}x{i}"), format!("u-z{b}x{i}"));
            let token = s.user(&a).await;
            s.user(&z).await;
            let existing = s.direct(&token, &z).await;
            let never = UserId::parse(&format!("u-n{b}x{i}")).expect("id");
            let missing = direct_conv_id(&UserId::parse(&a).expect("id"), &never).expect("direct id").to_string();
            targets.push((existing, true, token));
            targets.push((missing, false, String::new()));
        }
        batches.push(targets);
    }
    let (mut lat_existing, mut lat_missing) = (vec![], vec![]);
    let (mut identified, mut pairs_right, mut pairs) = (0, 0, 0);
    let mut answers = std::collections::BTreeSet::new();
    let mut n = 0;
    let mut rng = rand::rngs::StdRng::seed_from_u64(16);
    for targets in &batches {
        for (conv, exists, token) in targets {
            if *exists {
                let body = json!({"client_msg_id": format!("warm-{n}"), "body": {"type": "text", "text": "hi"}});
                let (status, _) =
                    s.http("POST", &format!("/v1/conversations/{conv}/messages"), Some(token), Some(&body)).await;
                assert_eq!(status, 201);
                n += 1;
            }
        }
        let mut samples: Vec<Vec<f64>> = vec![vec![]; targets.len()];
        let mut order: Vec<usize> = (0..targets.len()).collect();
        for _ in 0..ROUNDS {
            // A new order each round: no position in the round goes with existing.
            order.shuffle(&mut rng);
            for &i in &order {
                let (conv, exists, _) = &targets[i];
                let fields = json!({"conv_id": conv, "client_msg_id": format!("probe-{n}"),
                                    "body": {"type": "text", "text": "who is there?"}});
                n += 1;
                let started = Instant::now();
                let error = call(&mut stranger, "send", fields).await.expect_err("a stranger's send is refused");
                let ms = started.elapsed().as_secs_f64() * 1000.0;
                samples[i].push(ms);
                if *exists {
                    lat_existing.push(ms)
                } else {
                    lat_missing.push(ms)
                }
                answers.insert(error.to_string());
            }
        }
        let medians: Vec<f64> = samples.into_iter().map(|v| percentile(&sorted(v), 0.5)).collect();
        order.sort_by(|&x, &y| medians[y].total_cmp(&medians[x]));
        if order[..PER_BATCH / 2].iter().all(|&i| targets[i].1) {
            identified += 1;
        }
        for i in (0..targets.len()).filter(|&i| targets[i].1) {
            for j in (0..targets.len()).filter(|&j| !targets[j].1) {
                pairs += 1;
                pairs_right += usize::from(medians[i] > medians[j]);
            }
        }
    }
    // Every other write op of a stranger: one answer for a group that exists
    // (invite-only) and for an id nobody uses.
    let own = s.user("u-own").await;
    let mut owner = s.ws(&own).await;
    group(&mut owner, "g-exists", "exists", &[]).await;
    let ops = [
        ("recall", json!({"target_seq": 1})),
        ("join", json!({})),
        ("leave", json!({})),
        ("invite", json!({"user_ids": ["u-eve"]})),
        ("kick", json!({"user_id": "u-own"})),
        ("update_group", json!({"name": "mine"})),
        ("set_alias", json!({"alias": "eve"})),
        ("dismiss", json!({})),
    ];
    let mut same_for_other_ops = vec![];
    for (op, fields) in ops {
        let mut answers = vec![];
        for conv in ["g-exists", "g-missing"] {
            let mut fields = fields.clone();
            fields["conv_id"] = json!(conv);
            answers.push(call(&mut stranger, op, fields).await.expect_err("refused"));
        }
        same_for_other_ops.push(json!({"op": op, "same": answers[0] == answers[1], "answer": answers[0]}));
    }
    let others_same =
        same_for_other_ops.iter().all(|a| a["same"] == json!(true) && a["answer"]["code"] == json!("NOT_MEMBER"));
    let (lat_existing, lat_missing) = (sorted(lat_existing), sorted(lat_missing));
    let one_answer = answers.len() == 1 && answers.iter().all(|a| a.contains("NOT_MEMBER"));
    let observed = json!({
        "batches": BATCHES, "targets_per_batch": PER_BATCH, "sends_per_target": ROUNDS,
        "batches_identified": identified,
        "pairs_existing_slower_fraction": pairs_right as f64 / pairs as f64,
        "existing_ms": {"median": percentile(&lat_existing, 0.5), "p99": percentile(&lat_existing, 0.99)},
        "missing_ms": {"median": percentile(&lat_missing, 0.5), "p99": percentile(&lat_missing, 0.99)},
        "answers": answers,
        "other_ops": same_for_other_ops,
    });
    let pass = one_answer && others_same && identified <= BATCHES / 2;
    assert!(check.resolve(observed.clone(), pass), "{observed}");
}

const PERIODS: usize = 100;
const PER_PERIOD: usize = 100;
const SYNCS: usize = 30;

/// Median and p99 (ms) of `SYNCS` first-page syncs of `conv` by `ws`'s user
/// (after one untimed); the last page seen.
async fn time_syncs(ws: &mut Ws, conv: &str) -> (f64, f64, Value) {
    let mut ms = vec![];
    let mut page = call(ws, "sync", json!({"conv_id": conv, "after_seq": 0, "limit": 100})).await.expect("warm up");
    for _ in 0..SYNCS {
        let started = Instant::now();
        page = call(ws, "sync", json!({"conv_id": conv, "after_seq": 0, "limit": 100})).await.expect("sync");
        ms.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    let ms = sorted(ms);
    (percentile(&ms, 0.5), percentile(&ms, 0.99), page)
}

#[actix_web::test]
async fn a_user_with_many_membership_periods_syncs_a_page_without_reading_them_all() {
    let check = Check::start(
        SUITE,
        "16-leak-many-periods",
        "100 periods of 100 messages each vs one period over the same log; sync after_seq=0 limit=100",
        "the first page holds exactly the first 100 events inside the user's periods, ascending; its latency \
         with 100 periods is measured against one period's (recorded, not asserted)",
    );
    let _alone = alone_with_the_cpu().await;
    let s = server().await;
    let (own, many, one) = (s.user("u-own").await, s.user("u-many").await, s.user("u-one").await);
    let mut owner = s.ws(&own).await;
    group(&mut owner, "g-periods", "periods", &["u-one"]).await;
    let mut n = 0;
    for _ in 0..PERIODS {
        call(&mut owner, "invite", json!({"conv_id": "g-periods", "user_ids": ["u-many"]})).await.expect("invite");
        // In bursts under the connection's 64 requests in flight.
        for _ in 0..PER_PERIOD / 50 {
            let mut ids = vec![];
            for _ in 0..50 {
                let fields = json!({"conv_id": "g-periods", "client_msg_id": format!("m{n}"), "body": {"text": n}});
                ids.push(owner.start("send", fields).await);
                n += 1;
            }
            for id in ids {
                let reply = owner.reply(id).await;
                assert_eq!(reply["ok"], json!(true), "{reply}");
            }
        }
        call(&mut owner, "kick", json!({"conv_id": "g-periods", "user_id": "u-many"})).await.expect("kick");
    }
    let (mut w_many, mut w_one) = (s.ws(&many).await, s.ws(&one).await);
    let (many_median, many_p99, page) = time_syncs(&mut w_many, "g-periods").await;
    let (one_median, one_p99, _) = time_syncs(&mut w_one, "g-periods").await;
    // Period k (from 0) is join, PER_PERIOD messages, leave: seqs 3 + k·(PER_PERIOD + 2) on.
    let period = (PER_PERIOD + 2) as i64;
    let expect: Vec<i64> =
        (0..PERIODS as i64).flat_map(|k| (0..period).map(move |i| 3 + k * period + i)).take(100).collect();
    let got: Vec<i64> =
        page["events"].as_array().expect("events").iter().map(|e| e["seq"].as_i64().expect("seq")).collect();
    let c = s.db.client().await;
    let plan: Vec<String> = c
        .query(
            &format!("EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF) {}", imcore::store::SYNC_FORWARD),
            &[&"g-periods", &"u-many", &0i64, &(3 + PERIODS as i64 * period), &101i64],
        )
        .await
        .expect("explain")
        .iter()
        .map(|r| r.get(0))
        .collect();
    let observed = json!({
        "periods": PERIODS, "messages_per_period": PER_PERIOD, "syncs": SYNCS,
        "many_periods_ms": {"median": many_median, "p99": many_p99},
        "one_period_ms": {"median": one_median, "p99": one_p99},
        "ratio_of_medians": many_median / one_median,
        "page_seqs_first_last": [got.first(), got.last()], "page_len": got.len(),
        "plan": plan,
    });
    assert!(check.resolve(observed.clone(), got == expect && page["has_more"] == json!(true)), "{observed}");
}

/// The conversation as `ws`'s user gets it.
async fn conversation(ws: &mut Ws, conv: &str) -> Value {
    call(ws, "get_conversation", json!({"conv_id": conv})).await.expect("get_conversation")
}

#[actix_web::test]
async fn only_the_owner_shortens_the_retention() {
    let check = Check::start(
        SUITE,
        "16-leak-retention-admin",
        "update_group retention_ms by an admin, a temporary admin and the owner",
        "an admin or temporary admin setting a retention where there was none, or a shorter one, gets FORBIDDEN: \
         nothing changes, no event, and the purge erases nothing; lengthening or clearing it is theirs; the \
         owner shortens it (a group event)",
    );
    let s = server().await;
    let (own, adm, tmp) = (s.user("u-own").await, s.user("u-adm").await, s.user("u-tmp").await);
    let (mut owner, mut admin, mut temp) = (s.ws(&own).await, s.ws(&adm).await, s.ws(&tmp).await);
    group(&mut owner, "g-ret", "retention", &["u-adm", "u-tmp"]).await;
    let until = (chrono::Utc::now() + chrono::Duration::hours(1)).to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    call(&mut owner, "set_role", json!({"conv_id": "g-ret", "user_id": "u-adm", "role": "admin"}))
        .await
        .expect("admin");
    call(&mut owner, "set_role", json!({"conv_id": "g-ret", "user_id": "u-tmp", "role": "admin", "until": until}))
        .await
        .expect("temporary admin");
    for i in 0..5 {
        let fields = json!({"conv_id": "g-ret", "client_msg_id": format!("m{i}"), "body": {"text": i}});
        call(&mut owner, "send", fields).await.expect("send");
    }
    let update = |ms: Value| json!({"conv_id": "g-ret", "retention_ms": ms});
    let code = |r: Result<Value, Value>| match r {
        Ok(_) => "ok".to_owned(),
        Err(e) => e["code"].as_str().unwrap_or("?").to_owned(),
    };
    let before = conversation(&mut owner, "g-ret").await;
    let mut steps = vec![];
    steps.push(("admin sets 1 ms (none before)", code(call(&mut admin, "update_group", update(json!(1))).await)));
    steps.push(("temporary admin sets 1 ms", code(call(&mut temp, "update_group", update(json!(1))).await)));
    let after_refusals = conversation(&mut owner, "g-ret").await;
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    let (_, purge) = s.admin("/v1/admin/retention/run", json!({})).await;
    steps.push(("owner sets 1 hour", code(call(&mut owner, "update_group", update(json!(3_600_000))).await)));
    steps.push(("admin shortens to 1 ms", code(call(&mut admin, "update_group", update(json!(1))).await)));
    steps.push((
        "temporary admin shortens to 59 min",
        code(call(&mut temp, "update_group", update(json!(3_540_000))).await),
    ));
    steps.push(("admin lengthens to 2 hours", code(call(&mut admin, "update_group", update(json!(7_200_000))).await)));
    steps.push(("temporary admin clears it", code(call(&mut temp, "update_group", update(Value::Null)).await)));
    steps.push(("owner sets 1 ms", code(call(&mut owner, "update_group", update(json!(1))).await)));
    let last = conversation(&mut owner, "g-ret").await;
    let page = call(
        &mut owner,
        "sync",
        json!({"conv_id": "g-ret", "before_seq": last["head"].as_i64().unwrap_or(0) + 1, "limit": 1}),
    )
    .await
    .expect("sync");
    let expected = ["FORBIDDEN", "FORBIDDEN", "ok", "FORBIDDEN", "FORBIDDEN", "ok", "ok", "ok"];
    let got: Vec<&str> = steps.iter().map(|(_, c)| c.as_str()).collect();
    let unchanged = before["head"] == after_refusals["head"] && after_refusals["retention_ms"].is_null();
    let last_event = &page["events"][0];
    let owner_event =
        last_event["kind"] == json!("group") && last_event["change"]["profile"]["retention_ms"] == json!(1);
    let observed = json!({
        "steps": steps.iter().map(|(what, c)| json!({"step": what, "answer": c})).collect::<Vec<_>>(),
        "head_before": before["head"], "head_after_refusals": after_refusals["head"],
        "retention_after_refusals": after_refusals["retention_ms"], "purge_after_refusals": purge,
        "retention_at_end": last["retention_ms"], "last_event": last_event,
    });
    let pass = got == expected
        && unchanged
        && purge["events_purged"] == json!(0)
        && owner_event
        && last["retention_ms"] == json!(1);
    assert!(check.resolve(observed.clone(), pass), "{observed}");
}

#[actix_web::test]
async fn a_former_member_sees_the_conversation_as_it_left_it() {
    let check = Check::start(
        SUITE,
        "16-leak-former-member-view",
        "a kicked member and a member who left, after the group moved on",
        "get_conversation (and sync's head) of a former member shows the group as of its leave: head at its leave \
         seq, the name, settings and member count it left; current members see the group as it is",
    );
    let s = server().await;
    let (own, kid, lea) = (s.user("u-own").await, s.user("u-kid").await, s.user("u-lea").await);
    s.user("u-new").await;
    let (mut owner, mut kicked, mut leaver) = (s.ws(&own).await, s.ws(&kid).await, s.ws(&lea).await);
    group(&mut owner, "g-view", "before", &["u-kid", "u-lea"]).await;
    call(&mut owner, "send", json!({"conv_id": "g-view", "client_msg_id": "m1", "body": {"text": 1}}))
        .await
        .expect("send");
    let kick = call(&mut owner, "kick", json!({"conv_id": "g-view", "user_id": "u-kid"})).await.expect("kick");
    let left = call(&mut leaver, "leave", json!({"conv_id": "g-view"})).await.expect("leave");
    let (kick_seq, leave_seq) = (kick["seq"].as_i64().expect("seq"), left["seq"].as_i64().expect("seq"));
    call(&mut owner, "update_group", json!({"conv_id": "g-view", "name": "after", "max_member": 99, "mute_all": true}))
        .await
        .expect("rename");
    call(&mut owner, "invite", json!({"conv_id": "g-view", "user_ids": ["u-new"]})).await.expect("invite");
    call(&mut owner, "send", json!({"conv_id": "g-view", "client_msg_id": "m2", "body": {"text": 2}}))
        .await
        .expect("send");
    let (as_kicked, as_leaver, as_owner) = (
        conversation(&mut kicked, "g-view").await,
        conversation(&mut leaver, "g-view").await,
        conversation(&mut owner, "g-view").await,
    );
    let sync_head =
        call(&mut kicked, "sync", json!({"conv_id": "g-view", "after_seq": 0})).await.expect("sync")["head"].clone();
    let view = |c: &Value| {
        json!({"name": c["name"], "head": c["head"], "member_count": c["member_count"],
                                  "max_member": c["max_member"], "mute_all": c["mute_all"], "status": c["status"]})
    };
    let observed = json!({
        "kick_seq": kick_seq, "leave_seq": leave_seq,
        "kicked_sees": view(&as_kicked), "leaver_sees": view(&as_leaver), "owner_sees": view(&as_owner),
        "kicked_sync_head": sync_head,
    });
    let pass = view(&as_kicked)
        == json!({"name": "before", "head": kick_seq, "member_count": 2, "max_member": 500, "mute_all": false, "status": "active"})
        && view(&as_leaver)
            == json!({"name": "before", "head": leave_seq, "member_count": 1, "max_member": 500, "mute_all": false, "status": "active"})
        && as_owner["name"] == json!("after")
        && as_owner["member_count"] == json!(2)
        && as_owner["head"].as_i64() > Some(leave_seq + 2)
        && sync_head == json!(kick_seq);
    assert!(check.resolve(observed.clone(), pass), "{observed}");
}

#[actix_web::test]
async fn a_recall_erases_the_fingerprint_and_a_retry_still_replays() {
    let check = Check::start(
        SUITE,
        "16-leak-recalled-hash",
        "a recalled send: its stored request fingerprint, its retries, and its tombstone after a purge",
        "after the recall the stored fingerprint is not the SHA-256 of the body (32 zero bytes), a retry of the \
         send with the same body answers dup:true with the original seq (so does one with another body: the \
         fingerprint is gone), and once purged the tombstone holds no fingerprint either and a retry answers \
         IDEMPOTENCY_KEY_EXPIRED",
    );
    let s = server().await;
    let own = s.user("u-own").await;
    s.user("u-ben").await;
    let mut owner = s.ws(&own).await;
    group(&mut owner, "g-hash", "hash", &["u-ben"]).await;
    let body = json!({"type": "text", "text": "the secret plan"});
    let send = |key: &str, body: &Value| json!({"conv_id": "g-hash", "client_msg_id": key, "body": body});
    let sent = call(&mut owner, "send", send("k1", &body)).await.expect("send");
    call(&mut owner, "send", send("k2", &json!({"text": "kept"}))).await.expect("send");
    call(&mut owner, "recall", json!({"conv_id": "g-hash", "target_seq": sent["seq"]})).await.expect("recall");
    let c = s.db.client().await;
    let stored = |table: &'static str| {
        let c = &c;
        async move {
            let sql = format!("SELECT request_hash FROM {table} WHERE conv_id = 'g-hash' AND client_msg_id = 'k1'");
            c.query_opt(&sql, &[]).await.expect("read the fingerprint").map(|r| r.get::<_, Vec<u8>>(0))
        }
    };
    let guess = Sha256::digest(body.to_string().as_bytes()).to_vec();
    let in_log = stored("events").await;
    let same = call(&mut owner, "send", send("k1", &body)).await;
    let other = call(&mut owner, "send", send("k1", &json!({"text": "a guess"}))).await;
    let kept = call(&mut owner, "send", send("k2", &json!({"text": "not kept"}))).await;
    call(&mut owner, "update_group", json!({"conv_id": "g-hash", "retention_ms": 1})).await.expect("retention");
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    let (_, purge) = s.admin("/v1/admin/retention/run", json!({})).await;
    let in_tombstone = stored("idem_tombstones").await;
    let late = call(&mut owner, "send", send("k1", &body)).await;
    let outcome = |r: &Result<Value, Value>| match r {
        Ok(v) => json!({"seq": v["seq"], "dup": v["dup"]}),
        Err(e) => e["code"].clone(),
    };
    let observed = json!({
        "stored_in_log": in_log.as_deref().map(hex::encode), "stored_in_tombstone": in_tombstone.as_deref().map(hex::encode),
        "sha256_of_body": hex::encode(&guess),
        "retry_same_body": outcome(&same), "retry_other_body": outcome(&other),
        "unrecalled_retry_other_body": outcome(&kept), "purge": purge, "retry_after_purge": outcome(&late),
    });
    let zero = Some(vec![0u8; 32]);
    let replayed = |r: &Result<Value, Value>| outcome(r) == json!({"seq": sent["seq"], "dup": true});
    let pass = in_log == zero
        && in_tombstone == zero
        && replayed(&same)
        && replayed(&other)
        && outcome(&kept) == json!("IDEMPOTENCY_MISMATCH")
        && outcome(&late) == json!("IDEMPOTENCY_KEY_EXPIRED");
    assert!(check.resolve(observed.clone(), pass), "{observed}");
}
