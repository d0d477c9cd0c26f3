//! `imcore admin …`: the real binary against the real server, each command
//! checked by its effect through the API. Records go to evidence/web.

use std::process::Stdio;
use std::time::Duration;

use serde_json::json;

use crate::evidence::Check;
use crate::server::{TestServer, ADMIN};

/// Runs `imcore <args>` with the environment cleared of imcore settings but
/// `env`; its exit success, stdout and stderr.
pub async fn imcore(args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_imcore"));
    cmd.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).kill_on_drop(true);
    for (key, _) in std::env::vars() {
        if key.starts_with("IMCORE_") || key == "DATABASE_URL" {
            cmd.env_remove(key);
        }
    }
    cmd.envs(env.iter().copied());
    let out = tokio::time::timeout(Duration::from_secs(60), cmd.output()).await.expect("in time").expect("run imcore");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn line<'a>(out: &'a str, key: &str) -> &'a str {
    out.lines().find_map(|l| l.strip_prefix(key)).map(str::trim).unwrap_or_default()
}

#[actix_web::test]
async fn every_admin_command_works_against_a_running_server() {
    let check = Check::start(
        SUITE,
        "admin-commands",
        "the imcore binary's admin commands against a server on port 0; the admin token from IMCORE_ADMIN_TOKEN, \
         then from <data-dir>/admin-token; the server from --server, then from --listen",
        "user add creates the user (a second time: exit 1, ALREADY_EXISTS); device add prints a token that \
         authenticates and a login URL /#token=<it> on the server; epoch bump moves the epoch to 2; retention run \
         prints the purge report; a wrong admin token exits 1 with UNAUTHORIZED; no token at all exits 1 saying how to \
         give one",
    );
    let s = TestServer::start().await;
    let server = format!("http://127.0.0.1:{}", s.port);
    let by_env = [("IMCORE_ADMIN_TOKEN", ADMIN)];

    let added = imcore(&["admin", "--server", &server, "user", "add", "ana", "--name", "Ana"], &by_env).await;
    let again = imcore(&["admin", "--server", &server, "user", "add", "ana"], &by_env).await;
    let device = imcore(&["admin", "--server", &server, "device", "add", "ana", "laptop"], &by_env).await;
    let token = line(&device.1, "token:").to_owned();
    let login = line(&device.1, "login:").to_owned();
    let (me_status, me) = s.http("GET", "/v1/me", Some(&token), None).await;

    // The token from the data directory, the server from the listen address.
    let data_dir = std::env::temp_dir().join(format!("imcore-admin-{}", std::process::id()));
    std::fs::create_dir_all(&data_dir).expect("data dir");
    std::fs::write(data_dir.join("admin-token"), format!("{ADMIN}\n")).expect("token file");
    let listen = format!("127.0.0.1:{}", s.port);
    let data_dir_arg = data_dir.to_string_lossy().into_owned();
    s.user("ben").await;
    let conv = s.direct(&token, "ben").await;
    let bumped =
        imcore(&["admin", "--data-dir", &data_dir_arg, "--listen", &listen, "epoch", "bump", &conv], &[]).await;
    let (_, info) = s.http("GET", &format!("/v1/conversations/{conv}"), Some(&token), None).await;
    let purged = imcore(&["--data-dir", &data_dir_arg, "--listen", &listen, "admin", "retention", "run"], &[]).await;
    let _ = std::fs::remove_dir_all(&data_dir);

    let wrong = imcore(&["admin", "--server", &server, "retention", "run"], &[("IMCORE_ADMIN_TOKEN", "nope")]).await;
    let empty_dir = std::env::temp_dir().join(format!("imcore-admin-none-{}", std::process::id()));
    let none =
        imcore(&["admin", "--server", &server, "--data-dir", &empty_dir.to_string_lossy(), "retention", "run"], &[])
            .await;

    let pass = added.0
        && added.1.trim() == "created user ana"
        && !again.0
        && again.2.contains("ALREADY_EXISTS")
        && device.0
        && me_status == 200
        && me == json!({"user_id": "ana", "device_id": "laptop"})
        && login == format!("{server}/#token={token}")
        && bumped.0
        && info["epoch"] == 2
        && purged.0
        && purged.1.contains("events_purged: 0")
        && !wrong.0
        && wrong.2.contains("UNAUTHORIZED")
        && !none.0
        && none.2.contains("IMCORE_ADMIN_TOKEN");
    // The record keeps the shape of what was printed, not the token.
    let device = (device.0, device.1.replace(&token, "<token>"), device.2);
    let observed = json!({
        "user_add": added, "user_add_again": again, "device_add": device, "whoami": me, "epoch_bump": bumped,
        "epoch_after": info["epoch"], "retention_run": purged, "wrong_token": wrong, "no_token": none,
    });
    assert!(check.resolve(observed.clone(), pass), "{observed:#}");
}

const SUITE: &str = "web";
