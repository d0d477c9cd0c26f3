//! The client's second round, in headless Chromium against the real server:
//! finding people, one's own standing, errors beside their cause, a phone-sized
//! window, the keyboard alone, long chats and every v1.2 feature. One browser
//! session per window, reused across the steps of each test.

use fantoccini::key::Key;
use serde_json::{json, Value};

use super::{login_url, Driver, SUITE};
use crate::evidence::Check;
use crate::server::TestServer;

/// The text of `css` in the page ("" when absent).
fn text_of(css: &str) -> String {
    format!("(document.querySelector({})?.textContent ?? '')", json!(css))
}

#[actix_web::test]
async fn people_are_found_in_any_case_by_keyboard_alone_and_a_phone_window_always_has_a_way_back() {
    let check = Check::start(
        SUITE,
        "30-picker-keyboard-phone",
        "ana shares a group with bert; ben and zoe share nothing with her. Keyboard only: Tab to New chat, type \
         'Ben', pick with Enter, start, write, open the message's menu and close it, Esc back. A group of 'bert, zoe, yan, xi'. Then at 390x844: Members, \
         Esc, reload, Back",
        "'Be' suggests only bert; 'Ben' finds ben (exact id, any case); the chat starts and the message is sent \
         with keys alone; the group form names “yan”, “xi” next to its field and creates nothing; the members pane \
         has a close button and Esc closes it; a reload reopens the conversation; Back reaches the inbox",
    );
    let s = TestServer::start().await;
    let ana = s.user("ana").await;
    for u in ["ben", "bert", "zoe"] {
        s.user(u).await;
    }
    let body = json!({"kind": "group", "conv_id": "g-crew", "name": "Crew", "members": ["bert"]});
    assert_eq!(s.http("POST", "/v1/conversations", Some(&ana), Some(&body)).await.0, 201);
    let driver = Driver::start().await;
    let a = driver.window(&login_url(s.port, &ana)).await;
    a.online().await;
    a.until("the inbox", "document.querySelector(\"#inbox li[data-conv='g-crew']\")").await;

    // The keyboard alone, from the top of the page.
    a.eval("document.activeElement.blur(), true").await;
    let mut tabs = a.tab_to("#new-chat summary").await;
    a.keys(&Key::Enter.to_string()).await;
    tabs += a.tab_to("#direct-user").await;
    a.keys("Be").await;
    a.until("bert suggested", "document.querySelector('#direct-options li[data-user=bert]')").await;
    let suggested_be = a.eval("[...document.querySelectorAll('#direct-options li')].map(li => li.dataset.user)").await;
    a.keys("n").await;
    a.until("ben found by his exact id", "document.querySelector('#direct-options li[data-user=ben]')").await;
    a.screenshot("picker").await;
    a.keys(&Key::Enter.to_string()).await;
    a.until("ben chosen", "document.querySelector('#direct-picker .chips li[data-user=ben]')").await;
    a.keys(&Key::Enter.to_string()).await;
    let conv = a.open_conv().await;
    a.until("the composer focused", "document.activeElement?.id === 'text'").await;
    a.keys(&format!("Hi Ben, found you{}", Key::Enter)).await;
    a.shows_exactly(&["Hi Ben, found you"]).await;
    // The message's actions, by keyboard: its menu opens on Enter, Esc closes it, focus comes back.
    tabs += a.tab_back_to("#events li.msg.mine button.more").await;
    a.keys(&Key::Enter.to_string()).await;
    a.until("the menu open, its first item focused", "document.activeElement?.closest('.menu') !== null").await;
    let menu_items = a.eval("[...document.querySelectorAll('#events .menu button')].map(b => b.textContent)").await;
    a.screenshot("keyboard-menu").await;
    a.keys(&Key::Escape.to_string()).await;
    a.until(
        "the menu closed, focus on its button",
        "!document.querySelector('#events .menu') && \
             document.activeElement?.matches('#events li.msg.mine button.more')",
    )
    .await;
    a.keys(&Key::Escape.to_string()).await;
    a.until("Esc back at the inbox", "document.querySelector('#conv-pane').hidden").await;
    let focus_after_esc = a.eval("document.activeElement?.closest('#inbox') !== null").await;

    // A group naming ids that find nobody: each is named beside the field.
    a.click("#new-chat summary").await;
    a.type_into("#group-name", "Trip").await;
    a.type_into("#group-members", "bert, zoe, yan, xi").await;
    a.click("#new-group button[type=submit]").await;
    a.until("the unknown ids named", &format!("{}.includes('yan')", text_of("#group-error"))).await;
    let group_error = a.eval(&text_of("#group-error")).await;
    let chips = a.eval("[...document.querySelectorAll('#group-picker .chips li')].map(li => li.dataset.user)").await;
    a.screenshot("picker-unknown-ids").await;
    let (_, inbox) = s.http("GET", "/v1/conversations", Some(&ana), None).await;
    let conversations = inbox["conversations"].as_array().map_or(0, Vec::len);
    a.keys(&Key::Escape.to_string()).await;

    // A phone-sized window: every pane has a way back.
    a.client.set_window_size(390, 844).await.expect("phone-sized window");
    a.open("g-crew").await;
    a.click("#members-toggle").await;
    a.until("the members pane", "document.querySelectorAll('#members li').length === 2").await;
    let pane_covers = a
        .eval(
            "getComputedStyle(document.querySelector('#conv-pane')).display === 'none' && \
               document.querySelector('#members-close').getBoundingClientRect().width > 0",
        )
        .await;
    a.screenshot("phone-members").await;
    a.keys(&Key::Escape.to_string()).await;
    a.until("Esc closed the members pane", "document.querySelector('#members-pane').hidden").await;
    a.until("the conversation again", "getComputedStyle(document.querySelector('#conv-pane')).display !== 'none'")
        .await;
    a.client.refresh().await.expect("reload");
    a.online().await;
    a.until(
        "the conversation reopened after the reload",
        "document.querySelector('#inbox li.current')?.dataset.conv === 'g-crew'",
    )
    .await;
    let title_after_reload = a.eval(&text_of("#conv-title")).await;
    a.screenshot("phone-after-reload").await;
    a.click("#back").await;
    a.until("Back at the inbox", "getComputedStyle(document.querySelector('#inbox-pane')).display !== 'none'").await;
    let fragment_after_back = a.eval("location.hash").await;

    let pass = suggested_be == json!(["bert"])
        && menu_items.as_array().is_some_and(|m| m.contains(&json!("Edit")) && m.contains(&json!("Recall…")))
        && focus_after_esc == json!(true)
        && group_error.as_str().is_some_and(|e| e.contains("“yan”") && e.contains("“xi”") && !e.contains("zoe"))
        && chips == json!(["bert", "zoe"])
        && conversations == 2
        && pane_covers == json!(true)
        && title_after_reload == json!("Crew")
        && fragment_after_back == json!("");
    a.close().await;
    assert!(check.resolve(
        json!({"conv": conv, "tabs_to_reach_fields": tabs, "suggested_for_Be": suggested_be, "menu_by_keyboard": menu_items, "group_error": group_error,
               "chips": chips, "conversations": conversations, "members_pane_covers_with_close": pane_covers,
               "title_after_reload": title_after_reload, "fragment_after_back": fragment_after_back}),
        pass
    ));
}

#[actix_web::test]
async fn ones_own_standing_comes_from_the_log_and_a_failed_message_retries_once_it_can_succeed() {
    let check = Check::start(
        SUITE,
        "30-own-standing",
        "group of ana (owner), ben, cai. ben's window holds an unsent message when ana mutes him for an hour; \
         ana unmutes him; ana removes him. cai leaves from his window",
        "muted: composer disabled with 'You're muted until HH:MM', the message failed with a sentence and no Retry; \
         unmuted: Retry appears and sends it once; removed: 'You were removed by ana.', no Invite, Leave or message actions; cai: \
         'You left this group.'",
    );
    let s = TestServer::start().await;
    let ana = s.user("ana").await;
    let ben = s.user("ben").await;
    let cai = s.user("cai").await;
    let body = json!({"kind": "group", "conv_id": "g-team", "name": "Team", "members": ["ben", "cai"]});
    assert_eq!(s.http("POST", "/v1/conversations", Some(&ana), Some(&body)).await.0, 201);
    let driver = Driver::start().await;
    let b = driver.window(&login_url(s.port, &ben)).await;
    b.online().await;
    b.open("g-team").await;
    let until = (chrono::Utc::now() + chrono::Duration::hours(1)).to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    let mute = |until: Value| json!({"mute_until": until});
    assert_eq!(
        s.http("PATCH", "/v1/conversations/g-team/members/ben", Some(&ana), Some(&mute(json!(until)))).await.0,
        200
    );
    b.until("ben's muted standing", &format!("{}.startsWith(\"You're muted until\")", text_of("#standing"))).await;
    let muted_sentence = b.eval(&text_of("#standing")).await;
    let composer_disabled = b.eval("document.querySelector('#text').disabled").await;

    // A message written before the mute reached this window: it fails with a sentence.
    b.eval(
        "sessionStorage.setItem('imcore.outbox', JSON.stringify([{conv_id: 'g-team', client_msg_id: 'late-1', \
            body: {type: 'text', text: 'sent while muted'}}])), true",
    )
    .await;
    b.client.refresh().await.expect("reload");
    b.online().await;
    b.until("the failed message", "document.querySelector('#events li.pending[data-state=failed]')").await;
    let failed_line = b.eval(&text_of("#events li.pending .sending")).await;
    let retry_while_muted = b.eval("!!document.querySelector('#events li.pending button.retry')").await;
    let lowest_muted = b.eval(LOWEST_CONTRAST).await;
    b.screenshot("standing-muted").await;

    assert_eq!(
        s.http("PATCH", "/v1/conversations/g-team/members/ben", Some(&ana), Some(&mute(Value::Null))).await.0,
        200
    );
    b.until("Retry once unmuted", "document.querySelector('#events li.pending button.retry')").await;
    b.click("#events li.pending button.retry").await;
    b.until("the message sent", "!document.querySelector('#events li.pending')").await;

    assert_eq!(s.http("DELETE", "/v1/conversations/g-team/members/ben", Some(&ana), None).await.0, 200);
    b.until("ben's removed standing", &format!("{} === 'You were removed by ana.'", text_of("#standing"))).await;
    b.click("#members-toggle").await;
    let controls = b
        .eval(
            "[document.querySelector('#invite').hidden, document.querySelector('#leave').hidden, \
               document.querySelectorAll('#events button.more').length]",
        )
        .await;
    b.screenshot("standing-removed").await;

    let c = driver.window(&login_url(s.port, &cai)).await;
    c.online().await;
    c.open("g-team").await;
    c.click("#members-toggle").await;
    c.until("cai's Leave", "!document.querySelector('#leave').hidden").await;
    c.click("#leave").await;
    c.until("cai's standing", &format!("{} === 'You left this group.'", text_of("#standing"))).await;

    let (_, log) = s.http("GET", "/v1/conversations/g-team/events?after_seq=0", Some(&ana), None).await;
    let sent: Vec<&Value> = log["events"].as_array().into_iter().flatten().filter(|e| e["kind"] == "msg").collect();
    let pass = composer_disabled == json!(true)
        && failed_line.as_str().is_some_and(|l| l.contains("You are muted here"))
        && retry_while_muted == json!(false)
        && sent.len() == 1
        && sent[0]["client_msg_id"] == "late-1"
        && controls == json!([true, true, 0])
        && lowest_muted["ratio"].as_f64().unwrap_or(0.0) >= 4.5;
    for w in [b, c] {
        w.close().await;
    }
    assert!(check.resolve(
        json!({"muted": muted_sentence, "failed": failed_line, "retry_while_muted": retry_while_muted,
               "messages_in_log": sent.len(), "invite_leave_hidden_and_message_actions_when_removed": controls,
               "lowest_contrast": lowest_muted}),
        pass
    ));
}

/// The lowest contrast of any visible text in the page (WCAG ratio, its own
/// color, faded by any opacity above it, against the first opaque
/// background behind it). Disabled controls are exempt (WCAG 1.4.3).
const LOWEST_CONTRAST: &str = "(() => {
  const rgb = (c) => (c.match(/[\\d.]+/g) || []).map(Number);
  const lum = ([r, g, b]) => [r, g, b].map((v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; })
    .reduce((sum, v, i) => sum + v * [0.2126, 0.7152, 0.0722][i], 0);
  const background = (node) => { for (let n = node; n; n = n.parentElement) { const c = rgb(getComputedStyle(n).backgroundColor);
    if (c.length === 3 || c[3] > 0.9) return c.slice(0, 3); } return [255, 255, 255]; };
  let lowest = { ratio: 99 };
  const walk = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let t; (t = walk.nextNode()); ) {
    const node = t.parentElement;
    if (!t.data.trim() || !node.getClientRects().length || node.closest('[hidden], .visually-hidden')) continue;
    const style = getComputedStyle(node);
    if (style.visibility === 'hidden' || node.closest('button:disabled, textarea:disabled')) continue;
    let opacity = 1;
    for (let n = node; n; n = n.parentElement) opacity *= Number(getComputedStyle(n).opacity);
    const bg = background(node);
    const fg = rgb(style.color).slice(0, 3).map((v, i) => v * opacity + bg[i] * (1 - opacity));
    const [a, b] = [lum(fg), lum(bg)];
    const ratio = (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05);
    if (ratio < lowest.ratio) lowest = { ratio: Math.round(ratio * 100) / 100, text: t.data.trim().slice(0, 40), color: style.color };
  }
  return lowest;
})()";

/// The texts of the open log's messages, with their marks.
const SHOWN: &str = "[...document.querySelectorAll('#events li.msg')].map(li => ({seq: Number(li.dataset.seq), \
    text: li.querySelector('.body')?.textContent, edited: !!li.querySelector('.edited'), grouped: \
    li.classList.contains('grouped'), reactions: [...li.querySelectorAll('.reaction')].map(r => r.textContent + \
    (r.getAttribute('aria-pressed') === 'true' ? '*' : '')), quote: li.querySelector('.quote')?.textContent ?? null, \
    seen: li.querySelector('.seen')?.textContent ?? null}))";

#[actix_web::test]
async fn every_v1_2_feature_and_the_long_chat_niceties_work_between_two_windows() {
    const HISTORY: usize = 30;
    const RECALL_WINDOW_MS: u64 = 1500;
    let check = Check::start(
        SUITE,
        "30-v12-and-long-chats",
        "ben sent 30 messages (one Arabic) before ana opens their direct chat; then edit, reaction, reply, typing, \
         presence, seen, recall, a hidden-tab notification, Shift+Enter lines, and in a group of three an \
         @mention from the suggestions",
        "title '(30) imcore'; a 'New messages' line; a 'Today' line; messages grouped; the Arabic line rtl; the \
         edit shows 'edited' in ben's window; ben's 👍 shows as 1, his own highlighted; the reply quotes and jumps; \
         'ana is typing…'; ana 'online'; 'Seen' under ana's last message; the recall after confirming; one \
         notification; the composer grows; the mention reaches ben with an @ badge; lowest text contrast ≥ 4.5",
    );
    let s = TestServer::start().await;
    let (ana, ben) = (s.user("ana").await, s.user("ben").await);
    s.user("cai").await;
    let conv = s.direct(&ana, "ben").await;
    for i in 1..=HISTORY {
        let text = if i == 7 { "مرحبا، كيف حالك؟".to_owned() } else { format!("ben says {i}") };
        let body = json!({"client_msg_id": format!("h{i}"), "body": {"type": "text", "text": text}});
        assert_eq!(s.http("POST", &format!("/v1/conversations/{conv}/messages"), Some(&ben), Some(&body)).await.0, 201);
    }
    let driver = Driver::start().await;
    let a = driver.window(&login_url(s.port, &ana)).await;
    let b = driver.window(&login_url(s.port, &ben)).await;
    for w in [&a, &b] {
        w.online().await;
    }
    a.until("the tab title's unread count", "document.title === '(30) imcore'").await;
    a.open(&conv).await;
    a.until("the first unread line", "document.querySelector('#first-unread')").await;
    let day_line = a.eval(&text_of("#events li.day")).await;
    let rtl = a
        .eval("(() => { const p = [...document.querySelectorAll('#events .body')].find(p => p.textContent.startsWith('مرحبا')); \
               return p && p.getAttribute('dir') === 'auto' && getComputedStyle(p).direction === 'rtl'; })()")
        .await;
    a.screenshot("unread-divider").await;
    b.open(&conv).await;

    // Edit, from the message's menu.
    a.say("See you at 5").await;
    a.until("the message acknowledged", "!document.querySelector('#events li.pending')").await;
    let mine = "#events li.msg.mine:last-of-type";
    a.click(&format!("{mine} button.more")).await;
    a.press(&format!("{mine} .menu"), "Edit").await;
    a.until("the composer holding the text", "document.querySelector('#text').value === 'See you at 5'").await;
    a.type_into("#text", "See you at 6").await;
    a.enter("#text").await;
    b.until(
        "the edit in ben's window",
        "[...document.querySelectorAll('#events li.msg')].some(li => \
             li.querySelector('.body').textContent === 'See you at 6' && li.querySelector('.edited'))",
    )
    .await;

    // A reaction and a reply from ben.
    let anas = "#events li.msg:not(.mine):last-of-type";
    b.click(&format!("{anas} button.more")).await;
    b.press(&format!("{anas} .menu"), "👍").await;
    b.until("ben's reaction, his own", &format!("document.querySelector('{anas} .reaction.me')")).await;
    a.until("ben's reaction in ana's window", &format!("{}.startsWith('👍 1')", text_of(&format!("{mine} .reaction"))))
        .await;
    b.click(&format!("{anas} button.more")).await;
    b.press(&format!("{anas} .menu"), "Reply").await;
    b.say("6 works for me").await;
    a.until(
        "the reply quoting ana",
        "[...document.querySelectorAll('#events .quote')].some(q => q.textContent.includes('See you at 6'))",
    )
    .await;

    // Typing, presence, seen.
    a.type_into("#text", "typing something").await;
    b.until("ana typing", &format!("{} === 'ana is typing…'", text_of("#typing"))).await;
    b.until("ana online", &format!("{} === 'online'", text_of("#presence"))).await;
    a.type_into("#text", "").await;
    a.say("Great").await;
    a.until("the message acknowledged", "!document.querySelector('#events li.pending')").await;
    a.until("Seen under ana's last message", &format!("{} === 'Seen'", text_of(&format!("{mine} .seen")))).await;
    let shown_a = a.eval(SHOWN).await;
    a.screenshot("v12-direct").await;
    b.screenshot("v12-direct-other-side").await;
    a.click("#events li.msg .quote").await;

    // Recall after confirming; a notification while ben's tab is hidden.
    a.click(&format!("{mine} button.more")).await;
    a.press(&format!("{mine} .menu"), "Recall…").await;
    a.press(&format!("{mine} .menu"), "Yes, recall").await;
    b.until("the recall in ben's window", "document.querySelector('#events li.msg[data-recalled=true]')").await;
    b.eval(
        "(window.__notes = [], window.Notification = class { static permission = 'granted'; \
            constructor(title, o) { window.__notes.push([title, o.body]); } }, \
            Object.defineProperty(document, 'visibilityState', {get: () => 'hidden'}), true)",
    )
    .await;
    a.say("Are you there?").await;
    b.until("a notification", "window.__notes.length === 1").await;
    let notes = b.eval("window.__notes").await;

    // Shift+Enter lines grow the composer.
    let before = a.eval("document.querySelector('#text').offsetHeight").await;
    a.type_into("#text", "one").await;
    for line in ["two", "three", "four"] {
        a.keys(&format!("{}{}{}{line}", Key::Shift, Key::Enter, Key::Null)).await;
    }
    let after = a.eval("document.querySelector('#text').offsetHeight").await;
    let lines = a.eval("document.querySelector('#text').value.split('\\n').length").await;
    a.type_into("#text", "").await;

    // An @mention in a group, picked from the suggestions.
    let body = json!({"kind": "group", "conv_id": "g-three", "name": "Three", "members": ["ben", "cai"],
                      "recall_window_ms": RECALL_WINDOW_MS});
    assert_eq!(s.http("POST", "/v1/conversations", Some(&ana), Some(&body)).await.0, 201);
    b.client.refresh().await.expect("reload");
    b.online().await;
    a.open("g-three").await;
    a.type_into("#text", "hello @b").await;
    a.until("ben suggested", "document.querySelector('#mention-options li[data-user=ben]')").await;
    a.screenshot("mention-suggestions").await;
    a.keys(&Key::Enter.to_string()).await;
    a.until("the mention inserted", "document.querySelector('#text').value === 'hello @ben '").await;
    a.keys(&format!("see this{}", Key::Enter)).await;
    b.until("the @ badge", "document.querySelector(\"#inbox li[data-conv='g-three'] .badge.mention\")").await;
    b.screenshot("mention-badge").await;
    b.open("g-three").await;
    a.until("seen by ben", &format!("{} === 'Seen by 1'", text_of("#events li.msg.mine .seen"))).await;
    let seen_in_group = a.eval(&text_of("#events li.msg.mine .seen")).await;
    // Past the group's recall window, the message's menu offers no Recall (Edit still).
    a.until("the message acknowledged", "document.querySelector('#events li.msg.mine[data-seq]')").await;
    a.until(
        "the recall window passed",
        &format!(
            "Date.now() - Date.parse(document.querySelector('#events li.msg.mine time').getAttribute('datetime')) > {}",
            RECALL_WINDOW_MS + 500
        ),
    )
    .await;
    a.click("#events li.msg.mine[data-seq] button.more").await;
    a.until("the menu", "document.querySelector('#events li.msg.mine .menu')").await;
    let menu_after_window =
        a.eval("[...document.querySelectorAll('#events li.msg.mine .menu button')].map(b => b.textContent)").await;
    let lowest = a.eval(LOWEST_CONTRAST).await;
    let lowest_b = b.eval(LOWEST_CONTRAST).await;

    let ratio = |v: &Value| v["ratio"].as_f64().unwrap_or(0.0);
    let messages = shown_a.as_array().cloned().unwrap_or_default();
    let pass = day_line == json!("Today")
        && rtl == json!(true)
        && messages.iter().any(|m| m["grouped"] == json!(true))
        && messages
            .iter()
            .any(|m| m["text"] == "See you at 6" && m["edited"] == json!(true) && m["reactions"] == json!(["👍 1"]))
        && messages.iter().filter(|m| m["seen"] == "Seen").count() == 1
        && seen_in_group == json!("Seen by 1")
        && notes == json!([["ana", "Are you there?"]])
        && after.as_f64() > before.as_f64()
        && lines == json!(4)
        && menu_after_window.as_array().is_some_and(|m| m.contains(&json!("Edit")) && !m.contains(&json!("Recall…")))
        && ratio(&lowest) >= 4.5
        && ratio(&lowest_b) >= 4.5;
    for w in [a, b] {
        w.close().await;
    }
    assert!(check.resolve(
        json!({"day_line": day_line, "arabic_rtl": rtl, "shown_to_ana": shown_a, "notifications": notes,
               "menu_past_the_recall_window": menu_after_window, "seen_in_group": seen_in_group, "composer_height": [before, after], "composer_lines": lines, "lowest_contrast": [lowest, lowest_b]}),
        pass
    ));
}

#[test]
fn every_protocol_error_code_has_a_sentence_in_the_page() {
    let check = Check::start(
        SUITE,
        "30-every-code-has-a-sentence",
        "the codes of PROTOCOL §2's table, against the sentences of src/web/words.js",
        "each code has its own sentence (no raw server text reaches the person)",
    );
    let protocol = include_str!("../../../src/protocol/PROTOCOL.md");
    let words = include_str!("../../../src/web/words.js");
    let errors = protocol.split("## 2. Errors").nth(1).and_then(|s| s.split("\n## 3.").next()).unwrap_or_default();
    let codes: Vec<&str> =
        errors.lines().filter(|l| l.starts_with("| `")).filter_map(|l| l.split('`').nth(1)).collect();
    let missing: Vec<&&str> = codes.iter().filter(|c| !words.contains(&format!("  {c}: \""))).collect();
    let pass = codes.len() >= 20 && missing.is_empty();
    assert!(check.resolve(json!({"codes": codes, "missing": missing}), pass), "{missing:?}");
}
