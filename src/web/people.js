// The people picker: a field whose suggestions come from `search_users`
// (PROTOCOL v1.2: people sharing a conversation by prefix, anyone by exact
// id, any case), chosen with the arrow keys and Enter or a click, kept as
// removable chips. Ids typed or pasted without choosing are looked up
// before use, and each one that finds nobody is named next to the field.

import { el } from "./view.js";

const ID_FORM = /^[A-Za-z0-9._:@-]{1,64}$/;
const SEARCH_DELAY_MS = 150;
const SUGGESTIONS = 8;

export class Picker {
  /// `root`: an element holding `input`, `ul.options`, `ul.chips` and
  /// `p.field-error`; `search(prefix)` → [{user_id, display_name}];
  /// `single`: one person at most.
  constructor(root, search, { single = false } = {}) {
    this.root = root;
    this.search = search;
    this.single = single;
    this.input = root.querySelector("input");
    this.options = root.querySelector(".options");
    this.chips = root.querySelector(".chips");
    this.note = root.querySelector(".field-error");
    this.chosen = [];
    this.found = [];
    this.active = -1;
    this.timer = null;
    this.input.addEventListener("input", () => this.typed());
    this.input.addEventListener("keydown", (e) => this.key(e));
    this.input.addEventListener("blur", () => setTimeout(() => this.show([]), 200));
  }

  ids() {
    return this.chosen.slice();
  }

  error(text) {
    this.note.textContent = text || "";
    this.input.setAttribute("aria-invalid", text ? "true" : "false");
  }

  clear() {
    this.chosen = [];
    this.input.value = "";
    this.error("");
    this.show([]);
    this.drawChips();
  }

  /// The ids typed so far (commas or spaces between them); the last one is
  /// being typed and gets the suggestions.
  tokens() {
    return this.input.value.split(/[\s,]+/);
  }

  typed() {
    clearTimeout(this.timer);
    this.error("");
    const tokens = this.tokens();
    const last = tokens.at(-1);
    if (tokens.some((t) => t && !ID_FORM.test(t))) {
      this.show([]);
      return this.error("User ids use only letters, digits and . _ : @ - (up to 64).");
    }
    if (!last) return this.show([]);
    this.timer = setTimeout(async () => {
      const users = await this.search(last).catch(() => []);
      if (this.tokens().at(-1) === last) this.show(users.filter((u) => !this.chosen.includes(u.user_id)));
    }, SEARCH_DELAY_MS);
  }

  show(users) {
    this.found = users.slice(0, SUGGESTIONS);
    this.active = this.found.length ? 0 : -1;
    this.options.replaceChildren(
      ...this.found.map((u, i) =>
        el("li", {
          role: "option", id: `${this.options.id}-${i}`, dataset: { user: u.user_id },
          onmousedown: (e) => (e.preventDefault(), this.pick(u.user_id)),
        },
          u.user_id, u.display_name && el("span", { class: "display-name" }, ` · ${u.display_name}`)),
      ),
    );
    this.options.hidden = !this.found.length;
    this.input.setAttribute("aria-expanded", String(!this.options.hidden));
    this.highlight();
  }

  highlight() {
    [...this.options.children].forEach((li, i) => li.setAttribute("aria-selected", String(i === this.active)));
    if (this.active >= 0) this.input.setAttribute("aria-activedescendant", `${this.options.id}-${this.active}`);
    else this.input.removeAttribute("aria-activedescendant");
  }

  key(e) {
    const open = !this.options.hidden && this.found.length;
    if (e.key === "ArrowDown" && open) this.active = (this.active + 1) % this.found.length;
    else if (e.key === "ArrowUp" && open) this.active = (this.active + this.found.length - 1) % this.found.length;
    else if (e.key === "Enter" && open && this.active >= 0) this.pick(this.found[this.active].user_id);
    else if (e.key === "Escape" && open) this.show([]);
    else if (e.key === "Backspace" && !this.input.value && this.chosen.length) return this.unpick(this.chosen.at(-1));
    else return;
    e.preventDefault();
    e.stopPropagation();
    this.highlight();
  }

  /// Chooses `user_id` in place of the id being typed.
  pick(user_id) {
    this.chosen = this.single ? [user_id] : [...new Set([...this.chosen, user_id])];
    const before = this.tokens().slice(0, -1).filter(Boolean);
    this.input.value = before.length ? `${before.join(", ")}, ` : "";
    this.error("");
    this.show([]);
    this.drawChips();
    this.input.focus();
  }

  unpick(user_id) {
    this.chosen = this.chosen.filter((u) => u !== user_id);
    this.drawChips();
    this.input.focus();
  }

  drawChips() {
    this.chips.replaceChildren(
      ...this.chosen.map((u) =>
        el("li", { dataset: { user: u } }, u,
          el("button", { type: "button", "aria-label": `Remove ${u}`, onclick: () => this.unpick(u) }, "×")),
      ),
    );
  }

  /// Chooses what is still typed in the field (ids separated by commas or
  /// spaces) when each is exactly someone's id; names each that is not.
  /// Resolves with the chosen ids, or null after showing what failed.
  async resolve() {
    const typed = this.input.value.split(/[\s,]+/).filter(Boolean);
    const missing = [];
    for (const id of typed) {
      const found = ID_FORM.test(id) ? await this.search(id).catch(() => []) : [];
      const match = found.find((u) => u.user_id.toLowerCase() === id.toLowerCase());
      if (match) this.chosen = this.single ? [match.user_id] : [...new Set([...this.chosen, match.user_id])];
      else missing.push(id);
    }
    this.input.value = missing.join(", ");
    this.drawChips();
    if (missing.length) {
      this.error(`No one found with the id ${missing.map((m) => `“${m}”`).join(", ")}.`);
      return null;
    }
    if (!this.chosen.length) {
      this.error(this.single ? "Choose a person." : "Choose at least one person.");
      return null;
    }
    return this.ids();
  }
}
