//! What a person does with the web client, in headless Chromium windows
//! against the real server: chatting both ways, the read cursor reaching
//! another device, recall, a server restart mid-conversation, hostile bodies.

use serde_json::{json, Value};

use super::{login_url, Driver, Window, SUITE};
use crate::evidence::Check;
use crate::server::TestServer;

/// The seqs a window shows, in order.
fn seqs(messages: &[Value]) -> Vec<i64> {
    messages.iter().filter_map(|m| m["seq"].as_i64()).collect()
}

fn ascending(seqs: &[i64]) -> bool {
    seqs.windows(2).all(|w| w[0] < w[1])
}

/// Both windows online and showing the direct chat of ana and ben.
async fn both_in(s: &TestServer, driver: &Driver) -> (Window, Window, String) {
    let (ana, ben) = (s.user("ana").await, s.user("ben").await);
    let conv = s.direct(&ana, "ben").await;
    let a = driver.window(&login_url(s.port, &ana)).await;
    let b = driver.window(&login_url(s.port, &ben)).await;
    for w in [&a, &b] {
        w.online().await;
        w.open(&conv).await;
    }
    (a, b, conv)
}

#[actix_web::test]
async fn two_users_chat_both_ways_and_another_device_sees_the_read_cursor_move() {
    let check = Check::start(
        SUITE,
        "web-chat-both-ways",
        "3 windows: ana, ben's device d1, ben's device d2; ana starts the direct chat from the page",
        "ana's message reaches both of ben's windows live (d2 shows unread 1); ben opening it on d1 clears d2's badge \
         (the read push); replies go both ways; every window shows each message once, in seq order",
    );
    let s = TestServer::start().await;
    let (ana, ben) = (s.user("ana").await, s.user("ben").await);
    let ben_d2 = s.device("ben", "d2").await;
    let driver = Driver::start().await;
    let a = driver.window(&login_url(s.port, &ana)).await;
    let b = driver.window(&login_url(s.port, &ben)).await;
    let b2 = driver.window(&login_url(s.port, &ben_d2)).await;
    for w in [&a, &b, &b2] {
        w.online().await;
    }

    a.click("#new-chat summary").await;
    a.type_into("#direct-user", "ben").await;
    a.until("ben suggested", "document.querySelector('#direct-options li[data-user=ben]')").await;
    a.click("#new-direct button[type=submit]").await;
    let conv = a.open_conv().await;
    a.say("Hi Ben, it's Ana").await;
    a.shows_exactly(&["Hi Ben, it's Ana"]).await;

    let badge = format!("document.querySelector(\"#inbox li[data-conv='{conv}'] .badge\")");
    b2.until("one unread on ben's second device", &format!("{badge}?.textContent === '1'")).await;
    b.until("one unread on ben's first device", &format!("{badge}?.textContent === '1'")).await;
    let unread_before = b2.badge(&conv).await;
    b2.screenshot("inbox-unread").await;

    b.open(&conv).await;
    b.shows_exactly(&["Hi Ben, it's Ana"]).await;
    b2.until("the badge cleared by the read on ben's other device", &format!("!{badge}")).await;
    b2.screenshot("inbox-read-elsewhere").await;

    b.say("Hello Ana! All good here.").await;
    a.shows_exactly(&["Hi Ben, it's Ana", "Hello Ana! All good here."]).await;
    a.say("Great, see you at 5").await;
    let all = ["Hi Ben, it's Ana", "Hello Ana! All good here.", "Great, see you at 5"];
    b.shows_exactly(&all).await;
    a.shows_exactly(&all).await;
    b2.open(&conv).await;
    b2.shows_exactly(&all).await;
    a.screenshot("conversation").await;
    b.screenshot("conversation-other-side").await;
    a.client.set_window_size(390, 844).await.expect("phone-sized window");
    a.screenshot("phone-conversation").await;

    let (sa, sb, sb2) = (seqs(&a.messages().await), seqs(&b.messages().await), seqs(&b2.messages().await));
    let pass = unread_before == "1" && sa.len() == 3 && ascending(&sa) && sa == sb && sb == sb2;
    for w in [a, b, b2] {
        w.close().await;
    }
    assert!(check.resolve(json!({"d2_unread_before_read": unread_before, "seqs": [sa, sb, sb2]}), pass));
}

#[actix_web::test]
async fn a_recalled_message_disappears_in_the_other_window() {
    let check = Check::start(
        SUITE,
        "web-recall",
        "ana recalls her message from its menu (Recall…, then Yes) while ben's window shows it",
        "ben's window replaces the text by 'Message recalled' at the same seq, and the text is nowhere on his page",
    );
    let s = TestServer::start().await;
    let driver = Driver::start().await;
    let (a, b, _) = both_in(&s, &driver).await;
    a.say("Meet at the old place").await;
    a.say("Sorry, wrong chat!").await;
    b.shows_exactly(&["Meet at the old place", "Sorry, wrong chat!"]).await;
    let before = b.messages().await;

    a.click("#events li.msg.mine[data-seq] button.more").await;
    a.press("#events li.msg.mine[data-seq] .menu", "Recall…").await;
    a.press("#events li.msg.mine[data-seq] .menu", "Yes, recall").await;
    b.until("the recall in ben's window", "document.querySelector('#events li.msg[data-recalled=true]')").await;
    b.shows_exactly(&["Message recalled", "Sorry, wrong chat!"]).await;
    a.shows_exactly(&["Message recalled", "Sorry, wrong chat!"]).await;
    let after = b.messages().await;
    let text_gone = b.eval("!document.body.innerText.includes('Meet at the old place')").await == json!(true);
    b.screenshot("recalled").await;

    let pass = seqs(&before) == seqs(&after) && after[0]["recalled"] == json!(true) && text_gone;
    for w in [a, b] {
        w.close().await;
    }
    assert!(check.resolve(json!({"before": before, "after": after, "text_gone": text_gone}), pass));
}

#[actix_web::test]
async fn a_server_restart_mid_conversation_loses_and_doubles_nothing() {
    let check = Check::start(
        SUITE,
        "web-restart",
        "ana and ben chatting; the server shuts down gracefully and starts again on the same database and port; ana \
         writes while it is down",
        "both windows reconnect by themselves; the message written while down is sent once (same client_msg_id) \
         when the server is back; both windows and the log show exactly the four messages, once each, in seq order",
    );
    let s = TestServer::start().await;
    let driver = Driver::start().await;
    let (a, b, conv) = both_in(&s, &driver).await;
    a.say("before the restart (ana)").await;
    b.say("before the restart (ben)").await;
    let before = ["before the restart (ana)", "before the restart (ben)"];
    a.shows_exactly(&before).await;
    b.shows_exactly(&before).await;

    let stopped = s.stop().await;
    for w in [&a, &b] {
        w.until("the page noticing the server is gone", "document.querySelector('#status').dataset.state !== 'open'")
            .await;
    }
    a.say("written while the server was down").await;
    a.until("the message waiting in the outbox", "document.querySelector('#events li.pending')").await;
    a.screenshot("offline-outbox").await;
    let s = stopped.start().await;

    for w in [&a, &b] {
        w.online().await;
    }
    // Ana's resend and ben's next message would race for the next seq otherwise.
    a.until("the outbox resent and acked", "!document.querySelector('#events li.pending')").await;
    b.say("after the restart (ben)").await;
    let all = [before[0], before[1], "written while the server was down", "after the restart (ben)"];
    a.shows_exactly(&all).await;
    b.shows_exactly(&all).await;
    b.screenshot("after-restart").await;

    let token = s.device("ana", "check").await;
    let (_, page) = s.http("GET", &format!("/v1/conversations/{conv}/events?after_seq=0"), Some(&token), None).await;
    let logged: Vec<String> = page["events"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["kind"] == "msg")
        .map(|e| e["body"]["text"].as_str().unwrap_or_default().to_owned())
        .collect();
    let (sa, sb) = (seqs(&a.messages().await), seqs(&b.messages().await));
    let pass = logged == all && sa.len() == 4 && ascending(&sa) && sa == sb;
    for w in [a, b] {
        w.close().await;
    }
    assert!(check.resolve(json!({"log": logged, "seqs": [sa, sb]}), pass), "log {logged:?}");
}

#[actix_web::test]
async fn a_hostile_message_body_is_shown_as_text_and_never_run() {
    let check = Check::start(
        SUITE,
        "web-hostile-body",
        "ana types HTML with an onerror handler and a script; a bot sends a non-text body carrying HTML over HTTP",
        "ben's window shows both as their literal characters (the other body as its JSON); no element of theirs \
         exists in the page and no handler ran (window.__pwned stays undefined)",
    );
    let s = TestServer::start().await;
    let driver = Driver::start().await;
    let (a, b, conv) = both_in(&s, &driver).await;
    let typed = r#"<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script> & <b>bold</b>"#;
    a.say(typed).await;
    a.shows_exactly(&[typed]).await;
    let bot = s.device("ana", "bot").await;
    let odd = json!({"type": "html", "html": "<img src=y onerror=\"window.__pwned=3\">"});
    let (status, _) = s
        .http(
            "POST",
            &format!("/v1/conversations/{conv}/messages"),
            Some(&bot),
            Some(&json!({"client_msg_id": "bot-1", "body": odd})),
        )
        .await;
    assert_eq!(status, 201);
    let odd_text = odd.to_string();
    b.shows_exactly(&[typed, &odd_text]).await;
    a.shows_exactly(&[typed, &odd_text]).await;
    let planted = b.eval("document.querySelectorAll('#events img, #events script, #events b').length").await;
    let pwned = b.eval("typeof window.__pwned").await;
    let pwned_a = a.eval("typeof window.__pwned").await;
    b.screenshot("hostile-body").await;
    let pass = planted == json!(0) && pwned == json!("undefined") && pwned_a == json!("undefined");
    for w in [a, b] {
        w.close().await;
    }
    assert!(check.resolve(json!({"elements_planted": planted, "pwned": [pwned, pwned_a]}), pass));
}

#[actix_web::test]
async fn a_group_is_created_and_managed_from_the_page_as_the_roles_allow() {
    let check = Check::start(
        SUITE,
        "web-group",
        "ana creates group 'Team' with ben and cai from the page, then from its members pane searches, invites dan, \
         makes ben admin, mutes cai and removes dan; cai takes an alias opening with U+202E; ben (a member, then \
         admin) leaves from his window",
        "each action shows in the members pane and as a line in both windows' logs; ben sees no buttons over the \
         owner; the search finds only matching members; cai's id beside the alias still reads left to right",
    );
    let s = TestServer::start().await;
    let ana = s.user("ana").await;
    let ben = s.user("ben").await;
    let cai = s.user("cai").await;
    s.user("dan").await;
    let driver = Driver::start().await;
    let a = driver.window(&login_url(s.port, &ana)).await;
    let b = driver.window(&login_url(s.port, &ben)).await;
    for w in [&a, &b] {
        w.online().await;
    }
    a.click("#new-chat summary").await;
    a.type_into("#group-name", "Team").await;
    a.type_into("#group-members", "ben, cai").await;
    a.until("cai suggested", "document.querySelector('#group-options li[data-user=cai]')").await;
    a.click("#new-group button[type=submit]").await;
    let conv = a.open_conv().await;
    a.say("Welcome to the team").await;

    a.click("#members-toggle").await;
    let roster = "[...document.querySelectorAll('#members li')].map(li => li.dataset.user + ':' + \
                  li.querySelector('.role').textContent + (li.querySelector('.muted') ? ':muted' : '')).join(' ')";
    a.until("three members", &format!("{roster} === 'ana:owner ben:member cai:member'")).await;
    a.type_into("#member-q", "c").await;
    a.until("the search for 'c'", &format!("{roster} === 'cai:member'")).await;
    let searched = a.eval(roster).await;
    a.type_into("#member-q", "").await;
    a.enter("#member-q").await;
    a.until("the whole roster again", &format!("{roster} === 'ana:owner ben:member cai:member'")).await;

    a.type_into("#invite-users", "dan").await;
    a.until("dan suggested", "document.querySelector('#invite-options li[data-user=dan]')").await;
    a.click("#invite button[type=submit]").await;
    a.until("dan invited", &format!("{roster} === 'ana:owner ben:member cai:member dan:member'")).await;
    a.press("#members li[data-user=ben]", "Make admin").await;
    a.until("ben an admin", &format!("{roster}.includes('ben:admin')")).await;
    a.press("#members li[data-user=cai]", "Mute 1 h").await;
    a.until("cai muted", &format!("{roster}.includes('cai:member:muted')")).await;
    a.press("#members li[data-user=dan]", "Remove").await;
    a.until("dan removed", &format!("{roster} === 'ana:owner ben:admin cai:member:muted'")).await;
    // An alias opening with a right-to-left override (U+202E) must not turn
    // the id shown beside it around: "(cai)" still reads left to right.
    let (status, _) = s
        .http(
            "PATCH",
            &format!("/v1/conversations/{conv}/members/cai"),
            Some(&cai),
            Some(&json!({"alias": "\u{202E}evil"})),
        )
        .await;
    assert_eq!(status, 200, "cai's alias");
    let cai_who = "document.querySelector('#members li[data-user=cai] .who')";
    a.until("cai's alias in the roster", &format!("{cai_who}?.textContent.includes('evil')")).await;
    let id_reads_forward = a
        .eval(&format!(
            "(() => {{ const at = {{}}; const walk = document.createTreeWalker({cai_who}, NodeFilter.SHOW_TEXT); \
             for (let n; (n = walk.nextNode()); ) for (const c of ['(', ')']) {{ const i = n.data.indexOf(c); \
             if (i >= 0) {{ const r = document.createRange(); r.setStart(n, i); r.setEnd(n, i + 1); \
             at[c] = r.getBoundingClientRect().left; }} }} return at['('] < at[')']; }})()"
        ))
        .await;
    a.screenshot("group-members").await;

    b.open(&conv).await;
    let lines = ["ana made ben admin", "ana muted cai", "ana removed dan"];
    let all = serde_json::to_string(&lines).expect("json").replace("ana made ben admin", "ana made you admin");
    let shown = format!(
        "{all}.every(l => [...document.querySelectorAll('#events li.system')].some(li => li.textContent === l))"
    );
    b.until("the group's changes in ben's log", &shown).await;
    b.click("#members-toggle").await;
    b.until("the roster in ben's window", "document.querySelectorAll('#members li').length === 3").await;
    let over_owner = b.eval("document.querySelectorAll(\"#members li[data-user=ana] button\").length").await;
    b.click("#leave").await;
    b.until(
        "ben's own standing after leaving",
        "document.querySelector('#standing').textContent === 'You left this group.' && \
         document.querySelector('#text').disabled",
    )
    .await;
    a.until(
        "ben's leave in ana's log",
        "[...document.querySelectorAll('#events li.system')].some(li => li.textContent === 'ben left')",
    )
    .await;
    a.until("the roster without ben", &format!("{roster} === 'ana:owner cai:member:muted'")).await;

    let pass = searched == json!("cai:member") && over_owner == json!(0) && id_reads_forward == json!(true);
    for w in [a, b] {
        w.close().await;
    }
    assert!(check.resolve(
        json!({"search_c": searched, "ben_buttons_over_owner": over_owner, "rtl_alias_id_reads_forward": id_reads_forward}),
        pass
    ));
}

#[actix_web::test]
async fn history_pages_backward_as_the_reader_scrolls_up() {
    const SENT: usize = 100;
    let check = Check::start(
        SUITE,
        "web-history-paging",
        "100 messages sent over HTTP before ben opens the chat; ben scrolls to the top until the start",
        "the chat opens on the newest page only, offering a jump to the first unread; each scroll to the top adds an \
         older page; in the end all 100 show once each in seq order, the 'New messages' line before the first, and \
         the 'Load older' button is gone",
    );
    let s = TestServer::start().await;
    let driver = Driver::start().await;
    let (ana, ben) = (s.user("ana").await, s.user("ben").await);
    let conv = s.direct(&ana, "ben").await;
    for i in 1..=SENT {
        let body = json!({"client_msg_id": format!("h{i}"), "body": {"type": "text", "text": format!("message {i}")}});
        let (status, _) = s.http("POST", &format!("/v1/conversations/{conv}/messages"), Some(&ana), Some(&body)).await;
        assert_eq!(status, 201);
    }
    let b = driver.window(&login_url(s.port, &ben)).await;
    b.online().await;
    b.open(&conv).await;
    let count = "document.querySelectorAll('#events li.msg').length";
    b.until("the newest page", &format!("{count} > 0")).await;
    let first_page = b.eval(count).await.as_u64().unwrap_or_default();
    // All 100 unread, the first of them not loaded yet: a way to jump there.
    let jump_offered =
        b.eval("!document.querySelector('#jump-unread').hidden && !document.querySelector('#first-unread')").await;
    let mut pages = vec![first_page];
    while pages.last().copied().unwrap_or_default() < SENT as u64 && pages.len() <= SENT {
        let shown = pages.last().copied().unwrap_or_default();
        b.eval("document.querySelector('#log').scrollTop = 0").await;
        b.until("an older page after scrolling up", &format!("{count} > {shown}")).await;
        pages.push(b.eval(count).await.as_u64().unwrap_or_default());
    }
    let texts: Vec<String> = (1..=SENT).map(|i| format!("message {i}")).collect();
    let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
    b.shows_exactly(&texts).await;
    b.until("no 'Load older' button at the start", "document.querySelector('#older').hidden").await;
    let shown = seqs(&b.messages().await);
    let line_before_first = b
        .eval("document.querySelector('#first-unread')?.nextElementSibling?.querySelector('.body')?.textContent")
        .await;
    let pass = first_page < SENT as u64
        && pages.len() > 2
        && shown.len() == SENT
        && ascending(&shown)
        && jump_offered == json!(true)
        && line_before_first == json!("message 1");
    b.close().await;
    assert!(check.resolve(
        json!({"shown_after_each_scroll": pages, "seqs_ascending": ascending(&shown), "jump_offered": jump_offered,
               "first_unread_line_before": line_before_first}),
        pass
    ));
}
