// The page: sign-in, then the inbox, the open conversation and a group's
// members, drawn from the Chat's state whenever it changes.

import { Connection } from "./connection.js";
import { Chat } from "./chat.js";
import { el, describe, time, title, bodyText, reconcile } from "./view.js";

const TOKEN_KEY = "imcore.token";
const STATUS_TEXT = {
  connecting: "Connecting…",
  open: "Online",
  waiting: "Reconnecting…",
  replaced: "Open in another tab",
  stopped: "Signed out",
};
const PROBLEM_SHOWN_MS = 8000;
const SEARCH_DELAY_MS = 250;
const MUTE_FOR_MS = 60 * 60 * 1000;

const $ = (id) => document.getElementById(id);

let connection = null;
let chat = null;
let me = null;
let current = null;
const roster = { members: [], next: null, myRole: null };

/// The token of a login link (`/#token=…`) is kept for this tab only and
/// taken out of the address bar; the fragment never reaches the server.
function storedToken() {
  const fromLink = new URLSearchParams(location.hash.slice(1)).get("token");
  if (fromLink) {
    sessionStorage.setItem(TOKEN_KEY, fromLink);
    history.replaceState(null, "", location.pathname + location.search);
  }
  return sessionStorage.getItem(TOKEN_KEY);
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
  connection.addEventListener("state", (e) => showState(e.detail));
  chat.addEventListener("inbox", renderInbox);
  chat.addEventListener("log", (e) => e.detail === current && renderLog());
  chat.addEventListener("problem", (e) => showProblem(e.detail));
  chat.addEventListener("members", (e) => e.detail === current && !$("members-pane").hidden && loadMembers(false));
  connection.start();
}

function signOut() {
  connection?.stop();
  sessionStorage.clear();
  connection = chat = me = current = null;
  $("inbox").replaceChildren();
  $("events").replaceChildren();
  $("conv-pane").hidden = true;
  $("empty").hidden = false;
  $("chat").classList.remove("in-conversation");
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

let problemTimer = null;
function showProblem(text) {
  $("problem").textContent = text;
  clearTimeout(problemTimer);
  problemTimer = setTimeout(() => ($("problem").textContent = ""), PROBLEM_SHOWN_MS);
}

/// Runs an action of the person; its failure is shown, not thrown.
function attempt(promise) {
  return Promise.resolve(promise).catch((e) => showProblem(e.message || String(e)));
}

// ---- inbox ----

function renderInbox() {
  const items = chat.sortedInbox().map((c) => {
    const last = c.last_event;
    const sender = last?.kind === "msg" ? `${last.sender.user_id === me.user_id ? "you" : last.sender.user_id}: ` : "";
    const unread = c.unread > 0 ? (c.unread >= 1000 ? "999+" : String(c.unread)) : null;
    const name = title(c, chat.peers.get(c.conv_id));
    const preview = last ? sender + describe(last, me.user_id) : "No messages yet";
    const sig = JSON.stringify([name, unread, preview, last?.created_at, c.conv_id === current]);
    const build = () => el(
      "li",
      { dataset: { conv: c.conv_id }, class: c.conv_id === current ? "current" : "" },
      el(
        "button",
        {
          type: "button",
          class: "conv",
          "aria-current": c.conv_id === current ? "true" : null,
          "aria-label": unread ? `${name}, ${unread} unread` : name,
          onclick: () => openConversation(c.conv_id),
        },
        el("span", { class: "title" }, name),
        el("time", { datetime: last?.created_at }, time(last?.created_at)),
        el("span", { class: "preview" }, preview),
        unread && el("span", { class: "badge", dataset: { unread: c.unread } }, unread),
      ),
    );
    return { key: `c:${c.conv_id}`, sig, build };
  });
  reconcile($("inbox"), items);
  $("inbox-more").hidden = !chat.inboxCursor;
  if (current) {
    const entry = chat.inbox.get(current);
    if (entry) $("conv-title").textContent = title(entry, chat.peers.get(current));
  }
}

// ---- the open conversation ----

async function openConversation(conv_id) {
  current = conv_id;
  const entry = chat.inbox.get(conv_id);
  $("chat").classList.add("in-conversation");
  $("conv-pane").hidden = false;
  $("empty").hidden = true;
  $("conv-title").textContent = entry ? title(entry, chat.peers.get(conv_id)) : conv_id;
  $("members-toggle").hidden = entry?.kind !== "group";
  showMembers(false);
  renderInbox();
  renderLog(true);
  $("text").focus();
  await attempt(chat.open(conv_id));
}

function closeConversation() {
  current = null;
  chat.close();
  $("chat").classList.remove("in-conversation");
  $("conv-pane").hidden = true;
  $("empty").hidden = false;
  showMembers(false);
  renderInbox();
}

function eventItem(event, entry) {
  const key = `e:${current}:${event.seq}`;
  if (event.kind !== "msg") {
    const line = describe(event, me.user_id);
    const build = () => el("li", { class: "system", dataset: { seq: event.seq, kind: event.kind } }, line);
    return { key, sig: line, build };
  }
  const mine = event.sender.user_id === me.user_id;
  const windowMs = entry?.recall_window_ms ?? 0;
  const recallable =
    mine && !event.recalled && Date.now() - new Date(event.created_at).getTime() < windowMs && entry?.status !== "dismissed";
  return { key, sig: JSON.stringify([event.recalled, recallable]), build: () => renderMessage(event, mine, recallable) };
}

function renderMessage(event, mine, recallable) {
  return el(
    "li",
    { class: mine ? "msg mine" : "msg", dataset: { seq: event.seq, kind: "msg", recalled: event.recalled ? "true" : "false" } },
    el("span", { class: "sender" }, mine ? "you" : event.sender.user_id),
    event.recalled
      ? el("p", { class: "body recalled" }, "Message recalled")
      : el("p", { class: "body" }, bodyText(event.body)),
    el("time", { datetime: event.created_at }, time(event.created_at)),
    recallable &&
      el("button", { type: "button", class: "recall", onclick: () => attempt(chat.recall(current, event.seq)) }, "Recall"),
  );
}

function pendingItem(message) {
  const state = message.state === "failed" ? `Not sent: ${message.error}` : message.state === "sending" ? "Sending…" : "Waiting for the connection…";
  const build = () => el(
    "li",
    { class: "msg mine pending", dataset: { clientMsgId: message.client_msg_id, state: message.state } },
    el("p", { class: "body" }, bodyText(message.body)),
    el("span", { class: "sending" }, state),
    message.state === "failed" &&
      el("button", { type: "button", onclick: () => chat.discard(message.client_msg_id) }, "Discard"),
  );
  return { key: `p:${message.client_msg_id}`, sig: state, build };
}

/// Redraws the log, keeping the reader where it was: at the bottom when it
/// was there, else at the same distance from it (older pages grow upwards).
function renderLog(toBottom = false) {
  const box = $("log");
  const atBottom = toBottom || box.scrollHeight - box.scrollTop - box.clientHeight < 60;
  const fromBottom = box.scrollHeight - box.scrollTop;
  const log = chat.logs.get(current);
  const entry = chat.inbox.get(current);
  const shown = log ? log.sorted().filter((e) => e.kind !== "recall") : [];
  reconcile($("events"), [...shown.map((e) => eventItem(e, entry)), ...chat.pendingIn(current).map(pendingItem)]);
  $("older").hidden = !log?.loaded || log.nextBefore === null;
  box.scrollTop = atBottom ? box.scrollHeight : box.scrollHeight - fromBottom;
}

function loadOlder() {
  if (current) attempt(chat.loadOlder(current));
}

// ---- a group's members ----

function showMembers(visible) {
  $("members-pane").hidden = !visible;
  $("members-toggle").setAttribute("aria-expanded", String(visible));
  if (visible) loadMembers(false);
}

async function loadMembers(more) {
  const conv_id = current;
  const q = $("member-q").value.trim();
  await attempt(
    (async () => {
      if (!more) {
        const mine = await chat.members(conv_id, { q: me.user_id });
        roster.myRole = mine.members.find((m) => m.user_id === me.user_id)?.role ?? null;
      }
      const page = await chat.members(conv_id, { after: more ? roster.next : undefined, q });
      if (conv_id !== current) return;
      roster.members = more ? roster.members.concat(page.members) : page.members;
      roster.next = page.next;
      $("member-count").textContent = `(${page.member_count})`;
      renderMembers();
    })(),
  );
}

/// What the caller may do to `member` (PROTOCOL §5 role rules); the server
/// decides, this only hides buttons that would be refused.
function allowed(member) {
  const role = roster.myRole;
  const other = member.user_id !== me.user_id && member.role !== "owner";
  const overMember = role === "owner" || (role === "admin" && member.role === "member");
  return { kick: other && overMember, role: other && role === "owner", mute: other && overMember };
}

function renderMembers() {
  const groupOp = (op, fields) => attempt(chat.groupOp(op, { conv_id: current, ...fields }).then(() => loadMembers(false)));
  const muted = (m) => m.mute_until && new Date(m.mute_until) > new Date();
  const items = roster.members.map((m) => {
    const may = allowed(m);
    const button = (label, onclick) => el("button", { type: "button", "aria-label": `${label}: ${m.user_id}`, onclick }, label);
    const build = () => el(
      "li",
      { dataset: { user: m.user_id } },
      // The alias in <bdi>: a bidi control in it cannot reorder the id beside it.
      el("span", { class: "who" }, m.alias ? [el("bdi", {}, m.alias), ` (${m.user_id})`] : m.user_id),
      el("span", { class: "role" }, m.role),
      muted(m) && el("span", { class: "muted" }, "muted"),
      may.role &&
        button(m.role === "admin" ? "Make member" : "Make admin", () =>
          groupOp("set_role", { user_id: m.user_id, role: m.role === "admin" ? "member" : "admin" }),
        ),
      may.mute &&
        button(muted(m) ? "Unmute" : "Mute 1 h", () =>
          groupOp("mute_member", {
            user_id: m.user_id,
            mute_until: muted(m) ? null : new Date(Date.now() + MUTE_FOR_MS).toISOString(),
          }),
        ),
      may.kick && button("Remove", () => groupOp("kick", { user_id: m.user_id })),
    );
    return { key: `m:${m.user_id}`, sig: JSON.stringify([m, may, muted(m)]), build };
  });
  reconcile($("members"), items);
  $("members-more").hidden = !roster.next;
  $("leave").hidden = roster.myRole === "owner" || roster.myRole === null;
}

function userIds(text) {
  return text
    .split(/[\s,]+/)
    .map((s) => s.trim())
    .filter(Boolean);
}

// ---- wiring ----

function wire() {
  $("signin-form").addEventListener("submit", (e) => {
    e.preventDefault();
    signIn($("token").value.trim());
  });
  $("signout").addEventListener("click", signOut);
  $("reclaim").addEventListener("click", () => connection.reclaim());
  $("inbox-more").addEventListener("click", () => attempt(chat.moreInbox()));
  $("back").addEventListener("click", closeConversation);
  $("older").addEventListener("click", loadOlder);
  $("log").addEventListener("scroll", () => $("log").scrollTop < 40 && loadOlder());
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("text").value;
    if (!current || !text.trim()) return;
    chat.send(current, text);
    $("text").value = "";
    renderLog(true);
  });
  $("text").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("new-direct").addEventListener("submit", async (e) => {
    e.preventDefault();
    const other = $("direct-user").value.trim();
    const conv_id = await attempt(chat.create({ kind: "direct", members: [other] }));
    if (conv_id) {
      $("direct-user").value = "";
      $("new-chat").open = false;
      openConversation(conv_id);
    }
  });
  $("new-group").addEventListener("submit", async (e) => {
    e.preventDefault();
    const fields = { kind: "group", name: $("group-name").value.trim(), members: userIds($("group-members").value) };
    const conv_id = await attempt(chat.create(fields));
    if (conv_id) {
      $("group-name").value = $("group-members").value = "";
      $("new-chat").open = false;
      openConversation(conv_id);
    }
  });
  $("members-toggle").addEventListener("click", () => showMembers($("members-pane").hidden));
  let searchTimer = null;
  $("member-q").addEventListener("input", () => {
    clearTimeout(searchTimer);
    searchTimer = setTimeout(() => loadMembers(false), SEARCH_DELAY_MS);
  });
  $("member-search").addEventListener("submit", (e) => {
    e.preventDefault();
    loadMembers(false);
  });
  $("members-more").addEventListener("click", () => loadMembers(true));
  $("invite").addEventListener("submit", async (e) => {
    e.preventDefault();
    const reply = await attempt(chat.groupOp("invite", { conv_id: current, user_ids: userIds($("invite-users").value) }));
    if (reply) {
      $("invite-users").value = "";
      if (reply.pending?.length) showProblem(`Waiting for approval: ${reply.pending.join(", ")}`);
      loadMembers(false);
    }
  });
  $("leave").addEventListener("click", async () => {
    const left = await attempt(chat.groupOp("leave", { conv_id: current }).then(() => true));
    if (left) closeConversation();
  });
  document.addEventListener("visibilitychange", () => current && chat?.markRead(current));
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
