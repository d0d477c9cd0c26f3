//! `imcore admin …`: the admin endpoints (PROTOCOL §3, §6) of a running
//! server, called over HTTP so nobody needs curl to start. Each command
//! returns the text to print; a refusal carries the server's PROTOCOL code.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use imcore_actors::{ConvId, DeviceId, InvalidId, UserId};
use serde_json::{json, Value};

use crate::cli::{
    AdminArgs, AdminCommand, ConversationCommand, DeviceCommand, EpochCommand, RetentionCommand, UserCommand,
};
use crate::config::{admin_token_path, Config};

/// How long one admin request may take, connecting included.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error(
        "no admin token: set IMCORE_ADMIN_TOKEN (or --admin-token), or point --data-dir at the server's data \
         directory ({path}: {source})"
    )]
    NoToken { path: PathBuf, source: std::io::Error },
    #[error("`{0}` is not a server address (http://host:port or host:port)")]
    BadServer(String),
    #[error(transparent)]
    BadId(#[from] InvalidId),
    #[error("cannot reach the server at {url}: {cause}")]
    Unreachable { url: String, cause: String },
    #[error("the server answered {status} {code}: {message}")]
    Refused { status: u16, code: String, message: String },
}

/// Runs one admin command; the text to print on success.
pub async fn run(args: &AdminArgs, config: &Config) -> Result<String, AdminError> {
    let server = Server::new(args.server.as_deref(), config)?;
    match &args.command {
        AdminCommand::User(UserCommand::Add { user_id, name }) => {
            let user = UserId::parse(user_id)?;
            server.post("/v1/admin/users", json!({ "user_id": user.as_str(), "display_name": name })).await?;
            Ok(format!("created user {user}"))
        }
        AdminCommand::Device(DeviceCommand::Add { user_id, device_id }) => {
            let (user, device) = (UserId::parse(user_id)?, DeviceId::parse(device_id)?);
            let issued = server
                .post(&format!("/v1/admin/users/{user}/devices"), json!({ "device_id": device.as_str() }))
                .await?;
            let token = issued["token"].as_str().unwrap_or_default();
            Ok(format!("user:   {user}\ndevice: {device}\ntoken:  {token}\nlogin:  {}/#token={token}", server.base))
        }
        AdminCommand::Epoch(EpochCommand::Bump { conv_id }) => {
            let conv = ConvId::parse(conv_id)?;
            let bumped = server.post(&format!("/v1/admin/conversations/{conv}/epoch"), json!({})).await?;
            Ok(format!("conversation {conv} is now at epoch {}", bumped["epoch"]))
        }
        AdminCommand::Conversation(command) => {
            let (conv, action) = match command {
                ConversationCommand::Ban { conv_id } => (ConvId::parse(conv_id)?, "ban"),
                ConversationCommand::Unban { conv_id } => (ConvId::parse(conv_id)?, "unban"),
            };
            let done = server.post(&format!("/v1/admin/conversations/{conv}/{action}"), json!({})).await?;
            let how = if done["changed"] == true { "now" } else { "already" };
            Ok(format!("conversation {conv} is {how} {}", done["status"].as_str().unwrap_or_default()))
        }
        AdminCommand::Retention(RetentionCommand::Run) => {
            let report = server.post("/v1/admin/retention/run", json!({})).await?;
            let lines: Vec<String> =
                report.as_object().into_iter().flatten().map(|(k, v)| format!("{k}: {v}")).collect();
            Ok(lines.join("\n"))
        }
    }
}

/// A running server and the admin token it takes.
struct Server {
    /// `http://host:port`, no trailing slash.
    base: String,
    token: String,
    http: awc::Client,
}

impl Server {
    fn new(server: Option<&str>, config: &Config) -> Result<Self, AdminError> {
        let base = match server {
            Some(s) => base_url(s)?,
            None => format!("http://{}", reachable(config.listen)),
        };
        let token = match &config.admin_token {
            Some(t) => t.clone(),
            None => {
                let path = admin_token_path(&config.data_dir);
                std::fs::read_to_string(&path)
                    .map(|t| t.trim().to_owned())
                    .map_err(|source| AdminError::NoToken { path, source })?
            }
        };
        let http = awc::Client::builder().timeout(REQUEST_TIMEOUT).finish();
        Ok(Self { base, token, http })
    }

    /// POSTs `body`; the reply's JSON on a 2xx, else the PROTOCOL §2 error it carries.
    async fn post(&self, path: &str, body: Value) -> Result<Value, AdminError> {
        let url = format!("{}{path}", self.base);
        let unreachable = |cause: String| AdminError::Unreachable { url: self.base.clone(), cause };
        let mut reply = self
            .http
            .post(&url)
            .bearer_auth(&self.token)
            .send_json(&body)
            .await
            .map_err(|e| unreachable(e.to_string()))?;
        let status = reply.status();
        let answer: Value = reply.json().await.map_err(|e| unreachable(format!("reading the answer: {e}")))?;
        if status.is_success() {
            return Ok(answer);
        }
        let text = |field: &str| answer["error"][field].as_str().unwrap_or_default().to_owned();
        Err(AdminError::Refused { status: status.as_u16(), code: text("code"), message: text("message") })
    }
}

/// `http://host:port` from `http://host:port[/]` or `host:port`.
fn base_url(server: &str) -> Result<String, AdminError> {
    let url = if server.contains("://") { server.to_owned() } else { format!("http://{server}") };
    let url = url.trim_end_matches('/');
    let authority = url.strip_prefix("http://").ok_or_else(|| AdminError::BadServer(server.to_owned()))?;
    if authority.is_empty() || authority.contains('/') {
        return Err(AdminError::BadServer(server.to_owned()));
    }
    Ok(url.to_owned())
}

/// The listen address as a client reaches it: a wildcard means this machine.
fn reachable(listen: SocketAddr) -> SocketAddr {
    match listen.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => SocketAddr::new(Ipv4Addr::LOCALHOST.into(), listen.port()),
        IpAddr::V6(ip) if ip.is_unspecified() => SocketAddr::new(Ipv6Addr::LOCALHOST.into(), listen.port()),
        _ => listen,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_address_becomes_a_base_url() {
        assert_eq!(base_url("127.0.0.1:8080").expect("host:port"), "http://127.0.0.1:8080");
        assert_eq!(base_url("http://chat.example:80/").expect("url"), "http://chat.example:80");
        assert!(base_url("https://chat.example").is_err(), "no TLS in this client");
        assert!(base_url("http://host/path").is_err());
        assert!(base_url("").is_err());
        let wildcard: SocketAddr = "0.0.0.0:8080".parse().expect("addr");
        assert_eq!(reachable(wildcard).to_string(), "127.0.0.1:8080");
        let v6: SocketAddr = "[::]:9000".parse().expect("addr");
        assert_eq!(reachable(v6).to_string(), "[::1]:9000");
    }
}
