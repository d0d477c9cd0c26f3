//! Offline notifications (PROTOCOL v1.3) end to end: the server, a real
//! PostgreSQL, and a push gateway of the test's own (`gateway`) recording
//! what it receives. Records in `evidence/im-15`.

mod gateway;
mod restart;
mod two_nodes;

use std::time::Duration;

use imcore::config::Config;
use serde_json::{json, Value};

use crate::evidence::Check;
use crate::server::TestServer;
use gateway::Gateway;

pub const SUITE: &str = "im-15";
const WAIT: Duration = Duration::from_secs(15);
/// Long enough for a notification that is not coming to have come.
const QUIET: Duration = Duration::from_millis(1500);

/// Short intervals, so the suite stays fast.
pub fn fast(config: &mut Config) {
    config.notify.coalesce_ms = 300;
    config.notify.backoff_ms = 100;
    config.notify.flush_ms = 200;
    config.notify.lease_ms = 1500;
}

pub async fn set_pusher(s: &TestServer, token: &str, pushkey: &str, url: &str) {
    let body = json!({"app_id": "im.test", "pushkey": pushkey, "url": url, "data": {"format": "event_id_only"}});
    let (status, v) = s.http("POST", "/v1/pushers", Some(token), Some(&body)).await;
    assert_eq!(status, 200, "set_pusher: {v}");
}

/// Sends `text` (mentioning `mentions`); its seq.
pub async fn send(s: &TestServer, token: &str, conv: &str, text: &str, mentions: &[&str]) -> i64 {
    let body = json!({"client_msg_id": uuid::Uuid::new_v4().to_string(), "body": {"text": text}, "mentions": mentions});
    let (status, v) = s.http("POST", &format!("/v1/conversations/{conv}/messages"), Some(token), Some(&body)).await;
    assert_eq!(status, 201, "send: {v}");
    v["seq"].as_i64().expect("seq")
}

/// A gateway, a server, bob's token and his direct chat with ann, who is
/// offline with one pusher (`ann-k`) at that gateway.
async fn bob_and_offline_ann() -> (Gateway, TestServer, String, String) {
    let gw = Gateway::start(Duration::ZERO);
    let s = TestServer::with(fast).await;
    let bob = s.user("bob").await;
    let ann = s.user("ann").await;
    set_pusher(&s, &ann, "ann-k", &gw.url).await;
    let conv = s.direct(&bob, "ann").await;
    (gw, s, bob, conv)
}

fn event_ids(got: &[Value]) -> Vec<String> {
    got.iter().map(|n| n["event_id"].as_str().unwrap_or_default().to_owned()).collect()
}

#[actix_web::test]
async fn an_offline_device_gets_the_notification_with_its_event_and_unread_count_and_an_online_one_gets_none() {
    let check = Check::start(
        SUITE,
        "28-offline-gets-notification",
        "direct chat, HTTP pusher",
        "one notification naming the conversation, the event, unread 1, the pushkey; none for a connected device",
    );
    let gw = Gateway::start(Duration::ZERO);
    let s = TestServer::with(fast).await;
    let bob = s.user("bob").await;
    s.user("ann").await;
    let ann_phone = s.device("ann", "phone").await;
    set_pusher(&s, &ann_phone, "ann-phone", &gw.url).await;
    set_pusher(&s, &bob, "bob-d1", &gw.url).await;
    let _bob_online = s.ws(&bob).await;
    let conv = s.direct(&bob, "ann").await;
    let seq = send(&s, &bob, &conv, "hi", &[]).await;
    send(&s, &ann_phone, &conv, "yo", &[]).await;
    let got = gw.wait_delivered("ann-phone", 1, WAIT).await;
    tokio::time::sleep(QUIET).await;
    let (ann, bobs) = (gw.delivered("ann-phone"), gw.delivered("bob-d1"));
    let n = ann.first().cloned().unwrap_or(Value::Null);
    let pass = got.len() == 1
        && ann.len() == 1
        && n["room_id"] == conv.as_str()
        && n["event_id"] == format!("{conv}:{seq}")
        && n["counts"]["unread"] == 1
        && n["devices"][0]["pushkey"] == "ann-phone"
        && n["devices"][0]["app_id"] == "im.test"
        && n["devices"][0]["data"]["format"] == "event_id_only"
        && n["prio"] == "high"
        && n["type"] == "msg"
        && n["sender"] == "bob"
        && bobs.is_empty();
    let pass = check.resolve(json!({"to_offline": ann, "to_online": bobs.len()}), pass);
    assert!(pass);
}

#[actix_web::test]
async fn a_kicked_member_gets_nothing_after_its_kick_and_mentions_level_gets_only_mentions() {
    let check = Check::start(
        SUITE,
        "28-kicked-and-mentions",
        "group of 3, notify=mentions for one",
        "the kicked member: nothing past its kick; the mentions member: only the message naming it",
    );
    let gw = Gateway::start(Duration::ZERO);
    let s = TestServer::with(fast).await;
    let own = s.user("own").await;
    let kim = s.user("kim").await;
    let men = s.user("men").await;
    set_pusher(&s, &kim, "kim-k", &gw.url).await;
    set_pusher(&s, &men, "men-k", &gw.url).await;
    let body = json!({"kind": "group", "name": "g", "members": ["kim", "men"]});
    let (status, v) = s.http("POST", "/v1/conversations", Some(&own), Some(&body)).await;
    assert_eq!(status, 201, "{v}");
    let conv = v["conv_id"].as_str().expect("conv_id").to_owned();
    let (status, v) = s
        .http("POST", &format!("/v1/conversations/{conv}/notify"), Some(&men), Some(&json!({"level": "mentions"})))
        .await;
    assert_eq!((status, &v["level"]), (200, &json!("mentions")), "{v}");
    let m1 = send(&s, &own, &conv, "for all", &[]).await;
    let until = tokio::time::Instant::now() + WAIT;
    while !event_ids(&gw.delivered("kim-k")).contains(&format!("{conv}:{m1}")) && tokio::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (status, v) = s.http("DELETE", &format!("/v1/conversations/{conv}/members/kim"), Some(&own), None).await;
    assert_eq!(status, 200, "kick: {v}");
    let m2 = send(&s, &own, &conv, "hey men", &["men"]).await;
    let m3 = send(&s, &own, &conv, "after", &[]).await;
    let until = tokio::time::Instant::now() + WAIT;
    while !event_ids(&gw.delivered("men-k")).contains(&format!("{conv}:{m2}")) && tokio::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(QUIET).await;
    let kims = gw.delivered("kim-k");
    // Being added to the group is about the member whatever its level; messages follow the level.
    let mens: Vec<Value> = gw.delivered("men-k").into_iter().filter(|n| n["type"] == "msg").collect();
    let seq_of =
        |n: &Value| n["event_id"].as_str().and_then(|e| e.rsplit(':').next()).and_then(|s| s.parse::<i64>().ok());
    let kim_after = kims.iter().filter(|n| seq_of(n).is_some_and(|s| s >= m2)).count();
    let pass = event_ids(&kims).contains(&format!("{conv}:{m1}"))
        && kim_after == 0
        && event_ids(&mens) == [format!("{conv}:{m2}")]
        && mens[0]["prio"] == "high";
    let observed = json!({"kim": event_ids(&kims), "men": event_ids(&mens), "m1": m1, "m2": m2, "m3": m3});
    let pass = check.resolve(observed, pass);
    assert!(pass);
}

#[actix_web::test]
async fn a_gateway_answering_500_gets_the_notification_again_and_a_rejected_pushkey_loses_its_pusher() {
    let check = Check::start(
        SUITE,
        "28-retry-and-rejected",
        "500 then 200; then rejected",
        "the same event_id twice (500, 200); after a rejection the pusher row is gone and nothing more is sent",
    );
    let (gw, s, bob, conv) = bob_and_offline_ann().await;
    gw.fail_next(1);
    let seq = send(&s, &bob, &conv, "one", &[]).await;
    gw.wait_delivered("ann-k", 1, WAIT).await;
    let retried: Vec<(u16, String)> = gw
        .attempts("ann-k")
        .iter()
        .map(|(st, v)| (*st, v["notification"]["event_id"].as_str().unwrap_or("").to_owned()))
        .collect();
    gw.reject("ann-k");
    tokio::time::sleep(Duration::from_millis(400)).await;
    send(&s, &bob, &conv, "two", &[]).await;
    let client = s.db.client().await;
    let until = tokio::time::Instant::now() + WAIT;
    let mut pushers: i64 = 1;
    while pushers > 0 && tokio::time::Instant::now() < until {
        pushers = client.query_one("SELECT count(*) FROM pushers", &[]).await.expect("count").get(0);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let before = gw.attempts("ann-k").len();
    send(&s, &bob, &conv, "three", &[]).await;
    tokio::time::sleep(QUIET).await;
    let after = gw.attempts("ann-k").len();
    let id = format!("{conv}:{seq}");
    let pass = retried == [(500, id.clone()), (200, id)] && pushers == 0 && after == before;
    let pass = check.resolve(
        json!({"first_attempts": retried, "pushers_left": pushers, "sent_after_removal": after - before}),
        pass,
    );
    assert!(pass);
}

#[actix_web::test]
async fn a_burst_of_300_messages_to_an_offline_device_coalesces_into_a_few_notifications_ending_with_the_last() {
    let check = Check::start(
        SUITE,
        "28-burst-coalesces",
        "300 pipelined sends (the acked ones count), coalesce 300 ms",
        "at most 2 + burst time / coalescing interval notifications, the last naming the last message",
    );
    let (gw, s, bob, conv) = bob_and_offline_ann().await;
    let mut ws = s.ws(&bob).await;
    let started = std::time::Instant::now();
    let mut ids = Vec::new();
    for i in 0..300 {
        let f = json!({"conv_id": conv, "client_msg_id": format!("m{i}"), "body": {"text": i}});
        ids.push(ws.start("send", f).await);
    }
    let (mut last, mut acked) = (0, 0);
    for id in ids {
        let ack = ws.reply(id).await;
        // Past the connection's in-flight cap a send is refused OVERLOADED: those are not in the burst.
        acked += usize::from(ack["ok"] == true);
        last = last.max(ack["seq"].as_i64().unwrap_or(0));
    }
    let burst = started.elapsed();
    let want = format!("{conv}:{last}");
    let until = tokio::time::Instant::now() + WAIT;
    while !event_ids(&gw.delivered("ann-k")).contains(&want) && tokio::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(QUIET).await;
    let got = gw.delivered("ann-k");
    let bound = 2 + (burst.as_millis() / 300) as usize;
    let pass = !got.is_empty() && got.len() <= bound && event_ids(&got).last() == Some(&want);
    let observed = json!({"acked_sends": acked, "notifications": got.len(), "bound": bound, "burst_ms": burst.as_millis(), "last": event_ids(&got).last(), "unread_last": got.last().map(|n| n["counts"]["unread"].clone())});
    let pass = check.resolve(observed, pass);
    assert!(pass);
}

#[actix_web::test]
async fn an_https_pusher_is_reached_over_tls_and_a_failed_handshake_is_retried() {
    let check = Check::start(
        SUITE,
        "28-https-gateway-tls",
        "https pusher URL; a local TCP server that reads the first record and hangs up",
        "the connection opens with a TLS ClientHello (not plain HTTP), and the failed handshake is retried",
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("https://127.0.0.1:{}/notify", listener.local_addr().expect("addr").port());
    let hellos = std::sync::Arc::new(std::sync::Mutex::new(Vec::<Vec<u8>>::new()));
    let record = hellos.clone();
    actix_web::rt::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let mut head = [0u8; 6];
            let n = tokio::io::AsyncReadExt::read_exact(&mut conn, &mut head).await.map_or(0, |_| head.len());
            record.lock().expect("hellos").push(head[..n].to_vec());
        }
    });
    let s = TestServer::with(fast).await;
    let bob = s.user("bob").await;
    let ann = s.user("ann").await;
    set_pusher(&s, &ann, "ann-tls", &url).await;
    let conv = s.direct(&bob, "ann").await;
    send(&s, &bob, &conv, "over tls", &[]).await;
    let until = tokio::time::Instant::now() + WAIT;
    while hellos.lock().expect("hellos").len() < 2 && tokio::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let got = hellos.lock().expect("hellos").clone();
    // A TLS record: handshake (0x16), version 3.x, its first message a ClientHello (0x01).
    let tls_hello = |h: &Vec<u8>| h.len() == 6 && h[0] == 0x16 && h[1] == 0x03 && h[5] == 0x01;
    let pass = got.len() >= 2 && got.iter().all(tls_hello);
    let observed = json!({"connections": got.len(), "first_bytes": got.iter().map(hex::encode).collect::<Vec<_>>()});
    let pass = check.resolve(observed, pass);
    assert!(pass);
}
