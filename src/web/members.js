// A group's members pane: the roster (paged, searched), what the caller's
// role allows over each member (PROTOCOL §5 role rules; the server decides,
// this only hides buttons that would be refused), inviting with the people
// picker, and leaving. Each failure is said in the pane, next to its cause.

import { el } from "./view.js";
import { Picker } from "./people.js";
import { sentence } from "./words.js";

const SEARCH_DELAY_MS = 250;
const MUTE_FOR_MS = 60 * 60 * 1000;
const $ = (id) => document.getElementById(id);

export class MembersPane {
  /// `app`: {chat, me, current() → conv_id, standing() → the caller's standing, left()}.
  constructor(app) {
    this.app = app;
    this.members = [];
    this.next = null;
    this.invite = new Picker($("invite-picker"), (prefix) => app.chat.searchUsers(prefix));
    let searchTimer = null;
    $("member-q").addEventListener("input", () => {
      clearTimeout(searchTimer);
      searchTimer = setTimeout(() => this.load(false), SEARCH_DELAY_MS);
    });
    $("member-search").addEventListener("submit", (e) => (e.preventDefault(), this.load(false)));
    $("members-more").addEventListener("click", () => this.load(true));
    $("invite").addEventListener("submit", (e) => (e.preventDefault(), this.inviteChosen()));
    $("leave").addEventListener("click", () => this.leave());
    $("members-close").addEventListener("click", () => this.show(false));
  }

  get open() {
    return !$("members-pane").hidden;
  }

  show(visible) {
    $("members-pane").hidden = !visible;
    $("chat").classList.toggle("in-members", visible);
    $("members-toggle").setAttribute("aria-expanded", String(visible));
    $("members-error").textContent = "";
    if (visible) {
      this.controls();
      this.load(false);
      $("members-close").focus();
    } else if ($("conv-pane").hidden === false) {
      $("members-toggle").focus();
    }
  }

  problem(e) {
    $("members-error").textContent = sentence(e);
  }

  async load(more) {
    const conv_id = this.app.current();
    const q = $("member-q").value.trim();
    try {
      const page = await this.app.chat.members(conv_id, { after: more ? this.next : undefined, q });
      if (conv_id !== this.app.current()) return;
      this.members = more ? this.members.concat(page.members) : page.members;
      this.next = page.next;
      $("member-count").textContent = `(${page.member_count})`;
      this.render();
    } catch (e) {
      this.problem(e);
      this.controls();
    }
  }

  /// Invite and Leave, shown only to a current member (Leave: not the owner).
  controls() {
    const standing = this.app.standing();
    const member = !standing.left && !standing.dismissed;
    $("invite").hidden = !member;
    $("leave").hidden = !member || standing.role === "owner";
  }

  /// What the caller may do to `member`.
  allowed(member, standing) {
    const role = standing.left || standing.dismissed ? null : standing.role;
    const other = member.user_id !== this.app.me.user_id && member.role !== "owner";
    const over = role === "owner" || (role === "admin" && member.role === "member");
    return { kick: other && over, role: other && role === "owner", mute: other && over };
  }

  render() {
    const standing = this.app.standing();
    const groupOp = (op, fields) =>
      this.app.chat
        .groupOp(op, { conv_id: this.app.current(), ...fields })
        .then(() => this.load(false), (e) => this.problem(e));
    const muted = (m) => m.mute_until && new Date(m.mute_until) > new Date();
    const items = this.members.map((m) => {
      const may = this.allowed(m, standing);
      const button = (label, onclick) =>
        el("button", { type: "button", "aria-label": `${label}: ${m.user_id}`, onclick }, label);
      const muteUntil = muted(m) ? null : new Date(Date.now() + MUTE_FOR_MS).toISOString();
      const build = () => el(
        "li",
        { dataset: { user: m.user_id } },
        // The alias in <bdi>: a bidi control in it cannot reorder the id beside it.
        el("span", { class: "who" }, m.alias ? [el("bdi", {}, m.alias), ` (${m.user_id})`] : m.user_id),
        el("span", { class: "role" }, m.role),
        muted(m) && el("span", { class: "muted" }, "muted"),
        may.role && button(m.role === "admin" ? "Make member" : "Make admin", () =>
          groupOp("set_role", { user_id: m.user_id, role: m.role === "admin" ? "member" : "admin" })),
        may.mute && button(muted(m) ? "Unmute" : "Mute 1 h", () =>
          groupOp("mute_member", { user_id: m.user_id, mute_until: muteUntil })),
        may.kick && button("Remove", () => groupOp("kick", { user_id: m.user_id })),
      );
      return { key: `m:${m.user_id}`, sig: JSON.stringify([m, may, muted(m)]), build };
    });
    this.app.reconcile($("members"), items);
    $("members-more").hidden = !this.next;
    this.controls();
  }

  async inviteChosen() {
    const user_ids = await this.invite.resolve();
    if (!user_ids) return;
    try {
      const reply = await this.app.chat.groupOp("invite", { conv_id: this.app.current(), user_ids });
      this.invite.clear();
      if (reply.pending?.length) this.invite.error(`Waiting for an admin to approve: ${reply.pending.join(", ")}.`);
      this.load(false);
    } catch (e) {
      this.invite.error(sentence(e));
    }
  }

  async leave() {
    try {
      await this.app.chat.groupOp("leave", { conv_id: this.app.current() });
      this.show(false);
      this.app.left();
    } catch (e) {
      this.problem(e);
    }
  }
}
