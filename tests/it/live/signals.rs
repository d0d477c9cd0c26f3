//! Read receipts for others, typing and presence on one node (PROTOCOL v1.2).

use super::*;

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
