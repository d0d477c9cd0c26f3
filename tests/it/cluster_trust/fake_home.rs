//! Fake home nodes on the bus cannot capture forwarded writes (`16-bus-fake-home`).

use super::*;

/// Eight fake home nodes announcing themselves every 400 ms as `node` would
/// (`how`), answering every write forwarded to them with a fake `Sent`.
fn fake_homes(nats: &Client, how: Signed, tag: &str) -> Vec<tokio::task::JoinHandle<()>> {
    (0..8)
        .map(|i| {
            let (nats, name) = (nats.clone(), format!("imcore-fake{tag}{i}"));
            tokio::spawn(async move {
                let key = match how {
                    Signed::ClusterKey => CLUSTER_KEY,
                    _ => WRONG_KEY,
                };
                let mut writes = nats.subscribe(format!("imcore.write.{name}")).await.expect("subscribe as a fake home");
                let mut beat = tokio::time::interval(Duration::from_millis(400));
                loop {
                    tokio::select! {
                        _ = beat.tick() => {
                            let heartbeat = match how {
                                Signed::Not => Bytes::from(name.clone()),
                                _ => seal_as(&name, key, "imcore.node", None, &[], Duration::ZERO),
                            };
                            let _ = nats.publish("imcore.node", heartbeat).await;
                        }
                        Some(m) = writes.next() => {
                            let Some(reply) = m.reply else { continue };
                            let ack = json!({"Written": {"Sent": {"seq": 1, "message_id": uuid::Uuid::new_v4(), "dup": false, "created_at": "2026-01-01T00:00:00Z"}}});
                            let body = ack.to_string();
                            let answer = match how {
                                Signed::Not => Bytes::from(body),
                                _ => seal_as(&name, key, &reply, None, body.as_bytes(), Duration::ZERO),
                            };
                            let _ = nats.publish(reply, answer).await;
                        }
                    }
                }
            })
        })
        .collect()
}

/// alice (node 1) and bob (node 2) send 50 each to `conv`: acked, and stored.
async fn acked_and_stored(devices: &mut [Ws], conv: &str, prefix: &str) -> (usize, usize) {
    let mut acked = 0;
    for (d, ws) in devices.iter_mut().enumerate() {
        let mut ids = Vec::new();
        for i in 0..50 {
            ids.push(ws.start("send", hi(&format!("{prefix}-{d}-{i}"), conv, "hello")).await);
        }
        for id in ids {
            acked += usize::from(ws.reply(id).await["seq"].is_i64());
        }
    }
    let stored = log(&mut devices[0], conv).await.iter().filter(|(_, k, _)| k.starts_with(prefix)).count();
    (acked, stored)
}

/// `conv`'s home among `nodes`, picked as `cluster::home` picks it (rendezvous, SHA-256).
fn home_of<'a>(nodes: &'a [String], conv: &str) -> &'a str {
    let weight = |node: &&String| {
        let digest = Sha256::new().chain_update(node.as_bytes()).chain_update([0]).chain_update(conv).finalize();
        u64::from_be_bytes(digest[..8].try_into().expect("8 bytes"))
    };
    nodes.iter().max_by_key(weight).expect("some nodes")
}

#[actix_web::test]
async fn fake_home_nodes_cannot_capture_writes() {
    let check = Check::start(
        SUITE,
        "16-bus-fake-home",
        "3 nodes; 8 fake nodes announce on `imcore.node` every 400 ms (unsigned, and with a wrong key) and answer forwarded writes with a fake `Sent`; 100 sends (50 via node 1, 50 via node 2); control: the same fakes signing with the cluster key",
        "every node keeps knowing 3 nodes, the announcements are counted, and all 100 acked sends are stored; control: the fakes are taken for homes and acked sends go missing (what keeps them out is the signature)",
    );
    let c = Cluster::start(3).await;
    let tokens = [c.user("alice").await, c.user("bob").await];
    c.group(&tokens[0], "g-h", &["bob"]).await;
    let mut devices = vec![c.nodes[0].ws(&tokens[0]).await, c.nodes[1].ws(&tokens[1]).await];
    let nats = leaked(&c).await;
    // The control's conversation: one the signed fakes would be home of.
    let mut all = node_names(&nats, 3).await;
    all.extend((0..8).map(|i| format!("imcore-fakek{i}")));
    let control = (0..).map(|i| format!("g-c{i}")).find(|g| home_of(&all, g).starts_with("imcore-fake")).expect("one");
    c.group(&tokens[0], &control, &["bob"]).await;
    let before = rejections(&c.nodes).await;
    let mut fakes = fake_homes(&nats, Signed::Not, "u");
    fakes.extend(fake_homes(&nats, Signed::WrongKey, "w"));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let known_during = nodes_known(&c).await;
    let (acked, stored) = acked_and_stored(&mut devices, "g-h", "real").await;
    let dropped = rejected_since(&c.nodes, &before, 1.0).await;
    for fake in fakes.drain(..) {
        fake.abort();
    }
    // The control: the same fakes, signing as nodes.
    let fakes = fake_homes(&nats, Signed::ClusterKey, "k");
    let deadline = tokio::time::Instant::now() + WAIT;
    while nodes_known(&c).await.iter().any(|n| *n < 11.0) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let known_control = nodes_known(&c).await;
    let (control_acked, control_stored) = acked_and_stored(&mut devices, &control, "control").await;
    for fake in fakes {
        fake.abort();
    }
    let pass = known_during.iter().all(|n| *n == 3.0)
        && dropped["unsigned"] > 0.0
        && dropped["bad_signature"] > 0.0
        && acked == 100
        && stored == 100
        && control_stored < control_acked;
    let observed = json!({
        "cluster_nodes_during": known_during, "dropped": dropped, "acked": acked, "stored": stored,
        "control": {"conv": control, "home": home_of(&all, &control), "cluster_nodes": known_control, "acked": control_acked, "stored": control_stored},
    });
    assert!(check.resolve(observed.clone(), pass), "{observed}");
}
