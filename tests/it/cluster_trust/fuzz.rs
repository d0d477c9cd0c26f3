//! Mutated, garbage and unsigned payloads on every `imcore.*` subject (`16-bus-fuzz`).

use super::*;

pub(super) async fn mutated_payloads(s: &mut Scene) {
    let check = Check::start(
        SUITE,
        "16-bus-fuzz",
        "every subject a node hears (batch, route, revoke, lost, node, write.<node>): per subject 8 one-byte flips and 4 truncations of a message sealed with the cluster key, 4 random byte strings, the plain JSON, a wrong key, a copy 10 min old, and a copy sealed for another subject",
        "every message dropped and counted (exactly one count per node that hears it); the log and roster of g-t unchanged; no connection closed; a send after reaches every member",
    );
    let log_before = log(&mut s.devices[0], "g-t").await;
    let roster_before = roster(&mut s.devices[0], "g-t").await;
    let mut rng = StdRng::seed_from_u64(16);
    let claim = json!({"user": "bob", "device": "d1", "conn": 1}).to_string();
    let revoke = json!({"user": "bob", "device": "d1"}).to_string();
    let forward = json!({"conv": "g-t", "op": {"Send": {"sender": "alice", "device": "d1", "client_msg_id": "fuzz", "body": "{}"}}}).to_string();
    // (subject, a plausible payload, nodes hearing it)
    let mut subjects = vec![
        (
            "imcore.batch.g-t".to_owned(),
            r#"{"conv_id":"g-t","events":[],"head":1,"delivery_mode":"Push"}"#.to_owned(),
            3.0,
        ),
        ("imcore.batch.x".to_owned(), "{}".to_owned(), 3.0),
        ("imcore.route".to_owned(), claim, 3.0),
        ("imcore.revoke".to_owned(), revoke, 3.0),
        ("imcore.lost".to_owned(), String::new(), 3.0),
        ("imcore.node".to_owned(), String::new(), 3.0),
    ];
    subjects.extend(s.names.iter().map(|n| (format!("imcore.write.{n}"), forward.clone(), 1.0)));
    let before = rejections(&s.c.nodes).await;
    let (mut expected, mut messages) = (0.0, 0);
    for (subject, payload, hearers) in &subjects {
        let reply = subject.starts_with("imcore.write.").then_some("imcore.inbox.fuzz.0");
        let good = seal_as("imcore-forger", CLUSTER_KEY, subject, reply, payload.as_bytes(), Duration::ZERO);
        let mut variants: Vec<Bytes> = Vec::new();
        for _ in 0..8 {
            let mut flipped = good.to_vec();
            let at = rng.gen_range(0..flipped.len());
            flipped[at] ^= 1 << rng.gen_range(0..8);
            variants.push(flipped.into());
        }
        for _ in 0..4 {
            variants.push(good.slice(..rng.gen_range(0..good.len())));
        }
        for _ in 0..4 {
            let len = rng.gen_range(0..200);
            variants.push((0..len).map(|_| rng.gen::<u8>()).collect::<Vec<u8>>().into());
        }
        variants.push(Bytes::from(payload.clone()));
        variants.push(seal_as("imcore-forger", WRONG_KEY, subject, reply, payload.as_bytes(), Duration::ZERO));
        variants.push(seal_as(
            "imcore-forger",
            CLUSTER_KEY,
            subject,
            reply,
            payload.as_bytes(),
            Duration::from_secs(600),
        ));
        variants.push(seal_as("imcore-forger", CLUSTER_KEY, "imcore.other", reply, payload.as_bytes(), Duration::ZERO));
        for v in variants {
            match reply {
                Some(r) => s.nats.publish_with_reply(subject.clone(), r.to_owned(), v).await.expect("publish"),
                None => s.nats.publish(subject.clone(), v).await.expect("publish"),
            }
            expected += hearers;
            messages += 1;
        }
    }
    s.nats.flush().await.expect("flush");
    let dropped = rejected_since(&s.c.nodes, &before, expected).await;
    tokio::time::sleep(HARM).await;
    let counted: f64 = rejections(&s.c.nodes).await.iter().map(|(r, n)| n - before[r]).sum();
    let open = all_alive(&mut s.devices).await;
    let log_after = log(&mut s.devices[0], "g-t").await;
    let roster_after = roster(&mut s.devices[0], "g-t").await;
    let known = nodes_known(&s.c).await;
    let reached = delivered_everywhere(s, "after-fuzz").await;
    let pass = counted == expected
        && open.iter().all(|o| *o)
        && log_after == log_before
        && roster_after == roster_before
        && known.iter().all(|n| *n == 3.0)
        && reached;
    let observed = json!({
        "messages": messages, "deliveries_expected_dropped": expected, "counted": counted, "by_reason": dropped,
        "devices_open": open, "log_unchanged": log_after == log_before, "roster_unchanged": roster_after == roster_before,
        "cluster_nodes": known, "send_after_reached_bob_and_carol": reached,
    });
    assert!(check.resolve(observed.clone(), pass), "{observed}");
}
