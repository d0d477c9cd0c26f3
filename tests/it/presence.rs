//! Delivery decides recipients from what its lanes keep about online users
//! (ARCHITECTURE §5), never from a conversation's member list: a member who
//! leaves stops receiving at its leave, a member who joins after connecting
//! starts at its join, and a big group costs a lane per online member.

use imcore::delivery::Tracked;
use imcore::domain::{LeaveReason, Role};
use imcore::store::{JoinOp, LeaveOp, WriteOp, Written};
use imcore_actors::{ConvId, UserId};
use serde_json::{json, Value};

use crate::gateway::hi;
use crate::server::TestServer;
use crate::sync_points::{no_push_before_marker, pushed_seqs};

fn uid(u: &str) -> UserId {
    UserId::parse(u).expect("user id")
}

async fn group(s: &TestServer, token: &str, id: &str, members: &[&str]) -> String {
    // Pushed events are what these tests watch: `push`, not the `auto` that turns a large group `pull`.
    let body = json!({"kind": "group", "conv_id": id, "name": id, "members": members, "max_member": 100_000,
        "delivery_mode": "push"});
    let (status, v) = s.http("POST", "/v1/conversations", Some(token), Some(&body)).await;
    assert_eq!(status, 201, "create group: {v}");
    v["conv_id"].as_str().expect("conv_id").to_owned()
}

async fn write(s: &TestServer, conv: &str, op: WriteOp) -> Written {
    let conv = ConvId::parse(conv).expect("conv id");
    s.state.writer.write(conv, op).await.expect("write")
}

/// Every event kind and seq of `conv` in `push`.
fn kinds(push: &Value, conv: &str) -> Vec<(String, i64)> {
    let events = match push["push"].as_str() {
        Some("event") => vec![push["event"].clone()],
        Some("events") => push["events"].as_array().cloned().unwrap_or_default(),
        _ => vec![],
    };
    events
        .iter()
        .filter(|_| push["conv_id"] == conv)
        .map(|e| (e["kind"].as_str().unwrap_or("").to_owned(), e["seq"].as_i64().unwrap_or(0)))
        .collect()
}

#[actix_web::test]
async fn a_member_who_leaves_gets_its_leave_and_nothing_after_while_the_others_keep_receiving() {
    let s = TestServer::start().await;
    let (ana, ben, cai) = (s.user("u-ana").await, s.user("u-ben").await, s.user("u-cai").await);
    let conv = group(&s, &ana, "g-leave", &["u-ben", "u-cai"]).await;
    // Ben's marker conversation: his next push after the leave must be its marker.
    let direct = s.direct(&ana, "u-ben").await;
    let (mut a, mut b, mut c) = (s.ws(&ana).await, s.ws(&ben).await, s.ws(&cai).await);
    // A push reaches a connection only once its memberships are loaded: with
    // these in, each lane knows its user before the leave (a snapshot read
    // after the leave would know ben only as a former member).
    let hello = a.request("send", hi("hello", &conv, "hello")).await["seq"].as_i64().expect("seq");
    let back = c.request("send", hi("hello-back", &conv, "hello back")).await["seq"].as_i64().expect("seq");
    assert_eq!(pushed_seqs(&b.push().await, &conv), [hello]);
    assert_eq!(pushed_seqs(&b.push().await, &conv), [back]);
    assert_eq!(pushed_seqs(&c.push().await, &conv), [hello]);
    assert_eq!(pushed_seqs(&a.push().await, &conv), [back]);

    let left = write(
        &s,
        &conv,
        WriteOp::Leave(LeaveOp { user: uid("u-ben"), actor: uid("u-ana"), reason: LeaveReason::Kicked }),
    )
    .await;
    let Written::Left { seq: leave_seq } = left else { panic!("not a leave: {left:?}") };
    assert_eq!(kinds(&b.push().await, &conv), [("leave".to_owned(), leave_seq)], "ben sees his own leave");
    assert_eq!(kinds(&c.push().await, &conv), [("leave".to_owned(), leave_seq)]);
    assert_eq!(kinds(&a.push().await, &conv), [("leave".to_owned(), leave_seq)]);

    let after = a.request("send", hi("after-leave", &conv, "ben is gone")).await;
    assert_eq!(pushed_seqs(&c.push().await, &conv), [after["seq"].as_i64().expect("seq")], "cai keeps receiving");
    // Ana's sends are handed to the lanes in order (one arbiter): the group's
    // message is behind ben, and the first push he gets now must be the marker.
    let marker = a.request("send", hi("marker", &direct, "marker")).await;
    assert_eq!(pushed_seqs(&b.push().await, &direct), [marker["seq"].as_i64().expect("seq")]);
    assert!(no_push_before_marker(&mut c, &mut a, &conv).await);
}

#[actix_web::test]
async fn a_user_who_joins_after_connecting_receives_from_its_join_on() {
    let s = TestServer::start().await;
    let (ana, dan) = (s.user("u-ana").await, s.user("u-dan").await);
    let conv = group(&s, &ana, "g-join", &[]).await;
    let mut a = s.ws(&ana).await;
    let mut d = s.ws(&dan).await;
    a.request("send", hi("before", &conv, "before dan")).await;

    let joined =
        write(&s, &conv, WriteOp::Join(JoinOp { user: uid("u-dan"), actor: uid("u-ana"), role: Role::Member })).await;
    let Written::Joined { seq: join_seq } = joined else { panic!("not a join: {joined:?}") };
    assert_eq!(kinds(&d.push().await, &conv), [("join".to_owned(), join_seq)], "his own join first, nothing before");
    let sent = a.request("send", hi("after", &conv, "welcome")).await;
    assert_eq!(pushed_seqs(&d.push().await, &conv), [sent["seq"].as_i64().expect("seq")]);
    assert!(no_push_before_marker(&mut d, &mut a, &conv).await);
}

#[actix_web::test]
async fn a_send_to_a_group_of_2000_reaches_each_online_member_and_the_lanes_keep_only_online_users() {
    const MEMBERS: usize = 2000;
    const ONLINE: usize = 50;
    let s = TestServer::start().await;
    let names: Vec<String> = (0..MEMBERS).map(|i| format!("u-{i:04}")).collect();
    let db = s.db.client().await;
    db.execute("INSERT INTO users (user_id) SELECT unnest($1::text[])", &[&names]).await.expect("users");
    db.execute("INSERT INTO users (user_id) VALUES ('u-out')", &[]).await.expect("outsider");
    let creator = s.device(&names[0], "d1").await;
    let created: Vec<&str> = names[1..1000].iter().map(String::as_str).collect();
    let conv = group(&s, &creator, "g-big", &created).await;
    for chunk in names[1000..].chunks(100) {
        let joins = chunk.iter().map(|u| {
            let op = WriteOp::Join(JoinOp { user: uid(u), actor: uid(&names[0]), role: Role::Member });
            write(&s, &conv, op)
        });
        futures_util::future::join_all(joins).await;
    }
    // An online user outside the group, in a direct chat with the sender.
    let direct = s.direct(&creator, "u-out").await;

    // Half the online members came in at the creation, half by a join.
    let online: Vec<&String> = names.iter().step_by(MEMBERS / ONLINE).collect();
    let mut sockets = Vec::new();
    for u in &online {
        sockets.push(s.ws(&s.device(u, "d1").await).await);
    }
    let mut out = s.ws(&s.device("u-out", "d1").await).await;
    let sent = sockets[0].request("send", hi("to-all", &conv, "hello 2000")).await;
    let seq = sent["seq"].as_i64().expect("seq");
    for ws in &mut sockets[1..] {
        assert_eq!(pushed_seqs(&ws.push().await, &conv), [seq]);
    }
    let marker = sockets[0].request("send", hi("marker", &direct, "marker")).await;
    assert_eq!(pushed_seqs(&out.push().await, &direct), [marker["seq"].as_i64().expect("seq")], "nothing of the group");
    // One tracked membership per online member of the group, plus the direct chat's two.
    assert_eq!(s.state.delivery.tracked(), Tracked { users: ONLINE + 1, periods: ONLINE + 2 });
    drop(sockets);
    out.close().await;
}

/// Closing every connection leaves nothing tracked.
#[actix_web::test]
async fn a_user_whose_connections_all_closed_is_no_longer_tracked() {
    let s = TestServer::start().await;
    let ana = s.user("u-ana").await;
    group(&s, &ana, "g-gone", &[]).await;
    let second = s.device("u-ana", "d2").await;
    let (a1, mut a2) = (s.ws(&ana).await, s.ws(&second).await);
    a2.request("ping", json!({})).await;
    a1.close().await;
    a2.close().await;
    assert!(crate::sync_points::wait_for_connections(&s, 0, 0).await);
    // Each session unsubscribes as it stops, after its route is gone: poll the gauge.
    let deadline = std::time::Instant::now() + crate::gateway::WAIT;
    while s.state.delivery.tracked() != (Tracked { users: 0, periods: 0 }) {
        assert!(std::time::Instant::now() < deadline, "still tracked: {:?}", s.state.delivery.tracked());
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}
