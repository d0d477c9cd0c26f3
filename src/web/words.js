// What the page says to a person: each PROTOCOL §2 error code as a sentence
// (never the server's raw text), and one's own standing in a conversation.

import { time } from "./view.js";

const SENTENCES = {
  BAD_REQUEST: "That was not accepted. Check what you typed.",
  UNAUTHORIZED: "This device is signed out. Sign in again.",
  FORBIDDEN: "Your role in this group does not allow that.",
  NOT_MEMBER: "You are not a member of this conversation.",
  MUTED: "You are muted here, so you cannot send or react.",
  BLOCKED: "This person does not accept messages from you.",
  CONV_DISMISSED: "This group was dismissed: nothing more can be sent.",
  CONV_BANNED: "This group was banned by the operator: nothing can be sent for now.",
  ALREADY_MEMBER: "They are already a member.",
  GROUP_FULL: "The group is full.",
  IDEMPOTENCY_MISMATCH: "This message clashes with an earlier one. Discard it and write it again.",
  IDEMPOTENCY_KEY_EXPIRED: "This message is too old to send again. Discard it and write it again.",
  RECALL_WINDOW_EXPIRED: "It is too late to recall this message.",
  EDIT_WINDOW_EXPIRED: "It is too late to edit this message.",
  TOO_MANY_REACTIONS: "This message has as many different reactions as it can take.",
  EPOCH_CHANGED: "This conversation was restored; it is being reloaded.",
  NOT_FOUND: "That could not be found.",
  PAYLOAD_TOO_LARGE: "That is too long. Shorten it and try again.",
  REQUEST_TIMEOUT: "That took too long to arrive. Try again.",
  ALREADY_EXISTS: "That id is taken.",
  TOO_MANY_CONNECTIONS: "Too many of your devices are connected right now.",
  OVERLOADED: "The server is busy. It will be tried again.",
  INTERNAL: "Something went wrong on the server. Try again.",
  DISCONNECTED: "Not connected. It will be sent when the connection is back.",
};

/// The sentence for a failed request (`RequestError` or any error). A
/// NOT_FOUND naming user ids ("users ben, zoe not found") says which.
export function sentence(error) {
  const code = error?.code;
  const users = code === "NOT_FOUND" && /^users? (.+) not found$/.exec(error.message || "");
  if (users) return `No user with the id ${users[1].split(", ").join(", ")}. Pick people from the list.`;
  return SENTENCES[code] || "That did not work. Try again.";
}

/// Why the composer is closed, as a sentence; null while the caller may send.
export function standingSentence(standing, me, now = Date.now()) {
  if (!standing) return null;
  const who = (user) => (user === me ? "you" : user);
  if (standing.dismissed) return "This group was dismissed.";
  if (standing.left === "kicked") return `You were removed by ${who(standing.by)}.`;
  if (standing.left === "left") return "You left this group.";
  if (standing.left) return "You are no longer a member.";
  if (standing.muteUntil > now) return `You're muted until ${time(new Date(standing.muteUntil).toISOString())}.`;
  if (standing.muteAll && standing.role === "member") return "Only admins can send in this group right now.";
  return null;
}
