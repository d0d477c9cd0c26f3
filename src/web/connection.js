// One WebSocket to the server (PROTOCOL §4): requests paired with their
// replies by id, pushes handed on as events, and reconnection with backoff.
//
// Events: "state" (detail: the new state), "open" (after every (re)connect),
// "push" (detail: the push object).
// States: "connecting", "open", "waiting" (to reconnect), "replaced" (another
// tab took this device's connection), "unauthorized" (the token is unknown or
// revoked), "stopped".

const BACKOFF_FIRST_MS = 250;
const BACKOFF_MAX_MS = 15000;
// The server closes a connection silent for 45 s and pings every 15 s, but a
// browser never sees those pings: the client sends its own and gives up on a
// connection that answered nothing for as long as the server would wait.
const PING_EVERY_MS = 15000;
const SILENCE_LIMIT_MS = 45000;

/// A failed request. `code` is a PROTOCOL §2 code, or DISCONNECTED when the
/// connection closed before the reply (the request may or may not have run).
export class RequestError extends Error {
  constructor(error) {
    super(error.message || error.code);
    this.code = error.code;
    this.detail = error;
  }

  /// Worth repeating as is (with the same client_msg_id for a send).
  get retryable() {
    return ["DISCONNECTED", "OVERLOADED", "INTERNAL"].includes(this.code);
  }
}

export class Connection extends EventTarget {
  constructor(token) {
    super();
    this.token = token;
    this.state = "stopped";
    this.socket = null;
    this.nextId = 1;
    this.pending = new Map();
    this.attempt = 0;
    this.timer = null;
    this.heartbeat = null;
    this.lastFrameAt = 0;
    this.kickedFor = null;
    this.onOnline = () => {
      if (this.state === "waiting") this.connectNow();
    };
  }

  start() {
    window.addEventListener("online", this.onOnline);
    this.connectNow();
  }

  stop() {
    window.removeEventListener("online", this.onOnline);
    clearTimeout(this.timer);
    this.setState("stopped");
    this.socket?.close(1000);
  }

  /// Another tab had this device's connection: take it back.
  reclaim() {
    if (this.state === "replaced") this.connectNow();
  }

  /// Sends `{id, op, ...fields}`; resolves with the reply, rejects with a RequestError.
  request(op, fields = {}) {
    if (this.state !== "open") {
      return Promise.reject(new RequestError({ code: "DISCONNECTED", message: "not connected" }));
    }
    const id = this.nextId++;
    return new Promise((resolve, reject) => {
      this.pending.set(id, { resolve, reject });
      this.socket.send(JSON.stringify({ id, op, ...fields }));
    });
  }

  setState(state) {
    if (this.state === state) return;
    this.state = state;
    this.dispatchEvent(new CustomEvent("state", { detail: state }));
  }

  /// Asks over HTTP whether the token is still good before opening a socket:
  /// a refused WebSocket upgrade is indistinguishable from a server that is down.
  async connectNow() {
    clearTimeout(this.timer);
    this.setState("connecting");
    this.kickedFor = null;
    let status;
    try {
      status = (await fetch("/v1/me", { headers: { Authorization: `Bearer ${this.token}` }, cache: "no-store" }))
        .status;
    } catch {
      return this.retryLater();
    }
    if (this.state !== "connecting") return;
    if (status === 401) return this.setState("unauthorized");
    if (status !== 200) return this.retryLater();
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    const socket = new WebSocket(`${scheme}//${location.host}/v1/ws?token=${encodeURIComponent(this.token)}`);
    this.socket = socket;
    socket.onopen = () => {
      this.attempt = 0;
      this.lastFrameAt = Date.now();
      this.heartbeat = setInterval(() => this.beat(socket), PING_EVERY_MS);
      this.setState("open");
      this.dispatchEvent(new Event("open"));
    };
    socket.onmessage = (m) => this.received(m.data);
    socket.onclose = (e) => this.closed(socket, e.code);
  }

  beat(socket) {
    if (Date.now() - this.lastFrameAt > SILENCE_LIMIT_MS) {
      socket.close(4000, "silent");
      this.closed(socket, 4000);
    } else {
      socket.send(JSON.stringify({ op: "ping" }));
    }
  }

  received(text) {
    this.lastFrameAt = Date.now();
    let frame;
    try {
      frame = JSON.parse(text);
    } catch {
      return;
    }
    if (frame.id !== undefined && this.pending.has(frame.id)) {
      const { resolve, reject } = this.pending.get(frame.id);
      this.pending.delete(frame.id);
      if (frame.ok) resolve(frame);
      else reject(new RequestError(frame.error || { code: "INTERNAL", message: "malformed reply" }));
    } else if (frame.push) {
      if (frame.push === "kicked") this.kickedFor = frame.reason;
      this.dispatchEvent(new CustomEvent("push", { detail: frame }));
    }
  }

  /// Every request still waiting fails as DISCONNECTED; then, unless this
  /// device was replaced or revoked, reconnect.
  closed(socket, code) {
    if (socket !== this.socket) return;
    this.socket = null;
    clearInterval(this.heartbeat);
    for (const { reject } of this.pending.values()) {
      reject(new RequestError({ code: "DISCONNECTED", message: "the connection closed" }));
    }
    this.pending.clear();
    if (this.state === "stopped") return;
    if (this.kickedFor === "replaced") return this.setState("replaced");
    // 1008: token revoked; the HTTP check says so before the next attempt.
    if (this.kickedFor === "shutdown") this.attempt = 0;
    this.retryLater(code === 1008 ? 0 : undefined);
  }

  retryLater(delayMs) {
    if (this.state === "stopped") return;
    this.setState("waiting");
    const backoff = Math.min(BACKOFF_MAX_MS, BACKOFF_FIRST_MS * 2 ** this.attempt);
    this.attempt += 1;
    const delay = delayMs ?? backoff / 2 + Math.random() * (backoff / 2);
    this.timer = setTimeout(() => this.connectNow(), delay);
  }
}
