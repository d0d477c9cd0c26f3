// The open conversation's log as list items: day separators, the first
// unread line, messages grouped under one sender line, each message with
// its reply quote, "edited" mark, reactions, action menu and "seen" line,
// then the sends still in the outbox. Bodies are text nodes only (view.js).

import { el, bodyText, describe, time } from "./view.js";
import { sentence } from "./words.js";

export const QUICK_REACTIONS = ["👍", "❤️", "😂", "😮", "🎉"];
const GROUP_WITHIN_MS = 5 * 60 * 1000;
const DEFAULT_EDIT_WINDOW_MS = 86400000;

function day(iso) {
  const d = new Date(iso);
  const today = new Date();
  const yesterday = new Date(Date.now() - 86400000);
  if (d.toDateString() === today.toDateString()) return "Today";
  if (d.toDateString() === yesterday.toDateString()) return "Yesterday";
  return d.toLocaleDateString([], { weekday: "short", day: "numeric", month: "short", year: "numeric" });
}

function snippet(event) {
  if (!event) return "an earlier message";
  if (event.recalled) return "a recalled message";
  const text = bodyText(event.body);
  return text.length > 80 ? `${text.slice(0, 80)}…` : text;
}

// Sends that repeating cannot make succeed: Retry is not offered.
const FINAL_FAILURES = ["IDEMPOTENCY_MISMATCH", "IDEMPOTENCY_KEY_EXPIRED", "PAYLOAD_TOO_LARGE", "BAD_REQUEST"];

const line = (key, sig, attributes, text) => ({ key, sig, build: () => el("li", attributes, text) });

/// The items of `events` (ascending) and `pending` for `reconcile`. `ctx`:
/// - me, entry (the inbox item), member (a current member of an active
///   conversation), canSend (may send now);
/// - firstUnread (seq) and unreadLoaded (the log reaches back to it);
/// - menu, confirming (seqs), notes (seq → a failure to show);
/// - seen(seq) → a line or null, find(seq) → an event;
/// - act: {menu, reply, edit, react, recall, confirm, jump, retry, discard}.
export function logItems(events, pending, ctx) {
  const items = [];
  let lastDay = null;
  let previous = null;
  let unreadShown = false;
  const lastMine = [...events].reverse().find((e) => e.kind === "msg" && e.sender.user_id === ctx.me);
  for (const event of events) {
    if (event.kind === "recall" || event.kind === "edit" || event.kind === "reaction") continue;
    const d = day(event.created_at);
    if (d !== lastDay) {
      items.push(line(`d:${d}`, d, { class: "day", role: "separator" }, d));
      lastDay = d;
      previous = null;
    }
    const fromOther = event.kind === "msg" && event.sender.user_id !== ctx.me;
    if (!unreadShown && fromOther && ctx.unreadLoaded && event.seq >= ctx.firstUnread) {
      unreadShown = true;
      items.push(line("unread", "u", { id: "first-unread", class: "unread-line", role: "separator" }, "New messages"));
      previous = null;
    }
    if (event.kind !== "msg") {
      const text = describe(event, ctx.me);
      items.push(line(`e:${event.seq}`, text, { class: "system", dataset: { seq: event.seq, kind: event.kind } }, text));
      previous = null;
      continue;
    }
    const grouped =
      previous && previous.sender.user_id === event.sender.user_id &&
      Date.parse(event.created_at) - Date.parse(previous.created_at) < GROUP_WITHIN_MS;
    previous = event;
    items.push(messageItem(event, grouped, event === lastMine ? ctx.seen(event.seq) : null, ctx));
  }
  for (const message of pending) items.push(pendingItem(message, ctx));
  return items;
}

function messageItem(event, grouped, seen, ctx) {
  const mine = event.sender.user_id === ctx.me;
  const age = Date.now() - Date.parse(event.created_at);
  const live = !event.recalled && ctx.canSend;
  const may = {
    // A muted member may still recall its own message; a former member may not.
    recall: mine && !event.recalled && ctx.member && age < (ctx.entry?.recall_window_ms ?? 0),
    edit: mine && live && age < (ctx.entry?.edit_window_ms ?? DEFAULT_EDIT_WINDOW_MS),
    react: live,
    reply: ctx.canSend,
  };
  const menuOpen = ctx.menu === event.seq;
  const confirming = ctx.confirming === event.seq;
  const quoted = event.reply_to ? ctx.find(event.reply_to) : null;
  const note = ctx.notes.get(event.seq);
  const sig = JSON.stringify([
    note, event.body, event.recalled, event.edited_at, event.reactions, event.mentions,
    grouped, seen, may, menuOpen, confirming, quoted && snippet(quoted),
  ]);
  const build = () => {
    const at = time(event.created_at);
    const who = mine ? "you" : event.sender.user_id;
    const quotedWho = quoted ? `${quoted.sender?.user_id === ctx.me ? "you" : quoted.sender?.user_id}: ` : "";
    const classes = `msg${mine ? " mine" : ""}${grouped ? " grouped" : ""}`;
    const dataset = { seq: event.seq, kind: "msg", recalled: event.recalled ? "true" : "false" };
    const actions = may.react || may.reply || may.edit || may.recall;
    return el(
      "li",
      { class: classes, dataset },
      !grouped && el("span", { class: "sender" }, who),
      event.reply_to &&
        el("button", { type: "button", class: "quote", onclick: () => ctx.act.jump(event.reply_to) },
          `↪ ${quotedWho}${snippet(quoted)}`),
      event.recalled
        ? el("p", { class: "body recalled" }, "Message recalled")
        : el("p", { class: "body", dir: "auto" }, bodyText(event.body)),
      el("div", { class: "meta" },
        el("time", { datetime: event.created_at }, at),
        event.edited_at && !event.recalled && el("span", { class: "edited" }, "edited"),
        actions &&
          el("button", {
            type: "button", class: "more", "aria-label": `Actions for the message of ${who} at ${at}`,
            "aria-expanded": String(menuOpen), onclick: () => ctx.act.menu(event.seq),
          }, "⋯"),
      ),
      !event.recalled && event.reactions?.length > 0 && reactions(event, may.react, ctx),
      menuOpen && menu(event, may, confirming, ctx),
      note && el("p", { class: "field-error", role: "alert" }, note),
      seen && el("p", { class: "seen" }, seen),
    );
  };
  return { key: `e:${event.seq}`, sig, build };
}

/// Each emoji with its count; the caller's own pressed; a press toggles it.
function reactions(event, enabled, ctx) {
  return el("div", { class: "reactions" },
    event.reactions.map((r) => el("button", {
      type: "button", class: r.me ? "reaction me" : "reaction", "aria-pressed": String(!!r.me), disabled: !enabled,
      "aria-label": `${r.emoji} ${r.count}${r.me ? ", yours" : ""}`,
      onclick: () => ctx.act.react(event.seq, r.emoji, !r.me),
    }, `${r.emoji} ${r.count}`)));
}

function menu(event, may, confirming, ctx) {
  const mine = (emoji) => event.reactions?.some((r) => r.emoji === emoji && r.me);
  const item = (label, onclick, extra = {}) =>
    el("button", { type: "button", role: "menuitem", onclick, ...extra }, label);
  const react = (emoji) => () => ctx.act.react(event.seq, emoji, !mine(emoji));
  return el("div", { class: "menu", role: "menu", "aria-label": "Message actions" },
    may.reply && item("Reply", () => ctx.act.reply(event.seq)),
    may.react && QUICK_REACTIONS.map((emoji) => item(emoji, react(emoji), { "aria-label": `React ${emoji}`, class: "pick" })),
    may.edit && item("Edit", () => ctx.act.edit(event.seq)),
    may.recall && !confirming && item("Recall…", () => ctx.act.confirm(event.seq)),
    may.recall && confirming && el("span", { class: "confirm" }, "Recall for everyone? ",
      item("Yes, recall", () => ctx.act.recall(event.seq), { class: "danger" }),
      item("Keep", () => ctx.act.confirm(null))),
  );
}

function pendingItem(message, ctx) {
  const failed = message.state === "failed";
  const waiting = message.state === "sending" ? "Sending…" : "Waiting for the connection…";
  const state = failed ? `Not sent. ${sentence(message.error)}` : waiting;
  const retry = failed && ctx.canSend && !FINAL_FAILURES.includes(message.error?.code);
  const build = () => el(
    "li",
    { class: "msg mine pending", dataset: { clientMsgId: message.client_msg_id, state: message.state } },
    el("p", { class: "body", dir: "auto" }, bodyText(message.body)),
    el("span", { class: failed ? "sending failed" : "sending", role: failed ? "alert" : null }, state),
    retry &&
      el("button", { type: "button", class: "retry", onclick: () => ctx.act.retry(message.client_msg_id) }, "Retry"),
    failed && el("button", { type: "button", onclick: () => ctx.act.discard(message.client_msg_id) }, "Discard"),
  );
  return { key: `p:${message.client_msg_id}`, sig: JSON.stringify([state, retry]), build };
}
