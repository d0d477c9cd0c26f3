//! Pushers and notification levels (PROTOCOL v1.3): a device's registrations
//! with push gateways, and a user's level per conversation. Registration also
//! keeps `push_targets` for the user's current conversations, so the notifier
//! finds the new pusher's owner without reading any roster (ARCHITECTURE §5).

use imcore_actors::{ConvId, DeviceId, UserId};
use tokio_postgres::types::{Json, Type};

use super::{Store, StoreError};
use crate::domain::Rejection;

/// A device's registration, checked at the edge.
#[derive(Debug, Clone)]
pub struct NewPusher {
    pub app_id: String,
    pub pushkey: String,
    pub url: String,
    pub lang: Option<String>,
    /// A JSON object handed to the gateway as the device's `data`.
    pub data: Option<serde_json::Value>,
}

/// A user's notification level in a conversation (PROTOCOL v1.3 `set_notify`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotifyLevel {
    All,
    Mentions,
    None,
}

impl NotifyLevel {
    pub fn as_str(self) -> &'static str {
        match self {
            NotifyLevel::All => "all",
            NotifyLevel::Mentions => "mentions",
            NotifyLevel::None => "none",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "all" => Some(NotifyLevel::All),
            "mentions" => Some(NotifyLevel::Mentions),
            "none" => Some(NotifyLevel::None),
            _ => None,
        }
    }
}

/// Locks the device row (two registrations of one device count one after
/// the other), moves or inserts the pusher, counts the device's pushers.
const SET_PUSHER: &str = "
WITH device AS (SELECT 1 FROM devices WHERE user_id = $1 AND device_id = $2 FOR UPDATE),
     upsert AS (
  INSERT INTO pushers (app_id, pushkey, user_id, device_id, url, lang, data)
  SELECT $3, $4, $1, $2, $5, $6, $7 FROM device
  ON CONFLICT (app_id, pushkey) DO UPDATE
     SET user_id = excluded.user_id, device_id = excluded.device_id, url = excluded.url,
         lang = excluded.lang, data = excluded.data, created_at = now()
  RETURNING 1)
SELECT (SELECT count(*) FROM upsert),
       (SELECT count(*) FROM pushers WHERE user_id = $1 AND device_id = $2
         AND (app_id, pushkey) <> ($3, $4))";

/// The user's current conversations become its push targets.
const TARGETS_OF_USER: &str = "
INSERT INTO push_targets (conv_id, user_id)
SELECT conv_id, user_id FROM membership_periods WHERE user_id = $1 AND to_seq IS NULL
ON CONFLICT DO NOTHING";

/// A user left without pushers is no one's push target any more.
const UNTARGET_IF_NONE: &str = "
DELETE FROM push_targets t WHERE t.user_id = $1
   AND NOT EXISTS (SELECT 1 FROM pushers p WHERE p.user_id = $1)";

impl Store {
    /// Registers `pusher` for `user`'s `device` (moving it from wherever the
    /// same `(app_id, pushkey)` was). `BAD_REQUEST` past `max_per_device`.
    pub async fn set_pusher(
        &self,
        user: &UserId,
        device: &DeviceId,
        pusher: &NewPusher,
        max_per_device: i64,
    ) -> Result<(), StoreError> {
        let mut conn = self.pool.get().await?;
        let tx = conn.transaction().await?;
        let (u, d) = (user.as_str(), device.as_str());
        let data = pusher.data.as_ref().map(Json);
        let row = tx
            .query_typed_one(
                SET_PUSHER,
                &[
                    (&u, Type::TEXT),
                    (&d, Type::TEXT),
                    (&pusher.app_id, Type::TEXT),
                    (&pusher.pushkey, Type::TEXT),
                    (&pusher.url, Type::TEXT),
                    (&pusher.lang, Type::TEXT),
                    (&data, Type::JSONB),
                ],
            )
            .await?;
        let (written, others): (i64, i64) = (row.get(0), row.get(1));
        if written == 0 {
            return Err(Rejection::NotFound("device".into()).into());
        }
        if others >= max_per_device {
            // Dropped without commit: nothing changed.
            return Err(Rejection::BadRequest(format!("a device holds at most {max_per_device} pushers")).into());
        }
        tx.execute_typed(TARGETS_OF_USER, &[(&u, Type::TEXT)]).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Removes `user`'s pusher `(app_id, pushkey)`; whether there was one.
    pub async fn remove_pusher(&self, user: &UserId, app_id: &str, pushkey: &str) -> Result<bool, StoreError> {
        let conn = self.pool.get().await?;
        let removed = conn
            .execute_prepared(
                "DELETE FROM pushers WHERE app_id = $1 AND pushkey = $2 AND user_id = $3",
                &[(&app_id, Type::TEXT), (&pushkey, Type::TEXT), (&user.as_str(), Type::TEXT)],
            )
            .await?;
        if removed > 0 {
            conn.execute_prepared(UNTARGET_IF_NONE, &[(&user.as_str(), Type::TEXT)]).await?;
        }
        Ok(removed > 0)
    }

    /// Sets `user`'s level in `conv`; `NOT_MEMBER` unless a current member.
    pub async fn set_notify_level(&self, user: &UserId, conv: &ConvId, level: NotifyLevel) -> Result<(), StoreError> {
        let conn = self.pool.get().await?;
        let set = conn
            .execute_prepared(
                "INSERT INTO notify_levels (user_id, conv_id, level)
                 SELECT $1, $2, $3 FROM membership_periods WHERE conv_id = $2 AND user_id = $1 AND to_seq IS NULL
                 ON CONFLICT (user_id, conv_id) DO UPDATE SET level = excluded.level",
                &[(&user.as_str(), Type::TEXT), (&conv.as_str(), Type::TEXT), (&level.as_str(), Type::TEXT)],
            )
            .await?;
        if set == 0 {
            return Err(Rejection::NotMember.into());
        }
        Ok(())
    }
}
