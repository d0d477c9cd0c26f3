// One conversation's events as this client holds them (PROTOCOL §5, v1.2):
// a window of the log, with each message's state (recalled, latest body,
// reactions) kept current as recall, edit and reaction events arrive.

/// The events of one conversation this client holds: a window of the log
/// from `oldest` up to `top`, the newest seq up to which nothing is missing.
export class Log {
  constructor(me) {
    this.me = me;
    this.events = new Map();
    this.top = 0;
    this.oldest = Infinity;
    // Where backward paging goes on; null once the start of history is loaded.
    this.nextBefore = null;
    this.epoch = undefined;
    this.loaded = false;
    // Pushes may have been missed (reconnected): sync forward before trusting `top`.
    this.stale = false;
    this.syncing = null;
    this.syncAgain = false;
  }

  sorted() {
    return [...this.events.values()].sort((a, b) => a.seq - b.seq);
  }

  /// Adds or replaces one event; a recall marks its target recalled, an
  /// edit or a reaction changes its target unless the target's state
  /// (`asOf`: the head it was read at) already holds it (PROTOCOL v1.2).
  put(event) {
    const again = this.events.has(event.seq);
    this.events.set(event.seq, event.kind === "msg" ? { ...event, asOf: event.asOf ?? event.seq } : event);
    this.oldest = Math.min(this.oldest, event.seq);
    const target = this.events.get(event.target_seq);
    if (!target || (again && event.kind !== "recall")) return;
    if (event.kind === "recall") {
      this.events.set(target.seq, { ...target, recalled: true, body: null, reactions: undefined });
    } else if (event.kind === "edit" && event.seq > target.asOf && event.body !== null) {
      this.events.set(target.seq, { ...target, body: event.body, edited_at: event.created_at, asOf: event.seq });
    } else if (event.kind === "reaction" && event.seq > target.asOf) {
      this.events.set(target.seq, { ...target, reactions: reacted(target.reactions, event, this.me), asOf: event.seq });
    }
  }

  /// Moves `top` over events already held right above it.
  advance() {
    while (this.events.has(this.top + 1)) this.top += 1;
  }
}

/// A message's reactions after one `reaction` event: its emoji's count ± 1.
function reacted(reactions = [], event, me) {
  const list = reactions.map((r) => ({ ...r }));
  let entry = list.find((r) => r.emoji === event.emoji);
  if (!entry) list.push((entry = { emoji: event.emoji, count: 0, me: false }));
  entry.count += event.on ? 1 : -1;
  if (event.sender?.user_id === me) entry.me = event.on;
  return list.filter((r) => r.count > 0);
}
