//! Value syntaxes of the config file that are not YAML's own: sizes (`32MiB`) and UTC timestamps
//! (`2026-12-01T10:00Z`). Durations are humantime's.

/// `1024`, `512KiB`, `10MB`, `32 MiB`: decimal (kB, MB, GB) and binary (KiB, MiB, GiB) units.
pub(crate) fn parse_size(text: &str) -> Option<u64> {
    let text = text.trim();
    let digits = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(digits);
    let number: u64 = number.parse().ok()?;
    let scale: u64 = match unit.trim_start() {
        "" | "B" => 1,
        "k" | "K" | "kB" | "KB" => 1_000,
        "M" | "MB" => 1_000_000,
        "G" | "GB" => 1_000_000_000,
        "Ki" | "KiB" => 1 << 10,
        "Mi" | "MiB" => 1 << 20,
        "Gi" | "GiB" => 1 << 30,
        _ => return None,
    };
    number.checked_mul(scale)
}

const EXPECTED_TIME: &str = "expected a UTC time like \"2026-12-01T10:00Z\"";

/// An RFC 3339 time in UTC (`2026-12-01T10:00Z`, `2026-12-01T10:00:00Z`, `...+00:00`; seconds and
/// their fraction optional, the fraction ignored) as unix seconds.
pub(crate) fn parse_timestamp(text: &str) -> Result<i64, &'static str> {
    let text = text.trim();
    let (date, time) = text.split_once(['T', 't']).ok_or(EXPECTED_TIME)?;
    let time = if let Some(t) = time.strip_suffix(['Z', 'z']) {
        t
    } else if let Some(t) = time
        .strip_suffix("+00:00")
        .or_else(|| time.strip_suffix("-00:00"))
    {
        t
    } else if time.len() > 6 && time[time.len() - 6..].starts_with(['+', '-']) {
        return Err("only UTC times (ending in Z or +00:00) are accepted");
    } else {
        return Err(EXPECTED_TIME);
    };

    let mut d = date.split('-');
    let (year, month, day) = match (d.next(), d.next(), d.next(), d.next()) {
        (Some(y), Some(m), Some(d), None) if y.len() == 4 && m.len() == 2 && d.len() == 2 => {
            (number(y)?, number(m)?, number(d)?)
        }
        _ => return Err(EXPECTED_TIME),
    };
    let time = time
        .split_once('.')
        .map_or(time, |(whole, _fraction)| whole);
    let mut t = time.split(':');
    let (hour, minute, second) = match (t.next(), t.next(), t.next(), t.next()) {
        (Some(h), Some(m), s, None) if h.len() == 2 && m.len() == 2 => {
            let second = match s {
                Some(s) if s.len() == 2 => number(s)?,
                Some(_) => return Err(EXPECTED_TIME),
                None => 0,
            };
            (number(h)?, number(m)?, second)
        }
        _ => return Err(EXPECTED_TIME),
    };
    if !(1..=12).contains(&month)
        || day < 1
        || day > days_in_month(year, month)
        || hour > 23
        || minute > 59
        || second > 59
    {
        return Err("not a valid date and time");
    }
    Ok(days_from_civil(year, month, day) * 86_400 + hour * 3_600 + minute * 60 + second)
}

fn number(digits: &str) -> Result<i64, &'static str> {
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(EXPECTED_TIME);
    }
    digits.parse().map_err(|_| EXPECTED_TIME)
}

fn days_in_month(year: i64, month: i64) -> i64 {
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    match month {
        2 if leap => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_take_decimal_and_binary_units() {
        assert_eq!(parse_size("1024"), Some(1024));
        assert_eq!(parse_size("512KiB"), Some(512 * 1024));
        assert_eq!(parse_size("10MB"), Some(10_000_000));
        assert_eq!(parse_size("32MiB"), Some(32 << 20));
        assert_eq!(parse_size("32 MiB"), Some(32 << 20));
        assert_eq!(parse_size("1GiB"), Some(1 << 30));
        assert_eq!(parse_size("MiB"), None);
        assert_eq!(parse_size("12 parsecs"), None);
        assert_eq!(parse_size("-1"), None);
    }

    #[test]
    fn timestamps_are_utc_unix_seconds() {
        assert_eq!(parse_timestamp("1970-01-01T00:00Z"), Ok(0));
        assert_eq!(parse_timestamp("2026-12-01T10:00Z"), Ok(1_796_119_200));
        assert_eq!(parse_timestamp("2026-12-01T10:00:00Z"), Ok(1_796_119_200));
        assert_eq!(
            parse_timestamp("2026-12-01T10:00:00+00:00"),
            Ok(1_796_119_200)
        );
        assert_eq!(
            parse_timestamp("2026-12-01T10:00:30.250Z"),
            Ok(1_796_119_230)
        );
        assert_eq!(parse_timestamp("2024-02-29T00:00Z"), Ok(1_709_164_800));
    }

    #[test]
    fn timestamps_outside_utc_or_the_calendar_are_rejected() {
        assert!(parse_timestamp("2026-12-01T10:00+02:00")
            .unwrap_err()
            .contains("only UTC"));
        assert!(parse_timestamp("2026-12-01T10:00").is_err());
        assert!(parse_timestamp("2026-12-01").is_err());
        assert!(parse_timestamp("2025-02-29T10:00Z").is_err());
        assert!(parse_timestamp("2026-13-01T10:00Z").is_err());
        assert!(parse_timestamp("2026-12-01T24:00Z").is_err());
        assert!(parse_timestamp("tomorrow").is_err());
    }
}
