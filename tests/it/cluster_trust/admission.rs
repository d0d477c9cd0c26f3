//! Who may join the bus at all: NATS credentials, the cluster key, TLS
//! (`16-bus-no-credentials`, `16-bus-tls`).

use super::*;

/// Variables set (`Some`) or removed (`None`) for a node.
type Env<'a> = Vec<(&'a str, Option<&'a str>)>;

#[actix_web::test]
async fn without_the_credentials_or_the_key_nothing_joins() {
    let check = Check::start(
        SUITE,
        "16-bus-no-credentials",
        "NATS with authorization: a node without NATS credentials, with a wrong password, without the cluster key, with a 31-byte key, with an empty entry in its server list; a raw client with a wrong password; a NATS user who is not a node publishing on `imcore.route`",
        "each node refuses to start (exit status non-zero, the cause printed); the raw client is refused; the outsider's message never reaches a subscriber of `imcore.route` (while a node's does)",
    );
    let c = Cluster::start_writing_locally(1).await;
    let mut refusals = Vec::new();
    let cases: [(&str, Env, &str); 5] = [
        ("no credentials", vec![("IMCORE_NATS_USER", None), ("IMCORE_NATS_PASSWORD", None)], "authorization"),
        ("wrong password", vec![("IMCORE_NATS_PASSWORD", Some("wrong"))], "authorization"),
        ("no cluster key", vec![("IMCORE_CLUSTER_KEY", None)], "IMCORE_CLUSTER_KEY"),
        ("31-byte key", vec![("IMCORE_CLUSTER_KEY", Some(&CLUSTER_KEY[..31]))], "IMCORE_CLUSTER_KEY"),
        ("empty server in the list", vec![("IMCORE_NATS_URL", Some("nats://127.0.0.1:1,,"))], "comma-separated list"),
    ];
    let mut pass = true;
    for (case, env, cause) in cases {
        let (status, printed) = c.node_refused(&env).await;
        let said = printed.to_lowercase().contains(&cause.to_lowercase());
        pass &= status.is_some_and(|s| s != 0) && said && !printed.contains("imcore is listening");
        let last = printed.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("").to_owned();
        refusals.push(json!({"case": case, "exit_status": status, "cause_printed": said, "last_line": last}));
    }
    let wrong = ConnectOptions::new().user_and_password(NODE_USER.into(), "wrong".into()).connect(c.nats.url()).await;
    let raw_refused = wrong.is_err();
    let node_nats = leaked(&c).await;
    let mut sniffer = node_nats.subscribe("imcore.route").await.expect("subscribe as a node");
    node_nats.flush().await.expect("flush");
    let outsider = ConnectOptions::new()
        .user_and_password(OUTSIDER.into(), OUTSIDER_PASSWORD.into())
        .connect(c.nats.url())
        .await
        .expect("the outsider is a NATS user");
    let _ = outsider.publish("imcore.route", Bytes::from_static(b"from an outsider")).await;
    let _ = outsider.flush().await;
    let outsider_heard = tokio::time::timeout(HARM, sniffer.next()).await.is_ok();
    let other_node = leaked(&c).await;
    other_node.publish("imcore.route", Bytes::from_static(b"from a node")).await.expect("publish as a node");
    other_node.flush().await.expect("flush");
    let node_heard = tokio::time::timeout(WAIT, sniffer.next()).await.ok().flatten().map(|m| m.payload.to_vec());
    pass &= raw_refused && !outsider_heard && node_heard.as_deref() == Some(b"from a node".as_slice());
    let observed = json!({
        "nodes": refusals, "raw_client_wrong_password_refused": raw_refused,
        "outsider_message_heard": outsider_heard, "node_message_heard": node_heard.is_some(),
    });
    assert!(check.resolve(observed.clone(), pass), "{observed}");
}

#[actix_web::test]
async fn a_node_reaches_nats_over_tls_only_trusting_the_configured_ca() {
    let check = Check::start(
        SUITE,
        "16-bus-tls",
        "NATS with TLS (a certificate for 127.0.0.1 from a CA of the test's own) and authorization; a node with IMCORE_NATS_TLS_CA set to that CA, and one without it",
        "the node given the CA joins and listens; the one without it refuses to start (it does not trust the server)",
    );
    let c = Cluster::start_writing_locally(1).await;
    let (tls, ca) = crate::cluster_harness::Nats::start_tls().await;
    let ca_path = ca.to_string_lossy().into_owned();
    let with_ca = c.try_node(&tls.url(), &[("IMCORE_NATS_TLS_CA", &ca_path)]).await;
    let joined = with_ca.is_ok();
    drop(with_ca);
    let without_ca = c.try_node(&tls.url(), &[]).await;
    let refused = without_ca.as_ref().err().cloned();
    let pass = joined && refused.as_deref().is_some_and(|e| e.contains("cannot connect to NATS"));
    let observed = json!({"with_ca_joined": joined, "without_ca_error": refused});
    assert!(check.resolve(observed.clone(), pass), "{observed}");
}
