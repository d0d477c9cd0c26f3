//! The route registry under real thread concurrency (P7: the route of a device
//! is its newest connection's; an older connection's cleanup never removes it).
//!
//! The recipient in these tests is the connection's own number, so every route
//! read back can be checked for a recipient that matches its `conn_id`.
#![allow(clippy::unwrap_used)]

use std::collections::HashSet;
use std::sync::Barrier;
use std::thread;

use imcore_actors::registry::{ConnId, Registered, Route, RouteRegistry};
use imcore_actors::{DeviceId, UserId};

type Registry = RouteRegistry<u64>;

const STORM_THREADS: usize = 16;
const RECONNECTS_PER_THREAD: usize = 1_000;
const _: () = assert!(RECONNECTS_PER_THREAD % 8 == 0, "the storm runs in rounds of 8");

fn user(s: &str) -> UserId {
    UserId::parse(s).unwrap()
}

fn device(s: &str) -> DeviceId {
    DeviceId::parse(s).unwrap()
}

/// A small deterministic PRNG (xorshift64*), so schedules are reproducible
/// without a dependency.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) as usize % n
    }

    fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.below(i + 1));
        }
    }
}

fn register(reg: &Registry, u: &UserId, d: &DeviceId, id: ConnId) -> Registered<u64> {
    reg.register(u.clone(), d.clone(), id, id.get())
}

/// What a reconnect storm did, merged over all threads.
#[derive(Default)]
struct StormLog {
    /// Every connection id that tried to register.
    all: Vec<ConnId>,
    /// Registrations that installed their route (`New` or `Replaced`).
    installed: Vec<ConnId>,
    /// Routes handed back by `Replaced`, i.e. connections the caller kicks.
    kicked: Vec<ConnId>,
    /// Registrations refused as `Stale`.
    stale: Vec<ConnId>,
}

/// `STORM_THREADS` threads each reconnect one device `RECONNECTS_PER_THREAD`
/// times (a multiple of 8), all at once. Every 8th reconnect delivers two registrations in the
/// wrong order (the newer connection's first), so late registrations are
/// certain, not left to the scheduler; the thread also yields between taking
/// an id and registering, so the scheduler adds its own.
fn reconnect_storm(reg: &Registry, u: &UserId, d: &DeviceId) -> StormLog {
    let start = Barrier::new(STORM_THREADS);
    let logs: Vec<StormLog> = thread::scope(|s| {
        let handles: Vec<_> = (0..STORM_THREADS)
            .map(|_| {
                s.spawn(|| {
                    let mut log = StormLog::default();
                    let mut record = |id: ConnId, outcome: Registered<u64>| {
                        log.all.push(id);
                        match outcome {
                            Registered::New => log.installed.push(id),
                            Registered::Replaced(prev) => {
                                assert_eq!(prev.recipient, prev.conn_id.get());
                                assert!(prev.conn_id < id, "{} replaced newer {}", id, prev.conn_id);
                                log.installed.push(id);
                                log.kicked.push(prev.conn_id);
                            }
                            Registered::Stale { current } => {
                                assert!(current > id, "{id} refused by older {current}");
                                log.stale.push(id);
                            }
                        }
                    };
                    start.wait();
                    // Rounds of eight registrations: six in order, then a
                    // pair delivered newest first.
                    for _ in 0..RECONNECTS_PER_THREAD / 8 {
                        for _ in 0..6 {
                            let id = reg.next_conn_id();
                            thread::yield_now();
                            record(id, register(reg, u, d, id));
                        }
                        let older = reg.next_conn_id();
                        let newer = reg.next_conn_id();
                        record(newer, register(reg, u, d, newer));
                        record(older, register(reg, u, d, older));
                    }
                    log
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut merged = StormLog::default();
    for log in logs {
        merged.all.extend(log.all);
        merged.installed.extend(log.installed);
        merged.kicked.extend(log.kicked);
        merged.stale.extend(log.stale);
    }
    merged
}

/// Cleans up one closing connection's route; returns the connection whose
/// route it removed, if it removed one.
type Cleanup = fn(&Registry, &UserId, &DeviceId, ConnId) -> Option<ConnId>;

/// Delivers the close of every connection in `ids` from `STORM_THREADS`
/// threads at once, in a shuffled order, through `cleanup`. Returns how many
/// cleanups removed a route.
fn late_cleanups(reg: &Registry, u: &UserId, d: &DeviceId, mut ids: Vec<ConnId>, cleanup: Cleanup) -> usize {
    Rng::new(7).shuffle(&mut ids);
    let chunk = ids.len().div_ceil(STORM_THREADS).max(1);
    let start = Barrier::new(ids.chunks(chunk).count());
    thread::scope(|s| {
        let handles: Vec<_> = ids
            .chunks(chunk)
            .map(|mine| {
                let start = &start;
                s.spawn(move || {
                    start.wait();
                    mine.iter().filter(|&&id| cleanup(reg, u, d, id).is_some()).count()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).sum()
    })
}

/// The registry's own cleanup: compare-and-remove on the connection's id.
fn compare_and_remove(reg: &Registry, u: &UserId, d: &DeviceId, closing: ConnId) -> Option<ConnId> {
    reg.unregister(u, d, closing).then_some(closing)
}

/// The naive cleanup the registry exists to prevent: `remove(user, device)`,
/// whatever connection the route belongs to. The registry offers no such
/// call, so it is spelled as "remove the route that is there now".
fn naive_remove(reg: &Registry, u: &UserId, d: &DeviceId, _closing: ConnId) -> Option<ConnId> {
    let current = reg.route(u, d)?.conn_id;
    reg.unregister(u, d, current).then_some(current)
}

/// What reconnects racing late cleanups left behind.
struct RacingOutcome {
    /// The highest id of all: some thread's last connection, never closed.
    newest: ConnId,
    route: Option<Route<u64>>,
    counts: (usize, usize),
    /// Cleanups that removed the route of a connection other than the one
    /// closing.
    removed_others: usize,
}

/// `STORM_THREADS` threads reconnect one device `RECONNECTS_PER_THREAD`
/// times each, all at once, and clean up each of their connections a few
/// reconnects late, in a random order, through `cleanup`; at the end each
/// closes everything but its last connection.
fn reconnects_racing_late_cleanups(cleanup: Cleanup) -> RacingOutcome {
    let reg = Registry::new();
    let (ana, phone) = (user("ana"), device("phone"));
    let start = Barrier::new(STORM_THREADS);
    let per_thread: Vec<(ConnId, usize)> = thread::scope(|s| {
        let handles: Vec<_> = (0..STORM_THREADS)
            .map(|t| {
                let (reg, ana, phone, start) = (&reg, &ana, &phone, &start);
                s.spawn(move || {
                    let mut rng = Rng::new(t as u64 + 1);
                    let mut removed_others = 0;
                    let mut close = |closing: ConnId| {
                        removed_others += usize::from(cleanup(reg, ana, phone, closing).is_some_and(|r| r != closing));
                    };
                    // This thread's connections whose close is not yet processed.
                    let mut open: Vec<ConnId> = Vec::new();
                    start.wait();
                    for _ in 0..RECONNECTS_PER_THREAD {
                        let id = reg.next_conn_id();
                        let _ = register(reg, ana, phone, id);
                        open.push(id);
                        if open.len() > 3 {
                            close(open.swap_remove(rng.below(open.len() - 1)));
                        }
                    }
                    let last = *open.iter().max().unwrap();
                    for &id in open.iter().filter(|&&id| id != last) {
                        close(id);
                    }
                    (last, removed_others)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    RacingOutcome {
        newest: per_thread.iter().map(|&(last, _)| last).max().unwrap(),
        route: reg.route(&ana, &phone),
        counts: (reg.connection_count(), reg.user_count()),
        removed_others: per_thread.iter().map(|&(_, n)| n).sum(),
    }
}

fn conn_ids(routes: &[(DeviceId, Route<u64>)]) -> Vec<(String, u64)> {
    let mut v: Vec<_> = routes.iter().map(|(d, r)| (d.to_string(), r.conn_id.get())).collect();
    v.sort();
    v
}

#[test]
fn a_device_without_a_route_registers_as_new_and_is_listed_for_fan_out() {
    let reg = Registry::new();
    let (ana, phone, laptop) = (user("ana"), device("phone"), device("laptop"));
    let (c1, c2) = (reg.next_conn_id(), reg.next_conn_id());

    assert_eq!(register(&reg, &ana, &phone, c1), Registered::New);
    assert_eq!(register(&reg, &ana, &laptop, c2), Registered::New);

    assert_eq!(conn_ids(&reg.routes_of(&ana)), vec![("laptop".into(), c2.get()), ("phone".into(), c1.get())]);
    assert_eq!(reg.route(&ana, &phone), Some(Route { conn_id: c1, recipient: c1.get() }));
    assert_eq!(reg.routes_of(&user("bob")), vec![]);
    assert_eq!((reg.connection_count(), reg.user_count()), (2, 1));
}

#[test]
fn conn_ids_are_unique_and_increase_across_registries() {
    let (a, b) = (Registry::new(), Registry::new());
    let ids = [a.next_conn_id(), b.next_conn_id(), a.next_conn_id()];
    assert!(ids[0] < ids[1] && ids[1] < ids[2], "{ids:?}");
}

#[test]
fn a_reconnect_replaces_the_route_and_hands_back_the_previous_one_to_kick() {
    let reg = Registry::new();
    let (ana, phone) = (user("ana"), device("phone"));
    let (old, new) = (reg.next_conn_id(), reg.next_conn_id());

    assert_eq!(register(&reg, &ana, &phone, old), Registered::New);
    assert_eq!(register(&reg, &ana, &phone, new), Registered::Replaced(Route { conn_id: old, recipient: old.get() }));
    assert_eq!(reg.route(&ana, &phone).map(|r| r.conn_id), Some(new));
    assert_eq!((reg.connection_count(), reg.user_count()), (1, 1));
}

#[test]
fn register_of_an_older_conn_id_after_a_newer_one_is_refused_as_stale() {
    let reg = Registry::new();
    let (ana, phone) = (user("ana"), device("phone"));
    let (older, newer) = (reg.next_conn_id(), reg.next_conn_id());

    assert_eq!(register(&reg, &ana, &phone, newer), Registered::New);
    assert_eq!(register(&reg, &ana, &phone, older), Registered::Stale { current: newer });

    assert_eq!(reg.route(&ana, &phone), Some(Route { conn_id: newer, recipient: newer.get() }));
    assert!(!reg.unregister(&ana, &phone, older), "the refused connection owns no route");
    assert_eq!(reg.route(&ana, &phone).map(|r| r.conn_id), Some(newer));
    assert_eq!((reg.connection_count(), reg.user_count()), (1, 1));
}

#[test]
fn unregister_of_a_stale_conn_id_never_removes_the_newer_route() {
    let reg = Registry::new();
    let (ana, phone) = (user("ana"), device("phone"));
    let (old, new) = (reg.next_conn_id(), reg.next_conn_id());
    assert_eq!(register(&reg, &ana, &phone, old), Registered::New);
    assert!(matches!(register(&reg, &ana, &phone, new), Registered::Replaced(_)));

    assert!(!reg.unregister(&ana, &phone, old));
    assert!(!reg.unregister(&ana, &phone, old), "and not on a second try either");
    assert_eq!(reg.route(&ana, &phone).map(|r| r.conn_id), Some(new));
    assert_eq!((reg.connection_count(), reg.user_count()), (1, 1));

    assert!(reg.unregister(&ana, &phone, new));
    assert_eq!(reg.route(&ana, &phone), None);
}

#[test]
fn the_last_unregister_of_a_user_removes_the_user_entry_and_earlier_ones_keep_it() {
    let reg = Registry::new();
    let (ana, phone, laptop) = (user("ana"), device("phone"), device("laptop"));
    let (c1, c2) = (reg.next_conn_id(), reg.next_conn_id());
    assert_eq!(register(&reg, &ana, &phone, c1), Registered::New);
    assert_eq!(register(&reg, &ana, &laptop, c2), Registered::New);

    assert!(!reg.unregister(&ana, &phone, c2), "c2 is the laptop's, not the phone's");
    assert!(reg.unregister(&ana, &phone, c1));
    assert_eq!((reg.connection_count(), reg.user_count()), (1, 1));
    assert!(reg.unregister(&ana, &laptop, c2));
    assert_eq!((reg.connection_count(), reg.user_count()), (0, 0));
    assert!(!reg.unregister(&ana, &laptop, c2), "unregister is idempotent");
    assert!(!reg.unregister(&user("nobody"), &laptop, c2));
    assert_eq!((reg.connection_count(), reg.user_count()), (0, 0));
}

#[test]
fn after_a_reconnect_storm_the_route_is_the_highest_conn_id_and_exactly_one_route_remains() {
    let reg = Registry::new();
    let (ana, phone) = (user("ana"), device("phone"));

    let log = reconnect_storm(&reg, &ana, &phone);

    let highest = *log.all.iter().max().unwrap();
    assert_eq!(log.all.len(), STORM_THREADS * RECONNECTS_PER_THREAD);
    assert_eq!(reg.route(&ana, &phone), Some(Route { conn_id: highest, recipient: highest.get() }));
    assert_eq!((reg.connection_count(), reg.user_count()), (1, 1));
    assert_eq!(reg.routes_of(&ana).len(), 1);

    // Every registration either lost (stale) or won; every winner but the
    // highest was handed back for kicking exactly once; no loser ever was.
    assert_eq!(log.installed.len() + log.stale.len(), log.all.len());
    assert!(
        log.stale.len() >= STORM_THREADS * RECONNECTS_PER_THREAD / 8,
        "the storm delivers late registrations on purpose: {} stale",
        log.stale.len()
    );
    let kicked: HashSet<ConnId> = log.kicked.iter().copied().collect();
    assert_eq!(kicked.len(), log.kicked.len(), "a connection was kicked twice");
    assert!(!kicked.contains(&highest));
    let mut expected: HashSet<ConnId> = log.installed.iter().copied().collect();
    expected.remove(&highest);
    assert_eq!(kicked, expected);
}

#[test]
fn late_cleanup_of_every_old_connection_after_the_storm_leaves_the_newest() {
    let reg = Registry::new();
    let (ana, phone) = (user("ana"), device("phone"));
    let log = reconnect_storm(&reg, &ana, &phone);
    let newest = *log.all.iter().max().unwrap();
    let old: Vec<ConnId> = log.all.iter().copied().filter(|&id| id != newest).collect();

    let removed = late_cleanups(&reg, &ana, &phone, old, compare_and_remove);

    assert_eq!(removed, 0, "an old connection's cleanup removed a route");
    assert_eq!(reg.route(&ana, &phone), Some(Route { conn_id: newest, recipient: newest.get() }));
    assert_eq!((reg.connection_count(), reg.user_count()), (1, 1));

    assert!(reg.unregister(&ana, &phone, newest), "the newest connection's own cleanup works");
    assert_eq!((reg.connection_count(), reg.user_count()), (0, 0));
    assert_eq!(reg.routes_of(&ana), vec![]);
}

#[test]
fn reconnects_racing_late_cleanups_of_earlier_connections_keep_the_newest_route() {
    let r = reconnects_racing_late_cleanups(compare_and_remove);

    // No registration can displace the newest connection, and its own
    // cleanup never ran.
    assert_eq!(r.route, Some(Route { conn_id: r.newest, recipient: r.newest.get() }));
    assert_eq!(r.counts, (1, 1));
    assert_eq!(r.removed_others, 0);
}

/// Negative control: the same racing reconnects and cleanups, with each
/// cleanup an unconditional `remove(user, device)`. Cleanups then remove
/// newer connections' routes while the threads race, and the newest route
/// is lost; if that ever stopped happening, the check above would prove
/// nothing.
#[test]
fn control_a_naive_cleanup_racing_the_same_reconnects_removes_newer_routes_and_loses_the_newest() {
    let r = reconnects_racing_late_cleanups(naive_remove);

    assert!(r.removed_others > 0, "no naive cleanup removed another connection's route");
    assert_ne!(
        r.route.map(|route| route.conn_id),
        Some(r.newest),
        "the naive cleanup should have lost the newest connection's route"
    );
}

#[test]
fn concurrent_register_and_unregister_across_many_users_leaves_no_empty_user_entries_and_consistent_counts() {
    const THREADS: usize = 8;
    const OPS_PER_THREAD: usize = 5_000;
    const USERS: usize = 12;
    const DEVICES: usize = 3;
    let users: Vec<UserId> = (0..USERS).map(|i| user(&format!("u{i}"))).collect();
    let devices: Vec<DeviceId> = (0..DEVICES).map(|i| device(&format!("d{i}"))).collect();
    let reg = Registry::new();
    let start = Barrier::new(THREADS);

    // Phase 1: every thread opens connections on random devices of random
    // users and closes random ones of its own, racing the others; few users
    // and devices, so users often go from one route to none and back.
    let still_open: Vec<Vec<(usize, usize, ConnId)>> = thread::scope(|s| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let (reg, users, devices, start) = (&reg, &users, &devices, &start);
                s.spawn(move || {
                    let mut rng = Rng::new(100 + t as u64);
                    let mut open: Vec<(usize, usize, ConnId)> = Vec::new();
                    start.wait();
                    for _ in 0..OPS_PER_THREAD {
                        if open.is_empty() || rng.below(2) == 0 {
                            let (u, d) = (rng.below(USERS), rng.below(DEVICES));
                            let id = reg.next_conn_id();
                            match register(reg, &users[u], &devices[d], id) {
                                Registered::Stale { .. } => {}
                                Registered::New | Registered::Replaced(_) => open.push((u, d, id)),
                            }
                        } else {
                            let (u, d, id) = open.swap_remove(rng.below(open.len()));
                            reg.unregister(&users[u], &devices[d], id);
                        }
                    }
                    open
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });

    // Quiet now: the counts must match the map exactly, no user entry is
    // empty, and every route belongs to a connection that was never closed.
    let open_ids: HashSet<ConnId> = still_open.iter().flatten().map(|&(_, _, id)| id).collect();
    let mut routes = 0;
    let mut users_with_routes = 0;
    for u in &users {
        let of_user = reg.routes_of(u);
        routes += of_user.len();
        users_with_routes += usize::from(!of_user.is_empty());
        for (_, route) in of_user {
            assert_eq!(route.recipient, route.conn_id.get());
            assert!(open_ids.contains(&route.conn_id), "{} was closed", route.conn_id);
        }
    }
    assert!(routes > 0, "the schedule should leave some routes");
    assert_eq!(reg.connection_count(), routes);
    assert_eq!(reg.user_count(), users_with_routes, "an empty user entry was left behind");

    // Phase 2: every still-open connection closes, concurrently; nothing is
    // left, not even an empty user entry.
    thread::scope(|s| {
        for open in &still_open {
            let (reg, users, devices) = (&reg, &users, &devices);
            s.spawn(move || {
                for &(u, d, id) in open {
                    reg.unregister(&users[u], &devices[d], id);
                }
            });
        }
    });
    assert_eq!((reg.connection_count(), reg.user_count()), (0, 0));
    assert!(users.iter().all(|u| reg.routes_of(u).is_empty()));
}
