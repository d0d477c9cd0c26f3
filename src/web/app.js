// The page: sign-in, then the inbox, the open conversation and a group's
// members, drawn from the Chat's state whenever it changes. The address's
// fragment keeps the open conversation (`#conv=…`), so a reload reopens it.

import { Connection } from "./connection.js";
import { Chat } from "./chat.js";
import { Signals } from "./signals.js";
import { Picker } from "./people.js";
import { Composer } from "./composer.js";
import { MembersPane } from "./members.js";
import { logItems } from "./message.js";
import { sentence, standingSentence } from "./words.js";
import { el, describe, time, title, bodyText, reconcile } from "./view.js";

const TOKEN_KEY = "imcore.token";
const STATUS_TEXT = {
  connecting: "Connecting…",
  open: "Online",
  waiting: "Reconnecting…",
  replaced: "Open in another tab",
  stopped: "Signed out",
};
// Groups up to this size show "seen by N" (the server pushes their reads).
const SEEN_MAX_MEMBERS = 100;
// Redraws the log this often, so Recall and Edit go once their window passes.
const TICK_MS = 10000;
const JUMP_MAX_PAGES = 25;

const $ = (id) => document.getElementById(id);

let connection = null;
let chat = null;
let signals = null;
let me = null;
let current = null;
// Asked for by the address (`#conv=`), opened once the inbox is known.
let wanted = null;
// The open conversation's view state: the first unread seq when it was
// opened, the message whose menu is open, the recall being confirmed, and
// failures to show under a message.
const ui = { firstUnread: null, menu: null, confirming: null, notes: new Map() };

// Direct peers whose presence was asked since the last (re)connect.
const presenceAsked = new Set();
const pickers = {};
let composer = null;
let members = null;

/// The token of a login link (`/#token=…`) is kept for this tab only and
/// taken out of the address bar; the fragment never reaches the server.
function storedToken() {
  const params = new URLSearchParams(location.hash.slice(1));
  wanted = params.get("conv");
  const fromLink = params.get("token");
  if (fromLink) {
    sessionStorage.setItem(TOKEN_KEY, fromLink);
    keepInAddress(wanted);
  }
  return sessionStorage.getItem(TOKEN_KEY);
}

function keepInAddress(conv_id) {
  const fragment = conv_id ? `#conv=${encodeURIComponent(conv_id)}` : "";
  history.replaceState(null, "", location.pathname + location.search + fragment);
}

function showSignin(error = "") {
  $("chat").hidden = true;
  $("signin").hidden = false;
  $("signin-error").textContent = error;
  $("token").focus();
}

async function signIn(token) {
  let reply;
  try {
    reply = await fetch("/v1/me", { headers: { Authorization: `Bearer ${token}` }, cache: "no-store" });
  } catch {
    return showSignin("Cannot reach the server. Is it running?");
  }
  if (reply.status === 401) {
    sessionStorage.removeItem(TOKEN_KEY);
    return showSignin("That token is unknown or was revoked.");
  }
  if (!reply.ok) return showSignin(`The server answered ${reply.status}.`);
  me = await reply.json();
  sessionStorage.setItem(TOKEN_KEY, token);
  $("signin").hidden = true;
  $("chat").hidden = false;
  $("me").textContent = `${me.user_id} · ${me.device_id}`;
  connection = new Connection(token);
  chat = new Chat(connection, me);
  signals = new Signals(connection, me);
  connection.addEventListener("state", (e) => showState(e.detail));
  chat.addEventListener("inbox", renderInbox);
  chat.addEventListener("log", (e) => e.detail === current && renderLog());
  chat.addEventListener("problem", (e) => showProblem(e.detail));
  chat.addEventListener("members", (e) => {
    if (e.detail !== current) return;
    if (members.open) members.load(false);
    renderLog();
  });
  chat.addEventListener("incoming", (e) => notify(e.detail));
  signals.addEventListener("signals", () => current && renderLog());
  // Signals missed while away are not sent again (PROTOCOL v1.2): ask anew.
  connection.addEventListener("open", () => {
    presenceAsked.clear();
    if (current) liveSignals(current).catch(() => {});
  });
  connection.start();
}

function signOut() {
  connection?.stop();
  sessionStorage.clear();
  connection = chat = signals = me = current = null;
  $("inbox").replaceChildren();
  $("events").replaceChildren();
  $("conv-pane").hidden = true;
  $("empty").hidden = false;
  $("chat").classList.remove("in-conversation");
  keepInAddress(null);
  showSignin();
}

function showState(state) {
  if (state === "unauthorized") {
    connection.stop();
    sessionStorage.removeItem(TOKEN_KEY);
    return showSignin("This device's token was revoked or is unknown. Sign in again.");
  }
  $("status").textContent = STATUS_TEXT[state] || state;
  $("status").dataset.state = state;
  $("reclaim").hidden = state !== "replaced";
  if (current && chat?.logs.get(current)) renderLog();
}

/// A failure that has no field or message of its own to stand beside:
/// shown until dismissed or replaced, over the page (nothing moves).
function showProblem(error) {
  $("problem").textContent = typeof error === "string" ? error : sentence(error);
  $("problem-box").hidden = false;
}

function pageHidden() {
  return document.visibilityState !== "visible";
}

/// A message of someone else while the tab is hidden: a desktop notification.
function notify({ conv_id, event }) {
  if (!pageHidden() || !("Notification" in window) || Notification.permission !== "granted") return;
  const entry = chat.inbox.get(conv_id);
  const from = event.sender.user_id;
  const heading = entry?.kind === "group" ? `${from} in ${title(entry)}` : from;
  new Notification(heading, { body: bodyText(event.body), tag: conv_id });
}

// ---- inbox ----

function renderInbox() {
  let unreadTotal = 0;
  const items = chat.sortedInbox().map((c) => {
    const last = c.last_event;
    unreadTotal += c.unread || 0;
    const sender = last?.kind === "msg" ? `${last.sender.user_id === me.user_id ? "you" : last.sender.user_id}: ` : "";
    const unread = c.unread > 0 ? (c.unread >= 1000 ? "999+" : String(c.unread)) : null;
    const mentions = c.unread_mentions > 0;
    const name = title(c, chat.peers.get(c.conv_id));
    const preview = last ? sender + describe(last, me.user_id) : "No messages yet";
    const label = [name, unread && `${unread} unread`, mentions && "you were mentioned"].filter(Boolean).join(", ");
    const sig = JSON.stringify([name, unread, mentions, preview, last?.created_at, c.conv_id === current]);
    const build = () => el(
      "li",
      { dataset: { conv: c.conv_id }, class: c.conv_id === current ? "current" : "" },
      el(
        "button",
        {
          type: "button", class: "conv", "aria-current": c.conv_id === current ? "true" : null, "aria-label": label,
          onclick: () => openConversation(c.conv_id),
        },
        el("span", { class: "title" }, name),
        el("time", { datetime: last?.created_at }, time(last?.created_at)),
        el("span", { class: "preview", dir: "auto" }, preview),
        el("span", { class: "badges" },
          mentions && el("span", { class: "badge mention", title: "You were mentioned" }, "@"),
          unread && el("span", { class: "badge", dataset: { unread: c.unread } }, unread)),
      ),
    );
    return { key: `c:${c.conv_id}`, sig, build };
  });
  reconcile($("inbox"), items);
  $("inbox-more").hidden = !chat.inboxCursor;
  document.title = unreadTotal > 0 ? `(${unreadTotal >= 1000 ? "999+" : unreadTotal}) imcore` : "imcore";
  if (wanted) {
    const conv_id = wanted;
    wanted = null;
    openConversation(conv_id);
  }
  if (current) {
    $("conv-title").textContent = title(chat.inbox.get(current) || { conv_id: current }, chat.peers.get(current));
    askPresence();
  }
}

// ---- the open conversation ----

async function openConversation(conv_id) {
  const entry = chat.inbox.get(conv_id);
  current = conv_id;
  keepInAddress(conv_id);
  Object.assign(ui, { firstUnread: entry?.unread > 0 ? (entry.read_seq || 0) + 1 : null, menu: null, confirming: null });
  ui.notes.clear();
  composer.reset();
  $("chat").classList.add("in-conversation");
  $("conv-pane").hidden = false;
  $("empty").hidden = true;
  $("conv-title").textContent = entry ? title(entry, chat.peers.get(conv_id)) : conv_id;
  $("members-toggle").hidden = entry?.kind === "direct";
  members.show(false);
  renderInbox();
  renderLog(true);
  $("text").focus();
  try {
    await chat.open(conv_id);
    if ((entry?.kind ?? chat.inbox.get(conv_id)?.kind) !== "direct") await chat.loadStanding(conv_id);
    await liveSignals(conv_id);
  } catch (e) {
    if (conv_id === current) showProblem(e);
  }
  if (conv_id === current && $("first-unread")) $("first-unread").scrollIntoView({ block: "center" });
}

/// The other members' read cursors (small conversations) and a direct
/// peer's presence, as they are now; later changes come as pushes.
async function liveSignals(conv_id) {
  askPresence();
  const entry = chat.inbox.get(conv_id);
  if (entry?.kind === "direct" || (entry?.member_count ?? 0) <= SEEN_MAX_MEMBERS) await signals.loadReads(conv_id);
}

/// Asks once per connection whether the open direct chat's peer is online
/// (the peer may become known only after the chat opened).
function askPresence() {
  const entry = chat.inbox.get(current);
  const peer = entry?.kind === "direct" ? chat.peers.get(current) : null;
  if (!peer || presenceAsked.has(peer)) return;
  presenceAsked.add(peer);
  signals.askPresence(peer).catch(() => presenceAsked.delete(peer));
}

function closeConversation() {
  if (current) signals.type(current, false);
  current = null;
  chat.close();
  keepInAddress(null);
  $("chat").classList.remove("in-conversation");
  $("conv-pane").hidden = true;
  $("empty").hidden = false;
  members.show(false);
  renderInbox();
  $("inbox").querySelector("button")?.focus();
}

function standing() {
  return current ? chat.standing(current) : { role: null };
}

function canSend() {
  return connection.state !== "unauthorized" && !standingSentence(standing(), me.user_id);
}

/// What "seen" line goes under the caller's last message.
function seen(seq) {
  const entry = chat.inbox.get(current);
  const n = signals.seenBy(current, seq);
  if (!n) return null;
  return entry?.kind === "direct" ? "Seen" : `Seen by ${n}`;
}

const actions = {
  menu: (seq) => {
    ui.menu = ui.menu === seq ? null : seq;
    ui.confirming = null;
    renderLog();
    document.querySelector(`#events li[data-seq="${seq}"] .menu button`)?.focus();
  },
  confirm: (seq) => {
    ui.confirming = seq;
    renderLog();
    document.querySelector(`#events li[data-seq="${seq}"] .menu button.danger`)?.focus();
  },
  reply: (seq) => {
    const event = chat.logs.get(current)?.events.get(seq);
    ui.menu = null;
    renderLog();
    const who = event?.sender.user_id === me.user_id ? "yourself" : event?.sender.user_id;
    composer.reply(seq, `${who}: ${bodyText(event?.body).slice(0, 60)}`);
  },
  edit: (seq) => {
    const event = chat.logs.get(current)?.events.get(seq);
    ui.menu = null;
    renderLog();
    composer.edit(seq, bodyText(event?.body));
  },
  react: (seq, emoji, on) => act(seq, chat.react(current, seq, emoji, on)),
  recall: (seq) => act(seq, chat.recall(current, seq)),
  retry: (id) => chat.retry(id),
  discard: (id) => chat.discard(id),
  jump: (seq) => jumpTo(seq),
};

/// A message action; its failure is said under that message.
async function act(seq, promise) {
  const conv_id = current;
  ui.menu = ui.confirming = null;
  ui.notes.delete(seq);
  renderLog();
  try {
    await promise;
  } catch (e) {
    if (conv_id === current) ui.notes.set(seq, sentence(e));
  }
  if (conv_id === current) renderLog();
}

/// Scrolls to the message `seq`, paging back until it is loaded.
async function jumpTo(seq) {
  const find = () => document.querySelector(`#events li[data-seq="${seq}"]`);
  for (let page = 0; !find() && page < JUMP_MAX_PAGES; page += 1) {
    const log = chat.logs.get(current);
    if (!log || log.nextBefore === null) break;
    await chat.loadOlder(current);
  }
  const target = find();
  if (!target) return;
  target.scrollIntoView({ block: "center" });
  target.classList.add("flash");
  setTimeout(() => target.classList.remove("flash"), 1500);
  target.querySelector("button.more")?.focus();
}

/// Redraws the log, keeping the reader where it was: at the bottom when it
/// was there, else at the same distance from it (older pages grow upwards).
function renderLog(toBottom = false) {
  const box = $("log");
  const atBottom = toBottom || box.scrollHeight - box.scrollTop - box.clientHeight < 60;
  const fromBottom = box.scrollHeight - box.scrollTop;
  const log = chat.logs.get(current);
  const entry = chat.inbox.get(current);
  const s = standing();
  const ctx = {
    me: me.user_id, entry, member: !s.left && !s.dismissed, canSend: canSend(),
    firstUnread: ui.firstUnread, menu: ui.menu, confirming: ui.confirming,
    unreadLoaded: !!ui.firstUnread && !!log && (log.nextBefore === null || log.oldest <= ui.firstUnread),
    notes: ui.notes, seen, find: (seq) => log?.events.get(seq), act: actions,
  };
  reconcile($("events"), logItems(log ? log.sorted() : [], chat.pendingIn(current), ctx));
  $("older").hidden = !log?.loaded || log.nextBefore === null;
  box.scrollTop = atBottom ? box.scrollHeight : box.scrollHeight - fromBottom;
  composer.setStanding(standingSentence(s, me.user_id));
  $("members-toggle").hidden = entry?.kind === "direct";
  const typists = signals.typists(current);
  $("typing").textContent = typists.length ? `${typists.join(", ")} ${typists.length > 1 ? "are" : "is"} typing…` : "";
  const peer = entry?.kind === "direct" ? chat.peers.get(current) : null;
  const presence = peer && signals.presence.get(peer);
  $("presence").hidden = !presence || presence.online === null;
  if (presence) {
    $("presence").dataset.online = String(!!presence.online);
    const away = presence.last_seen ? `last seen ${time(presence.last_seen)}` : "offline";
    $("presence").textContent = presence.online ? "online" : away;
  }
  jumpButton();
}

/// "Jump to the first unread message" while that message is above the view
/// (or not loaded yet).
function jumpButton() {
  const line = $("first-unread");
  const box = $("log").getBoundingClientRect();
  const above = line ? line.getBoundingClientRect().bottom <= box.top : !!chat.logs.get(current)?.loaded;
  $("jump-unread").hidden = !ui.firstUnread || !above;
}

async function jumpToUnread() {
  for (let page = 0; !$("first-unread") && ui.firstUnread && page < JUMP_MAX_PAGES; page += 1) {
    const log = chat.logs.get(current);
    if (!log || log.nextBefore === null) break;
    await chat.loadOlder(current);
  }
  $("first-unread")?.scrollIntoView({ block: "start" });
  jumpButton();
}

function loadOlder() {
  if (current) chat.loadOlder(current).catch(showProblem);
}

// ---- wiring ----

async function createFrom(picker, fields) {
  const ids = await picker.resolve();
  if (!ids) return null;
  try {
    return await chat.create({ ...fields, members: ids });
  } catch (e) {
    picker.error(sentence(e));
    return null;
  }
}

/// Esc closes the innermost thing open: a message menu, the members pane,
/// "New chat", then the conversation (back to the inbox).
function escape(e) {
  if (e.key !== "Escape" || !chat) return;
  if (ui.menu !== null) {
    const seq = ui.menu;
    ui.menu = ui.confirming = null;
    renderLog();
    document.querySelector(`#events li[data-seq="${seq}"] button.more`)?.focus();
  } else if (members.open) members.show(false);
  else if ($("new-chat").open) {
    $("new-chat").open = false;
    $("new-chat").querySelector("summary").focus();
  } else if (current) closeConversation();
  else return;
  e.preventDefault();
}

function wire() {
  $("signin-form").addEventListener("submit", (e) => {
    e.preventDefault();
    signIn($("token").value.trim());
  });
  $("signout").addEventListener("click", signOut);
  $("reclaim").addEventListener("click", () => connection.reclaim());
  $("problem-close").addEventListener("click", () => ($("problem-box").hidden = true));
  $("inbox-more").addEventListener("click", () => chat.moreInbox().catch(showProblem));
  $("back").addEventListener("click", closeConversation);
  $("older").addEventListener("click", loadOlder);
  $("jump-unread").addEventListener("click", () => jumpToUnread().catch(showProblem));
  $("log").addEventListener("scroll", () => {
    if ($("log").scrollTop < 40) loadOlder();
    jumpButton();
  });
  const search = (prefix) => chat.searchUsers(prefix);
  pickers.direct = new Picker($("direct-picker"), search, { single: true });
  pickers.group = new Picker($("group-picker"), search);
  composer = new Composer({
    send: (text, extra) => {
      if (window.Notification?.permission === "default") Notification.requestPermission().catch(() => {});
      chat.send(current, text, extra);
      renderLog(true);
    },
    edit: (seq, text) => act(seq, chat.edit(current, seq, text)),
    typing: (on) => current && signals.type(current, on),
    members: async (prefix) => {
      if (chat.inbox.get(current)?.kind !== "group") return null;
      const page = await chat.members(current, { q: prefix || undefined });
      return page.members.map((m) => m.user_id).filter((u) => u !== me.user_id).slice(0, 6);
    },
  });
  members = new MembersPane({
    get chat() {
      return chat;
    },
    get me() {
      return me;
    },
    current: () => current,
    standing,
    left: () => renderLog(),
    reconcile,
  });
  $("new-direct").addEventListener("submit", async (e) => {
    e.preventDefault();
    const conv_id = await createFrom(pickers.direct, { kind: "direct" });
    if (conv_id) {
      pickers.direct.clear();
      $("new-chat").open = false;
      openConversation(conv_id);
    }
  });
  $("new-group").addEventListener("submit", async (e) => {
    e.preventDefault();
    const conv_id = await createFrom(pickers.group, { kind: "group", name: $("group-name").value.trim() });
    if (conv_id) {
      $("group-name").value = "";
      pickers.group.clear();
      $("new-chat").open = false;
      openConversation(conv_id);
    }
  });
  $("members-toggle").addEventListener("click", () => members.show(!members.open));
  document.addEventListener("keydown", escape);
  document.addEventListener("visibilitychange", () => current && chat?.markRead(current));
  setInterval(() => current && chat && renderLog(), TICK_MS);
}

wire();
// A login link opened in a tab that already shows the client signs in anew.
window.addEventListener("hashchange", () => {
  if (!new URLSearchParams(location.hash.slice(1)).has("token")) return;
  if (connection) signOut();
  signIn(storedToken());
});
const token = storedToken();
if (token) signIn(token);
else showSignin();
