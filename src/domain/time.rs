use chrono::{DateTime, SecondsFormat, Utc};

/// PROTOCOL §1: RFC 3339 UTC with milliseconds, e.g. `2026-11-30T02:13:47.123Z`.
pub fn format_time(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// A PROTOCOL §1 time from a client: RFC 3339 with any offset, kept in UTC
/// to the millisecond (as stored and echoed). `None` if it is not one.
pub fn parse_time(s: &str) -> Option<DateTime<Utc>> {
    let t = DateTime::parse_from_rfc3339(s).ok()?.with_timezone(&Utc);
    chrono::DurationRound::duration_trunc(t, chrono::Duration::milliseconds(1)).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_parse_to_utc_milliseconds() {
        let t = parse_time("2026-11-30T03:13:47.123456+01:00").expect("a time");
        assert_eq!(format_time(t), "2026-11-30T02:13:47.123Z");
        assert_eq!(parse_time("tomorrow"), None);
        assert_eq!(parse_time("2026-13-01T00:00:00Z"), None);
    }
}
