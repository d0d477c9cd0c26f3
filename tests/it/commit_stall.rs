//! A commit held open on purpose: a deferred constraint trigger on `events`
//! sleeps at COMMIT for a body carrying "STALL", after the batch's INSERT and
//! `next_seq` UPDATE ran. A test can then act while a send is known to be in
//! COMMIT (kill the server, shut it down) and observe the outcome.

use std::time::{Duration, Instant};

/// A body that stalls its batch's COMMIT once [`install`] ran.
pub const MARK: &str = "STALL";

/// Installs the trigger in the database of `client`; COMMIT sleeps `secs`.
pub async fn install(client: &tokio_postgres::Client, secs: f64) {
    client
        .batch_execute(&format!(
            "CREATE FUNCTION stall_at_commit() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
               IF NEW.body LIKE '%{MARK}%' THEN PERFORM pg_sleep({secs}); END IF;
               RETURN NULL;
             END $$;
             CREATE CONSTRAINT TRIGGER stall_at_commit AFTER INSERT ON events
               DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION stall_at_commit();"
        ))
        .await
        .expect("install the commit stall");
}

/// Backends of this database sleeping in the trigger now.
async fn stalled(client: &tokio_postgres::Client) -> Vec<i32> {
    let rows = client
        .query("SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND wait_event = 'PgSleep'", &[])
        .await
        .expect("pg_stat_activity");
    rows.iter().map(|r| r.get(0)).collect()
}

/// Waits until a COMMIT is stalled: the pids of the backends stalled, or
/// nothing once `within` passed.
pub async fn wait_until_stalled(client: &tokio_postgres::Client, within: Duration) -> Vec<i32> {
    let deadline = Instant::now() + within;
    loop {
        let pids = stalled(client).await;
        if !pids.is_empty() || Instant::now() > deadline {
            return pids;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until the backends `pids` are gone (a stalled COMMIT whose client
/// died finishes the commit, then the backend exits); `false` after `within`.
pub async fn wait_until_gone(client: &tokio_postgres::Client, pids: &[i32], within: Duration) -> bool {
    poll(within, || async {
        let left: i64 = client
            .query_one("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1)", &[&pids])
            .await
            .expect("pg_stat_activity")
            .get(0);
        left == 0
    })
    .await
}

async fn poll<F: std::future::Future<Output = bool>>(within: Duration, mut holds: impl FnMut() -> F) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if holds().await {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
