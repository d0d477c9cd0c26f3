// The live signals of PROTOCOL v1.2, none of them in a log: who is typing,
// whether a direct chat's other member is online, and how far the other
// members have read. Events: "signals" (something shown changed).

const TYPING_EXPIRES_MS = 6000; // PROTOCOL: `on: true` lasts 6 s unless repeated
const TYPING_REPEAT_MS = 3000; // a typist repeats `on: true` this often
// The server forwards one signal per second and device and drops the rest:
// signals go out at least this far apart, the latest wanted state winning.
const TYPING_SPACING_MS = 1100;
const READS_PAGE = 200;

export class Signals extends EventTarget {
  constructor(connection, me) {
    super();
    this.connection = connection;
    this.me = me;
    this.typing = new Map(); // conv_id → Map(user_id → expiry time)
    this.presence = new Map(); // user_id → {online, last_seen}
    this.reads = new Map(); // conv_id → Map(user_id → read_seq)
    this.typingOut = new Map(); // conv_id → {on, onAt, sentAt, timer}: what this device says
    connection.addEventListener("push", (e) => this.onPush(e.detail));
  }

  changed() {
    this.dispatchEvent(new Event("signals"));
  }

  onPush(push) {
    if (push.push === "typing" && push.user_id !== this.me.user_id) {
      const typists = this.typing.get(push.conv_id) || new Map();
      this.typing.set(push.conv_id, typists);
      if (push.on) {
        typists.set(push.user_id, Date.now() + TYPING_EXPIRES_MS);
        setTimeout(() => this.changed(), TYPING_EXPIRES_MS + 50);
      } else {
        typists.delete(push.user_id);
      }
      this.changed();
    } else if (push.push === "presence") {
      this.presence.set(push.user_id, { online: push.online, last_seen: push.last_seen });
      this.changed();
    } else if (push.push === "read" && push.user_id && push.user_id !== this.me.user_id) {
      this.readsOf(push.conv_id).set(push.user_id, push.read_seq);
      this.changed();
    }
  }

  readsOf(conv_id) {
    if (!this.reads.has(conv_id)) this.reads.set(conv_id, new Map());
    return this.reads.get(conv_id);
  }

  /// The others typing in `conv_id` now.
  typists(conv_id) {
    const now = Date.now();
    return [...(this.typing.get(conv_id) || new Map())].filter(([, until]) => until > now).map(([user]) => user);
  }

  /// The caller types (`on`) or stopped: `on: true` repeated every few
  /// seconds while typing, `on: false` only after an `on: true`; each sent
  /// once the previous is a spacing old. Lost signals are harmless.
  type(conv_id, on) {
    if (this.connection.state !== "open") return;
    const out = this.typingOut.get(conv_id) || { on: false, onAt: 0, sentAt: 0, timer: null };
    this.typingOut.set(conv_id, out);
    if (on === out.on && (!on || Date.now() - out.onAt < TYPING_REPEAT_MS)) return;
    out.on = on;
    if (on) out.onAt = Date.now();
    clearTimeout(out.timer);
    out.timer = setTimeout(() => {
      out.sentAt = Date.now();
      this.connection.request("typing", { conv_id, on: out.on }).catch(() => {});
    }, Math.max(0, out.sentAt + TYPING_SPACING_MS - Date.now()));
  }

  /// Asks whether `user_id` is online (later changes come as pushes).
  async askPresence(user_id) {
    const reply = await this.connection.request("presence", { user_ids: [user_id] });
    for (const p of reply.result || []) this.presence.set(p.user_id, { online: p.online, last_seen: p.last_seen });
    this.changed();
  }

  /// The other members' read cursors of a small conversation.
  async loadReads(conv_id) {
    const reply = await this.connection.request("reads", { conv_id, limit: READS_PAGE });
    const reads = this.readsOf(conv_id);
    for (const r of reply.reads) if (r.user_id !== this.me.user_id) reads.set(r.user_id, r.read_seq);
    this.changed();
  }

  /// How many others have read `seq` of `conv_id`.
  seenBy(conv_id, seq) {
    return [...this.readsOf(conv_id).values()].filter((read) => read >= seq).length;
  }
}
