//! The stranger gate: a write op (send, recall, group op) goes on to its
//! conversation's writer only for a user who has ever been a member of it,
//! or as a `join` of a group open to joins; anyone else gets `NOT_MEMBER`
//! here, from one probe that costs the same whether the conversation exists
//! or not (`store::access`), so timing tells a stranger nothing
//! (ARCHITECTURE §3 "Strangers never reach an actor"). The writer's own
//! checks under the row lock stay the rule; the gate only turns strangers away.
//!
//! Pairs found to have been members are remembered, bounded: having been a
//! member never stops being true, so nothing remembered goes stale, and no
//! refusal is remembered. A user's ops to a conversation that arrive while
//! its check runs wait behind it and go on in arrival order (P6).

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::hash::{Hash, Hasher};
use std::sync::{Mutex, PoisonError};

use imcore_actors::{ConvId, UserId};
use tokio::sync::oneshot;

use crate::domain::Rejection;
use crate::store::{Access, GroupChange, GroupOp, WriteOp, Written};
use crate::writer::WriteFailure;

const SHARDS: usize = 16;

type Key = (ConvId, UserId);
type Answer = Result<Written, WriteFailure>;

/// What [`Gate::enter`] did with an op.
pub enum Entry {
    /// The pair is known: write it now.
    Go(WriteOp),
    /// Queued behind the pair's check, which the caller must now run
    /// ([`Gate::settle`]) when `check` is true; the answer comes on the receiver.
    Wait { check: bool, answer: oneshot::Receiver<Answer> },
}

/// Bounded per node: `generation` pairs per shard and generation (two
/// generations: a pair used again is moved to the new one, the old one is
/// dropped whole when the new one fills).
pub struct Gate {
    shards: Box<[Mutex<Shard>]>,
    generation: usize,
}

#[derive(Default)]
struct Shard {
    recent: HashSet<Key>,
    older: HashSet<Key>,
    /// Pairs whose check runs, and the ops waiting for it, in arrival order.
    checking: HashMap<Key, VecDeque<(WriteOp, oneshot::Sender<Answer>)>>,
}

impl Shard {
    fn knows(&mut self, key: &Key, generation: usize) -> bool {
        if self.recent.contains(key) {
            return true;
        }
        let Some(key) = self.older.take(key) else { return false };
        self.remember(key, generation);
        true
    }

    fn remember(&mut self, key: Key, generation: usize) {
        if self.recent.len() >= generation {
            self.older = std::mem::take(&mut self.recent);
        }
        self.recent.insert(key);
    }
}

fn is_join(op: &WriteOp) -> bool {
    matches!(op, WriteOp::Group(GroupOp { change: GroupChange::Join, .. }))
}

impl Gate {
    /// Remembers about `pairs` (conversation, user) pairs.
    pub fn new(pairs: usize) -> Self {
        let generation = (pairs / SHARDS / 2).max(1);
        Self { shards: (0..SHARDS).map(|_| Mutex::default()).collect(), generation }
    }

    fn shard(&self, key: &Key) -> std::sync::MutexGuard<'_, Shard> {
        let mut h = DefaultHasher::new();
        key.hash(&mut h);
        self.shards[h.finish() as usize % SHARDS].lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Lets `op` of `user` to `conv` through, or queues it behind the pair's
    /// check (a pair with a check running queues even if known meanwhile, so
    /// ops keep their order).
    pub fn enter(&self, conv: &ConvId, user: &UserId, op: WriteOp) -> Entry {
        let key = (conv.clone(), user.clone());
        let mut shard = self.shard(&key);
        if !shard.checking.contains_key(&key) && shard.knows(&key, self.generation) {
            return Entry::Go(op);
        }
        let (tx, answer) = oneshot::channel();
        let waiting = shard.checking.entry(key).or_default();
        waiting.push_back((op, tx));
        Entry::Wait { check: waiting.len() == 1, answer }
    }

    /// Runs the pair's check (`access(join)`, join: whether the first op
    /// waiting is a `join`) until every op waiting is let through `write`,
    /// in order, or refused. An op goes on when the user was ever a member,
    /// or is a `join` of a joinable group, or follows one that went on (the
    /// writer judges it behind that one). A `join` behind refused ops of a
    /// check that did not ask about joins is checked again.
    pub async fn settle<A, F, W>(&self, conv: &ConvId, user: &UserId, access: A, write: W)
    where
        A: Fn(bool) -> F,
        F: Future<Output = Result<Access, WriteFailure>>,
        W: Fn(ConvId, WriteOp, oneshot::Sender<Answer>),
    {
        let key = (conv.clone(), user.clone());
        loop {
            let join = self.shard(&key).checking.get(&key).and_then(|w| w.front()).is_some_and(|(op, _)| is_join(op));
            let found = access(join).await;
            let mut shard = self.shard(&key);
            let Some(mut waiting) = shard.checking.remove(&key) else { return };
            let access = match found {
                Ok(access) => access,
                Err(e) => {
                    for (_, tx) in waiting {
                        let _ = tx.send(Err(e.clone()));
                    }
                    return;
                }
            };
            if access.ever_member {
                shard.remember(key.clone(), self.generation);
            }
            let mut through = access.ever_member;
            while let Some((op, tx)) = waiting.pop_front() {
                through = through || (access.joinable && is_join(&op));
                if through {
                    write(conv.clone(), op, tx);
                } else if is_join(&op) && !join {
                    waiting.push_front((op, tx));
                    break;
                } else {
                    let _ = tx.send(Err(Rejection::NotMember.into()));
                }
            }
            if waiting.is_empty() {
                return;
            }
            shard.checking.insert(key.clone(), waiting);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::cell::RefCell;

    use imcore_actors::{ClientMsgId, DeviceId};
    use serde_json::json;

    use super::*;
    use crate::domain::Body;
    use crate::store::SendOp;

    fn send(key: &str) -> WriteOp {
        WriteOp::Send(SendOp {
            sender: UserId::parse("u").unwrap(),
            device: DeviceId::parse("d").unwrap(),
            client_msg_id: ClientMsgId::parse(key).unwrap(),
            body: Body::parse(&json!({"type": "text", "text": "hi"}), 1024).unwrap(),
            reply_to: None,
            mentions: vec![],
        })
    }

    fn join() -> WriteOp {
        WriteOp::Group(GroupOp { actor: UserId::parse("u").unwrap(), change: GroupChange::Join })
    }

    fn key(op: &WriteOp) -> String {
        match op {
            WriteOp::Send(s) => s.client_msg_id.as_str().to_owned(),
            _ => "join".into(),
        }
    }

    /// Enters `ops`, settles with `found`, returns the ops written in order
    /// and the answers of those refused.
    async fn run(gate: &Gate, ops: Vec<WriteOp>, found: impl Fn(bool) -> Access) -> (Vec<String>, Vec<String>) {
        let (conv, user) = (ConvId::parse("c").unwrap(), UserId::parse("u").unwrap());
        let mut answers = vec![];
        let mut checks = 0;
        for op in ops {
            match gate.enter(&conv, &user, op) {
                Entry::Go(op) => answers.push(Err(key(&op))),
                Entry::Wait { check, answer } => {
                    checks += usize::from(check);
                    answers.push(Ok(answer));
                }
            }
        }
        let written = RefCell::new(vec![]);
        if checks == 1 {
            let access = |join| std::future::ready(Ok(found(join)));
            gate.settle(&conv, &user, access, |_, op, _| written.borrow_mut().push(key(&op))).await;
        }
        let mut refused = vec![];
        for a in answers {
            match a {
                Err(went) => written.borrow_mut().push(went),
                Ok(rx) => {
                    if let Ok(Err(e)) = rx.await {
                        refused.push(e.to_string());
                    }
                }
            }
        }
        (written.into_inner(), refused)
    }

    #[actix::test]
    async fn a_member_is_checked_once_and_its_ops_keep_their_order() {
        let gate = Gate::new(64);
        let member = |_| Access { ever_member: true, joinable: false };
        let (written, refused) = run(&gate, vec![send("1"), send("2"), send("3")], member).await;
        assert_eq!((written, refused.len()), (vec!["1".to_owned(), "2".into(), "3".into()], 0));
        let never = |_| panic!("a known pair is not checked again");
        assert_eq!(run(&gate, vec![send("4")], never).await.0, vec!["4".to_owned()]);
    }

    #[actix::test]
    async fn a_stranger_is_refused_every_time_and_never_remembered() {
        let gate = Gate::new(64);
        let stranger = |_| Access { ever_member: false, joinable: false };
        for _ in 0..2 {
            let (written, refused) = run(&gate, vec![send("1"), join()], stranger).await;
            assert!(written.is_empty());
            assert_eq!(refused.len(), 2);
        }
    }

    #[actix::test]
    async fn a_join_of_an_open_group_lets_the_ops_behind_it_through() {
        let gate = Gate::new(64);
        let open = |join| Access { ever_member: false, joinable: join };
        let (written, refused) = run(&gate, vec![send("1"), join(), send("2")], open).await;
        assert_eq!(written, vec!["join".to_owned(), "2".into()]);
        assert_eq!(refused.len(), 1, "the send before the join");
    }

    #[test]
    fn the_cache_is_bounded_and_keeps_what_is_used() {
        let gate = Gate::new(2 * SHARDS * 2);
        let mut shard = Shard::default();
        let k = |i: usize| (ConvId::parse(&format!("c{i}")).unwrap(), UserId::parse("u").unwrap());
        for i in 0..100 {
            shard.remember(k(i), gate.generation);
            assert!(shard.knows(&k(0), gate.generation), "used at every step, kept");
            assert!(shard.recent.len() + shard.older.len() <= 2 * gate.generation);
        }
        assert!(!shard.knows(&k(50), gate.generation));
    }
}
