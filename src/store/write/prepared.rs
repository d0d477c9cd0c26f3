//! The write transaction's hot statements, prepared once per pooled
//! connection (`store::connection`): the lock, the request-key and standing
//! lookups, the append and the one-round-trip append run with no parse or
//! plan of their own.

use tokio_postgres::types::Type;
use tokio_postgres::{Client, Error, Statement};

use super::append::APPEND_EVENTS;
use super::lookup::{
    EXISTING_CONVERSATIONS, LOAD_STANDINGS, LOCK_CONVERSATIONS, LOCK_CONVERSATIONS_SKIP_LOCKED, LOOKUP_REQUEST_KEYS,
};
use super::one_trip::{APPEND_IF_UNCHANGED, APPEND_IF_UNCHANGED_SKIP_LOCKED};

pub struct Prepared {
    pub(super) lock: Statement,
    pub(super) lock_skip_locked: Statement,
    pub(super) existing: Statement,
    pub(super) request_keys: Statement,
    pub(super) standings: Statement,
    pub(super) append: Statement,
    pub(super) append_if_unchanged: Statement,
    pub(super) append_if_unchanged_skip_locked: Statement,
}

impl Prepared {
    /// Prepares every statement in one round trip (the requests of futures
    /// polled together are pipelined).
    pub(in crate::store) async fn prepare(client: &Client) -> Result<Self, Error> {
        use Type as T;
        let texts = [T::TEXT_ARRAY, T::TEXT_ARRAY, T::TEXT_ARRAY];
        let append = [
            T::TEXT_ARRAY,
            T::INT8_ARRAY,
            T::TEXT_ARRAY,
            T::UUID_ARRAY,
            T::TEXT_ARRAY,
            T::TEXT_ARRAY,
            T::TEXT_ARRAY,
            T::BYTEA_ARRAY,
            T::TEXT_ARRAY,
            T::TEXT_ARRAY,
            T::TEXT_ARRAY,
            T::TEXT_ARRAY,
            T::TEXT_ARRAY,
            T::INT8_ARRAY,
            T::BOOL_ARRAY,
            T::TIMESTAMPTZ,
            T::TEXT_ARRAY,
            T::INT8_ARRAY,
            T::INT8_ARRAY,
            T::INT4_ARRAY,
            T::TEXT_ARRAY,
            T::INT8_ARRAY,
            T::BYTEA,
        ];
        let expected = [
            T::TEXT,
            T::INT8,
            T::INT8,
            T::INT8,
            T::BOOL,
            T::TEXT,
            T::TEXT,
            T::TIMESTAMPTZ,
            T::TIMESTAMPTZ,
            T::TEXT_ARRAY,
        ];
        let guarded = [&append[..15], &expected].concat();
        let (
            lock,
            lock_skip_locked,
            existing,
            request_keys,
            standings,
            append,
            append_if_unchanged,
            append_if_unchanged_skip_locked,
        ) = futures_util::try_join!(
            client.prepare_typed(LOCK_CONVERSATIONS, &texts[..1]),
            client.prepare_typed(LOCK_CONVERSATIONS_SKIP_LOCKED, &texts[..1]),
            client.prepare_typed(EXISTING_CONVERSATIONS, &texts[..1]),
            client.prepare_typed(LOOKUP_REQUEST_KEYS, &texts),
            client.prepare_typed(LOAD_STANDINGS, &texts[..2]),
            client.prepare_typed(APPEND_EVENTS, &append),
            client.prepare_typed(APPEND_IF_UNCHANGED, &guarded),
            client.prepare_typed(APPEND_IF_UNCHANGED_SKIP_LOCKED, &guarded),
        )?;
        Ok(Self {
            lock,
            lock_skip_locked,
            existing,
            request_keys,
            standings,
            append,
            append_if_unchanged,
            append_if_unchanged_skip_locked,
        })
    }
}

/// The connection a write transaction runs on, with its prepared statements.
#[derive(Clone, Copy)]
pub(super) struct Conn<'a> {
    pub(super) client: &'a Client,
    pub(super) prepared: &'a Prepared,
}
