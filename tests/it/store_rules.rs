//! Further persistence rules of the store (ARCHITECTURE §2, §3): faults, P3
//! in the database, epochs, truncation, refusals that change nothing, rows
//! the schema forbids.

use imcore::domain::{Body, BodyError, Rejection};
use imcore::store::{MemberQuery, StoreError, SyncRequest};
use imcore_actors::{ClientMsgId, ConvId, UserId};
use serde_json::json;

use crate::env::{cid, text, uid, Env, Path, PathName, WriteErr};
use crate::evidence::record;
use crate::row_rules::{CONVERSATION_GROUP, EVENT_EDIT, EVENT_MSG};

const SUITE: &str = "im-04";

async fn group(env: &Env, id: &str, members: &[&str]) -> ConvId {
    env.users(&["u-ana", "u-ben", "u-cai"]).await;
    env.group(id, "u-ana", members).await
}

/// A deferred constraint trigger fails the transaction at COMMIT — after the
/// events INSERT and the next_seq UPDATE ran — for a body carrying "FAULT".
const INJECT_COMMIT_FAULT: &str = "
CREATE FUNCTION fail_at_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.body LIKE '%FAULT%' THEN RAISE EXCEPTION 'injected fault at commit'; END IF;
  RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER fail_at_commit AFTER INSERT ON events
  DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION fail_at_commit();";

async fn rollback_between_insert_and_commit(path: Path) {
    let env = Env::new(path).await;
    let conv = group(&env, "g-fault", &["u-ben"]).await;
    env.send(&conv, "u-ana", "m1", text("fine")).await.expect("send");
    env.db.client().await.batch_execute(INJECT_COMMIT_FAULT).await.expect("inject fault");
    let before = env.log_stats(&conv).await;
    let faulted = env.send(&conv, "u-ana", "m2", text("FAULT")).await;
    let after_fault = env.log_stats(&conv).await;
    let next = env.send(&conv, "u-ana", "m3", text("after")).await.expect("send after fault");
    let (count, _, max, next_seq) = env.log_stats(&conv).await;
    let pass = matches!(faulted, Err(WriteErr::Failed(_)))
        && after_fault == before
        && next.seq == before.2 + 1
        && count == max
        && next_seq == max + 1;
    record(
        SUITE,
        "04-rollback-between-insert-and-commit",
        path.name(),
        "a fault after the insert, at commit: the send fails, next_seq and the log are unchanged, the next send takes the next seq (no hole)",
        json!({"faulted": format!("{faulted:?}"), "before": before, "after_fault": after_fault, "next_seq_acked": next.seq,
               "final": {"count": count, "max": max, "next_seq": next_seq}}),
        pass,
    );
    assert!(pass);
}

async fn p3_overlap_rejected_by_the_database(path: Path) {
    let env = Env::new(path).await;
    let conv = group(&env, "g-p3", &["u-ben"]).await;
    let c = env.db.client().await;
    c.batch_execute(&format!("UPDATE conversations SET next_seq = 20 WHERE conv_id = '{conv}'")).await.expect("room");
    // u-ben has an open period from 2. A second open one, and a closed one overlapping it:
    let second_open = c
        .execute(
            "INSERT INTO membership_periods (conv_id, user_id, from_seq) VALUES ($1, 'u-ben', 5)",
            &[&conv.as_str()],
        )
        .await;
    let overlapping = c
        .execute(
            "INSERT INTO membership_periods (conv_id, user_id, from_seq, to_seq) VALUES ($1, 'u-ben', 1, 3)",
            &[&conv.as_str()],
        )
        .await;
    // Closed periods too: close ben's at 4, then try [3, 6].
    c.execute("UPDATE membership_periods SET to_seq = 4 WHERE conv_id = $1 AND user_id = 'u-ben'", &[&conv.as_str()])
        .await
        .expect("close");
    let closed_overlap = c
        .execute(
            "INSERT INTO membership_periods (conv_id, user_id, from_seq, to_seq) VALUES ($1, 'u-ben', 3, 6)",
            &[&conv.as_str()],
        )
        .await;
    let state =
        |r: &Result<u64, tokio_postgres::Error>| r.as_ref().err().and_then(|e| e.code()).map(|c| c.code().to_owned());
    // Two open periods always overlap too, so either constraint may be the one to refuse.
    let pass = matches!(state(&second_open).as_deref(), Some("23505" | "23P01"))
        && state(&overlapping).as_deref() == Some("23P01")
        && state(&closed_overlap).as_deref() == Some("23P01");
    record(
        SUITE,
        "p3-overlap-rejected-by-database",
        path.name(),
        "a second open period is refused (partial unique index 23505 or exclusion 23P01); overlapping periods fail the exclusion constraint (23P01)",
        json!({"second_open": state(&second_open), "overlapping_open": state(&overlapping), "overlapping_closed": state(&closed_overlap)}),
        pass,
    );
    assert!(pass);
}

async fn epoch_mismatch(path: Path) {
    let env = Env::new(path).await;
    let conv = group(&env, "g-epoch", &["u-ben"]).await;
    let epoch = env.store().bump_epoch(&conv).await.expect("bump");
    let mut req = SyncRequest::forward(conv.clone(), uid("u-ben"), 0);
    req.epoch = Some(1);
    let stale = env.store().sync(&req).await.map(|p| p.head);
    req.epoch = Some(epoch);
    let current = env.store().sync(&req).await.map(|p| p.epoch);
    let pass = matches!(stale, Err(StoreError::Rejected(Rejection::EpochChanged { epoch: 2, min_seq: 1 })))
        && matches!(current, Ok(2));
    record(
        SUITE,
        "04-epoch-mismatch",
        path.name(),
        "after an epoch bump, sync with the old epoch gets EPOCH_CHANGED (epoch 2, min_seq 1); with the new one it succeeds",
        json!({"new_epoch": epoch, "old_epoch_sync": format!("{stale:?}"), "new_epoch_sync": format!("{current:?}")}),
        pass,
    );
    assert!(pass);
}

async fn after_seq_below_min_seq_is_truncated(path: Path) {
    let env = Env::new(path).await;
    let conv = group(&env, "g-trunc", &["u-ben"]).await;
    for i in 0..8 {
        env.send(&conv, "u-ana", &format!("m{i}"), text("x")).await.expect("send");
    }
    // Stand-in for a retention purge: everything below seq 6 is gone.
    env.db
        .client()
        .await
        .batch_execute(&format!(
            "DELETE FROM events WHERE conv_id = '{conv}' AND seq < 6; UPDATE conversations SET min_seq = 6 WHERE conv_id = '{conv}'"
        ))
        .await
        .expect("purge");
    let page = env.sync(&conv, "u-ben", 0).await.expect("sync");
    let at_edge = env.sync(&conv, "u-ben", 5).await.expect("sync");
    let first = page.events.first().map(|e| e.seq);
    let pass = page.truncated && first == Some(6) && page.min_seq == 6 && !at_edge.truncated;
    record(
        SUITE,
        "04-after-seq-below-min-seq-truncated",
        path.name(),
        "after_seq < min_seq - 1 starts at min_seq with truncated:true; after_seq = min_seq - 1 is not truncated",
        json!({"min_seq": page.min_seq, "truncated": page.truncated, "first_seq": first, "at_edge_truncated": at_edge.truncated}),
        pass,
    );
    assert!(pass);
}

async fn every_refused_send_leaves_head_unchanged(path: Path) {
    let env = Env::new(path).await;
    let conv = group(&env, "g-refuse", &["u-ben"]).await;
    env.send(&conv, "u-ana", "m1", text("hi")).await.expect("send");
    let c = env.db.client().await;
    let mut observed = vec![];
    let mut pass = true;
    let mut expect =
        |what: &str, got: Result<imcore::store::SendAck, WriteErr>, want: Rejection, head: i64, before: i64| {
            let ok = matches!(&got, Err(WriteErr::Rejected(r)) if *r == want) && head == before;
            observed
                .push(json!({"case": what, "answer": format!("{got:?}"), "head_before": before, "head_after": head}));
            pass &= ok;
        };
    let h = env.head(&conv).await;
    let got = env.send(&conv, "u-cai", "c1", text("x")).await;
    expect("non-member", got, Rejection::NotMember, env.head(&conv).await, h);
    let got = env.send(&conv, "u-ana", "m1", text("other body")).await;
    expect("fingerprint mismatch", got, Rejection::IdempotencyMismatch, env.head(&conv).await, h);
    let got = env.send(&cid("g-nowhere"), "u-ana", "m9", text("x")).await;
    expect("unknown conversation", got, Rejection::NotMember, env.head(&conv).await, h);
    c.execute(
        "UPDATE members SET mute_until = now() + interval '1 hour' WHERE conv_id = $1 AND user_id = 'u-ben'",
        &[&conv.as_str()],
    )
    .await
    .expect("mute ben");
    c.execute("UPDATE conversations SET member_version = member_version + 1 WHERE conv_id = $1", &[&conv.as_str()])
        .await
        .expect("version");
    let got = env.send(&conv, "u-ben", "b1", text("x")).await;
    expect("muted member", got, Rejection::Muted, env.head(&conv).await, h);
    c.execute("UPDATE conversations SET mute_all = true WHERE conv_id = $1", &[&conv.as_str()])
        .await
        .expect("mute all");
    c.execute("UPDATE members SET mute_until = NULL WHERE conv_id = $1", &[&conv.as_str()]).await.expect("unmute");
    c.execute("UPDATE conversations SET member_version = member_version + 1 WHERE conv_id = $1", &[&conv.as_str()])
        .await
        .expect("version");
    let got = env.send(&conv, "u-ben", "b2", text("x")).await;
    expect("mute_all, plain member", got, Rejection::Muted, env.head(&conv).await, h);
    let mention = Body::parse(&json!({"type": "text", "text": "@all", "mention_all": true}), 1024).expect("body");
    c.execute("UPDATE conversations SET mute_all = false WHERE conv_id = $1", &[&conv.as_str()])
        .await
        .expect("unmute all");
    let got = env.send(&conv, "u-ben", "b3", mention).await;
    expect(
        "mention_all without AT_ALL",
        got,
        Rejection::Forbidden("your role may not mention everyone".into()),
        env.head(&conv).await,
        h,
    );
    c.execute("UPDATE conversations SET status = 'dismissed' WHERE conv_id = $1", &[&conv.as_str()])
        .await
        .expect("dismiss");
    let got = env.send(&conv, "u-ana", "m2", text("x")).await;
    expect("dismissed group", got, Rejection::ConvDismissed, env.head(&conv).await, h);
    // A replay still gets its original answer after dismissal (replay is checked first).
    let replay = env.send(&conv, "u-ana", "m1", text("hi")).await;
    let replay_ok = matches!(&replay, Ok(a) if a.dup && a.seq == 3);
    pass &= replay_ok;
    observed.push(json!({"case": "replay after dismissal", "answer": format!("{replay:?}")}));
    record(
        SUITE,
        "04-refused-sends-leave-head-unchanged",
        path.name(),
        "every refused send (non-member, mismatch, unknown conversation, muted, mute_all, AT_ALL, dismissed) leaves head unchanged; a replay keeps its original answer",
        json!(observed),
        pass,
    );
    assert!(pass);
}

/// Ids and bodies outside their forms never become values the store accepts:
/// they are refused while parsing, before any database work.
#[test]
fn invalid_ids_and_bodies_are_refused_before_the_database() {
    let bad_ids = ["", "a b", "x/y", "ü", &"x".repeat(65)];
    let ids_refused = bad_ids
        .iter()
        .all(|s| UserId::parse(s).is_err() && ConvId::parse(s).is_err() && ClientMsgId::parse(s).is_err());
    let big = json!({"type": "text", "text": "x".repeat(16 * 1024)});
    let too_large = Body::parse(&big, 16 * 1024);
    let pass = ids_refused && matches!(too_large, Err(BodyError::TooLarge { .. }));
    record(
        SUITE,
        "04-invalid-input-refused-before-database",
        "parse",
        "ids outside 1-64 chars of [A-Za-z0-9._:@-] and bodies over 16 KiB are refused at parse time (BAD_REQUEST / PAYLOAD_TOO_LARGE)",
        json!({"bad_ids": bad_ids, "ids_refused": ids_refused, "oversized_body": format!("{too_large:?}")}),
        pass,
    );
    assert!(pass);
}

on_path!(
    direct,
    super::Path::Direct,
    [
        rollback_between_insert_and_commit,
        p3_overlap_rejected_by_the_database,
        epoch_mismatch,
        after_seq_below_min_seq_is_truncated,
        every_refused_send_leaves_head_unchanged,
    ]
);

on_path!(
    actor,
    super::Path::Actor,
    [
        rollback_between_insert_and_commit,
        epoch_mismatch,
        after_seq_below_min_seq_is_truncated,
        every_refused_send_leaves_head_unchanged,
    ]
);

/// A group may not take a direct conversation's id: it would capture that
/// pair's direct chat (creating the direct chat would return the group).
#[actix_web::test]
async fn a_group_cannot_take_a_direct_conversations_id() {
    let env = Env::new(Path::Direct).await;
    env.users(&["u-ana", "u-ben", "u-eve"]).await;
    let direct_id = imcore::store::direct_conv_id(&uid("u-ana"), &uid("u-ben")).expect("direct id");
    let squat = env
        .store()
        .create_conversation(&imcore::store::CreateConversation::Group {
            creator: uid("u-eve"),
            conv_id: Some(direct_id.clone()),
            name: "squat".into(),
            members: vec![uid("u-ana"), uid("u-ben")],
            settings: Default::default(),
        })
        .await;
    let direct = env
        .store()
        .create_conversation(&imcore::store::CreateConversation::Direct { creator: uid("u-ana"), other: uid("u-ben") })
        .await
        .expect("direct");
    let pass = matches!(squat, Err(StoreError::Rejected(Rejection::BadRequest(_))))
        && direct.created
        && direct.info.kind == "direct"
        && direct.info.conv_id == direct_id;
    record(
        SUITE,
        "direct-id-reserved",
        "direct",
        "a group created with a direct conversation's id is refused (BAD_REQUEST); the pair's direct chat is then created as a direct chat",
        json!({"group_with_direct_id": format!("{:?}", squat.map(|c| c.info.conv_id)), "direct_created": direct.created, "direct_kind": direct.info.kind}),
        pass,
    );
    assert!(pass);
}

/// A row the schema forbids (its CHECK dropped to plant it) fails the read
/// that meets it (ARCHITECTURE §2): never a page without that event, never a
/// roster with a made-up role; other conversations read as before.
#[actix_web::test]
async fn a_row_the_schema_forbids_fails_the_read_instead_of_being_skipped_or_defaulted() {
    let env = Env::new(Path::Direct).await;
    let bad = group(&env, "g-bad-row", &["u-ben"]).await;
    let fine = env.group("g-fine-row", "u-ana", &["u-ben"]).await;
    let mut planted = 0;
    for (i, conv) in [&bad, &fine, &bad].into_iter().enumerate() {
        let ack = env.send(conv, "u-ana", &format!("m{i}"), text("x")).await.expect("send");
        planted = ack.seq;
    }
    env.db
        .client()
        .await
        .batch_execute(&format!(
            "ALTER TABLE events DROP CONSTRAINT events_rules;
             UPDATE events SET client_msg_id = 'not an id' WHERE conv_id = '{bad}' AND seq = {planted};
             ALTER TABLE members DROP CONSTRAINT members_role_check;
             UPDATE members SET role = 'tyrant' WHERE conv_id = '{bad}' AND user_id = 'u-ben'"
        ))
        .await
        .expect("plant rows the schema forbids");
    let sync = env.sync(&bad, "u-ben", 0).await;
    let roster = env.store().members(&bad, &uid("u-ana"), &MemberQuery::Joined { after: 0 }, 50).await;
    let other = env.sync(&fine, "u-ben", 0).await;
    let undecodable = |e: &StoreError| matches!(e, StoreError::Undecodable(_));
    let pass = sync.as_ref().err().is_some_and(undecodable)
        && roster.as_ref().err().is_some_and(undecodable)
        && other.as_ref().is_ok_and(|p| p.events.iter().any(|e| e.seq > 0));
    record(
        "im-16",
        "16-undecodable-row-fails-the-read",
        "direct",
        "an event with a malformed client_msg_id and a member with an unknown role: sync and members fail with \
         StoreError::Undecodable (INTERNAL at the edge); another conversation syncs as before",
        json!({"sync": format!("{:?}", sync.as_ref().err()), "members": format!("{:?}", roster.as_ref().err()),
               "other_conversation_ok": other.is_ok()}),
        pass,
    );
    assert!(pass);
}

/// The id checks of migration 0015 against the rule they replaced and the
/// parser's (one rule for every id: `is_valid_id`): every check accepts
/// exactly the strings `ClientMsgId::parse` accepts, as the bounded regular
/// expression of 0001 did; on `events` and `conversations` the rule is part
/// of the table's one CHECK (0016), evaluated on a valid row (for `events`, a
/// `msg` and an `edit` row). Negative control: the same corpus tells a check
/// without the length bound apart.
#[actix_web::test]
async fn the_databases_id_checks_accept_exactly_the_ids_the_parser_accepts() {
    let env = Env::new(Path::Direct).await;
    let db = env.db.client().await;
    let corpus = id_corpus();
    let parsed: Vec<bool> = corpus.iter().map(|s| ClientMsgId::parse(s).is_ok()).collect();
    // A check's verdict on each string put in `column` of the valid row of
    // `table` (`jsonb`): NULL (unknown) passes, as in a CHECK.
    let verdicts = |expr: String, table: &'static str, column: &'static str, valid: &'static str| {
        let (db, corpus) = (&db, &corpus);
        async move {
            let sql = format!(
                "SELECT coalesce({expr}, true) FROM unnest($1::text[]) WITH ORDINALITY AS s(candidate, n),
                   jsonb_populate_record(NULL::{table}, $2::text::jsonb || jsonb_build_object('{column}', s.candidate)) r
                 ORDER BY n"
            );
            let rows = db.query(&sql, &[corpus, &valid]).await.expect("evaluate check");
            rows.iter().map(|r| r.get::<_, bool>(0)).collect::<Vec<bool>>()
        }
    };
    let mut seen = serde_json::Map::new();
    // On `events` and `conversations` the id rule is in the CHECK's function (0016).
    let functions: String = db
        .query_one(
            "SELECT string_agg(prosrc, ' ') FROM pg_proc WHERE proname IN ('event_rules_hold', 'conversation_rules_hold')",
            &[],
        )
        .await
        .expect("the functions")
        .get(0);
    let mut pass = !functions.contains("{1,64}");
    for (name, table, column, valid) in [
        ("users_user_id_check", "users", "user_id", "{}"),
        ("devices_device_id_check", "devices", "device_id", "{}"),
        ("conversations_rules", "conversations", "conv_id", CONVERSATION_GROUP),
        ("events_rules", "events", "client_msg_id", EVENT_MSG),
        ("events_rules", "events", "client_msg_id", EVENT_EDIT),
    ] {
        let expr: String = db
            .query_one("SELECT pg_get_expr(conbin, conrelid) FROM pg_constraint WHERE conname = $1", &[&name])
            .await
            .expect("the check")
            .get(0);
        let agrees = verdicts(expr.clone(), table, column, valid).await == parsed;
        pass &= agrees && !expr.contains('{');
        let kind = if valid == EVENT_EDIT { " (edit)" } else { "" };
        seen.insert(format!("{name}{kind}"), json!({"check": expr, "agrees_with_parser": agrees}));
    }
    let old = verdicts(r"user_id ~ '^[A-Za-z0-9._:@-]{1,64}$'".into(), "users", "user_id", "{}").await;
    let unbounded = verdicts(r"user_id ~ '^[A-Za-z0-9._:@-]+$'".into(), "users", "user_id", "{}").await;
    let accepted = parsed.iter().filter(|ok| **ok).count();
    pass &= old == parsed && unbounded != parsed && accepted > 0 && accepted < corpus.len();
    record(
        SUITE,
        "04-id-checks-are-the-id-rule",
        "sql",
        "the CHECKs on users.user_id, devices.device_id, conversations (conversations_rules, on a group row) and \
         events (events_rules, on a msg and an edit row), evaluated from the catalog over a corpus of lengths \
         0-70 with allowed, forbidden and non-ASCII characters, accept exactly what ClientMsgId::parse accepts, \
         with no bounded repetition; the regular expression they replaced agrees too. Negative control: the check \
         without its length bound disagrees.",
        json!({"checks": seen, "corpus": corpus.len(), "accepted": accepted, "old_rule_agrees": old == parsed,
               "unbounded_control_agrees": unbounded == parsed}),
        pass,
    );
    assert!(pass);
}

/// Strings around the id rule's edges: every length from 0 to 70 of allowed
/// characters, and at the start, middle and end of valid ids one character of
/// each kind the rule forbids.
fn id_corpus() -> Vec<String> {
    let allowed = "Az09._:@-";
    let mut corpus: Vec<String> = (0..=70).map(|n| allowed.chars().cycle().take(n).collect()).collect();
    for bad in [' ', '/', '#', '\n', '[', '\u{7f}', 'ü', '日'] {
        for n in [1, 2, 63, 64] {
            let base: Vec<char> = allowed.chars().cycle().take(n).collect();
            for at in [0, n / 2, n.saturating_sub(1)] {
                let mut s = base.clone();
                s[at] = bad;
                corpus.push(s.into_iter().collect());
                let mut longer = base.clone();
                longer.insert(at, bad);
                corpus.push(longer.into_iter().collect());
            }
        }
    }
    corpus
}

/// A pooled connection's I/O runs on its pool's own thread: one first opened
/// by a task on another runtime, which then ends (as a conversation actor's
/// arbiter does when its hub stops), still answers the statement its holder
/// sends next. Its task used to live on that runtime and die with it, and the
/// statement failed `Closed`.
#[actix_web::test]
async fn a_pooled_connection_outlives_the_runtime_that_opened_it() {
    let db = crate::harness::TestDb::with_pool(2).await;
    let pool = db.store.pool();
    let opened_before = pool.state().connections;
    let conn = std::thread::scope(|s| {
        s.spawn(|| {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
            runtime.block_on(pool.get()).expect("a connection")
        })
        .join()
        .expect("the other runtime's thread")
    });
    let answered = conn.simple_query("SELECT 1").await;
    let pass = opened_before == 0 && answered.is_ok();
    record(
        SUITE,
        "04-connection-outlives-its-opener",
        "pool",
        "a pool's first connection, checked out by a task on a runtime of its own thread that then ends, answers \
         SELECT 1 afterwards (its I/O runs on the pool's thread, not the opener's)",
        json!({"connections_before": opened_before, "answer": format!("{:?}", answered.as_ref().map(|_| "ok"))}),
        pass,
    );
    assert!(pass);
}
