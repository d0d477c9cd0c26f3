// Building DOM nodes. Every string from the server or a person becomes a
// text node (textContent), never markup: a message body of HTML or script
// shows as the characters it is.

/// `el("li", {class: "x", dataset: {seq: 3}, onclick: f}, "text", childNode, …)`.
export function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attributes)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "dataset") Object.assign(node.dataset, value);
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key === "class") node.className = value;
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

/// Makes `list`'s children the `items` (`{key, sig, build}`), in order,
/// rebuilding only an item that is new or whose `sig` changed: the rest stay
/// the same nodes, so focus and a press in progress survive a redraw.
export function reconcile(list, items) {
  const old = new Map([...list.children].map((node) => [node.dataset.key, node]));
  const wanted = new Set(items.map((item) => item.key));
  for (const [key, node] of old) if (!wanted.has(key)) node.remove();
  let at = list.firstElementChild;
  for (const { key, sig, build } of items) {
    let node = old.get(key);
    if (!node || node.dataset.sig !== sig) {
      const fresh = build();
      fresh.dataset.key = key;
      fresh.dataset.sig = sig;
      if (node === at) at = fresh;
      node?.replaceWith(fresh);
      node = fresh;
    }
    if (node === at) at = at.nextElementSibling;
    else list.insertBefore(node, at);
  }
}

/// The text a message body shows: its `text` for the usual form, the JSON otherwise.
export function bodyText(body) {
  if (body && body.type === "text" && typeof body.text === "string") return body.text;
  return JSON.stringify(body);
}

export function time(iso) {
  if (!iso) return "";
  const t = new Date(iso);
  return Number.isNaN(t.getTime()) ? "" : t.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
}

/// One line for a non-message event, or for an inbox preview.
export function describe(event, me) {
  const who = (user) => (user === me ? "you" : user);
  switch (event.kind) {
    case "msg":
      return event.recalled ? "Message recalled" : bodyText(event.body);
    case "recall":
      return `${who(event.sender?.user_id)} recalled a message`;
    case "join":
      return event.actor && event.actor !== event.subject_user
        ? `${who(event.actor)} added ${who(event.subject_user)}`
        : `${who(event.subject_user)} joined`;
    case "leave":
      if (event.reason === "kicked") return `${who(event.actor)} removed ${who(event.subject_user)}`;
      if (event.reason === "dismissed") return `${who(event.subject_user)} left: the group was dismissed`;
      return `${who(event.subject_user)} left`;
    case "group":
      return describeChange(event, who);
    default:
      return event.kind;
  }
}

function describeChange(event, who) {
  const c = event.change || {};
  const by = who(event.actor);
  if (c.role) return `${by} made ${who(c.role.user_id)} ${c.role.role}`;
  if (c.mute) return c.mute.mute_until ? `${by} muted ${who(c.mute.user_id)}` : `${by} unmuted ${who(c.mute.user_id)}`;
  if (c.owner) return `${who(c.owner.to)} is now the owner`;
  if (c.alias) return `${who(c.alias.user_id)} is now called ${c.alias.alias}`;
  if (c.status === "dismissed") return `${by} dismissed the group`;
  if (c.status === "banned") return "The group was banned by the operator";
  if (c.status === "active") return "The operator lifted the group's ban";
  if (c.profile) return `${by} changed ${Object.keys(c.profile).join(", ")}`;
  if (c.perms) return `${by} changed the permissions of ${who(c.perms.user_id)}`;
  return `${by} changed the group`;
}

/// A conversation's title: a group's name, a direct chat's other member.
export function title(conversation, peer) {
  if (conversation.kind === "group") return conversation.name || conversation.conv_id;
  return peer || "Direct chat";
}
