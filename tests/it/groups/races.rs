//! Membership ends racing sends (PROTOCOL §5: membership is judged at send
//! time; a leaving member's period ends at and includes its `leave` event;
//! after `dismiss` no write is accepted), and two admins inviting overlapping
//! users at once.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use futures_util::future::join_all;
use serde_json::{json, Value};

use super::{ok, pushed_seqs, server, visible_events, ws_op, SUITE};
use crate::evidence::Check;
use crate::server::{TestServer, Ws};

const SENDERS: usize = 4;
const SENDS_EACH: usize = 60;
/// Messages the observer sees before the membership ends: mid-stream.
const ENDS_AFTER: usize = 50;
/// How long the ended member's devices are watched for a push past the end.
const QUIET: Duration = Duration::from_millis(400);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    Kick,
    Leave,
    Dismiss,
}

/// Pushes of `conv` on `ws` up to and including `last`, then any within [`QUIET`].
async fn pushes_through(ws: &mut Ws, conv: &str, last: i64) -> Vec<i64> {
    let mut seqs = vec![];
    while !seqs.contains(&last) {
        let push = ws.push().await;
        seqs.extend(pushed_seqs(&push, conv));
    }
    while let Some(push) = ws.push_within(QUIET).await {
        seqs.extend(pushed_seqs(&push, conv));
    }
    seqs
}

/// `(seq, kind, subject_user)` of every event of `conv`, from the table.
async fn log(s: &TestServer, conv: &str) -> Vec<(i64, String, Option<String>)> {
    let c = s.db.client().await;
    c.query("SELECT seq, kind, subject_user FROM events WHERE conv_id = $1 ORDER BY seq", &[&conv])
        .await
        .expect("read the log")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect()
}

/// `SENDS_EACH` sends, one at a time, on a connection of `token`'s: each seq or refusal.
async fn send_all(s: &TestServer, token: &str, conv: &str) -> Vec<Result<i64, String>> {
    let mut ws = s.ws(token).await;
    let mut answers = vec![];
    for i in 0..SENDS_EACH {
        let body = json!({"conv_id": conv, "client_msg_id": format!("m{i}"), "body": {"type": "text", "text": "x"}});
        answers.push(ws_op(&mut ws, "send", body).await.map(|v| v["seq"].as_i64().unwrap_or(0)));
    }
    answers
}

/// Once `observer` has been pushed `ENDS_AFTER` messages: the kick (of
/// `u-vic`), leave or dismiss on `ws`; its seq.
async fn end_mid_stream(observer: &mut Ws, ws: &mut Ws, ending: Ending, conv: &str) -> i64 {
    let mut seen = 0;
    while seen < ENDS_AFTER {
        seen += pushed_seqs(&observer.push().await, conv).len();
    }
    let r = match ending {
        Ending::Kick => ws_op(ws, "kick", json!({"conv_id": conv, "user_id": "u-vic"})).await,
        Ending::Leave => ws_op(ws, "leave", json!({"conv_id": conv})).await,
        Ending::Dismiss => ws_op(ws, "dismiss", json!({"conv_id": conv})).await,
    };
    ok(r, "end the membership")["seq"].as_i64().unwrap_or(0)
}

async fn race(ending: Ending) -> (Value, bool) {
    let s = server().await;
    let conv = "g-race";
    let senders: Vec<String> = (0..SENDERS).map(|i| format!("u-s{i}")).collect();
    let mut tokens = BTreeMap::new();
    for u in ["u-own", "u-adm", "u-vic", "u-obs"].into_iter().map(str::to_owned).chain(senders.iter().cloned()) {
        tokens.insert(u.clone(), s.user(&u).await);
    }
    let mut owner = s.ws(&tokens["u-own"]).await;
    let members: Vec<&str> =
        ["u-adm", "u-vic", "u-obs"].into_iter().chain(senders.iter().map(String::as_str)).collect();
    let created = owner
        .request("create_conversation", json!({"kind": "group", "conv_id": conv, "name": conv, "members": members}))
        .await;
    assert_eq!(created["ok"], true, "{created}");
    ok(ws_op(&mut owner, "set_role", json!({"conv_id": conv, "user_id": "u-adm", "role": "admin"})).await, "set_role");
    let mut admin = s.ws(&tokens["u-adm"]).await;
    let mut victim = s.ws(&tokens["u-vic"]).await;
    let mut victim_d2 = s.ws(&s.device("u-vic", "d2").await).await;
    let mut observer = s.ws(&tokens["u-obs"]).await;
    let head0 = ok(ws_op(&mut observer, "get_conversation", json!({"conv_id": conv})).await, "get")["head"]
        .as_i64()
        .unwrap_or(0);

    let sends = senders.iter().map(|u| send_all(&s, &tokens[u], conv));
    let ender = match ending {
        Ending::Kick => &mut admin,
        Ending::Leave => &mut victim,
        Ending::Dismiss => &mut owner,
    };
    let end = end_mid_stream(&mut observer, ender, ending, conv);
    let (answers, end_seq) = futures_util::join!(join_all(sends), end);
    let answers: Vec<Result<i64, String>> = answers.into_iter().flatten().collect();

    let log = log(&s, conv).await;
    let head = log.last().map_or(0, |e| e.0);
    let want_pushed: Vec<i64> = log.iter().map(|e| e.0).filter(|&q| q > head0 && q <= end_seq).collect();
    let mut devices = vec![];
    for ws in [&mut victim, &mut victim_d2] {
        let mut got = pushes_through(ws, conv, end_seq).await;
        got.sort_unstable();
        devices.push(got);
    }
    let after_end = ok(ws_op(&mut victim, "sync", json!({"conv_id": conv, "after_seq": end_seq})).await, "sync");
    let history: Vec<i64> = visible_events(&mut victim, conv).await.iter().filter_map(|e| e["seq"].as_i64()).collect();
    let joined = log.iter().find(|e| e.1 == "join" && e.2.as_deref() == Some("u-vic")).map_or(0, |e| e.0);
    let want_history: Vec<i64> = log.iter().map(|e| e.0).filter(|&q| q >= joined && q <= end_seq).collect();
    let end_event = log.iter().find(|e| e.0 == end_seq).cloned();

    let accepted: Vec<i64> = answers.iter().filter_map(|a| a.as_ref().ok().copied()).collect();
    let refused: BTreeSet<&str> = answers.iter().filter_map(|a| a.as_ref().err().map(String::as_str)).collect();
    let (before, after) =
        (accepted.iter().filter(|&&q| q < end_seq).count(), accepted.iter().filter(|&&q| q > end_seq).count());
    let msgs_in_log = log.iter().filter(|e| e.1 == "msg").count();
    let mut pass = devices.iter().all(|d| *d == want_pushed)
        && after_end["events"].as_array().is_some_and(Vec::is_empty)
        && history == want_history
        && before > 0
        && msgs_in_log == accepted.len();
    pass &= match ending {
        Ending::Kick | Ending::Leave => {
            let kind = end_event.as_ref().map(|e| (e.1.as_str(), e.2.as_deref()));
            kind == Some(("leave", Some("u-vic"))) && refused.is_empty() && after > 0
        }
        Ending::Dismiss => {
            let observer_history = visible_events(&mut observer, conv).await;
            head == end_seq
                && after == 0
                && refused.iter().all(|c| *c == "CONV_DISMISSED")
                && !refused.is_empty()
                && observer_history.last().and_then(|e| e["seq"].as_i64()) == Some(end_seq)
        }
    };
    let observed = json!({
        "end_seq": end_seq, "head": head, "events_before_connect": head0,
        "sends_accepted_before_end": before, "sends_accepted_after_end": after, "refusals": refused,
        "pushed_to_device_1": devices[0].len(), "pushed_to_device_2": devices[1].len(),
        "expected_pushes": want_pushed.len(),
        "devices_saw_exactly_the_log_up_to_end": devices.iter().all(|d| *d == want_pushed),
        "sync_after_end": after_end["events"], "joined_seq": joined, "history_via_sync": history.len(),
        "history_right": history == want_history,
        "end_event": end_event.map(|e| json!([e.0, e.1, e.2])),
    });
    (observed, pass)
}

#[actix_web::test]
async fn a_kick_racing_sends_ends_the_kicked_members_view_at_its_leave_event() {
    let check = Check::start(
        SUITE,
        "02-kick-races-sends",
        "ws, 4 senders x 60 sends one at a time, the victim on 2 devices, the admin kicks after 50 messages",
        "both devices of the kicked member were pushed exactly the log's events from its connection through its \
         leave event (every message committed before the kick, the leave event) and nothing after (watched \
         400 ms past the leave); its sync after the leave seq is empty and its whole history is the log up to \
         the leave; sends went on being accepted after the kick (the race happened), every accepted send is \
         in the log",
    );
    let (observed, pass) = race(Ending::Kick).await;
    assert!(check.resolve(observed, pass));
}

#[actix_web::test]
async fn a_leave_racing_sends_ends_the_members_view_at_its_leave_event() {
    let check = Check::start(
        SUITE,
        "02-leave-races-sends",
        "ws, 4 senders x 60 sends one at a time, the leaving member on 2 devices, leaves after 50 messages",
        "as for a kick: both devices were pushed exactly the log through the leave event and nothing after; \
         sync after the leave seq is empty; the history is the log up to the leave; sends continued after it",
    );
    let (observed, pass) = race(Ending::Leave).await;
    assert!(check.resolve(observed, pass));
}

#[actix_web::test]
async fn a_dismiss_racing_sends_accepts_no_write_after_its_seq() {
    let check = Check::start(
        SUITE,
        "02-dismiss-races-sends",
        "ws, 4 senders x 60 sends one at a time, the owner dismisses after 50 messages",
        "the dismiss event is the log's last event: every send after it answered CONV_DISMISSED (and some did), \
         every accepted send is before it; members' devices were pushed exactly the log through the dismiss \
         event and nothing after; former members still read the whole history through sync, ending at the \
         dismiss seq",
    );
    let (observed, pass) = race(Ending::Dismiss).await;
    assert!(check.resolve(observed, pass));
}

const ROUNDS: usize = 20;
const INVITEES: usize = 12;

#[actix_web::test]
async fn two_admins_inviting_overlapping_users_at_once_add_each_user_once() {
    let check = Check::start(
        SUITE,
        "02-invite-races",
        "ws, 20 rounds, two admins invite overlapping sets of 12 users at once (8 each, 4 in common)",
        "each round: every user has exactly one join event, is in exactly one reply's `joined` and in the other's \
         `skipped` when both named it; each admin came first in some round; member_count equals the number \
         of open membership periods (SQL), and equals the roster's row count",
    );
    let s = server().await;
    let own = s.user("u-own").await;
    let (a1, a2) = (s.user("u-a1").await, s.user("u-a2").await);
    for i in 0..ROUNDS * INVITEES {
        s.admin("/v1/admin/users", json!({"user_id": format!("u-i{i}")})).await;
    }
    let mut owner = s.ws(&own).await;
    let (mut w1, mut w2) = (s.ws(&a1).await, s.ws(&a2).await);
    let c = s.db.client().await;
    let mut rounds = vec![];
    let mut all_right = true;
    for round in 0..ROUNDS {
        let conv = format!("g-inv{round}");
        let created = owner
            .request(
                "create_conversation",
                json!({"kind": "group", "conv_id": conv, "name": conv, "members": ["u-a1", "u-a2"]}),
            )
            .await;
        assert_eq!(created["ok"], true, "{created}");
        for a in ["u-a1", "u-a2"] {
            ok(
                ws_op(&mut owner, "set_role", json!({"conv_id": conv, "user_id": a, "role": "admin"})).await,
                "set_role",
            );
        }
        let users: Vec<String> = (0..INVITEES).map(|i| format!("u-i{}", round * INVITEES + i)).collect();
        let (first, second) = (&users[..8], &users[4..]);
        // Both frames are written before either reply is read; odd rounds write the second admin's first.
        let (i1, i2) = (json!({"conv_id": conv, "user_ids": first}), json!({"conv_id": conv, "user_ids": second}));
        let (r1, r2) = if round % 2 == 0 {
            futures_util::join!(ws_op(&mut w1, "invite", i1), ws_op(&mut w2, "invite", i2))
        } else {
            let (r2, r1) = futures_util::join!(ws_op(&mut w2, "invite", i2), ws_op(&mut w1, "invite", i1));
            (r1, r2)
        };
        let (r1, r2) = (ok(r1, "invite 1"), ok(r2, "invite 2"));
        let names = |v: &Value, k: &str| -> Vec<String> {
            v[k].as_array().into_iter().flatten().filter_map(|u| u.as_str().map(str::to_owned)).collect()
        };
        let joins: Vec<String> = c
            .query(
                "SELECT subject_user FROM events WHERE conv_id = $1 AND kind = 'join' AND subject_user LIKE 'u-i%'",
                &[&conv],
            )
            .await
            .expect("joins")
            .iter()
            .map(|r| r.get(0))
            .collect();
        let counts = c
            .query_one(
                "SELECT member_count,
                        (SELECT count(*) FROM membership_periods p WHERE p.conv_id = c.conv_id AND to_seq IS NULL),
                        (SELECT count(*) FROM members m WHERE m.conv_id = c.conv_id)
                   FROM conversations c WHERE conv_id = $1",
                &[&conv],
            )
            .await
            .expect("counts");
        let (count, open, roster): (i32, i64, i64) = (counts.get(0), counts.get(1), counts.get(2));
        let mut right = count as i64 == open && open == roster && open == 3 + INVITEES as i64;
        for u in &users {
            let joined = [&r1, &r2].iter().filter(|r| names(r, "joined").contains(u)).count();
            let skipped = [&r1, &r2].iter().filter(|r| names(r, "skipped").contains(u)).count();
            let named = usize::from(first.contains(u)) + usize::from(second.contains(u));
            right &= joins.iter().filter(|j| *j == u).count() == 1 && joined == 1 && joined + skipped == named;
        }
        all_right &= right;
        rounds.push(json!({"round": round, "joined": [names(&r1, "joined").len(), names(&r2, "joined").len()],
                           "skipped": [names(&r1, "skipped").len(), names(&r2, "skipped").len()],
                           "join_events": joins.len(), "member_count": count, "open_periods": open, "right": right}));
    }
    let each_won = rounds.iter().any(|r| r["skipped"][0] == 0) && rounds.iter().any(|r| r["skipped"][1] == 0);
    let pass = check
        .resolve(json!({"rounds": rounds, "each_admin_came_first_in_some_round": each_won}), all_right && each_won);
    assert!(pass);
}
