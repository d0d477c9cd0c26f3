//! What a check runs against: a fresh database and one write path.

/// One `#[actix_web::test]` per check on one write path:
/// `on_path!(module, Path::X, [check, …])` calls `check(Path::X)`.
macro_rules! on_path {
    ($module:ident, $path:expr, [$($check:ident),* $(,)?]) => {
        mod $module {
            $(
                #[actix_web::test]
                async fn $check() {
                    super::$check($path).await
                }
            )*
        }
    };
}

use imcore::config::{EngineSettings, WriteSettings};
use imcore::domain::{Body, Rejection};
use imcore::store::{
    CreateConversation, GroupSettings, SendAck, SendOp, Store, StoreError, SyncPage, SyncRequest, WriteOp, Written,
};
use imcore::writer::{Engine, WriteFailure, Writer};
use imcore_actors::{ClientMsgId, ConvId, DeviceId, UserId};
use serde_json::json;

use crate::harness::TestDb;

pub use imcore::config::WritePath as Path;

pub trait PathName {
    fn name(self) -> &'static str;
}

impl PathName for Path {
    fn name(self) -> &'static str {
        match self {
            Path::Actor => "actor",
            Path::Direct => "direct",
        }
    }
}

/// A write that did not append: refused by a rule, or failed.
#[derive(Debug)]
pub enum WriteErr {
    Rejected(Rejection),
    /// Read through `Debug` when a check records what it observed.
    Failed(#[allow(dead_code)] String),
}

pub struct Env {
    pub db: TestDb,
    pub writer: Writer,
}

pub fn uid(s: &str) -> UserId {
    UserId::parse(s).expect("user id")
}

pub fn cid(s: &str) -> ConvId {
    ConvId::parse(s).expect("conv id")
}

pub fn text(t: &str) -> Body {
    Body::parse(&json!({"type": "text", "text": t}), 16 * 1024).expect("body")
}

pub fn send_op(user: &str, key: &str, body: Body) -> WriteOp {
    WriteOp::Send(SendOp {
        sender: uid(user),
        device: DeviceId::parse("d1").expect("device"),
        client_msg_id: ClientMsgId::parse(key).expect("key"),
        body,
        reply_to: None,
        mentions: Vec::new(),
    })
}

pub async fn write_with(writer: &Writer, conv: &ConvId, op: WriteOp) -> Result<Written, WriteErr> {
    writer.write(conv.clone(), op).await.map_err(|e| match e {
        WriteFailure::Rejected(r) => WriteErr::Rejected(r),
        other => WriteErr::Failed(format!("{other:?}")),
    })
}

pub async fn send_with(writer: &Writer, conv: &ConvId, user: &str, key: &str, body: Body) -> Result<SendAck, WriteErr> {
    match write_with(writer, conv, send_op(user, key, body)).await? {
        Written::Sent(ack) => Ok(ack),
        other => Err(WriteErr::Failed(format!("unexpected {other:?}"))),
    }
}

impl Env {
    pub async fn new(path: Path) -> Self {
        Self::with_pool(path, 16).await
    }

    pub async fn with_pool(path: Path, pool: u32) -> Self {
        let db = TestDb::with_pool(pool).await;
        // The server's engine, commit stage included, on two arbiters.
        let write = WriteSettings { arbiters: 2, ..WriteSettings::on(path) };
        let writer = Engine::start(db.store.clone(), &EngineSettings { write, ..EngineSettings::default() }).writer;
        Self { db, writer }
    }

    pub fn store(&self) -> &Store {
        &self.db.store
    }

    /// Another engine on the same write path over `store` (a pool of its
    /// own on this database, as a second node would have); its conversation
    /// actors commit at most `max_batch` ops a transaction.
    pub fn another_node(&self, store: Store, max_batch: usize) -> Writer {
        // No bus joins these nodes: neither tail would see the other's commits.
        self.store().tail().disable();
        store.tail().disable();
        let write = WriteSettings { arbiters: 2, max_batch, ..WriteSettings::on(self.writer.path()) };
        Engine::start(store, &EngineSettings { write, ..EngineSettings::default() }).writer
    }

    pub async fn write(&self, conv: &ConvId, op: WriteOp) -> Result<Written, WriteErr> {
        write_with(&self.writer, conv, op).await
    }

    pub async fn send(&self, conv: &ConvId, user: &str, key: &str, body: Body) -> Result<SendAck, WriteErr> {
        send_with(&self.writer, conv, user, key, body).await
    }

    /// A group created by `creator` with `members` and default settings.
    pub async fn group(&self, id: &str, creator: &str, members: &[&str]) -> ConvId {
        self.store()
            .create_conversation(&CreateConversation::Group {
                creator: uid(creator),
                conv_id: Some(cid(id)),
                name: id.into(),
                members: members.iter().map(|m| uid(m)).collect(),
                settings: GroupSettings::default(),
            })
            .await
            .expect("create group")
            .info
            .conv_id
    }

    pub async fn users(&self, ids: &[&str]) {
        for id in ids {
            self.store().create_user(&uid(id), None).await.expect("create user");
        }
    }

    pub async fn sync(&self, conv: &ConvId, user: &str, after: i64) -> Result<SyncPage, StoreError> {
        let mut req = SyncRequest::forward(conv.clone(), uid(user), after);
        req.limit = 1000;
        self.store().sync(&req).await
    }

    /// Seqs `user` sees from the start, following `next_after` to the end.
    pub async fn visible_seqs(&self, conv: &ConvId, user: &str) -> Vec<i64> {
        let mut seqs = vec![];
        let mut after = 0;
        loop {
            let page = self.sync(conv, user, after).await.expect("sync");
            seqs.extend(page.events.iter().map(|e| e.seq));
            if !page.has_more {
                return seqs;
            }
            after = page.next_after;
        }
    }

    /// `(count, min(seq), max(seq), next_seq)` of a conversation's log.
    pub async fn log_stats(&self, conv: &ConvId) -> (i64, i64, i64, i64) {
        let c = self.db.client().await;
        let r = c
            .query_one(
                "SELECT count(e.seq), coalesce(min(e.seq), 0), coalesce(max(e.seq), 0),
                        (SELECT next_seq FROM conversations WHERE conv_id = $1)
                   FROM events e WHERE e.conv_id = $1",
                &[&conv.as_str()],
            )
            .await
            .expect("log stats");
        (r.get(0), r.get(1), r.get(2), r.get(3))
    }

    pub async fn head(&self, conv: &ConvId) -> i64 {
        self.log_stats(conv).await.3 - 1
    }
}
