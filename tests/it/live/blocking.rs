//! Blocking (PROTOCOL v1.2): every path of a blocked user, privacy, bad input.

use super::*;

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
        // The actor path writes one connection's sends in issue order, so the
        // block cuts them at one send; the direct path runs a wave's ten sends
        // as concurrent transactions, so there the cut is at one wave.
        let cut_from = match path {
            WritePath::Actor => first_refused,
            WritePath::Direct => first_refused.map(|i| (i / 10 + 1) * 10),
        };
        let cut_once = cut_from.is_some_and(|i| answers.iter().skip(i).all(|a| a == "BLOCKED"))
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
            "after block, the blocked user's send in the direct chat is BLOCKED and the blocker's goes; after unblock it goes again; pipelined sends in waves of 10 racing a block: ok up to one point, BLOCKED from there on (the direct path: from the wave after the first refusal on)",
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
