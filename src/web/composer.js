// The composer: Enter sends, Shift+Enter adds a line (the field grows);
// a reply or an edit in progress shown above it; @mention suggestions from
// the group's members; typing signals; closed with a sentence when the
// caller may not send (words.js).

import { el } from "./view.js";

const MAX_HEIGHT_PX = 160;
const MENTION = /(^|\s)@([A-Za-z0-9._:@-]{0,64})$/;
const MENTION_DELAY_MS = 120;

export class Composer {
  /// `hooks`: send(text, {reply_to, mentions}), edit(seq, text), typing(on),
  /// members(prefix) → Promise of user ids (null outside groups).
  constructor(hooks) {
    this.hooks = hooks;
    this.form = document.getElementById("composer");
    this.text = document.getElementById("text");
    this.context = document.getElementById("composer-context");
    this.standing = document.getElementById("standing");
    this.options = document.getElementById("mention-options");
    this.mode = null; // {reply: seq} or {edit: seq}
    this.mentioned = new Set();
    this.found = [];
    this.active = 0;
    this.timer = null;
    this.form.addEventListener("submit", (e) => (e.preventDefault(), this.submit()));
    this.text.addEventListener("keydown", (e) => this.key(e));
    this.text.addEventListener("input", () => this.typed());
    this.text.addEventListener("blur", () => this.hooks.typing(false));
    document.getElementById("context-cancel").addEventListener("click", () => this.cancel());
  }

  /// `sentence`: why the caller may not send (the composer closes), or null.
  setStanding(sentence) {
    this.standing.textContent = sentence || "";
    this.standing.hidden = !sentence;
    this.text.disabled = !!sentence;
    this.form.querySelector("button[type=submit]").disabled = !!sentence;
    if (sentence) this.cancel();
  }

  reply(seq, label) {
    this.mode = { reply: seq };
    this.showContext(`Replying to ${label}`, "Cancel the reply");
  }

  edit(seq, text) {
    this.mode = { edit: seq };
    this.text.value = text;
    this.grow();
    this.showContext("Editing your message", "Cancel the edit");
  }

  showContext(text, cancelLabel) {
    this.context.hidden = false;
    document.getElementById("context-text").textContent = text;
    document.getElementById("context-cancel").setAttribute("aria-label", cancelLabel);
    this.text.focus();
  }

  /// Ends a reply or edit in progress; false when there was none.
  cancel() {
    const had = !!this.mode;
    if (this.mode?.edit) this.text.value = "";
    this.mode = null;
    this.context.hidden = true;
    this.grow();
    return had;
  }

  reset() {
    this.cancel();
    this.text.value = "";
    this.mentioned.clear();
    this.showMentions([]);
    this.grow();
  }

  submit() {
    const text = this.text.value;
    if (!text.trim() || this.text.disabled) return;
    if (this.mode?.edit) {
      this.hooks.edit(this.mode.edit, text);
    } else {
      const mentions = [...this.mentioned].filter((u) => text.includes(`@${u}`));
      this.hooks.send(text, { reply_to: this.mode?.reply, mentions: mentions.length ? mentions : undefined });
    }
    this.hooks.typing(false);
    this.reset();
  }

  /// Fits the field to its lines (one line when empty or not laid out).
  grow() {
    this.text.style.height = "";
    if (!this.text.value || !this.text.scrollHeight) return;
    this.text.style.height = `${Math.min(this.text.scrollHeight + 2, MAX_HEIGHT_PX)}px`;
  }

  typed() {
    this.grow();
    this.hooks.typing(this.text.value.trim() !== "");
    clearTimeout(this.timer);
    const m = MENTION.exec(this.text.value.slice(0, this.text.selectionStart));
    if (!m) return this.showMentions([]);
    this.timer = setTimeout(async () => {
      const users = (await this.hooks.members(m[2]).catch(() => null)) || [];
      this.showMentions(users);
    }, MENTION_DELAY_MS);
  }

  showMentions(users) {
    this.found = users;
    this.active = 0;
    this.options.replaceChildren(
      ...users.map((u, i) =>
        el("li", {
          role: "option", id: `mention-${i}`, "aria-selected": String(i === 0), dataset: { user: u },
          onmousedown: (e) => (e.preventDefault(), this.mention(u)),
        }, `@${u}`),
      ),
    );
    this.options.hidden = !users.length;
    this.text.setAttribute("aria-expanded", String(!!users.length));
  }

  mention(user) {
    const caret = this.text.selectionStart;
    const before = this.text.value.slice(0, caret).replace(MENTION, (_, space) => `${space}@${user} `);
    this.text.value = before + this.text.value.slice(caret);
    this.text.selectionStart = this.text.selectionEnd = before.length;
    this.mentioned.add(user);
    this.showMentions([]);
    this.text.focus();
  }

  key(e) {
    const open = this.found.length > 0;
    if (open && (e.key === "ArrowDown" || e.key === "ArrowUp")) {
      this.active = (this.active + (e.key === "ArrowDown" ? 1 : this.found.length - 1)) % this.found.length;
      [...this.options.children].forEach((li, i) => li.setAttribute("aria-selected", String(i === this.active)));
    } else if (open && (e.key === "Enter" || e.key === "Tab")) {
      this.mention(this.found[this.active]);
    } else if (e.key === "Escape" && (open || this.mode)) {
      if (open) this.showMentions([]);
      else this.cancel();
    } else if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      this.submit();
    } else {
      return;
    }
    e.preventDefault();
    e.stopPropagation();
  }
}
