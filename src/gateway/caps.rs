//! Connection caps: TCP connections per IP address, counted at accept and
//! refused there, and WebSocket devices per user, counted at the upgrade.
//! A slot is held by the connection (or session) and given back when it is
//! dropped, so a count is always the number of live holders (ARCHITECTURE §5).

use std::any::Any;
use std::collections::HashMap;
use std::net::IpAddr;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use actix_web::body::{EitherBody, MessageBody};
use actix_web::dev::{Extensions, ServiceRequest, ServiceResponse};
use actix_web::middleware::Next;
use actix_web::rt::net::TcpStream;
use actix_web::HttpResponse;
use dashmap::DashMap;
use imcore_actors::{DeviceId, UserId};
use serde_json::json;

use super::error::ApiError;
use crate::protocol::ErrorCode;

/// Open TCP connections per peer address (`limits.max_connections_per_ip`; 0: no cap).
pub struct PerIp {
    max: usize,
    open: DashMap<IpAddr, usize>,
}

/// Held in a connection's extensions: its count goes when the connection does.
struct IpSlot {
    caps: Arc<PerIp>,
    ip: IpAddr,
}

impl PerIp {
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(Self { max, open: DashMap::new() })
    }

    fn admit(self: &Arc<Self>, ip: IpAddr) -> Option<IpSlot> {
        let mut open = self.open.entry(ip).or_insert(0);
        if self.max > 0 && *open >= self.max {
            return None;
        }
        *open += 1;
        Some(IpSlot { caps: self.clone(), ip })
    }

    /// Connections open from `ip` now.
    pub fn open(&self, ip: IpAddr) -> usize {
        self.open.get(&ip).map_or(0, |n| *n)
    }

    /// `HttpServer::on_connect`: a connection within the cap gets its slot; one
    /// past it is answered `TOO_MANY_CONNECTIONS` at once and marked
    /// [`Refused`], so no request of it runs ([`refused_connection`]).
    pub fn on_connect(self: &Arc<Self>, io: &dyn Any, ext: &mut Extensions) {
        let Some(stream) = io.downcast_ref::<TcpStream>() else { return };
        let Ok(peer) = stream.peer_addr() else { return };
        match self.admit(peer.ip()) {
            Some(slot) => {
                ext.insert(slot);
            }
            None => {
                refuse(stream, self.max);
                ext.insert(Refused);
            }
        }
    }
}

/// Marks a connection refused at accept.
struct Refused;

/// Whether the connection of these extensions was refused at accept (its
/// answer is written): the WebSocket upgrade, which no middleware sees, asks.
pub(super) fn refused(conn_data: &Extensions) -> bool {
    conn_data.get::<Refused>().is_some()
}

/// Middleware: a request on a [`Refused`] connection does not run. Its
/// answer was written at accept and the write side is shut, so this one goes
/// nowhere and the connection closes.
pub async fn refused_connection(
    req: ServiceRequest,
    next: Next<impl MessageBody>,
) -> Result<ServiceResponse<EitherBody<impl MessageBody>>, actix_web::Error> {
    if req.request().conn_data::<Refused>().is_some() {
        let response = HttpResponse::TooManyRequests().force_close().finish();
        return Ok(req.into_response(response).map_into_right_body());
    }
    next.call(req).await.map(ServiceResponse::map_into_left_body)
}

impl Drop for IpSlot {
    fn drop(&mut self) {
        self.caps.open.remove_if_mut(&self.ip, |_, n| {
            *n -= 1;
            *n == 0
        });
    }
}

/// The PROTOCOL §2 answer, written straight to the fresh socket (a few
/// hundred bytes always fit its empty send buffer), then the write side shut
/// (FIN after it). The read side stays open: shutting it would make the
/// kernel answer the client's request with a reset, which can destroy the
/// answer before the client reads it. The connection then lasts until the
/// client closes, its request is refused, or actix-web's head timeout.
fn refuse(stream: &TcpStream, max: usize) {
    let e = ApiError::new(ErrorCode::TooManyConnections, format!("over {max} connections from this address"));
    e.count();
    let body = json!({ "error": e.0 }).to_string();
    let response = format!(
        "HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n{body}",
        body.len()
    );
    let fd = stream.as_raw_fd();
    // Straight to the socket: tokio's `try_write` would not try before the
    // reactor has seen it writable. Best effort: a peer that cannot take it
    // is closed all the same.
    // SAFETY: send(2) and shutdown(2) on a socket the dispatcher owns and
    // keeps open, with a pointer to live bytes and their length; shutdown
    // ends only the write direction, the descriptor stays valid.
    unsafe {
        libc::send(fd, response.as_ptr().cast(), response.len(), libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL);
        libc::shutdown(fd, libc::SHUT_WR);
    }
}

/// Devices with a WebSocket session per user (`limits.max_connections_per_user`;
/// 0: no cap). Counted per device, so a device replacing its own session is
/// always let in, even at the cap.
pub struct PerUser {
    max: usize,
    open: DashMap<UserId, HashMap<DeviceId, usize>>,
}

/// Held by a session; its device's count goes when the session does.
pub struct UserSlot {
    caps: Arc<PerUser>,
    user: UserId,
    device: DeviceId,
}

impl PerUser {
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(Self { max, open: DashMap::new() })
    }

    /// A slot for `device`'s session, or `TOO_MANY_CONNECTIONS` if the user
    /// has `max` other devices in session.
    pub fn admit(self: &Arc<Self>, user: &UserId, device: &DeviceId) -> Result<UserSlot, ApiError> {
        let mut devices = self.open.entry(user.clone()).or_default();
        if self.max > 0 && devices.len() >= self.max && !devices.contains_key(device) {
            return Err(ApiError::new(
                ErrorCode::TooManyConnections,
                format!("over {} devices of this user connected", self.max),
            ));
        }
        *devices.entry(device.clone()).or_insert(0) += 1;
        Ok(UserSlot { caps: self.clone(), user: user.clone(), device: device.clone() })
    }
}

impl Drop for UserSlot {
    fn drop(&mut self) {
        self.caps.open.remove_if_mut(&self.user, |_, devices| {
            if let Some(n) = devices.get_mut(&self.device) {
                *n -= 1;
                if *n == 0 {
                    devices.remove(&self.device);
                }
            }
            devices.is_empty()
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_count_live_holders_and_a_device_already_in_is_let_in_at_the_cap() {
        let ips = PerIp::new(2);
        let ip: IpAddr = [10, 0, 0, 1].into();
        let (a, b) = (ips.admit(ip).expect("1"), ips.admit(ip).expect("2"));
        assert!(ips.admit(ip).is_none(), "third refused");
        assert!(ips.admit([10, 0, 0, 2].into()).is_some(), "another address");
        drop(a);
        let c = ips.admit(ip).expect("a slot came back");
        drop((b, c));
        assert!(ips.open.is_empty(), "no entry left behind");

        let users = PerUser::new(1);
        let (u, d1, d2) =
            (UserId::parse("u").expect("id"), DeviceId::parse("d1").expect("id"), DeviceId::parse("d2").expect("id"));
        let first = users.admit(&u, &d1).expect("first device");
        assert_eq!(users.admit(&u, &d2).err().map(|e| e.code()), Some(ErrorCode::TooManyConnections));
        let again = users.admit(&u, &d1).expect("the same device replacing itself");
        drop((first, again));
        assert!(users.open.is_empty());
        assert!(users.admit(&u, &d2).is_ok());
    }
}
