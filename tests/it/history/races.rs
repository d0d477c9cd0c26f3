//! Concurrency of the history ops: one user's concurrent reaction toggles
//! leave a set, and an edit racing a recall leaves no content behind.

use super::*;

pub(super) struct Toggled {
    events: Vec<bool>,
    stored_on: bool,
    count: i32,
}

pub(super) async fn toggled(s: &TestServer, conv: &str, target: i64, user: &str, emoji: &str) -> Toggled {
    let db = s.db.client().await;
    let rows = db
        .query(
            "SELECT reaction_on FROM events WHERE conv_id = $1 AND kind = 'reaction' AND target_seq = $2
                AND sender_user = $3 AND emoji = $4 ORDER BY seq",
            &[&conv, &target, &user, &emoji],
        )
        .await
        .expect("reaction events");
    let stored_on = db
        .query_opt(
            "SELECT 1 FROM reactions WHERE conv_id = $1 AND target_seq = $2 AND user_id = $3 AND emoji = $4",
            &[&conv, &target, &user, &emoji],
        )
        .await
        .expect("reactions")
        .is_some();
    let count = db
        .query_opt(
            "SELECT count FROM reaction_counts WHERE conv_id = $1 AND target_seq = $2 AND emoji = $3",
            &[&conv, &target, &emoji],
        )
        .await
        .expect("reaction_counts")
        .map_or(0, |r| r.get(0));
    Toggled { events: rows.iter().map(|r| r.get(0)).collect(), stored_on, count }
}

/// The set's invariant over a log of toggles starting from "off": each event
/// flips the state (it alternates on, off, on…), `changed` answers are as
/// many as events, and the stored set and count are where the last event left them.
pub(super) fn a_set(t: &Toggled, changed: usize) -> bool {
    let alternates = t.events.iter().enumerate().all(|(i, &on)| on == (i % 2 == 0));
    let last = t.events.last().copied().unwrap_or(false);
    alternates && t.events.len() == changed && t.stored_on == last && t.count == i32::from(last)
}

#[actix_web::test]
async fn one_users_32_concurrent_toggles_leave_a_set() {
    let check = Check::start(
        SUITE,
        "14-react-set-semantics-32-toggles",
        "ws+http",
        "32 react requests of one user on one (message, emoji) at once, 16 on and 16 off, over 4 WebSocket \
         connections and HTTP: the reaction events alternate on/off from off, as many as changed:true answers, \
         every other answer changed:false with seq null; the stored set and count match the last event; sync \
         shows that count with me",
    );
    let s = TestServer::start().await;
    let ana = s.user("u-ana").await;
    s.user("u-ben").await;
    let conv = "g-toggles";
    let create = json!({"kind": "group", "conv_id": conv, "name": conv, "members": ["u-ben"]});
    ok_http(&s, &ana, "POST", "/v1/conversations".into(), create).await;
    let (_, sent) = s
        .http(
            "POST",
            &format!("/v1/conversations/{conv}/messages"),
            Some(&ana),
            Some(&json!({"client_msg_id": "m", "body": text("m")})),
        )
        .await;
    let target = sent["seq"].as_i64().expect("seq");
    let mut conns = vec![];
    for i in 0..4 {
        let token = s.device("u-ben", &format!("t{i}")).await;
        conns.push((s.ws(&token).await, token));
    }
    // 6 frames on each connection, sent before any answer is read, and 8 over HTTP.
    let mut ids = vec![];
    for (i, (ws, _)) in conns.iter_mut().enumerate() {
        for j in 0..6 {
            let on = (i * 6 + j) % 2 == 0;
            ids.push(ws.start("react", json!({"conv_id": conv, "target_seq": target, "emoji": "🔥", "on": on})).await);
        }
    }
    let path = format!("/v1/conversations/{conv}/react");
    let token = conns[0].1.clone();
    let http = futures_util::future::join_all((0..8).map(|k| {
        let body = json!({"target_seq": target, "emoji": "🔥", "on": k % 2 == 0});
        let (s, path, token) = (&s, &path, &token);
        async move { outcome(&s.http("POST", path, Some(token), Some(&body)).await.1) }
    }));
    let http = http.await;
    let mut answers = http;
    for (i, (ws, _)) in conns.iter_mut().enumerate() {
        for id in &ids[i * 6..i * 6 + 6] {
            answers.push(outcome(&ws.reply(*id).await));
        }
    }
    let changed = answers.iter().filter(|a| a["changed"] == true).count();
    let unchanged_ok = answers.iter().filter(|a| a["changed"] == false).all(|a| a["seq"].is_null());
    let t = toggled(&s, conv, target, "u-ben", "🔥").await;
    let (_, page) = s.http("GET", &format!("/v1/conversations/{conv}/events?after_seq=0"), Some(&token), None).await;
    let msg = page["events"].as_array().and_then(|es| es.iter().find(|e| e["seq"] == target)).cloned();
    let shown = msg.map(|m| m["reactions"].clone()).unwrap_or_default();
    let last = t.events.last().copied().unwrap_or(false);
    let shown_ok = if last { shown == json!([{"emoji": "🔥", "count": 1, "me": true}]) } else { shown.is_null() };
    let pass = answers.len() == 32
        && answers.iter().all(|a| a.get("error").is_none())
        && unchanged_ok
        && a_set(&t, changed)
        && shown_ok;
    let pass = check.resolve(
        json!({"answers": answers.len(), "changed": changed, "events_on": t.events, "stored_on": t.stored_on,
               "count": t.count, "synced_reactions": shown}),
        pass,
    );
    assert!(pass);
}

#[actix_web::test]
async fn an_edit_racing_a_recall_never_leaves_content_behind() {
    let check = Check::start(
        SUITE,
        "14-edit-racing-recall",
        "ws+http",
        "for 12 messages, the sender's edit and recall sent at once on two connections, alternating which goes \
         out first: either the edit lands first (both succeed, edit seq < recall seq) or the recall does (edit NOT_FOUND); every message ends \
         recalled with body null, and so does the body of every edit of it, in the log and in sync",
    );
    let s = TestServer::start().await;
    let ana = s.user("u-ana").await;
    let conv = "g-race";
    let create = json!({"kind": "group", "conv_id": conv, "name": conv, "members": []});
    ok_http(&s, &ana, "POST", "/v1/conversations".into(), create).await;
    let mut ws = s.ws(&ana).await;
    let mut other = s.ws(&s.device("u-ana", "d2").await).await;
    let mut rows = vec![];
    let mut all_ok = true;
    for i in 0..12 {
        let m = ws.request("send", json!({"conv_id": conv, "client_msg_id": format!("m{i}"), "body": text("x")})).await;
        let target = m["seq"].as_i64().expect("seq");
        let edit =
            json!({"conv_id": conv, "client_msg_id": format!("e{i}"), "target_seq": target, "body": text("secret")});
        let recall = json!({"conv_id": conv, "target_seq": target});
        // Alternate which goes out first; both are in flight before either answer is read.
        let (edit_id, recall_id) = if i % 2 == 0 {
            (ws.start("edit", edit).await, other.start("recall", recall).await)
        } else {
            let recall_id = other.start("recall", recall).await;
            (ws.start("edit", edit).await, recall_id)
        };
        let (edit, recall) = (outcome(&ws.reply(edit_id).await), outcome(&other.reply(recall_id).await));
        let ok = match edit.get("error") {
            None => edit["seq"].as_i64() < recall["seq"].as_i64() && recall["dup"] == false,
            Some(code) => code == "NOT_FOUND" && recall["dup"] == false,
        };
        all_ok &= ok;
        rows.push(json!({"target": target, "edit": edit, "recall": recall}));
    }
    let edits_first = rows.iter().filter(|r| r["edit"].get("error").is_none()).count();
    let leaked = leaks(&s, conv).await;
    let synced = events(&s, &ana, conv).await;
    let sync_clean = synced.values().all(|e| match e["kind"].as_str() {
        Some("msg") => e["recalled"] == true && e["body"].is_null(),
        Some("edit") => e["body"].is_null(),
        _ => true,
    });
    let pass = all_ok && leaked == 0 && sync_clean;
    let pass = check.resolve(
        json!({"pairs": rows, "edit_landed_first": edits_first, "edits_with_content_left": leaked,
               "sync_shows_nothing": sync_clean}),
        pass,
    );
    assert!(pass);
}
