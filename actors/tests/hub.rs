//! Fast actor tests against the in-memory store. Real threads:
//! actors run on their own arbiters, submitters on the test's thread and on
//! extra OS threads.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashSet;
use std::error::Error;
use std::sync::Arc;
use std::time::{Duration, Instant};

use imcore_actors::testing::{Appended, MemoryStore, RecordingFanout, SendOp, SendOutcome};
use imcore_actors::{ActorConfig, ClientMsgId, ConvId, Hub, HubConfig, UserId, WriteError};

type TestHub = Hub<MemoryStore, RecordingFanout<Appended>>;

fn conv(name: &str) -> ConvId {
    ConvId::parse(name).unwrap()
}

fn op(sender: &str, key: &str) -> SendOp {
    SendOp {
        sender: UserId::parse(sender).unwrap(),
        key: ClientMsgId::parse(key).unwrap(),
        payload: format!("body of {key}"),
    }
}

fn hub(store: &MemoryStore, arbiters: usize, actor: ActorConfig) -> (Arc<TestHub>, Arc<RecordingFanout<Appended>>) {
    let fanout = Arc::new(RecordingFanout::default());
    let hub =
        Hub::new(Arc::new(store.clone()), Arc::clone(&fanout), HubConfig { arbiters, actor, ..HubConfig::default() });
    (hub, fanout)
}

/// Gapless seqs 1..=n, one event per key, and every `expected` key present.
fn assert_gapless_with_keys(store: &MemoryStore, c: &ConvId, expected: &HashSet<String>) {
    let log = store.log(c);
    for (i, e) in log.iter().enumerate() {
        assert_eq!(e.seq, i as u64 + 1, "seqs are gapless and in order");
    }
    let keys: HashSet<String> = log.iter().map(|e| e.key.to_string()).collect();
    assert_eq!(keys.len(), log.len(), "one event per request key");
    assert_eq!(&keys, expected, "exactly the acknowledged ops are in the log");
}

/// `error: cause: cause…`, as the edge logs it.
fn chain(e: &dyn Error) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(cause) = next {
        out.push_str(": ");
        out.push_str(&cause.to_string());
        next = cause.source();
    }
    out
}

/// Replies go out before fan-out, so a test that has its reply may
/// look at the fan-out a moment too early.
async fn deliveries_once(fanout: &RecordingFanout<Appended>, events: usize) -> Vec<(ConvId, Appended)> {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let d = fanout.deliveries();
        if d.iter().map(|(_, a)| a.events.len()).sum::<usize>() >= events || Instant::now() > deadline {
            return d;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[actix::test]
async fn ops_of_one_submitter_issued_without_waiting_get_seqs_in_issue_order() {
    let store = MemoryStore::new();
    store.set_latency(Duration::from_millis(1));
    let (hub, fanout) = hub(&store, 2, ActorConfig::default());
    let c = conv("c-order");

    let pending: Vec<_> = (0..300).map(|i| hub.enqueue(c.clone(), op("u1", &format!("k{i}")))).collect();
    let mut seqs = Vec::new();
    for p in pending {
        seqs.push(p.await.unwrap().seq);
    }
    assert_eq!(seqs, (1..=300).collect::<Vec<u64>>());

    let log_keys: Vec<String> = store.log(&c).iter().map(|e| e.key.to_string()).collect();
    let issued: Vec<String> = (0..300).map(|i| format!("k{i}")).collect();
    assert_eq!(log_keys, issued);
    let delivered: Vec<u64> = deliveries_once(&fanout, 300)
        .await
        .into_iter()
        .flat_map(|(_, a)| a.events.into_iter().map(|e| e.seq))
        .collect();
    assert_eq!(delivered, seqs, "fan-out sees every commit once, in order");
}

#[actix::test]
async fn many_concurrent_submitters_get_a_gapless_log_and_every_op_is_answered_once() {
    let store = MemoryStore::new();
    store.set_latency(Duration::from_micros(300));
    let (hub, _fanout) = hub(&store, 2, ActorConfig::default());
    let convs: Vec<ConvId> = (0..3).map(|i| conv(&format!("c-many-{i}"))).collect();

    const THREADS: usize = 4;
    const TASKS: usize = 8;
    const OPS: usize = 40;
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let hub = Arc::clone(&hub);
            let convs = convs.clone();
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                rt.block_on(async move {
                    let mut tasks = Vec::new();
                    for k in 0..TASKS {
                        let hub = Arc::clone(&hub);
                        let convs = convs.clone();
                        tasks.push(tokio::spawn(async move {
                            let mut answers = Vec::new();
                            for i in 0..OPS {
                                let c = convs[(k + i) % convs.len()].clone();
                                let key = format!("t{t}-k{k}-i{i}");
                                let res = hub.submit(c.clone(), op("u1", &key)).await;
                                answers.push((c, key, res));
                            }
                            answers
                        }));
                    }
                    let mut all = Vec::new();
                    for task in tasks {
                        all.extend(task.await.unwrap());
                    }
                    all
                })
            })
        })
        .collect();

    let mut answers = Vec::new();
    for t in threads {
        answers.extend(t.join().unwrap());
    }
    assert_eq!(answers.len(), THREADS * TASKS * OPS, "every op answered");
    for c in &convs {
        let log = store.log(c);
        let mut expected = HashSet::new();
        for (ac, key, res) in answers.iter().filter(|(ac, _, _)| ac == c) {
            let out = res.as_ref().unwrap();
            assert!(!out.duplicate);
            let event = &log[out.seq as usize - 1];
            assert_eq!((&event.key.to_string(), &event.seq), (key, &out.seq), "{ac}");
            expected.insert(key.clone());
        }
        assert_gapless_with_keys(&store, c, &expected);
    }
}

#[actix::test]
async fn batches_form_while_a_transaction_is_in_flight_and_respect_max_batch() {
    let store = MemoryStore::new();
    store.set_latency(Duration::from_millis(5));
    let config = ActorConfig { max_batch: 32, ..ActorConfig::default() };
    let (hub, _fanout) = hub(&store, 1, config);
    let c = conv("c-batch");

    let mut tasks = Vec::new();
    for s in 0..64 {
        let hub = Arc::clone(&hub);
        let c = c.clone();
        tasks.push(actix::spawn(async move {
            for i in 0..10 {
                hub.submit(c.clone(), op("u1", &format!("s{s}-i{i}"))).await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let sizes = store.batch_sizes();
    let total: usize = sizes.iter().sum();
    assert_eq!(total, 640);
    let mean = total as f64 / sizes.len() as f64;
    assert!(mean > 4.0, "mean batch size {mean} over {} batches", sizes.len());
    assert!(sizes.iter().all(|&n| n <= 32), "{sizes:?}");
}

#[actix::test]
async fn a_flooded_queue_answers_overloaded_at_once_and_loses_nothing_acknowledged() {
    let store = MemoryStore::new();
    let latency = Duration::from_millis(300);
    store.set_latency(latency);
    let config = ActorConfig { max_queue: 8, mailbox_capacity: 8, ..ActorConfig::default() };
    let (hub, _fanout) = hub(&store, 1, config);
    let c = conv("c-flood");

    let started = Instant::now();
    let tasks: Vec<_> = (0..200)
        .map(|i| {
            let key = format!("k{i}");
            let answer = hub.enqueue(c.clone(), op("u1", &key));
            actix::spawn(async move { (key, answer.await, started.elapsed()) })
        })
        .collect();
    let mut acked = HashSet::new();
    let mut overloaded = 0;
    for t in tasks {
        let (key, res, at) = t.await.unwrap();
        match res {
            Ok(_) => {
                acked.insert(key);
            }
            Err(WriteError::Overloaded) => {
                overloaded += 1;
                assert!(at < latency / 2, "Overloaded came after {at:?}");
            }
            Err(e) => panic!("unexpected {e}"),
        }
    }
    assert!(overloaded > 0 && !acked.is_empty(), "{overloaded} refused, {} acked", acked.len());
    assert!(acked.len() <= 1 + 8 + 8 + 1, "queue and mailbox are bounded: {}", acked.len());
    assert_gapless_with_keys(&store, &c, &acked);
}

#[actix::test]
async fn a_failed_batch_fails_its_callers_with_internal_and_the_next_batch_succeeds() {
    let store = MemoryStore::new();
    let (hub, fanout) = hub(&store, 1, ActorConfig::default());
    let c = conv("c-fail");

    store.fail_next_batches(1);
    let err = hub.submit(c.clone(), op("u1", "k1")).await.unwrap_err();
    assert!(matches!(&err, WriteError::Internal(_)), "{err:?}");
    assert!(chain(&err).contains("injected failure"), "the store's error is kept as the cause: {}", chain(&err));
    assert!(store.log(&c).is_empty(), "a failed batch commits nothing");

    let retried = hub.submit(c.clone(), op("u1", "k1")).await.unwrap();
    assert_eq!(retried, SendOutcome { seq: 1, duplicate: false, refused: false });
    let next = hub.submit(c.clone(), op("u1", "k2")).await.unwrap();
    assert_eq!(next.seq, 2);
    let delivered = deliveries_once(&fanout, 2).await;
    assert_eq!(delivered.len(), 2, "only committed batches fan out");
    assert_eq!(hub.actors_started(), 1, "the same actor carried on");
}

#[actix::test]
async fn a_panicking_batch_does_not_leave_callers_hanging_and_the_actor_carries_on() {
    let store = MemoryStore::new();
    store.set_latency(Duration::from_millis(2));
    let (hub, _fanout) = hub(&store, 1, ActorConfig::default());
    let c = conv("c-panic");

    store.panic_next_batches(1);
    let pending: Vec<_> = (0..5).map(|i| hub.enqueue(c.clone(), op("u1", &format!("k{i}")))).collect();
    let mut results = Vec::new();
    for p in pending {
        let res = tokio::time::timeout(Duration::from_secs(5), p)
            .await
            .expect("a caller of a panicking batch was left hanging");
        results.push(res);
    }
    let Err(err @ WriteError::Internal(_)) = &results[0] else { panic!("{results:?}") };
    assert!(chain(err).contains("panicked"), "the panic is kept as the cause: {}", chain(err));
    let committed: HashSet<String> =
        results.iter().enumerate().filter(|(_, r)| r.is_ok()).map(|(i, _)| format!("k{i}")).collect();
    assert_gapless_with_keys(&store, &c, &committed);

    let after = hub.submit(c.clone(), op("u1", "after")).await.unwrap();
    assert_eq!(after.seq, committed.len() as u64 + 1);
    assert_eq!(hub.actors_started(), 1, "the same actor carried on");
}

#[actix::test]
async fn idle_eviction_racing_new_sends_answers_every_send_and_keeps_one_actor_per_conversation() {
    let store = MemoryStore::new();
    let config = ActorConfig { idle_timeout: Duration::from_millis(4), ..ActorConfig::default() };
    let (hub, _fanout) = hub(&store, 2, config);
    let c = conv("c-evict");

    const ROUNDS: u64 = 60;
    let threads: Vec<_> = (0..2u64)
        .map(|t| {
            let hub = Arc::clone(&hub);
            let c = c.clone();
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                rt.block_on(async move {
                    let mut keys = Vec::new();
                    let mut last_seq = 0;
                    for r in 0..ROUNDS {
                        // Land sends before, at and after the idle deadline.
                        let pause = (r * 7 + t * 3) % 9;
                        tokio::time::sleep(Duration::from_millis(pause)).await;
                        let pending: Vec<_> = (0..3)
                            .map(|i| {
                                let key = format!("t{t}-r{r}-i{i}");
                                keys.push(key.clone());
                                hub.enqueue(c.clone(), op("u1", &key))
                            })
                            .collect();
                        for p in pending {
                            let seq = p.await.expect("every send is answered with success").seq;
                            assert!(seq > last_seq, "one submitter's ops stay in issue order");
                            last_seq = seq;
                        }
                    }
                    keys
                })
            })
        })
        .collect();

    let mut max_live = 0;
    while threads.iter().any(|t| !t.is_finished()) {
        max_live = max_live.max(hub.live_actors());
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
    let mut expected = HashSet::new();
    for t in threads {
        expected.extend(t.join().unwrap());
    }
    assert!(max_live <= 1, "at most one actor per conversation, saw {max_live}");
    assert!(hub.actors_started() > 1, "evictions happened during the run");
    assert_gapless_with_keys(&store, &c, &expected);

    let deadline = Instant::now() + Duration::from_secs(2);
    while hub.live_actors() > 0 {
        assert!(Instant::now() < deadline, "an idle actor left the hub");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[actix::test]
async fn shutdown_commits_and_answers_everything_queued_then_refuses_new_ops() {
    let store = MemoryStore::new();
    store.set_latency(Duration::from_millis(10));
    let (hub, _fanout) = hub(&store, 2, ActorConfig::default());

    let pending: Vec<_> =
        (0..100).map(|i| hub.enqueue(conv(&format!("c-shut-{}", i % 4)), op("u1", &format!("k{i}")))).collect();
    hub.shutdown().await;
    assert_eq!(hub.live_actors(), 0);
    for p in pending {
        assert!(p.await.is_ok());
    }
    let late = hub.submit(conv("c-shut-0"), op("u1", "late")).await;
    assert!(matches!(late, Err(WriteError::Overloaded)), "{late:?}");
}
