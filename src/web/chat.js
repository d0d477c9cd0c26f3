// The client's state and its rules, without DOM: the inbox, each opened
// conversation's log, the outbox of sends not yet acknowledged, and how each
// is brought up to date after pushes, gaps and reconnects (PROTOCOL §4, §5, §7),
// the v1.2 writes (edit, react, reply, mentions), and the caller's own standing.
//
// Events: "inbox" (the inbox changed), "log" (detail: conv_id whose log
// changed), "members" (detail: conv_id whose roster or roles changed),
// "incoming" (detail: {conv_id, event}, a new message of someone else),
// "problem" (detail: the error, for the person).

import { RequestError } from "./connection.js";
import { Log } from "./log.js";

const PAGE_BACK = 40; // events per backward page
const PAGE_FORWARD = 200; // events per forward sync page
const INBOX_PAGE = 50;
const OVERLOADED_RETRY_MS = 1000;
const OUTBOX_KEY = "imcore.outbox";

export function newClientMsgId() {
  return crypto.randomUUID();
}

export class Chat extends EventTarget {
  constructor(connection, me) {
    super();
    this.connection = connection;
    this.me = me;
    this.inbox = new Map();
    this.inboxCursor = null;
    // PROTOCOL §7: the token of the last inbox reply, when the server gives one.
    this.since = null;
    this.logs = new Map();
    // A direct chat's other member, by conv_id (its id is a digest of the pair).
    this.peers = new Map();
    // The caller's own member row of a group, as fetched: {role, muteUntil, seq}.
    this.standings = new Map();
    this.openConv = null;
    this.outbox = JSON.parse(sessionStorage.getItem(OUTBOX_KEY) || "[]").map((m) => ({ ...m, state: "waiting" }));
    this.inboxRefresh = null;
    connection.addEventListener("open", () => this.resume());
    connection.addEventListener("push", (e) => this.onPush(e.detail));
  }

  request(op, fields) {
    return this.connection.request(op, fields).then(({ id, ok, ...result }) => result);
  }

  changed(what, conv_id) {
    this.dispatchEvent(new CustomEvent(what, { detail: conv_id }));
  }

  problem(error) {
    this.dispatchEvent(new CustomEvent("problem", { detail: error }));
  }

  /// After every (re)connect: the inbox (a `since` delta where the server
  /// has one), the open conversation's missed events, then the sends still
  /// waiting for their ack, with their original client_msg_id.
  async resume() {
    for (const log of this.logs.values()) log.stale = true;
    try {
      await this.refreshInbox();
      if (this.openConv) await this.catchUp(this.openConv);
    } catch (e) {
      if (!(e instanceof RequestError && e.code === "DISCONNECTED")) this.problem(e);
    }
    for (const message of this.outbox) {
      if (message.state !== "failed") this.transmit(message);
    }
  }

  // ---- inbox ----

  sortedInbox() {
    const activity = (c) => c.last_event?.created_at || c.created_at || "";
    return [...this.inbox.values()].sort((a, b) => activity(b).localeCompare(activity(a)));
  }

  /// PROTOCOL §7: with a token, only what changed; without one (or on
  /// `reset`), the first page of the whole inbox again.
  async refreshInbox() {
    if (this.since) {
      const delta = await this.request("conversations", { since: this.since });
      if (!delta.reset) {
        for (const c of delta.conversations || []) this.upsert(c);
        for (const id of delta.left || []) this.inbox.delete(id);
        if (delta.since) this.since = delta.since;
        this.changed("inbox");
        return;
      }
    }
    const page = await this.request("conversations", { limit: INBOX_PAGE });
    this.inbox.clear();
    for (const c of page.conversations) this.upsert(c);
    this.inboxCursor = page.next_cursor;
    this.since = page.since ?? null;
    this.changed("inbox");
  }

  async moreInbox() {
    if (!this.inboxCursor) return;
    const page = await this.request("conversations", { limit: INBOX_PAGE, cursor: this.inboxCursor });
    for (const c of page.conversations) this.upsert(c);
    this.inboxCursor = page.next_cursor;
    this.changed("inbox");
  }

  /// Debounced: pushes of a conversation this client does not know yet, or
  /// of a pull-mode one, are answered by refreshing the inbox once.
  refreshInboxSoon() {
    if (this.inboxRefresh) return;
    this.inboxRefresh = setTimeout(() => {
      this.inboxRefresh = null;
      this.refreshInbox().catch((e) => this.problem(e));
    }, 100);
  }

  upsert(conversation) {
    const known = this.inbox.get(conversation.conv_id) || { read_seq: 0, unread: 0, last_event: null };
    this.inbox.set(conversation.conv_id, { ...known, ...conversation });
    if (conversation.kind === "direct") this.findPeer(conversation.conv_id);
    if (this.openConv === conversation.conv_id) this.markRead(conversation.conv_id);
  }

  async findPeer(conv_id) {
    if (this.peers.has(conv_id)) return;
    this.peers.set(conv_id, null);
    const page = await this.request("members", { conv_id, limit: 2 }).catch(() => null);
    const other = page?.members.find((m) => m.user_id !== this.me.user_id);
    if (!other) return this.peers.delete(conv_id);
    this.peers.set(conv_id, other.user_id);
    this.changed("inbox");
  }

  /// The inbox entry after an event of its conversation.
  noteEvent(conv_id, event) {
    const entry = this.inbox.get(conv_id);
    if (!entry) return this.refreshInboxSoon();
    // An event at or below the known head is already in the server's unread count.
    const isNew = event.seq > (entry.head || 0);
    entry.head = Math.max(entry.head || 0, event.seq);
    if (!entry.last_event || event.seq >= entry.last_event.seq) entry.last_event = event;
    if (event.kind === "recall" && entry.last_event?.seq === event.target_seq) {
      entry.last_event = { ...entry.last_event, recalled: true, body: null };
    }
    if (isNew && event.kind === "msg" && event.sender.user_id !== this.me.user_id && event.seq > entry.read_seq) {
      entry.unread = Math.min(1000, (entry.unread || 0) + 1);
      if (event.mentions?.includes(this.me.user_id) || event.body?.mention_all === true) {
        entry.unread_mentions = Math.min(100, (entry.unread_mentions || 0) + 1);
      }
      this.dispatchEvent(new CustomEvent("incoming", { detail: { conv_id, event } }));
    }
    if (event.kind === "group" && event.change?.profile) Object.assign(entry, event.change.profile);
    if (event.kind === "group" && event.change?.status) entry.status = event.change.status;
    if (isNew && ["join", "leave", "group"].includes(event.kind)) this.changed("members", conv_id);
    if (event.kind === "leave" && event.subject_user === this.me.user_id) entry.left = true;
    if (event.kind === "join" && event.subject_user === this.me.user_id) entry.left = false;
  }

  // ---- pushes ----

  onPush(push) {
    switch (push.push) {
      case "event":
        return this.pushed(push.conv_id, [push.event]);
      case "events":
        return this.pushed(push.conv_id, push.events);
      case "head": {
        const entry = this.inbox.get(push.conv_id);
        if (entry) entry.head = Math.max(entry.head || 0, push.head);
        const log = this.logs.get(push.conv_id);
        if (push.conv_id === this.openConv) this.catchUp(push.conv_id).catch((e) => this.problem(e));
        else if (log) log.stale = true;
        return this.refreshInboxSoon();
      }
      case "read":
        // Another member's cursor (PROTOCOL v1.2) is not ours.
        if (push.user_id && push.user_id !== this.me.user_id) return;
        return this.readElsewhere(push.conv_id, push.read_seq);
    }
  }

  /// Pushed events, ascending. One past `top + 1` means some were missed:
  /// PROTOCOL §4 gap detection, filled by a forward `sync`.
  pushed(conv_id, events) {
    const log = this.logs.get(conv_id);
    for (const event of events) {
      this.noteEvent(conv_id, event);
      if (log) {
        log.put(event);
        this.settle(conv_id, event);
      }
    }
    if (log) {
      log.advance();
      if (log.events.size && Math.max(...log.events.keys()) > log.top) {
        if (conv_id === this.openConv) this.catchUp(conv_id).catch((e) => this.problem(e));
        else log.stale = true;
      }
      this.changed("log", conv_id);
    }
    if (conv_id === this.openConv) this.markRead(conv_id);
    this.changed("inbox");
  }

  /// Another device of this user read up to `read_seq`.
  readElsewhere(conv_id, read_seq) {
    const entry = this.inbox.get(conv_id);
    if (!entry) return;
    entry.read_seq = Math.max(entry.read_seq || 0, read_seq);
    const log = this.logs.get(conv_id);
    if (read_seq >= (entry.head || 0)) {
      entry.unread = entry.unread_mentions = 0;
    } else if (log?.loaded && log.oldest <= read_seq + 1 && log.top >= (entry.head || 0)) {
      entry.unread = log.sorted().filter(
        (e) => e.kind === "msg" && e.seq > read_seq && !e.recalled && e.sender.user_id !== this.me.user_id,
      ).length;
    } else {
      this.refreshInboxSoon();
    }
    this.changed("inbox");
  }

  // ---- a conversation's log ----

  log(conv_id) {
    if (!this.logs.has(conv_id)) this.logs.set(conv_id, new Log(this.me.user_id));
    return this.logs.get(conv_id);
  }

  async open(conv_id) {
    this.openConv = conv_id;
    const log = this.log(conv_id);
    this.changed("log", conv_id);
    if (!log.loaded) await this.loadLatest(conv_id);
    else if (log.stale) await this.catchUp(conv_id);
    this.markRead(conv_id);
  }

  close() {
    this.openConv = null;
  }

  /// The newest page (backward from the head), then forward to whatever came meanwhile.
  async loadLatest(conv_id) {
    const log = this.log(conv_id);
    const entry = this.inbox.get(conv_id) || (await this.request("get_conversation", { conv_id }));
    const before = (entry.head || 0) + 1;
    const page = await this.request("sync", { conv_id, before_seq: before, limit: PAGE_BACK });
    for (const event of page.events) log.put({ ...event, asOf: page.head });
    log.top = before - 1;
    log.epoch = page.epoch;
    log.nextBefore = page.has_more ? (page.next_before ?? page.events[0]?.seq) : null;
    log.loaded = true;
    log.stale = true;
    this.changed("log", conv_id);
    await this.catchUp(conv_id);
  }

  /// Forward `sync` from `top` until the head; one run at a time per
  /// conversation (a request during a run makes it go round once more).
  catchUp(conv_id) {
    const log = this.log(conv_id);
    if (!log.loaded) return Promise.resolve();
    if (log.syncing) {
      log.syncAgain = true;
      return log.syncing;
    }
    log.syncing = (async () => {
      try {
        do {
          log.syncAgain = false;
          await this.syncForward(conv_id, log);
        } while (log.syncAgain);
        log.stale = false;
      } finally {
        log.syncing = null;
      }
      this.markRead(conv_id);
    })();
    return log.syncing;
  }

  async syncForward(conv_id, log) {
    for (;;) {
      let page;
      try {
        page = await this.request("sync", { conv_id, after_seq: log.top, limit: PAGE_FORWARD, epoch: log.epoch });
      } catch (e) {
        if (e.code !== "EPOCH_CHANGED") throw e;
        // The log was rebuilt (restore): what this client holds is not it any more.
        this.logs.set(conv_id, new Log(this.me.user_id));
        if (this.openConv === conv_id) await this.loadLatest(conv_id);
        return;
      }
      for (const event of page.events) {
        log.put({ ...event, asOf: page.head });
        this.noteEvent(conv_id, event);
        this.settle(conv_id, event);
      }
      log.top = Math.max(log.top, page.next_after ?? log.top);
      log.advance();
      log.epoch = page.epoch;
      this.changed("log", conv_id);
      this.changed("inbox");
      if (!page.has_more) return;
    }
  }

  async loadOlder(conv_id) {
    const log = this.log(conv_id);
    if (log.nextBefore === null || log.loadingOlder) return;
    log.loadingOlder = true;
    try {
      const page = await this.request("sync", { conv_id, before_seq: log.nextBefore, limit: PAGE_BACK });
      for (const event of page.events) log.put({ ...event, asOf: page.head });
      log.nextBefore = page.has_more ? (page.next_before ?? page.events[0]?.seq) : null;
      this.changed("log", conv_id);
    } finally {
      log.loadingOlder = false;
    }
  }

  /// Moves the read cursor to what this client shows, while the page is looked at.
  markRead(conv_id) {
    const entry = this.inbox.get(conv_id);
    const log = this.logs.get(conv_id);
    if (!entry || !log?.loaded || document.visibilityState !== "visible") return;
    const seq = log.top;
    if (seq <= (entry.read_seq || 0) && (!entry.unread || seq < (entry.head || 0))) return;
    entry.read_seq = Math.max(entry.read_seq || 0, seq);
    entry.unread = entry.unread_mentions = 0;
    this.changed("inbox");
    this.request("read", { conv_id, seq }).then(
      (r) => (entry.read_seq = Math.max(entry.read_seq, r.read_seq)),
      () => {}, // a lost read is sent again at the next look
    );
  }

  // ---- sending ----

  saveOutbox() {
    const kept = this.outbox.map(({ conv_id, client_msg_id, body, reply_to, mentions }) =>
      ({ conv_id, client_msg_id, body, reply_to, mentions }));
    sessionStorage.setItem(OUTBOX_KEY, JSON.stringify(kept));
  }

  pendingIn(conv_id) {
    return this.outbox.filter((m) => m.conv_id === conv_id);
  }

  /// `extra`: `reply_to` (a seq) and `mentions` (user ids), when any.
  send(conv_id, text, extra = {}) {
    const message = { conv_id, client_msg_id: newClientMsgId(), body: { type: "text", text }, state: "waiting", ...extra };
    this.outbox.push(message);
    this.saveOutbox();
    this.transmit(message);
  }

  /// Sends (or sends again, with the same client_msg_id: PROTOCOL §5 makes a
  /// repeat safe) one message of the outbox.
  async transmit(message) {
    if (message.state === "sending" || this.connection.state !== "open") return;
    message.state = "sending";
    this.changed("log", message.conv_id);
    try {
      const fields = { conv_id: message.conv_id, client_msg_id: message.client_msg_id, body: message.body };
      if (message.reply_to) fields.reply_to = message.reply_to;
      if (message.mentions?.length) fields.mentions = message.mentions;
      const ack = await this.request("send", fields);
      const event = {
        conv_id: message.conv_id,
        seq: ack.seq,
        kind: "msg",
        message_id: ack.message_id,
        sender: { user_id: this.me.user_id, device_id: this.me.device_id },
        client_msg_id: message.client_msg_id,
        body: message.body,
        recalled: false,
        created_at: ack.created_at,
        reply_to: message.reply_to,
        mentions: message.mentions,
      };
      this.acknowledged(message.conv_id, event);
    } catch (e) {
      if (!(e instanceof RequestError)) throw e;
      message.state = e.retryable ? "waiting" : "failed";
      message.error = e.retryable ? null : e;
      if (e.code === "OVERLOADED") setTimeout(() => this.transmit(message), OVERLOADED_RETRY_MS);
      this.changed("log", message.conv_id);
    }
  }

  /// The ack's event joins the log; a gap below it is filled by a sync.
  acknowledged(conv_id, event) {
    this.noteEvent(conv_id, event);
    this.settle(conv_id, event);
    const log = this.logs.get(conv_id);
    if (log?.loaded) {
      log.put(event);
      log.advance();
      if (event.seq > log.top) this.catchUp(conv_id).catch((e) => this.problem(e));
    }
    this.changed("log", conv_id);
    this.changed("inbox");
  }

  /// A message of this user found in the log ends its outbox entry (its ack
  /// was lost with a connection, or it was sent before a reload).
  settle(conv_id, event) {
    if (event.kind !== "msg" || event.sender?.user_id !== this.me.user_id) return;
    const i = this.outbox.findIndex((m) => m.conv_id === conv_id && m.client_msg_id === event.client_msg_id);
    if (i < 0) return;
    this.outbox.splice(i, 1);
    this.saveOutbox();
  }

  /// A failed message sent again, with its client_msg_id (PROTOCOL §5).
  retry(client_msg_id) {
    const message = this.outbox.find((m) => m.client_msg_id === client_msg_id);
    if (!message || message.state !== "failed") return;
    message.state = "waiting";
    this.transmit(message);
  }

  discard(client_msg_id) {
    this.outbox = this.outbox.filter((m) => m.client_msg_id !== client_msg_id);
    this.saveOutbox();
    if (this.openConv) this.changed("log", this.openConv);
  }

  async recall(conv_id, target_seq) {
    const reply = await this.request("recall", { conv_id, target_seq });
    const event = {
      conv_id,
      seq: reply.seq,
      kind: "recall",
      sender: { user_id: this.me.user_id, device_id: this.me.device_id },
      target_seq,
      created_at: new Date().toISOString(),
    };
    this.log(conv_id).put(event);
    this.noteEvent(conv_id, event);
    this.log(conv_id).advance();
    this.changed("log", conv_id);
    this.changed("inbox");
  }

  /// Puts an event this client caused into the log at once (its push may
  /// come too: the seq makes that a no-op).
  own(conv_id, event) {
    const log = this.log(conv_id);
    const sender = { user_id: this.me.user_id, device_id: this.me.device_id };
    log.put({ conv_id, sender, created_at: new Date().toISOString(), ...event });
    log.advance();
    this.changed("log", conv_id);
  }

  async edit(conv_id, target_seq, text) {
    const body = { type: "text", text };
    const reply = await this.request("edit", { conv_id, client_msg_id: newClientMsgId(), target_seq, body });
    this.own(conv_id, { seq: reply.seq, kind: "edit", target_seq, body });
  }

  async react(conv_id, target_seq, emoji, on) {
    const reply = await this.request("react", { conv_id, target_seq, emoji, on });
    if (reply.changed) this.own(conv_id, { seq: reply.seq, kind: "reaction", target_seq, emoji, on });
  }

  /// The caller's standing in `conv_id`: its member row as last fetched,
  /// then every event of the log after it that is about the caller.
  standing(conv_id) {
    const entry = this.inbox.get(conv_id);
    const base = this.standings.get(conv_id) || { role: entry?.owner === this.me.user_id ? "owner" : "member", seq: 0 };
    const s = { ...base, dismissed: entry?.status === "dismissed", muteAll: !!entry?.mute_all };
    const me = this.me.user_id;
    for (const e of this.logs.get(conv_id)?.sorted() || []) {
      if (e.seq <= base.seq) continue;
      const c = e.change || {};
      if (e.kind === "join" && e.subject_user === me) Object.assign(s, { left: null, by: null, role: "member" });
      if (e.kind === "leave" && e.subject_user === me) Object.assign(s, { left: e.reason, by: e.actor });
      if (c.role?.user_id === me) s.role = c.role.role;
      if (c.mute?.user_id === me) s.muteUntil = c.mute.mute_until ? Date.parse(c.mute.mute_until) : 0;
      if (c.owner) s.role = c.owner.to === me ? "owner" : c.owner.from === me ? "admin" : s.role;
      if (c.status === "dismissed") s.dismissed = true;
      if (c.profile && "mute_all" in c.profile) s.muteAll = c.profile.mute_all;
    }
    return s;
  }

  /// Fetches the caller's own member row of a group (role, mute); a former
  /// member has none, and its standing comes from the log alone.
  async loadStanding(conv_id) {
    const seq = this.logs.get(conv_id)?.top || 0;
    try {
      const page = await this.members(conv_id, { q: this.me.user_id });
      const row = page.members.find((m) => m.user_id === this.me.user_id);
      if (row) {
        const muteUntil = row.mute_until ? Date.parse(row.mute_until) : 0;
        this.standings.set(conv_id, { role: row.role, muteUntil, seq });
      }
    } catch (e) {
      if (e.code !== "NOT_MEMBER") throw e;
    }
    this.changed("log", conv_id);
  }

  // ---- conversations and groups ----

  async create(fields) {
    const conversation = await this.request("create_conversation", fields);
    this.upsert(conversation);
    this.changed("inbox");
    return conversation.conv_id;
  }

  /// The people picker's search (PROTOCOL v1.2 `search_users`).
  async searchUsers(prefix) {
    return (await this.request("search_users", { prefix, limit: 8 })).users;
  }

  members(conv_id, { after, q } = {}) {
    const fields = { conv_id, limit: 50 };
    if (after !== undefined && after !== null) fields.after = after;
    if (q) fields.q = q;
    return this.request("members", fields);
  }

  /// A group op (invite, kick, set_role, mute_member, leave); the events it
  /// appends reach the log by push or sync like any other.
  async groupOp(op, fields) {
    const reply = await this.request(op, fields);
    await this.catchUp(fields.conv_id);
    return reply;
  }
}
