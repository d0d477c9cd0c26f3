//! The `since` token handed out with an inbox page and with each delta, and
//! read back by the next delta (PROTOCOL §7). What it holds, and why no
//! change is missed, is told in `changes`.

use super::connection::PooledClient;
use chrono::{DateTime, Utc};

use super::StoreError;

const SINCE_NOW: &str = "
SELECT date_trunc('milliseconds', least(now(), (SELECT min(xact_start) FROM pg_stat_activity
                                                WHERE datname = current_database() AND state <> 'idle')))";

/// A new token (`changes` module docs). Poll it before the statements it goes with.
pub(super) async fn since_token(c: &PooledClient) -> Result<String, StoreError> {
    let at: DateTime<Utc> = c.query_prepared_one(SINCE_NOW, &[]).await?.get(0);
    Ok(hex::encode(at.timestamp_millis().to_string()))
}

/// The time a token of ours holds; `None` for any other string.
pub(super) fn decode_token(token: &str) -> Option<DateTime<Utc>> {
    let millis: i64 = String::from_utf8(hex::decode(token).ok()?).ok()?.parse().ok()?;
    DateTime::from_timestamp_millis(millis)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_decodes_to_its_time_and_anything_else_to_nothing() {
        assert_eq!(decode_token(&hex::encode("1790000000123")).map(|t| t.timestamp_millis()), Some(1_790_000_000_123));
        for bad in ["", "zz", &hex::encode("x1"), &hex::encode("99999999999999999999")] {
            assert_eq!(decode_token(bad), None, "{bad}");
        }
    }
}
