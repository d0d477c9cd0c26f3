//! One XMPP client session over WebSocket (RFC 7395: one stanza per text
//! frame, so no streaming XML parser is needed): SASL PLAIN (loopback, no
//! TLS), resource binding, a MUC join without history. Stanzas are read by
//! their opening tag only; the peer under test writes them, not a stranger.

use std::time::Duration;

use base64::Engine;
use futures_util::{SinkExt, StreamExt};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

use crate::ws::provision::BoxError;

/// How long one login or join step may take on a loaded machine.
const STEP: Duration = Duration::from_secs(30);

pub struct Xmpp {
    stream: WebSocketStream<TcpStream>,
}

impl Xmpp {
    /// Connects to `url`, authenticates `user@domain` and binds a resource.
    pub async fn login(url: &str, domain: &str, user: &str, password: &str) -> Result<Self, BoxError> {
        let mut req = url.into_client_request()?;
        req.headers_mut().insert("Sec-WebSocket-Protocol", "xmpp".parse()?);
        let host = req.uri().host().ok_or("no host in the WebSocket URL")?.to_owned();
        let port = req.uri().port_u16().unwrap_or(80);
        let tcp = TcpStream::connect((host.as_str(), port)).await?;
        tcp.set_nodelay(true)?;
        let (stream, _) = tokio_tungstenite::client_async(req, tcp).await?;
        let mut x = Self { stream };
        let open = format!("<open xmlns='urn:ietf:params:xml:ns:xmpp-framing' to='{domain}' version='1.0'/>");
        x.send(open.clone()).await?;
        x.expect(|f| f.contains("features"), "stream features").await?;
        let plain = base64::engine::general_purpose::STANDARD.encode(format!("\0{user}\0{password}"));
        x.send(format!("<auth xmlns='urn:ietf:params:xml:ns:xmpp-sasl' mechanism='PLAIN'>{plain}</auth>")).await?;
        let auth = x.expect(|f| f.starts_with("<success") || f.starts_with("<failure"), "SASL outcome").await?;
        if auth.starts_with("<failure") {
            return Err(format!("{user}: authentication failed: {auth}").into());
        }
        x.send(open).await?;
        x.expect(|f| f.contains("features"), "stream features after SASL").await?;
        x.send("<iq type='set' id='bind'><bind xmlns='urn:ietf:params:xml:ns:xmpp-bind'/></iq>".into()).await?;
        let bound = x.expect(|f| f.starts_with("<iq") && attr(f, "id") == Some("bind"), "bind result").await?;
        if attr(&bound, "type") != Some("result") {
            return Err(format!("{user}: bind failed: {bound}").into());
        }
        Ok(x)
    }

    /// Enters `room` as `nick` with no history replayed; done when the room
    /// reflects our own presence (status 110).
    pub async fn join(&mut self, room: &str, nick: &str) -> Result<(), BoxError> {
        self.send(format!(
            "<presence to='{room}/{nick}'><x xmlns='http://jabber.org/protocol/muc'><history maxstanzas='0'/></x></presence>"
        ))
        .await?;
        let me = format!("{room}/{nick}");
        let own = |f: &str| f.starts_with("<presence") && attr(f, "from") == Some(me.as_str());
        let presence = self.expect(own, "own presence in the room").await?;
        if attr(&presence, "type") == Some("error") || !presence.contains("code='110'") {
            return Err(format!("{me}: join refused: {presence}").into());
        }
        Ok(())
    }

    pub async fn send(&mut self, stanza: String) -> Result<(), BoxError> {
        Ok(self.stream.send(Message::Text(stanza)).await?)
    }

    /// The next stanza; an error when the server closed the stream. Cancel-safe.
    pub async fn next(&mut self) -> Result<String, BoxError> {
        loop {
            match self.stream.next().await {
                Some(Ok(Message::Text(t))) if t.starts_with("<close") => {
                    return Err("stream closed by the server".into())
                }
                Some(Ok(Message::Text(t))) => return Ok(t),
                Some(Ok(Message::Close(_))) | None => return Err("connection closed by the server".into()),
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(e.into()),
            }
        }
    }

    /// Ends the stream (best effort: the server may be gone).
    pub async fn close(mut self) {
        let _ = self.send("<close xmlns='urn:ietf:params:xml:ns:xmpp-framing'/>".into()).await;
        let _ = self.stream.close(None).await;
    }

    /// Skips stanzas until one `wanted`; a stream error or `STEP` is a failure.
    async fn expect(&mut self, wanted: impl Fn(&str) -> bool, what: &str) -> Result<String, BoxError> {
        let found = async {
            loop {
                let f = self.next().await?;
                if f.starts_with("<stream:error") {
                    return Err(format!("stream error awaiting {what}: {f}").into());
                }
                if wanted(&f) {
                    return Ok::<_, BoxError>(f);
                }
            }
        };
        tokio::time::timeout(STEP, found).await.map_err(|_| format!("no {what} within {STEP:?}"))?
    }
}

/// The value of attribute `name` in the opening tag of `stanza`.
pub fn attr<'a>(stanza: &'a str, name: &str) -> Option<&'a str> {
    let tag = &stanza[..stanza.find('>')?];
    [format!(" {name}='"), format!(" {name}=\"")].iter().find_map(|start| {
        let from = tag.find(start.as_str())? + start.len();
        let quote = start.chars().last()?;
        tag[from..].find(quote).map(|end| &tag[from..from + end])
    })
}

#[cfg(test)]
mod tests {
    use super::attr;

    #[test]
    fn attributes_are_read_from_the_opening_tag_only() {
        let m = "<message from='r@c.l/u1' type='groupchat' id=\"c0-1\"><body id='x'>t</body></message>";
        assert_eq!(attr(m, "from"), Some("r@c.l/u1"));
        assert_eq!(attr(m, "id"), Some("c0-1"));
        assert_eq!(attr(m, "to"), None);
        assert_eq!(attr("<presence/>", "type"), None);
    }
}
