//! How many actors a hub keeps (ARCHITECTURE §3, idle eviction), against the
//! in-memory store: an actor whose batches appended nothing retires at once,
//! and at the cap on live actors a new one evicts the idlest idle actor, or is
//! refused `Overloaded` when none is idle.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use imcore_actors::testing::{Appended, MemoryStore, RecordingFanout, SendOp};
use imcore_actors::{ActorConfig, ClientMsgId, ConvId, Hub, HubConfig, UserId, WriteError};

type TestHub = Hub<MemoryStore, RecordingFanout<Appended>>;

fn conv(name: &str) -> ConvId {
    ConvId::parse(name).unwrap()
}

fn op(key: &str) -> SendOp {
    SendOp { sender: UserId::parse("u1").unwrap(), key: ClientMsgId::parse(key).unwrap(), payload: key.into() }
}

/// One arbiter; idle actors stay for a minute unless evicted.
fn hub(store: &MemoryStore, max_actors: usize) -> Arc<TestHub> {
    let actor = ActorConfig { idle_timeout: Duration::from_secs(60), ..ActorConfig::default() };
    let config = HubConfig { arbiters: 1, max_actors, actor };
    Hub::new(Arc::new(store.clone()), Arc::new(RecordingFanout::default()), config)
}

/// An actor retires on its own thread after it has answered: polls `what`
/// until it holds, for at most 2 s.
async fn eventually(what: &str, holds: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(2);
    while !holds() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

async fn seq(hub: &TestHub, c: &ConvId, key: &str) -> u64 {
    hub.submit(c.clone(), op(key)).await.unwrap().seq
}

#[actix::test]
async fn an_actor_whose_batches_appended_nothing_retires_at_once_and_one_that_appended_stays() {
    let store = MemoryStore::new();
    let hub = hub(&store, 100);
    let (real, missing) = (conv("c-real"), conv("c-missing"));
    store.set_missing(&missing);

    assert_eq!(seq(&hub, &real, "k1").await, 1);
    let refused = hub.submit(missing.clone(), op("k1")).await.unwrap();
    assert!(refused.refused);
    eventually("the refused conversation's actor is gone", || hub.live_actors() == 1).await;

    assert_eq!(seq(&hub, &real, "k2").await, 2);
    assert_eq!(hub.actors_started(), 2, "the conversation that appended kept its actor");

    // Back-to-back ops to a conversation that does not exist: each answered,
    // however many actors it takes, and none left behind.
    let pending: Vec<_> = (0..20).map(|i| hub.enqueue(missing.clone(), op(&format!("m{i}")))).collect();
    for p in pending {
        assert!(p.await.unwrap().refused);
    }
    eventually("no actor is left for the refused conversation", || hub.live_actors() == 1).await;
}

#[actix::test]
async fn at_the_cap_a_new_actor_evicts_the_idlest_idle_one() {
    let store = MemoryStore::new();
    let hub = hub(&store, 2);
    let (a, b, c) = (conv("c-a"), conv("c-b"), conv("c-c"));
    assert_eq!(seq(&hub, &a, "k1").await, 1);
    assert_eq!(seq(&hub, &b, "k1").await, 1);
    eventually("a and b are listed idle", || hub.idle_actors() == 2).await;

    // c over the cap: a, idle the longest, is asked to retire.
    assert_eq!(seq(&hub, &c, "k1").await, 1);
    assert_eq!(hub.evictions(), 1);
    eventually("a is gone", || hub.live_actors() == 2).await;

    // b is busy again, so c becomes the idlest; a's return evicts c, not b.
    assert_eq!(seq(&hub, &b, "k2").await, 2);
    assert_eq!(hub.actors_started(), 3, "b kept its actor");
    eventually("b and c are listed idle", || hub.idle_actors() == 2).await;
    assert_eq!(seq(&hub, &a, "k2").await, 2, "a's new actor continues its log");
    assert_eq!(hub.actors_started(), 4);
    eventually("c is gone", || hub.live_actors() == 2).await;
    assert_eq!(seq(&hub, &b, "k3").await, 3);
    assert_eq!(hub.actors_started(), 4, "b still has its actor");
}

#[actix::test]
async fn at_the_cap_with_no_idle_actor_a_new_conversation_is_refused_overloaded() {
    let store = MemoryStore::new();
    store.set_latency(Duration::from_millis(50));
    let hub = hub(&store, 1);
    let (a, b) = (conv("c-a"), conv("c-b"));

    let busy = hub.enqueue(a.clone(), op("k1"));
    let refused = hub.submit(b.clone(), op("k1")).await;
    assert!(matches!(refused, Err(WriteError::Overloaded)), "{refused:?}");
    assert_eq!(hub.actors_started(), 1);

    assert_eq!(busy.await.unwrap().seq, 1);
    eventually("a is listed idle", || hub.idle_actors() == 1).await;
    assert_eq!(seq(&hub, &b, "k1").await, 1, "once a is idle, b evicts it");
    eventually("a is gone", || hub.live_actors() == 1).await;
    assert!(store.log(&b).len() == 1 && store.log(&a).len() == 1);
}
