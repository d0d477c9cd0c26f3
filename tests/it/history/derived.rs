//! What history derives and keeps: unread mentions, the naive statements the
//! checks catch, retention of reactions and edits, and the pushes.

use imcore::store::Pace;

use super::races::{a_set, toggled};
use super::*;

#[actix_web::test]
async fn unread_mentions_count_what_is_still_there_after_the_read_cursor() {
    let check = Check::start(
        SUITE,
        "14-unread-mentions-after-recall-and-read",
        "ws+http",
        "ben's unread_mentions counts the unread msgs of others that mention him or mention_all: 4 sent \
         (one mentions cai only) -> 3; one of them recalled -> 2; edits and reactions change neither unread nor \
         unread_mentions; ben reads past the first -> 1; ana's own mention_all never counts for ana",
    );
    let s = TestServer::start().await;
    let ana = s.user("u-ana").await;
    let ben = s.user("u-ben").await;
    s.user("u-cai").await;
    let conv = "g-mentions";
    let create = json!({"kind": "group", "conv_id": conv, "name": conv, "members": ["u-ben", "u-cai"]});
    ok_http(&s, &ana, "POST", "/v1/conversations".into(), create).await;
    let mut ws = s.ws(&ana).await;
    let mut seqs = vec![];
    for (key, body, mentions) in [
        ("x1", text("hi ben"), json!(["u-ben"])),
        ("x2", json!({"type": "text", "text": "all", "mention_all": true}), json!([])),
        ("x3", text("hi cai"), json!(["u-cai"])),
        ("x4", text("ben again"), json!(["u-ben", "u-cai"])),
    ] {
        let f = json!({"conv_id": conv, "client_msg_id": key, "body": body, "mentions": mentions});
        seqs.push(ws.request("send", f).await["seq"].as_i64().unwrap_or_else(|| panic!("send {key}")));
    }
    let (x1, x4) = (seqs[0], seqs[3]);
    let counts = |token: String| {
        let s = &s;
        async move {
            let item = inbox_item(s, &token, conv).await;
            (item["unread"].clone(), item["unread_mentions"].clone())
        }
    };
    let sent = counts(ben.clone()).await;
    let recall = ws.request("recall", json!({"conv_id": conv, "target_seq": x4})).await;
    let recalled = counts(ben.clone()).await;
    ws.request("edit", json!({"conv_id": conv, "client_msg_id": "e", "target_seq": x1, "body": text("hey ben")})).await;
    let react = json!({"conv_id": conv, "target_seq": x1, "emoji": "👀", "on": true});
    let (status, _) = s.http("POST", &format!("/v1/conversations/{conv}/react"), Some(&ana), Some(&react)).await;
    let edited = counts(ben.clone()).await;
    let (_, read) =
        s.http("POST", &format!("/v1/conversations/{conv}/read"), Some(&ben), Some(&json!({"seq": x1}))).await;
    let after_read = counts(ben.clone()).await;
    let own = counts(ana.clone()).await;
    let pass = sent == (json!(4), json!(3))
        && recall["ok"] == true
        && recalled == (json!(3), json!(2))
        && status == 200
        && edited == recalled
        && after_read == (json!(2), json!(1))
        && own.1 == 0;
    let pass = check.resolve(
        json!({"after_4_sends": sent, "after_recall": recalled, "after_edit_and_reaction": edited, "read": read,
               "after_read_past_the_first": after_read, "anas_own": own}),
        pass,
    );
    assert!(pass);
}

#[actix_web::test]
async fn the_checks_catch_the_naive_statements() {
    // The invariant checks of this suite, run against logs written by the
    // naive statements (a recall that erases only its target; a react that
    // appends every request), must fail: they are what the rules prevent.
    let check = Check::start(
        SUITE,
        "14-negative-control",
        "sql",
        "the recall-erasure check finds the edited body a naive recall (UPDATE of the target alone) leaves in \
         the log, where the real recall leaves none; the set check fails on 32 toggles appended naively (one \
         event per request) and passes on the real path's log of the same requests",
    );
    let s = TestServer::start().await;
    let ana = s.user("u-ana").await;
    let conv = "g-naive";
    let create = json!({"kind": "group", "conv_id": conv, "name": conv, "members": []});
    ok_http(&s, &ana, "POST", "/v1/conversations".into(), create).await;
    // Over HTTP only: the naive statements bypass delivery, whose gap rule
    // would close a connection.
    let call = |op: &'static str, body: Value| {
        let (s, ana) = (&s, &ana);
        async move {
            let (method, path) = route(op, conv);
            outcome(&s.http(method, &path, Some(ana), Some(&body)).await.1)
        }
    };
    let mut sent = vec![];
    for key in ["real", "naive", "set"] {
        let target = call("send", json!({"client_msg_id": key, "body": text(key)})).await["seq"].as_i64().expect("seq");
        let edit = json!({"client_msg_id": format!("e-{key}"), "target_seq": target, "body": text("secret")});
        assert_eq!(call("edit", edit).await["dup"], false);
        sent.push(target);
    }
    let real = call("recall", json!({"target_seq": sent[0]})).await;
    let after_real = leaks(&s, conv).await;
    // The same 32 requests (on, on, off, off…) through the real path.
    let target = sent[2];
    let requests: Vec<bool> = (0..32).map(|i| (i / 2) % 2 == 0).collect();
    let mut changed = 0;
    for &on in &requests {
        let r = call("react", json!({"target_seq": target, "emoji": "✅", "on": on})).await;
        changed += usize::from(r["changed"] == true);
    }
    let real_set = a_set(&toggled(&s, conv, target, "u-ana", "✅").await, changed);

    // The naive recall: the recall event, and the target's body erased — its edit's left.
    let db = s.db.client().await;
    db.batch_execute(&format!(
        "BEGIN;
         INSERT INTO events (conv_id, seq, kind, sender_user, target_seq, created_at)
              SELECT conv_id, next_seq, 'recall', 'u-ana', {t}, now() FROM conversations WHERE conv_id = '{conv}';
         UPDATE conversations SET next_seq = next_seq + 1 WHERE conv_id = '{conv}';
         UPDATE events SET body = NULL, recalled = true WHERE conv_id = '{conv}' AND seq = {t};
         COMMIT;",
        t = sent[1]
    ))
    .await
    .expect("the naive recall");
    let after_naive = leaks(&s, conv).await;
    // The naive react: one event per request, whatever the set holds.
    for &on in &requests {
        db.batch_execute(&format!(
            "BEGIN;
             INSERT INTO events (conv_id, seq, kind, sender_user, sender_device, target_seq, emoji, reaction_on,
                                 created_at)
                  SELECT conv_id, next_seq, 'reaction', 'u-ana', 'd1', {target}, '❌', {on}, now()
                    FROM conversations WHERE conv_id = '{conv}';
             UPDATE conversations SET next_seq = next_seq + 1 WHERE conv_id = '{conv}';
             COMMIT;"
        ))
        .await
        .expect("a naive reaction");
    }
    let naive_set = a_set(&toggled(&s, conv, target, "u-ana", "❌").await, requests.len());
    let pass = real["dup"] == false && after_real == 0 && after_naive == 1 && real_set && !naive_set;
    let pass = check.resolve(
        json!({"leaks_after_real_recall": after_real, "leaks_after_naive_recall": after_naive,
               "set_check_on_real_path": real_set, "set_check_on_naive_log": naive_set, "real_changed": changed}),
        pass,
    );
    assert!(pass);
}

#[actix_web::test]
async fn retention_takes_a_messages_reactions_and_answers_its_edits_key_from_a_tombstone() {
    let check = Check::start(
        SUITE,
        "14-retention",
        "http",
        "after the purge of a reacted and edited message: no reactions or counts of it remain; the edit's \
         key replayed answers IDEMPOTENCY_KEY_EXPIRED, another body IDEMPOTENCY_MISMATCH; nothing appended",
    );
    let s = TestServer::start().await;
    let ana = s.user("u-ana").await;
    let conv = "g-purge";
    let create = json!({"kind": "group", "conv_id": conv, "name": conv, "members": [], "retention_ms": 86_400_000});
    ok_http(&s, &ana, "POST", "/v1/conversations".into(), create).await;
    let call = |op: &'static str, body: Value| {
        let (s, ana) = (&s, &ana);
        async move {
            let (method, path) = route(op, conv);
            outcome(&s.http(method, &path, Some(ana), Some(&body)).await.1)
        }
    };
    let m = call("send", json!({"client_msg_id": "m", "body": text("m")})).await["seq"].as_i64().expect("seq");
    let edit = json!({"client_msg_id": "e", "target_seq": m, "body": text("m2")});
    assert_eq!(call("edit", edit.clone()).await["dup"], false);
    assert_eq!(call("react", json!({"target_seq": m, "emoji": "🙂", "on": true})).await["changed"], true);
    let keep = call("send", json!({"client_msg_id": "k", "body": text("k")})).await["seq"].as_i64().expect("seq");
    age(&s, conv, &(1..keep).collect::<Vec<_>>(), 2 * 86_400_000).await;
    let conv_id = imcore_actors::ConvId::parse(conv).expect("conv id");
    let (purged, _) = s.db.store.purge_conversation(&conv_id, Pace::chunk(100)).await.expect("purge");
    let db = s.db.client().await;
    let left: i64 = db
        .query_one(
            "SELECT (SELECT count(*) FROM reactions WHERE conv_id = $1)
                  + (SELECT count(*) FROM reaction_counts WHERE conv_id = $1)",
            &[&conv],
        )
        .await
        .expect("reactions left")
        .get(0);
    let before = head(&s, conv).await;
    let replayed = call("edit", edit).await;
    let other = call("edit", json!({"client_msg_id": "e", "target_seq": m, "body": text("m3")})).await;
    let unchanged = head(&s, conv).await == before;
    let pass = purged as i64 == keep - 1
        && left == 0
        && replayed == json!({"error": "IDEMPOTENCY_KEY_EXPIRED"})
        && other == json!({"error": "IDEMPOTENCY_MISMATCH"})
        && unchanged;
    let pass = check.resolve(
        json!({"purged": purged, "reaction_rows_left": left, "edit_replayed": replayed, "edit_other_body": other,
               "head_unchanged": unchanged}),
        pass,
    );
    assert!(pass);
}

#[actix_web::test]
async fn edits_and_reactions_are_pushed_like_every_event() {
    let check = Check::start(
        SUITE,
        "14-pushes",
        "ws",
        "ben's connection gets ana's reply (reply_to, mentions), her edit (target_seq, the new body) and her \
         reaction (target_seq, emoji, on) pushed as events; an unchanged react pushes nothing",
    );
    let s = TestServer::start().await;
    let ana = s.user("u-ana").await;
    let ben = s.user("u-ben").await;
    let conv = "g-push";
    let create = json!({"kind": "group", "conv_id": conv, "name": conv, "members": ["u-ben"]});
    ok_http(&s, &ana, "POST", "/v1/conversations".into(), create).await;
    let mut b = s.ws(&ben).await;
    let post = |op: &'static str, body: Value| {
        let (s, ana) = (&s, &ana);
        async move {
            let (method, path) = route(op, conv);
            outcome(&s.http(method, &path, Some(ana), Some(&body)).await.1)
        }
    };
    let m = post("send", json!({"client_msg_id": "m", "body": text("m")})).await["seq"].as_i64().expect("seq");
    let sent = b.push().await;
    let reply = json!({"client_msg_id": "r", "body": text("re"), "reply_to": m, "mentions": ["u-ben"]});
    post("send", reply).await;
    let replied = b.push().await;
    post("edit", json!({"client_msg_id": "e", "target_seq": m, "body": text("m, edited")})).await;
    let edited = b.push().await;
    post("react", json!({"target_seq": m, "emoji": "🎉", "on": true})).await;
    let reacted = b.push().await;
    let again = post("react", json!({"target_seq": m, "emoji": "🎉", "on": true})).await;
    let nothing = b.push_within(std::time::Duration::from_millis(500)).await;
    let pass = sent["event"]["seq"] == m
        && replied["event"]["reply_to"] == m
        && replied["event"]["mentions"] == json!(["u-ben"])
        && edited["event"]["kind"] == "edit"
        && edited["event"]["target_seq"] == m
        && edited["event"]["body"] == text("m, edited")
        && reacted["event"]["kind"] == "reaction"
        && reacted["event"]["target_seq"] == m
        && reacted["event"]["emoji"] == "🎉"
        && reacted["event"]["on"] == true
        && again == json!({"changed": false, "seq": null})
        && nothing.is_none();
    let pass = check.resolve(
        json!({"reply": replied, "edit": edited, "reaction": reacted, "unchanged_react": again,
               "pushed_after_it": nothing}),
        pass,
    );
    assert!(pass);
}
