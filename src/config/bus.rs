//! The cluster bus's settings: which NATS servers a node may connect to, how
//! it authenticates to them, and the key every bus message is signed with
//! (ARCHITECTURE §7).

use std::path::PathBuf;

use async_nats::ServerAddr;
use clap::Args;

/// The servers of `IMCORE_NATS_URL`: one URL, or several separated by commas
/// (the servers of one NATS cluster; the credentials and TLS settings apply to
/// each). `None` if the list is empty or an entry is not a NATS URL.
pub fn nats_servers(list: &str) -> Option<Vec<ServerAddr>> {
    let servers: Option<Vec<ServerAddr>> =
        list.split(',').map(str::trim).map(|url| url.parse().ok().filter(|_| !url.is_empty())).collect();
    servers.filter(|s| !s.is_empty())
}

/// `IMCORE_NATS_URL` as it may be logged: the secret in an entry's user info
/// (`nats://user:secret@host`, or a token: `nats://secret@host`) is `***`.
pub fn nats_servers_redacted(list: &str) -> String {
    let redact = |url: &str| -> String {
        let start = url.find("://").map_or(0, |i| i + 3);
        let authority_end = url[start..].find('/').map_or(url.len(), |i| start + i);
        let Some(at) = url[start..authority_end].rfind('@').map(|i| start + i) else { return url.to_owned() };
        match url[start..at].find(':') {
            Some(colon) => format!("{}:***{}", &url[..start + colon], &url[at..]),
            None => format!("{}***{}", &url[..start], &url[at..]),
        }
    };
    list.split(',').map(redact).collect::<Vec<_>>().join(",")
}

/// The cluster bus as a trust boundary (ARCHITECTURE §7): how a node
/// authenticates to NATS, and the key every bus message is signed with.
#[derive(Clone, Args)]
pub struct BusSettings {
    /// NATS user (with `IMCORE_NATS_PASSWORD`).
    #[arg(long, env = "IMCORE_NATS_USER", requires = "nats_password", conflicts_with_all = ["nats_nkey", "nats_creds"])]
    pub nats_user: Option<String>,

    /// NATS password of `IMCORE_NATS_USER`.
    #[arg(long, env = "IMCORE_NATS_PASSWORD", hide_env_values = true, requires = "nats_user")]
    pub nats_password: Option<String>,

    /// NATS nkey seed (`SU…`) to authenticate with.
    #[arg(long, env = "IMCORE_NATS_NKEY", hide_env_values = true, conflicts_with = "nats_creds")]
    pub nats_nkey: Option<String>,

    /// NATS credentials file (a user JWT and its nkey seed).
    #[arg(long, env = "IMCORE_NATS_CREDS")]
    pub nats_creds: Option<PathBuf>,

    /// CA certificate (PEM) NATS's certificate is checked against; set, the
    /// connection must be TLS.
    #[arg(long, env = "IMCORE_NATS_TLS_CA")]
    pub nats_tls_ca: Option<PathBuf>,

    /// Client certificate (PEM) for NATS servers that verify clients (with `IMCORE_NATS_TLS_KEY`).
    #[arg(long, env = "IMCORE_NATS_TLS_CERT", requires = "nats_tls_key")]
    pub nats_tls_cert: Option<PathBuf>,

    /// The client certificate's private key (PEM).
    #[arg(long, env = "IMCORE_NATS_TLS_KEY", requires = "nats_tls_cert")]
    pub nats_tls_key: Option<PathBuf>,

    /// Key shared by the nodes of this cluster, at least 32 bytes: every bus
    /// message is signed with it (HMAC-SHA256), and one not signed with it is
    /// dropped. Required with `IMCORE_NATS_URL`.
    #[arg(long, env = "IMCORE_CLUSTER_KEY", hide_env_values = true)]
    pub cluster_key: Option<String>,

    /// A bus message signed more than this many ms before or after this
    /// node's clock is dropped (a replay, or clocks too far apart).
    #[arg(long, env = "IMCORE_BUS_MAX_AGE_MS", default_value_t = BusSettings::default().max_age_ms)]
    pub max_age_ms: u64,
}

impl Default for BusSettings {
    fn default() -> Self {
        Self {
            nats_user: None,
            nats_password: None,
            nats_nkey: None,
            nats_creds: None,
            nats_tls_ca: None,
            nats_tls_cert: None,
            nats_tls_key: None,
            cluster_key: None,
            max_age_ms: 30_000,
        }
    }
}

/// Secrets shown only as set or not.
impl std::fmt::Debug for BusSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let set = |s: &Option<String>| s.as_ref().map(|_| "<set>");
        f.debug_struct("BusSettings")
            .field("nats_user", &self.nats_user)
            .field("nats_password", &set(&self.nats_password))
            .field("nats_nkey", &set(&self.nats_nkey))
            .field("nats_creds", &self.nats_creds)
            .field("nats_tls_ca", &self.nats_tls_ca)
            .field("nats_tls_cert", &self.nats_tls_cert)
            .field("nats_tls_key", &self.nats_tls_key)
            .field("cluster_key", &set(&self.cluster_key))
            .field("max_age_ms", &self.max_age_ms)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::{nats_servers, nats_servers_redacted};

    #[test]
    fn a_comma_separated_list_names_every_server_and_a_bad_entry_refuses_it_all() {
        let servers =
            nats_servers("nats://127.0.0.1:4222, nats://127.0.0.1:4223,tls://10.0.0.3:4222").expect("three servers");
        let ports: Vec<u16> = servers.iter().map(|s| s.port()).collect();
        assert_eq!(ports, [4222, 4223, 4222]);
        assert!(servers[2].tls_required());
        for bad in ["", "nats://127.0.0.1:4222,", "nats://127.0.0.1:4222,,nats://127.0.0.1:4223", "http://x:1"] {
            assert!(nats_servers(bad).is_none(), "{bad:?} taken");
        }
    }

    #[test]
    fn a_logged_server_list_shows_no_password() {
        let shown = nats_servers_redacted("nats://imcore:s3cret@10.0.0.1:4222,nats://10.0.0.2:4222,tls://tok@h:1/x");
        assert_eq!(shown, "nats://imcore:***@10.0.0.1:4222,nats://10.0.0.2:4222,tls://***@h:1/x");
        assert!(!nats_servers_redacted("nats://a:b:c@h:1").contains("b:c"));
    }
}
