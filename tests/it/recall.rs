//! `recall` (PROTOCOL §5) on the wire: its rules as one table run over
//! WebSocket and over HTTP on identical groups, and what a recall leaves
//! behind (the erased body, sync, the inbox, the push). The window is met by
//! moving a target's `created_at` in SQL, not by waiting. Each check writes
//! its record to evidence/im-11.

use std::collections::HashMap;

use imcore::store::Pace;
use serde_json::{json, Value};

use crate::evidence::Check;
use crate::server::{TestServer, Ws};

const SUITE: &str = "im-11";
const USERS: [&str; 8] = ["u-ana", "u-ben", "u-cai", "u-dan", "u-eve", "u-fay", "u-gus", "u-hal"];
/// RECALL_OTHER (PROTOCOL §5 permission bits).
const RECALL_OTHER: u32 = 2;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Via {
    Ws,
    Http,
}

/// The callers: a token each and, over WebSocket, a connection each.
struct Callers {
    tokens: HashMap<&'static str, String>,
    conns: HashMap<&'static str, Ws>,
}

/// A recall's answer, the same shape whatever carried it:
/// `{"seq","dup"}` or `{"error": code}`.
fn outcome(reply: &Value) -> Value {
    match reply["error"]["code"].as_str() {
        Some(code) => json!({"error": code}),
        None => json!({"seq": reply["seq"], "dup": reply["dup"]}),
    }
}

impl Callers {
    async fn start(s: &TestServer, via: Via) -> Self {
        let mut tokens = HashMap::new();
        let mut conns = HashMap::new();
        for user in USERS {
            let token = s.device(user, if via == Via::Ws { "ws" } else { "http" }).await;
            if via == Via::Ws {
                conns.insert(user, s.ws(&token).await);
            }
            tokens.insert(user, token);
        }
        Self { tokens, conns }
    }

    async fn start_recall(&mut self, s: &TestServer, caller: &'static str, conv: &str, target: i64) -> Pending {
        match self.conns.get_mut(caller) {
            Some(ws) => Pending::Ws(caller, ws.start("recall", json!({"conv_id": conv, "target_seq": target})).await),
            None => {
                let (path, token) = (format!("/v1/conversations/{conv}/recall"), self.tokens[caller].clone());
                let body = json!({"target_seq": target});
                Pending::Http(s.http("POST", &path, Some(&token), Some(&body)).await.1)
            }
        }
    }

    async fn finish(&mut self, pending: Pending) -> Value {
        match pending {
            Pending::Ws(caller, id) => outcome(&self.conns.get_mut(caller).expect("connection").reply(id).await),
            Pending::Http(reply) => outcome(&reply),
        }
    }

    async fn recall(&mut self, s: &TestServer, caller: &'static str, conv: &str, target: i64) -> Value {
        let pending = self.start_recall(s, caller, conv, target).await;
        self.finish(pending).await
    }
}

enum Pending {
    Ws(&'static str, u64),
    Http(Value),
}

/// Sends as `user` over HTTP; the seq.
async fn send(s: &TestServer, token: &str, conv: &str, key: &str) -> i64 {
    let body = json!({"client_msg_id": key, "body": {"type": "text", "text": key}});
    let (status, v) = s.http("POST", &format!("/v1/conversations/{conv}/messages"), Some(token), Some(&body)).await;
    assert_eq!(status, 201, "send {key}: {v}");
    v["seq"].as_i64().expect("seq")
}

/// A group op over HTTP that must succeed.
async fn group_op(s: &TestServer, token: &str, method: &str, path: String, body: Value) {
    let (status, v) = s.http(method, &path, Some(token), Some(&body)).await;
    assert!(status == 200 || status == 201, "{method} {path}: {status} {v}");
}

/// Moves the `created_at` of `seqs` back by `ms`.
async fn age(s: &TestServer, conv: &str, seqs: &[i64], ms: i64) {
    let c = s.db.client().await;
    c.execute(
        "UPDATE events SET created_at = now() - $3 * interval '1 millisecond' WHERE conv_id = $1 AND seq = ANY($2)",
        &[&conv, &seqs, &(ms as f64)],
    )
    .await
    .expect("age events");
}

/// The group the table runs on: owner ana, admin ben, members cai and dan,
/// eve with `RECALL_OTHER` as an extra bit, gus who left, hal who joined late
/// as an admin; fay never a member. Window 60 s, retention 5 days. Its
/// messages by name, and the purged one's seq.
async fn arrange(s: &TestServer, t: &HashMap<&'static str, String>, conv: &str) -> HashMap<&'static str, i64> {
    let create = json!({"kind": "group", "conv_id": conv, "name": conv,
        "members": ["u-ben", "u-cai", "u-dan", "u-eve", "u-gus"], "recall_window_ms": 60_000,
        "retention_ms": 5 * 86_400_000i64});
    group_op(s, &t["u-ana"], "POST", "/v1/conversations".into(), create).await;
    let member = |u: &str| format!("/v1/conversations/{conv}/members/{u}");
    group_op(s, &t["u-ana"], "PATCH", member("u-ben"), json!({"role": "admin"})).await;
    group_op(s, &t["u-ana"], "PATCH", member("u-eve"), json!({"extra_perms": RECALL_OTHER})).await;
    let mut m = HashMap::new();
    m.insert("purged", send(s, &t["u-cai"], conv, "purged").await);
    for (name, user) in [("in", "u-cai"), ("past", "u-cai"), ("dans", "u-dan"), ("old", "u-cai")] {
        m.insert(name, send(s, &t[user], conv, name).await);
    }
    for (name, user) in [("dans_old", "u-dan"), ("dans_old2", "u-dan"), ("gus", "u-gus")] {
        m.insert(name, send(s, &t[user], conv, name).await);
    }
    group_op(s, &t["u-gus"], "POST", format!("/v1/conversations/{conv}/leave"), json!({})).await;
    group_op(s, &t["u-ana"], "POST", format!("/v1/conversations/{conv}/members"), json!({"user_ids": ["u-hal"]})).await;
    m.insert("hal_join", m["gus"] + 2);
    group_op(s, &t["u-ana"], "PATCH", member("u-hal"), json!({"role": "admin"})).await;
    m.insert("late", send(s, &t["u-dan"], conv, "late").await);
    m.insert("contested", send(s, &t["u-ana"], conv, "contested").await);
    // Everything up to "purged" ten days old, then purged (retention 5 days).
    let upto: Vec<i64> = (1..=m["purged"]).collect();
    age(s, conv, &upto, 10 * 86_400_000).await;
    age(s, conv, &[m["old"], m["dans_old"], m["dans_old2"]], 3_600_000).await;
    let conv_id = imcore_actors::ConvId::parse(conv).expect("conv id");
    let (purged, _) = s.db.store.purge_conversation(&conv_id, Pace::chunk(100)).await.expect("purge");
    assert_eq!(purged as i64, m["purged"], "the purge took the prefix up to the purged message");
    m
}

/// One row of the table: who recalls what, and the answer expected
/// (`"new"`: `{seq, dup:false}`; `"dup:<row>"`: `dup:true` with that row's seq).
const TABLE: &[(&str, &str, &str, &str)] = &[
    ("own, just inside the window (58 s)", "u-cai", "in", "new"),
    ("own, just past the window (62 s)", "u-cai", "past", "RECALL_WINDOW_EXPIRED"),
    ("member, someone else's", "u-cai", "dans", "FORBIDDEN"),
    ("owner, someone else's, an hour old", "u-ana", "old", "new"),
    ("admin, someone else's, an hour old", "u-ben", "dans_old", "new"),
    ("member with extra_perms RECALL_OTHER", "u-eve", "dans_old2", "new"),
    ("non-member", "u-fay", "dans", "NOT_MEMBER"),
    ("former member, its own message", "u-gus", "gus", "NOT_MEMBER"),
    ("again, the same caller", "u-cai", "in", "dup:0"),
    ("again, the owner", "u-ana", "old", "dup:3"),
    ("a join event", "u-ana", "hal_join", "NOT_FOUND"),
    ("a purged message", "u-ana", "purged", "NOT_FOUND"),
    ("admin, a message from before it joined", "u-hal", "gus", "NOT_FOUND"),
    ("admin, a message after it joined", "u-hal", "late", "new"),
    ("past the head", "u-ana", "beyond", "NOT_FOUND"),
];

/// Runs the table over `via` on a fresh group; the answers, then the
/// contested recall's pair and its recall events, then the dismissed answer.
async fn run_table(s: &TestServer, via: Via, conv: &str) -> (Vec<Value>, Value, Value) {
    let mut callers = Callers::start(s, via).await;
    let mut m = arrange(s, &callers.tokens, conv).await;
    m.insert("beyond", m["contested"] + 100);
    age(s, conv, &[m["in"]], 58_000).await;
    age(s, conv, &[m["past"]], 62_000).await;
    let mut answers = vec![];
    for (_, caller, target, _) in TABLE {
        answers.push(callers.recall(s, caller, conv, m[target]).await);
    }
    // Two recalls of one message at once, by the owner and an admin.
    let (a, b) = if via == Via::Ws {
        let a = callers.start_recall(s, "u-ana", conv, m["contested"]).await;
        let b = callers.start_recall(s, "u-ben", conv, m["contested"]).await;
        (callers.finish(a).await, callers.finish(b).await)
    } else {
        let path = format!("/v1/conversations/{conv}/recall");
        let body = json!({"target_seq": m["contested"]});
        let (t, b) = (&callers.tokens, Some(&body));
        let (a, b) =
            tokio::join!(s.http("POST", &path, Some(&t["u-ana"]), b), s.http("POST", &path, Some(&t["u-ben"]), b));
        (outcome(&a.1), outcome(&b.1))
    };
    let c = s.db.client().await;
    let events: i64 = c
        .query_one(
            "SELECT count(*) FROM events WHERE conv_id = $1 AND kind = 'recall' AND target_seq = $2",
            &[&conv, &m["contested"]],
        )
        .await
        .expect("recall events")
        .get(0);
    let fresh = [&a, &b].iter().filter(|o| o["dup"] == false).count();
    let contested_once = events == 1 && a["seq"] == b["seq"] && a["seq"].is_i64() && fresh == 1;
    let contested = json!({"answers": [a, b], "recall_events": events, "once": contested_once});
    group_op(s, &callers.tokens["u-ana"], "DELETE", format!("/v1/conversations/{conv}"), json!({})).await;
    let dismissed = callers.recall(s, "u-ana", conv, m["dans"]).await;
    (answers, contested, dismissed)
}

/// Whether the table's answers are the expected ones.
fn as_expected(answers: &[Value]) -> bool {
    TABLE.iter().zip(answers).all(|((_, _, _, want), got)| match *want {
        "new" => got["dup"] == false && got["seq"].is_i64(),
        w if w.starts_with("dup:") => {
            let row: usize = w[4..].parse().expect("row");
            got["dup"] == true && got["seq"] == answers[row]["seq"]
        }
        code => got["error"] == code,
    })
}

#[actix_web::test]
async fn the_recall_rules_hold_alike_over_websocket_and_http() {
    let checks = [Via::Ws, Via::Http].map(|via| {
        Check::start(
            SUITE,
            "11-recall-rules",
            if via == Via::Ws { "ws" } else { "http" },
            "own message inside the window: new recall; 2 s past it: RECALL_WINDOW_EXPIRED; a member on another's: \
             FORBIDDEN; owner, admin and an extra_perms RECALL_OTHER member on others' hour-old messages: new \
             recall; non-member and former member: NOT_MEMBER; again: dup:true with the first recall's seq; a join \
             event, a purged message, one from before the caller joined, past the head: NOT_FOUND; two at once: \
             one recall event, one dup:false, the same seq; dismissed: CONV_DISMISSED",
        )
    });
    let s = TestServer::start().await;
    for user in USERS {
        s.user(user).await;
    }
    let ws = run_table(&s, Via::Ws, "g-recall-ws").await;
    let http = run_table(&s, Via::Http, "g-recall-http").await;
    let mut passed = true;
    for (check, (answers, contested, dismissed)) in checks.into_iter().zip([&ws, &http]) {
        let rows: Vec<Value> = TABLE
            .iter()
            .zip(answers)
            .map(|((what, caller, target, want), got)| {
                json!({"case": what, "caller": caller, "target": target, "expected": want, "answer": got})
            })
            .collect();
        let pass = as_expected(answers)
            && contested["once"] == true
            && dismissed["error"] == "CONV_DISMISSED"
            && ws.0 == http.0
            && ws.2 == http.2;
        passed &= check.resolve(
            json!({"table": rows, "concurrent": contested, "dismissed": dismissed,
                   "ws_and_http_answers_identical": ws.0 == http.0 && ws.2 == http.2}),
            pass,
        );
    }
    assert!(passed);
}

/// The event `seq` of a sync page's `events`, or null.
fn event_at(page: &Value, seq: i64) -> Value {
    page["events"].as_array().and_then(|es| es.iter().find(|e| e["seq"] == seq)).cloned().unwrap_or(Value::Null)
}

#[actix_web::test]
async fn a_recalled_message_is_erased_everywhere_and_its_recall_is_pushed() {
    let check = Check::start(
        SUITE,
        "11-after-recall",
        "ws+http",
        "after ana recalls m1: its events row has body NULL and recalled true; sync forward and backward show \
         m1 recalled:true, body:null and m2 intact; ben's inbox last_event is the recall event and unread goes \
         2 -> 1; ben's and cai's connections get the recall event pushed",
    );
    let s = TestServer::start().await;
    let ana = s.user("u-ana").await;
    let (ben, cai) = (s.user("u-ben").await, s.user("u-cai").await);
    let conv = "g-after";
    let create = json!({"kind": "group", "conv_id": conv, "name": conv, "members": ["u-ben", "u-cai"]});
    group_op(&s, &ana, "POST", "/v1/conversations".into(), create).await;
    let (m1, m2) = (send(&s, &ana, conv, "m1").await, send(&s, &ana, conv, "m2").await);
    let inbox = |token: String| {
        let s = &s;
        async move {
            let (_, v) = s.http("GET", "/v1/conversations", Some(&token), None).await;
            v["conversations"][0].clone()
        }
    };
    let unread_before = inbox(ben.clone()).await["unread"].clone();
    let (mut b, mut c) = (s.ws(&ben).await, s.ws(&cai).await);
    let (status, recall) =
        s.http("POST", &format!("/v1/conversations/{conv}/recall"), Some(&ana), Some(&json!({"target_seq": m1}))).await;
    let recall_seq = recall["seq"].as_i64().unwrap_or(0);
    let (pushed_b, pushed_c) = (b.push().await, c.push().await);
    let row =
        s.db.client()
            .await
            .query_one("SELECT body IS NULL, recalled FROM events WHERE conv_id = $1 AND seq = $2", &[&conv, &m1])
            .await
            .expect("the target's row");
    let (body_null, recalled): (bool, bool) = (row.get(0), row.get(1));
    let events = format!("/v1/conversations/{conv}/events");
    let (_, forward) = s.http("GET", &format!("{events}?after_seq=0"), Some(&ben), None).await;
    let (_, backward) = s.http("GET", &format!("{events}?before_seq={}", recall_seq + 1), Some(&ben), None).await;
    let after = inbox(ben.clone()).await;
    let erased = |e: &Value| e["recalled"] == true && e["body"].is_null() && e["kind"] == "msg";
    let intact = |e: &Value| e["recalled"] == false && e["body"] == json!({"type": "text", "text": "m2"});
    let recall_event =
        |p: &Value| p["push"] == "event" && p["event"]["kind"] == "recall" && p["event"]["target_seq"] == m1;
    let pass = status == 200
        && recall["dup"] == false
        && body_null
        && recalled
        && erased(&event_at(&forward, m1))
        && intact(&event_at(&forward, m2))
        && erased(&event_at(&backward, m1))
        && intact(&event_at(&backward, m2))
        && event_at(&forward, recall_seq)["target_seq"] == m1
        && after["last_event"]["seq"] == recall_seq
        && after["last_event"]["kind"] == "recall"
        && unread_before == 2
        && after["unread"] == 1
        && recall_event(&pushed_b)
        && recall_event(&pushed_c);
    let pass = check.resolve(
        json!({"recall": [status, recall], "row_body_null": body_null, "row_recalled": recalled,
               "forward_m1": event_at(&forward, m1), "backward_m1": event_at(&backward, m1),
               "forward_m2": event_at(&forward, m2), "inbox_last_event": after["last_event"],
               "unread_before_after": [unread_before, after["unread"]], "push_ben": pushed_b, "push_cai": pushed_c}),
        pass,
    );
    assert!(pass);
}
