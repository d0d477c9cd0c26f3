//! Writes forwarded to their conversation's home node over the bus
//! (ARCHITECTURE §7): what crosses (`imcore.write.<node>`, a request answered
//! on the forwarding node's inbox), the forwarding node's table of writes
//! waiting for their answers, and the home node's side that writes them —
//! only the ops a client can send, in the forms the gateway checks.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use std::collections::HashSet;

use async_nats::Client;
use imcore_actors::ConvId;
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use super::node::NodeId;
use super::seal::{Refused, Seal};
use crate::domain::{
    check_text, Rejection, Role, ADMIN_BITS, MAX_ALIAS_CHARS, MAX_DURATION_MS, MAX_GROUP_NAME_CHARS, MAX_GROUP_SIZE,
    MAX_INVITE_USERS, MAX_MENTIONS,
};
use crate::metrics::metrics;
use crate::store::{GroupChange, ProfilePatch, WriteOp, Written};
use crate::writer::{WriteFailure, Writer};

/// `imcore.write.<node>`: the writes forwarded to that node.
pub(super) const WRITES: &str = "imcore.write";

/// A write on its way to its conversation's home node.
#[derive(Serialize, Deserialize)]
pub(super) struct Forward {
    pub(super) conv: ConvId,
    pub(super) op: WriteOp,
}

/// The home node's answer to a [`Forward`].
#[derive(Serialize, Deserialize)]
enum Answer {
    Written(Written),
    Rejected(Rejection),
    Overloaded,
    Failed(String),
}

impl From<Result<Written, WriteFailure>> for Answer {
    fn from(result: Result<Written, WriteFailure>) -> Self {
        match result {
            Ok(written) => Answer::Written(written),
            Err(WriteFailure::Rejected(r)) => Answer::Rejected(r),
            Err(WriteFailure::Overloaded) => Answer::Overloaded,
            Err(WriteFailure::Internal(cause)) => Answer::Failed(cause.to_string()),
        }
    }
}

impl From<Answer> for Result<Written, WriteFailure> {
    fn from(answer: Answer) -> Self {
        match answer {
            Answer::Written(written) => Ok(written),
            Answer::Rejected(r) => Err(WriteFailure::Rejected(r)),
            Answer::Overloaded => Err(WriteFailure::Overloaded),
            Answer::Failed(cause) => Err(WriteFailure::internal(format!("at the home node: {cause}"))),
        }
    }
}

/// Where a write goes.
pub enum Route {
    /// To its home node; the answer comes here.
    Forwarded(oneshot::Receiver<Forwarded>),
    Here(ConvId, WriteOp),
}

/// What became of a forwarded write.
pub enum Forwarded {
    /// The home node wrote it (or refused it).
    Answered(Result<Written, WriteFailure>),
    /// No node listens at the home (it died or left): nothing was written
    /// there; the op comes back to be written here.
    NotThere(ConvId, WriteOp),
    /// This node lost its bus connection with the write in flight: it may or
    /// may not have been written.
    Lost,
}

/// A forwarded write waiting for its answer.
struct Pending {
    reply: oneshot::Sender<Forwarded>,
    /// Kept for [`Forwarded::NotThere`].
    forward: Forward,
}

impl Pending {
    fn not_there(self) {
        let _ = self.reply.send(Forwarded::NotThere(self.forward.conv, self.forward.op));
    }
}

/// This node's forwarded writes waiting for their answers, by reply token.
pub(super) struct PendingWrites {
    /// Where the answers come (`<inbox>.<token>`).
    inbox: String,
    next_token: AtomicU64,
    by_token: Mutex<HashMap<u64, Pending>>,
}

impl PendingWrites {
    pub(super) fn new(inbox: String) -> Self {
        Self { inbox, next_token: AtomicU64::new(0), by_token: Mutex::new(HashMap::new()) }
    }

    /// The subject the answers come on.
    pub(super) fn answers(&self) -> String {
        format!("{}.*", self.inbox)
    }

    fn table(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Pending>> {
        self.by_token.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Publishes `forward` for `home`, its answer due to `reply`. Not kept for
    /// publishing again: a lost request is answered `Lost` (the caller's retry
    /// with the same key is safe), not repeated.
    pub(super) async fn publish(
        &self,
        client: &Client,
        seal: &Seal,
        home: NodeId,
        forward: Forward,
        reply: oneshot::Sender<Forwarded>,
    ) {
        let pending = Pending { reply, forward };
        let bytes = match serde_json::to_vec(&pending.forward) {
            Ok(b) => b,
            Err(e) => {
                tracing::error!(error = %e, "bus: a write that does not encode is written here");
                return pending.not_there();
            }
        };
        let token = self.next_token.fetch_add(1, Ordering::Relaxed);
        self.table().insert(token, pending);
        let (subject, reply) = (format!("{WRITES}.{}", home.as_str()), format!("{}.{token}", self.inbox));
        let sealed = seal.seal(&subject, Some(&reply), &bytes);
        if client.publish_with_reply(subject, reply, sealed).await.is_err() {
            // Never queued on the connection: nothing went out, so it is written here.
            let pending = self.table().remove(&token);
            if let Some(pending) = pending {
                pending.not_there();
            }
        }
    }

    fn take(&self, subject: &str) -> Option<Pending> {
        let token = subject.rsplit('.').next().and_then(|t| t.parse::<u64>().ok())?;
        self.table().remove(&token)
    }

    /// NATS answered the request on `subject` "no responders": no node
    /// listens at that home. (A status of the server, which cannot be
    /// signed; forged, it makes the write be written here too, under the
    /// row lock, which its key makes safe.)
    pub(super) fn not_there(&self, subject: &str) {
        if let Some(pending) = self.take(subject) {
            pending.not_there();
        }
    }

    /// Hands the home node's answer on `subject`, already opened, to its caller.
    pub(super) fn answered(&self, subject: &str, payload: &[u8]) {
        let Some(pending) = self.take(subject) else { return };
        let result = match serde_json::from_slice::<Answer>(payload) {
            Ok(answer) => answer.into(),
            Err(e) => {
                Refused::Malformed.count(subject);
                Err(WriteFailure::internal(format!("an answer that does not decode: {e}")))
            }
        };
        let _ = pending.reply.send(Forwarded::Answered(result));
    }

    /// Forgets the writes whose callers stopped waiting.
    pub(super) fn forget_abandoned(&self) {
        self.table().retain(|_, p| !p.reply.is_closed());
    }

    /// The connection they went out on dropped: every write in flight is `Lost`.
    pub(super) fn lose_all(&self) {
        for (_, pending) in self.table().drain() {
            let _ = pending.reply.send(Forwarded::Lost);
        }
    }
}

/// Writes what another node forwarded here (`payload`, opened) with
/// `writer`, and answers it on `reply_to`. Called in the order the requests
/// came: each op is queued before this returns. An op that does not decode
/// or that no client can send is not written: counted and answered `Failed`.
pub(super) fn serve(
    client: &Client,
    seal: &Arc<Seal>,
    writer: &Writer,
    max_body: usize,
    payload: &[u8],
    reply_to: String,
) {
    metrics().forwarded_writes.with_label_values(&["served"]).inc();
    let written = match serde_json::from_slice::<Forward>(payload) {
        Ok(f) => match client_op(&f.op, max_body) {
            Ok(()) => Ok(writer.write(f.conv, f.op)),
            Err(why) => {
                Refused::Op.count(&reply_to);
                tracing::warn!(why, "bus: a forwarded write no client can send, refused");
                Err(format!("refused at the home node: {why}"))
            }
        },
        Err(e) => {
            Refused::Malformed.count(&reply_to);
            Err(format!("the forwarded write does not decode: {e}"))
        }
    };
    let (client, seal) = (client.clone(), seal.clone());
    tokio::spawn(async move {
        let answer = match written {
            Ok(written) => Answer::from(written.await),
            Err(why) => Answer::Failed(why),
        };
        match serde_json::to_vec(&answer) {
            Ok(bytes) => {
                let sealed = seal.seal(&reply_to, None, &bytes);
                drop(client.publish(reply_to, sealed).await)
            }
            Err(e) => tracing::error!(error = %e, "bus: an answer that does not encode"),
        }
    });
}

/// Whether `op` is one the gateway makes from a client's request, in the
/// forms it checks: a send, an edit, a reaction, a recall, a group op; or
/// the operator's ban from the admin endpoint. Never a join or leave
/// "as such" (those skip every permission check: a new conversation's
/// members, written where it is created).
fn client_op(op: &WriteOp, max_body: usize) -> Result<(), &'static str> {
    match op {
        WriteOp::Join(_) | WriteOp::Leave(_) => Err("a join or leave without checks"),
        WriteOp::Send(send) if send.body.text().len() > max_body => Err("a body over the limit"),
        WriteOp::Send(send) if send.mentions.len() > MAX_MENTIONS => Err("too many mentions"),
        WriteOp::Send(send) if send.reply_to.is_some_and(|seq| seq < 1) => Err("a reply to no message"),
        WriteOp::Send(_) => Ok(()),
        WriteOp::Edit(edit) if edit.body.text().len() > max_body => Err("a body over the limit"),
        WriteOp::Edit(edit) if edit.target_seq < 1 => Err("an edit of no message"),
        WriteOp::Edit(_) => Ok(()),
        WriteOp::React(react) if react.target_seq < 1 => Err("a reaction to no message"),
        WriteOp::React(_) => Ok(()),
        WriteOp::Recall(recall) if recall.target_seq < 1 => Err("a recall of no message"),
        WriteOp::Recall(_) => Ok(()),
        WriteOp::Group(group) => group_change(&group.change),
        WriteOp::Ban(_) => Ok(()),
    }
}

/// The checks `gateway::group::parse_change` makes, on the parsed change.
fn group_change(change: &GroupChange) -> Result<(), &'static str> {
    let ok = match change {
        GroupChange::Invite(users) => {
            (1..=MAX_INVITE_USERS).contains(&users.len()) && users.iter().collect::<HashSet<_>>().len() == users.len()
        }
        GroupChange::SetRole { role, until, .. } => match role {
            Role::Admin => true,
            Role::Member => until.is_none(),
            Role::Owner => false,
        },
        GroupChange::SetPerms { extra_perms, .. } => extra_perms & !ADMIN_BITS == 0,
        GroupChange::SetAlias(Some(alias)) => !alias.is_empty() && check_text("alias", alias, MAX_ALIAS_CHARS).is_ok(),
        GroupChange::Update(patch) => profile_patch(patch),
        GroupChange::Join
        | GroupChange::Approve(_)
        | GroupChange::Reject(_)
        | GroupChange::Leave
        | GroupChange::Kick(_)
        | GroupChange::Mute { .. }
        | GroupChange::SetAlias(None)
        | GroupChange::TransferOwner(_)
        | GroupChange::Dismiss => true,
    };
    ok.then_some(()).ok_or("a group op out of its form")
}

fn profile_patch(p: &ProfilePatch) -> bool {
    let name = p.name.as_deref().map_or(true, |n| check_text("name", n, MAX_GROUP_NAME_CHARS).is_ok());
    let members = p.max_member.map_or(true, |m| (1..=MAX_GROUP_SIZE).contains(&i64::from(m)));
    let window = p.recall_window_ms.map_or(true, |ms| (0..=MAX_DURATION_MS).contains(&ms));
    let retention = p.retention_ms.map_or(true, |ms| ms.map_or(true, |ms| (1..=MAX_DURATION_MS).contains(&ms)));
    !p.is_empty() && name && members && window && retention
}
