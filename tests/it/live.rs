//! Live signals and blocking (PROTOCOL v1.2) on the wire: `block`/`unblock`/
//! `blocks` and every path a block closes, `reads` and read pushes to other
//! members, `typing` (throttle, mute, `pull`), `presence` (who may see it, the
//! grace period). The caller's ops go over WebSocket or over HTTP (the
//! variant); pushes are watched on WebSocket connections. Each check writes
//! its record to evidence/im-14. Two-node checks are in `live_cluster`.

use std::time::{Duration, Instant};

use imcore::config::WritePath;
use serde_json::{json, Value};

use crate::evidence::Check;
use crate::server::{TestServer, Ws};

pub const SUITE: &str = "im-14";
/// Long enough for a push that is coming to arrive.
const QUIET: Duration = Duration::from_millis(400);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Via {
    Ws,
    Http,
}

impl Via {
    pub fn name(self) -> &'static str {
        match self {
            Via::Ws => "ws",
            Via::Http => "http",
        }
    }
}

/// The HTTP route of a v1.2 op (or one the tests use beside them): method,
/// path, body.
fn route(op: &str, f: &Value) -> (&'static str, String, Value) {
    let conv = f["conv_id"].as_str().unwrap_or_default();
    let user = f["user_id"].as_str().unwrap_or_default();
    // Path parameters win over body fields, so the body may keep them.
    let body = f.clone();
    let query = |names: &[&str]| {
        let q: Vec<String> = names
            .iter()
            .filter_map(|n| f.get(*n).map(|v| format!("{n}={}", v.as_str().map_or(v.to_string(), str::to_owned))))
            .collect();
        if q.is_empty() {
            String::new()
        } else {
            format!("?{}", q.join("&"))
        }
    };
    match op {
        "block" => ("POST", "/v1/blocks".into(), body),
        "unblock" => ("DELETE", format!("/v1/blocks/{user}"), json!({})),
        "blocks" => ("GET", "/v1/blocks".into(), json!({})),
        "reads" => ("GET", format!("/v1/conversations/{conv}/reads{}", query(&["after", "limit"])), json!({})),
        "typing" => ("POST", format!("/v1/conversations/{conv}/typing"), body),
        "presence" => ("POST", "/v1/presence".into(), body),
        "send" => ("POST", format!("/v1/conversations/{conv}/messages"), body),
        "read" => ("POST", format!("/v1/conversations/{conv}/read"), body),
        "invite" => ("POST", format!("/v1/conversations/{conv}/members"), body),
        "create_conversation" => ("POST", "/v1/conversations".into(), body),
        "get_conversation" => ("GET", format!("/v1/conversations/{conv}"), json!({})),
        other => panic!("no route for {other}"),
    }
}

/// A user as a test drives it: a token, and a connection for pushes (and
/// for its ops over WebSocket).
pub struct Client {
    pub user: &'static str,
    pub token: String,
    pub ws: Ws,
    port: u16,
}

impl Client {
    pub async fn new(s: &TestServer, user: &'static str) -> Self {
        let token = s.user(user).await;
        let ws = s.ws(&token).await;
        Self { user, token, ws, port: s.port }
    }

    /// `op` over `via`: the result as over HTTP (an error as `{"error": CODE}`).
    pub async fn call(&mut self, via: Via, op: &str, fields: Value) -> Value {
        match via {
            Via::Ws => {
                let mut reply = self.ws.request(op, fields).await;
                if reply["ok"] == false {
                    return json!({"error": reply["error"]["code"]});
                }
                let Value::Object(m) = &mut reply else { panic!("reply {reply}") };
                m.remove("id");
                m.remove("ok");
                m.remove("result").unwrap_or(reply)
            }
            Via::Http => {
                let (method, path, body) = route(op, &fields);
                let body = (method != "GET" && method != "DELETE").then(|| body.to_string());
                let (_, v) =
                    crate::server::http_raw(self.port, method, &path, Some(&self.token), body.as_deref()).await;
                match v["error"]["code"].as_str() {
                    Some(code) => json!({"error": code}),
                    None => v,
                }
            }
        }
    }

    /// The pushes of `kind` (`"*"`: any) that arrive within `wait` (others are dropped).
    pub async fn pushes(&mut self, kind: &str, wait: Duration) -> Vec<Value> {
        let until = Instant::now() + wait;
        let mut got = vec![];
        while let Some(left) = until.checked_duration_since(Instant::now()) {
            match self.ws.live_push_within(left).await {
                Some(p) if kind == "*" || p["push"] == kind => got.push(p),
                Some(_) => {}
                None => break,
            }
        }
        got
    }

    pub async fn send(&mut self, via: Via, conv: &str, key: &str) -> Value {
        self.call(via, "send", json!({"conv_id": conv, "client_msg_id": key, "body": {"type": "text", "text": key}}))
            .await
    }
}

fn code(v: &Value) -> &str {
    v["error"].as_str().unwrap_or("ok")
}

/// A direct chat created by `a` with `b`.
async fn direct(a: &mut Client, b: &Client) -> String {
    let v = a.call(Via::Http, "create_conversation", json!({"kind": "direct", "members": [b.user]})).await;
    v["conv_id"].as_str().unwrap_or_else(|| panic!("direct: {v}")).to_owned()
}

/// A group `id` created by `owner` with `members`, with extra `settings`.
async fn group(owner: &mut Client, id: &str, members: &[&str], settings: Value) -> Value {
    let mut f = json!({"kind": "group", "conv_id": id, "name": id, "members": members});
    f.as_object_mut().expect("object").extend(settings.as_object().cloned().unwrap_or_default());
    owner.call(Via::Http, "create_conversation", f).await
}

#[actix_web::test]
async fn a_blocked_user_cannot_send_in_the_direct_chat_and_a_block_racing_its_sends_cuts_them_at_one_point() {
    for (via, path) in [(Via::Ws, WritePath::Actor), (Via::Http, WritePath::Actor), (Via::Ws, WritePath::Direct)] {
        let s = TestServer::with(|c| c.engine.write.path = path).await;
        let (mut ana, mut ben) = (Client::new(&s, "ana").await, Client::new(&s, "ben").await);
        let conv = direct(&mut ana, &ben).await;
        let before = code(&ben.send(via, &conv, "b-0").await).to_owned();
        let blocked = ana.call(via, "block", json!({"user_id": "ben"})).await;
        let refused = code(&ben.send(via, &conv, "b-1").await).to_owned();
        let blocker_sends = code(&ana.send(via, &conv, "a-1").await).to_owned();
        let unblocked = ana.call(via, "unblock", json!({"user_id": "ben"})).await;
        let after = code(&ben.send(via, &conv, "b-2").await).to_owned();

        // The race: ben pipelines sends on one connection (sequenced in
        // order) in waves, ana blocks meanwhile; once one is refused, every
        // later one is.
        let ben_sends = async {
            let mut answers: Vec<String> = vec![];
            for wave in 0..100 {
                let mut ids = vec![];
                for i in 0..10 {
                    let key = format!("r-{wave}-{i}");
                    let f = json!({"conv_id": conv, "client_msg_id": key, "body": {"type": "text", "text": "x"}});
                    ids.push(ben.ws.start("send", f).await);
                }
                for id in ids {
                    let r = ben.ws.reply(id).await;
                    answers.push(r["error"]["code"].as_str().unwrap_or("ok").to_owned());
                }
                if answers.last().is_some_and(|a| a == "BLOCKED") {
                    break;
                }
            }
            answers
        };
        let ana_blocks = async {
            tokio::time::sleep(Duration::from_millis(30)).await;
            ana.ws.request("block", json!({"user_id": "ben"})).await
        };
        let (answers, _) = futures_util::join!(ben_sends, ana_blocks);
        let first_refused = answers.iter().position(|a| a == "BLOCKED");
        let cut_once = first_refused.is_some_and(|i| answers[i..].iter().all(|a| a == "BLOCKED"))
            && answers.iter().all(|a| a == "ok" || a == "BLOCKED");
        let pass = before == "ok"
            && blocked == json!({})
            && refused == "BLOCKED"
            && blocker_sends == "ok"
            && unblocked == json!({})
            && after == "ok"
            && cut_once;
        let variant = match path {
            WritePath::Actor => via.name().to_owned(),
            WritePath::Direct => format!("{} write_path=direct", via.name()),
        };
        let check = Check::start(
            SUITE,
            "14-block-direct-send",
            variant,
            "after block, the blocked user's send in the direct chat is BLOCKED and the blocker's goes; after unblock it goes again; 150 pipelined sends racing a block: ok up to one point, BLOCKED from there on",
        );
        let observed = json!({"before": before, "block": blocked, "blocked_send": refused, "blocker_send": blocker_sends,
            "unblock": unblocked, "after_unblock": after, "race_first_refused": first_refused, "race_cut_once": cut_once});
        assert!(check.resolve(observed, pass));
    }
}

#[actix_web::test]
async fn a_blocked_user_cannot_create_the_direct_chat_and_one_the_blocker_creates_starts_blocked() {
    for via in [Via::Ws, Via::Http] {
        let s = TestServer::start().await;
        let (mut ana, mut ben) = (Client::new(&s, "ana").await, Client::new(&s, "ben").await);
        ana.call(via, "block", json!({"user_id": "ben"})).await;
        let new = ben.call(via, "create_conversation", json!({"kind": "direct", "members": ["ana"]})).await;
        let inbox = s.http("GET", "/v1/conversations", Some(&ana.token), None).await.1;
        let none_created = inbox["conversations"].as_array().is_some_and(Vec::is_empty);
        // Created by the blocker, the chat exists; the blocked member still may not send.
        let by_blocker = ana.call(via, "create_conversation", json!({"kind": "direct", "members": ["ben"]})).await;
        let conv = by_blocker["conv_id"].as_str().unwrap_or_default().to_owned();
        let send = code(&ben.send(via, &conv, "b-1").await).to_owned();
        let existing = ben.call(via, "create_conversation", json!({"kind": "direct", "members": ["ana"]})).await;
        let pass = code(&new) == "BLOCKED"
            && none_created
            && !conv.is_empty()
            && send == "BLOCKED"
            && code(&existing) == "BLOCKED";
        let check = Check::start(
            SUITE,
            "14-block-create-direct",
            via.name(),
            "the blocked user's create_conversation of the direct chat is BLOCKED (none created; an existing one too); one the blocker creates refuses the blocked user's send",
        );
        let observed = json!({"create_by_blocked": code(&new), "none_created": none_created,
            "create_by_blocker": by_blocker["kind"], "blocked_send": send, "create_existing_by_blocked": code(&existing)});
        assert!(check.resolve(observed, pass));
    }
}

#[actix_web::test]
async fn a_blocked_user_cannot_invite_the_blocker_but_both_still_see_each_other_in_a_group() {
    for via in [Via::Ws, Via::Http] {
        let s = TestServer::start().await;
        let mut ana = Client::new(&s, "ana").await;
        let mut ben = Client::new(&s, "ben").await;
        let mut cai = Client::new(&s, "cai").await;
        group(&mut ben, "g-ben", &["cai"], json!({})).await;
        ana.call(via, "block", json!({"user_id": "ben"})).await;
        let invite = ben.call(via, "invite", json!({"conv_id": "g-ben", "user_ids": ["cai", "ana"]})).await;
        let count = ben.call(via, "get_conversation", json!({"conv_id": "g-ben"})).await["member_count"].clone();
        let create = ben
            .call(
                via,
                "create_conversation",
                json!({"kind": "group", "conv_id": "g-new", "name": "n", "members": ["ana"]}),
            )
            .await;
        // Another member may invite the blocker; then both see each other's messages.
        let by_cai = cai.call(via, "invite", json!({"conv_id": "g-ben", "user_ids": ["ana"]})).await;
        ana.pushes("*", QUIET).await;
        let ben_sends = code(&ben.send(via, "g-ben", "b-1").await).to_owned();
        let ana_got =
            ana.pushes("*", QUIET).await.iter().filter(|p| p["push"] == "event" || p["push"] == "events").count();
        let ana_sends = code(&ana.send(via, "g-ben", "a-1").await).to_owned();
        let pass = code(&invite) == "BLOCKED"
            && count == 2
            && code(&create) == "BLOCKED"
            && by_cai["joined"] == json!(["ana"])
            && ben_sends == "ok"
            && ana_got >= 1
            && ana_sends == "ok";
        let check = Check::start(
            SUITE,
            "14-block-invite",
            via.name(),
            "the blocked user's invite naming the blocker is BLOCKED whole (member_count unchanged), so is a group created with the blocker; another member's invite works and in the group the blocked user's message reaches the blocker",
        );
        let observed = json!({"invite": code(&invite), "member_count": count, "create_group": code(&create),
            "other_invite": by_cai, "blocked_sends_in_group": ben_sends, "blocker_got_pushes": ana_got, "blocker_sends": ana_sends});
        assert!(check.resolve(observed, pass));
    }
}

#[actix_web::test]
async fn blocking_is_private_the_blocked_user_learns_nothing_but_its_refusals() {
    for via in [Via::Ws, Via::Http] {
        let s = TestServer::start().await;
        let (mut ana, mut ben) = (Client::new(&s, "ana").await, Client::new(&s, "ben").await);
        let conv = direct(&mut ana, &ben).await;
        ben.pushes("*", QUIET).await;
        ana.call(via, "block", json!({"user_id": "ben"})).await;
        let pushes_to_ben = ben.pushes("*", QUIET).await.len();
        let ana_list = ana.call(via, "blocks", json!({})).await;
        let ben_list = ben.call(via, "blocks", json!({})).await;
        let conv_seen = ben.call(via, "get_conversation", json!({"conv_id": conv})).await["conv_id"] == conv.as_str();
        let typing = ben.call(via, "typing", json!({"conv_id": conv, "on": true})).await;
        let typing_to_ana = ana.pushes("typing", QUIET).await.len();
        let listed = ana_list["blocks"].as_array().map(|b| b.iter().map(|x| x["user_id"].clone()).collect::<Vec<_>>());
        let pass = pushes_to_ben == 0
            && listed == Some(vec![json!("ben")])
            && ben_list == json!({"blocks": []})
            && conv_seen
            && typing == json!({})
            && typing_to_ana == 0;
        let check = Check::start(
            SUITE,
            "14-block-private",
            via.name(),
            "a block pushes nothing to the blocked user, shows only in the blocker's `blocks`, leaves the chat readable to it, and its typing is answered {} but not forwarded",
        );
        let observed = json!({"pushes_to_blocked": pushes_to_ben, "blocker_list": ana_list, "blocked_list": ben_list,
            "blocked_reads_conv": conv_seen, "blocked_typing_answer": typing, "typing_pushed_to_blocker": typing_to_ana});
        assert!(check.resolve(observed, pass));
    }
}

#[actix_web::test]
async fn bad_block_requests_get_their_codes_and_change_nothing() {
    for via in [Via::Ws, Via::Http] {
        let s = TestServer::with(|c| c.live.max_blocks = 2).await;
        let mut ana = Client::new(&s, "ana").await;
        for u in ["ben", "cai", "dan"] {
            s.user(u).await;
        }
        let own = ana.call(via, "block", json!({"user_id": "ana"})).await;
        let unknown = ana.call(via, "block", json!({"user_id": "nobody"})).await;
        let malformed = match via {
            Via::Ws => ana.call(via, "block", json!({"user_id": "a b"})).await,
            Via::Http => ana.call(via, "block", json!({"user_id": 7})).await,
        };
        let two = [
            ana.call(via, "block", json!({"user_id": "ben"})).await,
            ana.call(via, "block", json!({"user_id": "cai"})).await,
            ana.call(via, "block", json!({"user_id": "ben"})).await,
        ];
        let over = ana.call(via, "block", json!({"user_id": "dan"})).await;
        let unblock_unknown = ana.call(via, "unblock", json!({"user_id": "nobody"})).await;
        let list = ana.call(via, "blocks", json!({})).await;
        let ids: Vec<Value> =
            list["blocks"].as_array().map(|b| b.iter().map(|x| x["user_id"].clone()).collect()).unwrap_or_default();
        let pass = code(&own) == "BAD_REQUEST"
            && code(&unknown) == "NOT_FOUND"
            && code(&malformed) == "BAD_REQUEST"
            && two.iter().all(|v| *v == json!({}))
            && code(&over) == "BAD_REQUEST"
            && code(&unblock_unknown) == "NOT_FOUND"
            && ids == [json!("ben"), json!("cai")];
        let check = Check::start(
            SUITE,
            "14-block-bad-input",
            via.name(),
            "blocking oneself or a malformed id: BAD_REQUEST; an unknown user: NOT_FOUND; past the cap (2 here): BAD_REQUEST; the list keeps exactly the blocks that went through",
        );
        let observed = json!({"self": code(&own), "unknown": code(&unknown), "malformed": code(&malformed),
            "within_cap": two, "over_cap": code(&over), "unblock_unknown": code(&unblock_unknown), "list": ids});
        assert!(check.resolve(observed, pass));
    }
}

#[actix_web::test]
async fn reads_pages_the_members_cursors_in_join_order() {
    for via in [Via::Ws, Via::Http] {
        let s = TestServer::start().await;
        let mut ana = Client::new(&s, "ana").await;
        let mut others = vec![];
        for u in ["ben", "cai", "dan"] {
            others.push(Client::new(&s, u).await);
        }
        group(&mut ana, "g-r", &["ben", "cai", "dan"], json!({})).await;
        ana.send(Via::Http, "g-r", "m1").await;
        others[0].call(Via::Http, "read", json!({"conv_id": "g-r", "seq": 5})).await;
        others[2].call(Via::Http, "read", json!({"conv_id": "g-r", "seq": 3})).await;
        let first = ana.call(via, "reads", json!({"conv_id": "g-r", "limit": 2})).await;
        let second = ana.call(via, "reads", json!({"conv_id": "g-r", "limit": 2, "after": first["next"]})).await;
        let mut out = Client::new(&s, "eve").await;
        let outsider = out.call(via, "reads", json!({"conv_id": "g-r"})).await;
        let bad = ana.call(via, "reads", json!({"conv_id": "g-r", "limit": 0})).await;
        let expected_first =
            json!({"reads": [{"user_id": "ana", "read_seq": 0}, {"user_id": "ben", "read_seq": 5}], "next": 2});
        let expected_second =
            json!({"reads": [{"user_id": "cai", "read_seq": 0}, {"user_id": "dan", "read_seq": 3}], "next": 4});
        let third = ana.call(via, "reads", json!({"conv_id": "g-r", "limit": 2, "after": 4})).await;
        let pass = first == expected_first
            && second == expected_second
            && third == json!({"reads": [], "next": null})
            && code(&outsider) == "NOT_MEMBER"
            && code(&bad) == "BAD_REQUEST";
        let check = Check::start(
            SUITE,
            "14-reads-paged",
            via.name(),
            "reads pages {user_id, read_seq} in join order with `next` = the last joined_seq (null past the end); a non-member: NOT_MEMBER; limit 0: BAD_REQUEST",
        );
        let observed =
            json!({"page1": first, "page2": second, "page3": third, "outsider": code(&outsider), "limit0": code(&bad)});
        assert!(check.resolve(observed, pass));
    }
}

#[actix_web::test]
async fn a_read_in_a_direct_chat_is_pushed_to_the_other_member_once_it_moves() {
    for via in [Via::Ws, Via::Http] {
        let s = TestServer::start().await;
        let (mut ana, mut ben) = (Client::new(&s, "ana").await, Client::new(&s, "ben").await);
        let conv = direct(&mut ana, &ben).await;
        ana.send(Via::Http, &conv, "m1").await;
        ben.pushes("*", QUIET).await;
        let read = ben.call(via, "read", json!({"conv_id": conv, "seq": 3})).await;
        let pushed = ana.pushes("read", QUIET).await;
        let again = ben.call(via, "read", json!({"conv_id": conv, "seq": 2})).await;
        let pushed_again = ana.pushes("read", QUIET).await;
        let expected = json!([{"push": "read", "conv_id": conv, "user_id": "ben", "read_seq": 3}]);
        let pass = read == json!({"read_seq": 3})
            && json!(pushed) == expected
            && again == json!({"read_seq": 3})
            && pushed_again.is_empty();
        let check = Check::start(
            SUITE,
            "14-read-push-direct",
            via.name(),
            "ben's read in a direct chat pushes {push: read, conv_id, user_id: ben, read_seq} to ana; a read that does not move the cursor pushes nothing",
        );
        let observed =
            json!({"read": read, "pushed": pushed, "read_back": again, "pushed_after_no_move": pushed_again});
        assert!(check.resolve(observed, pass));
    }
}

#[actix_web::test]
async fn read_pushes_reach_a_group_up_to_the_size_limit_and_none_above_it() {
    for via in [Via::Ws, Via::Http] {
        let s = TestServer::with(|c| c.live.read_push_max_members = 3).await;
        let mut ana = Client::new(&s, "ana").await;
        let mut ben = Client::new(&s, "ben").await;
        let mut cai = Client::new(&s, "cai").await;
        s.user("dan").await;
        group(&mut ana, "g-small", &["ben", "cai"], json!({})).await;
        group(&mut ana, "g-big", &["ben", "cai", "dan"], json!({})).await;
        ben.pushes("*", QUIET).await;
        cai.pushes("*", QUIET).await;
        ana.call(via, "read", json!({"conv_id": "g-small", "seq": 3})).await;
        let small = (ben.pushes("read", QUIET).await.len(), cai.pushes("read", QUIET).await.len());
        ana.call(via, "read", json!({"conv_id": "g-big", "seq": 4})).await;
        let big = (ben.pushes("read", QUIET).await.len(), cai.pushes("read", QUIET).await.len());
        let pass = small == (1, 1) && big == (0, 0);
        let check = Check::start(
            SUITE,
            "14-read-push-size-limit",
            via.name(),
            "with the limit at 3 members: a read in a 3-member group is pushed to both others, one in a 4-member group to none",
        );
        let observed = json!({"limit": 3, "pushes_3_members": small, "pushes_4_members": big});
        assert!(check.resolve(observed, pass));
    }
}

/// ana types `n` times at once in a direct chat with ben: the answers, the
/// typing pushes ben gets, and how long the burst took.
async fn typing_burst(s: &TestServer, via: Via, n: usize) -> (Vec<Value>, Vec<Value>, Duration) {
    let (mut ana, mut ben) = (Client::new(s, "ana").await, Client::new(s, "ben").await);
    let conv = direct(&mut ana, &ben).await;
    ben.pushes("*", QUIET).await;
    let started = Instant::now();
    let mut answers = vec![];
    if via == Via::Ws {
        let mut ids = vec![];
        for _ in 0..n {
            ids.push(ana.ws.start("typing", json!({"conv_id": conv, "on": true})).await);
        }
        for id in ids {
            let mut r = ana.ws.reply(id).await;
            if let Some(m) = r.as_object_mut() {
                m.retain(|k, _| k != "id" && k != "ok");
            }
            answers.push(r);
        }
    } else {
        for _ in 0..n {
            answers.push(ana.call(via, "typing", json!({"conv_id": conv, "on": true})).await);
        }
    }
    let burst = started.elapsed();
    (answers, ben.pushes("typing", Duration::from_millis(600)).await, burst)
}

#[actix_web::test]
async fn a_typing_flood_is_answered_and_forwarded_once_per_second() {
    for via in [Via::Ws, Via::Http] {
        let s = TestServer::start().await;
        let (answers, pushed, burst) = typing_burst(&s, via, 20).await;
        let burst_ms = burst.as_millis();
        // At most one per started second of the burst (one, unless the machine is very slow).
        let allowed = 1 + (burst_ms / 1000) as usize;
        let shaped = pushed.iter().all(|p| {
            p.as_object().map(|m| m.len()) == Some(4)
                && p["push"] == "typing"
                && p["user_id"] == "ana"
                && p["on"] == true
        });
        let pass = answers.iter().all(|a| *a == json!({})) && !pushed.is_empty() && pushed.len() <= allowed && shaped;
        let check = Check::start(
            SUITE,
            "14-typing-throttled",
            via.name(),
            "20 typing signals in a burst: all answered {}, one forwarded to the other member per started second of the burst ({push: typing, conv_id, user_id, on})",
        );
        let observed = json!({"answers_all_empty": answers.iter().all(|a| *a == json!({})), "forwarded": pushed, "burst_ms": burst_ms, "allowed": allowed});
        assert!(check.resolve(observed, pass));
    }
}

#[actix_web::test]
async fn negative_control_without_the_throttle_the_typing_flood_check_fails() {
    let s = TestServer::with(|c| c.live.typing_interval_ms = 0).await;
    let (answers, pushed, burst) = typing_burst(&s, Via::Ws, 20).await;
    // The check of `14-typing-throttled`, run against a server whose throttle is off.
    let allowed = 1 + (burst.as_millis() / 1000) as usize;
    let throttled_check_passes =
        answers.iter().all(|a| *a == json!({})) && !pushed.is_empty() && pushed.len() <= allowed;
    let check = Check::start(
        SUITE,
        "14-negative-control",
        "typing_interval_ms=0",
        "with the throttle switched off (IMCORE_TYPING_INTERVAL_MS=0) the 14-typing-throttled check fails: every one of the 20 signals is forwarded",
    );
    let observed = json!({"forwarded": pushed.len(), "throttled_check_passes": throttled_check_passes});
    assert!(check.resolve(observed, !throttled_check_passes && pushed.len() == 20));
}

#[actix_web::test]
async fn typing_is_not_forwarded_from_a_muted_member_nor_in_a_pull_group_and_a_non_member_is_refused() {
    for via in [Via::Ws, Via::Http] {
        let s = TestServer::start().await;
        let mut ana = Client::new(&s, "ana").await;
        let mut ben = Client::new(&s, "ben").await;
        let mut eve = Client::new(&s, "eve").await;
        group(&mut ana, "g-push", &["ben"], json!({})).await;
        group(&mut ana, "g-pull", &["ben"], json!({"delivery_mode": "pull"})).await;
        ana.pushes("*", QUIET).await;
        let muted_until = "2099-01-01T00:00:00.000Z";
        let (_, m) = s
            .http(
                "PATCH",
                "/v1/conversations/g-push/members/ben",
                Some(&ana.token),
                Some(&json!({"mute_until": muted_until})),
            )
            .await;
        let muted = ben.call(via, "typing", json!({"conv_id": "g-push", "on": true})).await;
        let pull = ben.call(via, "typing", json!({"conv_id": "g-pull", "on": true})).await;
        let to_ana = ana.pushes("typing", QUIET).await.len();
        let outsider = eve.call(via, "typing", json!({"conv_id": "g-push", "on": true})).await;
        let unknown = eve.call(via, "typing", json!({"conv_id": "g-none", "on": false})).await;
        // The control: the owner's typing in the push group does reach ben.
        let owner = ana.call(via, "typing", json!({"conv_id": "g-push", "on": false})).await;
        let to_ben = ben.pushes("typing", QUIET).await;
        let pass = m.get("seq").is_some()
            && muted == json!({})
            && pull == json!({})
            && to_ana == 0
            && code(&outsider) == "NOT_MEMBER"
            && code(&unknown) == "NOT_MEMBER"
            && owner == json!({})
            && json!(to_ben) == json!([{"push": "typing", "conv_id": "g-push", "user_id": "ana", "on": false}]);
        let check = Check::start(
            SUITE,
            "14-typing-muted-or-pull",
            via.name(),
            "a muted member's typing and any typing in a pull group are answered {} and not forwarded; a non-member (or an unknown conversation): NOT_MEMBER; the owner's typing in the push group reaches the other member",
        );
        let observed = json!({"muted": muted, "pull": pull, "forwarded_to_owner": to_ana, "non_member": code(&outsider),
            "unknown_conv": code(&unknown), "owner_typing_pushed": to_ben});
        assert!(check.resolve(observed, pass));
    }
}

#[actix_web::test]
async fn presence_answers_only_for_users_sharing_a_conversation_and_refuses_101_ids() {
    for via in [Via::Ws, Via::Http] {
        let s = TestServer::start().await;
        let mut ana = Client::new(&s, "ana").await;
        let ben = Client::new(&s, "ben").await;
        let _eve = Client::new(&s, "eve").await;
        group(&mut ana, "g-p", &["ben"], json!({})).await;
        let answer = ana.call(via, "presence", json!({"user_ids": ["ben", "eve", "nobody", "ana"]})).await;
        let expected = json!([
            {"user_id": "ben", "online": true, "last_seen": null},
            {"user_id": "eve", "online": null, "last_seen": null},
            {"user_id": "nobody", "online": null, "last_seen": null},
            {"user_id": "ana", "online": true, "last_seen": null},
        ]);
        let ids: Vec<String> = (0..101).map(|i| format!("u{i}")).collect();
        let too_many = ana.call(via, "presence", json!({"user_ids": ids})).await;
        let hundred = ana.call(via, "presence", json!({"user_ids": ids[..100]})).await;
        drop(ben);
        let pass = answer == expected
            && code(&too_many) == "BAD_REQUEST"
            && hundred.as_array().is_some_and(|a| a.len() == 100);
        let check = Check::start(
            SUITE,
            "14-presence-no-shared-conversation",
            via.name(),
            "presence answers online/last_seen for users sharing a conversation (and oneself); a user sharing none answers exactly like one that does not exist (online: null); 100 ids answer, 101: BAD_REQUEST",
        );
        let observed =
            json!({"answer": answer, "ids_101": code(&too_many), "ids_100": hundred.as_array().map(Vec::len)});
        assert!(check.resolve(observed, pass));
    }
}

#[actix_web::test]
async fn presence_changes_reach_direct_peers_after_the_grace_and_a_quick_reconnect_announces_nothing() {
    let s = TestServer::with(|c| c.live.presence_grace_ms = 1000).await;
    let mut ana = Client::new(&s, "ana").await;
    let ben = Client::new(&s, "ben").await;
    direct(&mut ana, &ben).await;
    ana.pushes("*", QUIET).await;
    let ben_token = ben.token.clone();
    ben.ws.close().await;
    // Back within the grace: nothing is announced.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let back = s.ws(&ben_token).await;
    let flap = ana.pushes("presence", Duration::from_millis(1500)).await;
    let online_mid = ana.call(Via::Ws, "presence", json!({"user_ids": ["ben"]})).await;
    back.close().await;
    let left_at = Instant::now();
    let offline = ana.pushes("presence", Duration::from_millis(2500)).await;
    let announced_after_ms = left_at.elapsed().as_millis();
    let answer = ana.call(Via::Http, "presence", json!({"user_ids": ["ben"]})).await;
    let again = s.ws(&ben_token).await;
    let online = ana.pushes("presence", Duration::from_millis(800)).await;
    drop(again);
    let pass = flap.is_empty()
        && online_mid[0]["online"] == true
        && offline.len() == 1
        && offline[0]["online"] == false
        && offline[0]["user_id"] == "ben"
        && offline[0]["last_seen"].is_string()
        && answer[0]["online"] == false
        && answer[0]["last_seen"] == offline[0]["last_seen"]
        && online.len() == 1
        && online[0]["online"] == true;
    let check = Check::start(
        SUITE,
        "14-presence-single-node-grace",
        "grace=1000ms",
        "a reconnect within the grace announces nothing (and ben reads online meanwhile); the last device gone is announced to the direct peer once, after the grace, with last_seen (presence then answers it); coming back is announced at once",
    );
    let observed = json!({"pushes_during_flap": flap, "online_during_flap": online_mid, "offline_pushes": offline,
        "offline_push_within_ms": announced_after_ms, "presence_after": answer, "online_pushes": online});
    assert!(check.resolve(observed, pass));
}
