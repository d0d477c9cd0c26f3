//! Users and devices. A device token is 256 random bits shown once; only its
//! SHA-256 is stored, so a database leak yields no usable token.

use imcore_actors::{DeviceId, UserId};
use rand::RngCore;
use sha2::{Digest, Sha256};
use tokio_postgres::error::SqlState;
use tokio_postgres::types::Type;

use super::error::decoded;
use super::{Store, StoreError};
use crate::domain::Rejection;

/// A freshly issued token, returned to the admin once.
#[derive(Debug, Clone)]
pub struct DeviceToken {
    pub user_id: UserId,
    pub device_id: DeviceId,
    pub token: String,
}

/// Whom a token authenticates.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TokenOwner {
    pub user_id: UserId,
    pub device_id: DeviceId,
}

pub fn token_hash(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

impl Store {
    /// `ALREADY_EXISTS` when the id is taken.
    pub async fn create_user(&self, user: &UserId, display_name: Option<&str>) -> Result<(), StoreError> {
        let conn = self.pool.get().await?;
        let inserted = conn
            .execute_prepared(
                "INSERT INTO users (user_id, display_name) VALUES ($1, $2) ON CONFLICT DO NOTHING",
                &[(&user.as_str(), Type::TEXT), (&display_name, Type::TEXT)],
            )
            .await?;
        if inserted == 0 {
            return Err(Rejection::AlreadyExists("user".into()).into());
        }
        Ok(())
    }

    /// Issues a device token; issuing again for the same device rotates it
    /// (the old token stops working at once, the device's pushers are removed). `NOT_FOUND` for an unknown user.
    pub async fn issue_device_token(&self, user: &UserId, device: &DeviceId) -> Result<DeviceToken, StoreError> {
        let mut raw = [0u8; 32];
        rand::thread_rng().fill_bytes(&mut raw);
        let token = hex::encode(raw);
        let hash = token_hash(&token);
        let conn = self.pool.get().await?;
        let result = conn
            .execute_prepared(
                // A new token is a new install as far as pushers go: the old one's go.
                "WITH gone AS (DELETE FROM pushers WHERE user_id = $1 AND device_id = $2)
                 INSERT INTO devices (user_id, device_id, token_hash) VALUES ($1, $2, $3)
                 ON CONFLICT (user_id, device_id) DO UPDATE SET token_hash = excluded.token_hash, rotated_at = now()",
                &[(&user.as_str(), Type::TEXT), (&device.as_str(), Type::TEXT), (&hash.as_slice(), Type::BYTEA)],
            )
            .await;
        match result {
            Ok(_) => Ok(DeviceToken { user_id: user.clone(), device_id: device.clone(), token }),
            Err(e) if e.code() == Some(&SqlState::FOREIGN_KEY_VIOLATION) => {
                Err(Rejection::NotFound("user".into()).into())
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The device a token belongs to, if it is current.
    pub async fn resolve_token(&self, token: &str) -> Result<Option<TokenOwner>, StoreError> {
        let hash = token_hash(token);
        let conn = self.pool.get().await?;
        let row = conn
            .query_prepared_opt(
                "SELECT user_id, device_id FROM devices WHERE token_hash = $1",
                &[(&hash.as_slice(), Type::BYTEA)],
            )
            .await?;
        row.map(|r| {
            Ok(TokenOwner {
                user_id: decoded(UserId::parse(r.get(0)), "user_id")?,
                device_id: decoded(DeviceId::parse(r.get(1)), "device_id")?,
            })
        })
        .transpose()
    }
}
