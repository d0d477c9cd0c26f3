use chrono::{DateTime, SecondsFormat, Utc};

/// PROTOCOL §1: RFC 3339 UTC with milliseconds, e.g. `2026-11-30T02:13:47.123Z`.
pub fn format_time(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}
