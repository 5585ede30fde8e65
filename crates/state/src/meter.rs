//! Meters: what a tenant, a key or a backend has used. A rolling minute of requests and tokens
//! (sixty one-second buckets: a charge leaves the window between 59 and 60 seconds after it was
//! made), the same over the last ten seconds (the eleven buckets that end now, so a charge counts
//! there between 10 and 11 seconds: Azure enforces a sixth of a deployment's rpm in any ten
//! seconds, and a count that may fall short of a real ten seconds would let a burst through),
//! the requests in flight, the tokens of the current UTC day and the spend (in millionths
//! of a dollar) of the current UTC month. The Redis scripts implement the same arithmetic; the
//! memory store uses this module's.

use std::borrow::Cow;
use std::cell::Cell;

/// Seconds in the rolling window.
pub const WINDOW_SECONDS: u64 = 60;
/// Seconds in the short window; a charge counts in it for one bucket more (see the module).
pub const SHORT_WINDOW_SECONDS: u64 = 10;
const DAY_MS: u64 = 86_400_000;

/// Which meter: its hash tag (meters checked together share one, so one script may touch them
/// all on Redis Cluster) and its path under it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MeterKey {
    pub tag: String,
    /// Fixed for a tenant's own meter, so building it allocates only the tag.
    pub path: Cow<'static, str>,
}

impl MeterKey {
    pub fn tenant(tenant: &str) -> Self {
        MeterKey {
            tag: ["t:", tenant].concat(),
            path: Cow::Borrowed("tenant"),
        }
    }

    /// A key of `tenant`: shares the tenant's tag, so both are checked and charged atomically.
    pub fn key(tenant: &str, key: &str) -> Self {
        MeterKey {
            tag: ["t:", tenant].concat(),
            path: Cow::Owned(["key:", key].concat()),
        }
    }

    /// A backend's quota meter, under the routing tag that the routing view reads.
    pub fn backend(backend: &str) -> Self {
        MeterKey {
            tag: "routing".to_owned(),
            path: Cow::Owned(["backend:", backend].concat()),
        }
    }
}

/// The limits one meter enforces; `None` is unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MeterLimits {
    pub rpm: Option<u64>,
    pub tpm: Option<u64>,
    pub max_in_flight: Option<u64>,
    pub tokens_per_day: Option<u64>,
    pub micro_usd_per_month: Option<u64>,
}

/// What one request reserves.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Charge {
    pub tokens: u64,
    pub micro_usd: u64,
    /// How long it may count as in flight if it is never settled (its instance died).
    pub lease_ms: u64,
}

/// One admission: every meter with its limits, and the charge.
#[derive(Debug, Clone)]
pub struct Ask {
    pub meters: Vec<(MeterKey, MeterLimits)>,
    pub charge: Charge,
    /// `false`: count the charge whatever the limits say (a backend's own quota is a routing
    /// preference, not a refusal).
    pub enforce: bool,
}

/// What a meter has used, in its current windows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MeterUsage {
    /// Requests in the rolling minute.
    pub requests: u64,
    /// Tokens in the rolling minute.
    pub tokens: u64,
    /// Requests in the last ten seconds (the short window).
    pub requests_10s: u64,
    /// Tokens in the last ten seconds.
    pub tokens_10s: u64,
    pub in_flight: u64,
    pub day_tokens: u64,
    pub month_micro_usd: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    Rpm,
    Tpm,
    MaxInFlight,
    TokensPerDay,
    UsdPerMonth,
}

impl Limit {
    /// Period quotas end with their period; rate limits free up within a minute.
    pub fn is_period(self) -> bool {
        matches!(self, Limit::TokensPerDay | Limit::UsdPerMonth)
    }

    pub fn name(self) -> &'static str {
        match self {
            Limit::Rpm => "rpm",
            Limit::Tpm => "tpm",
            Limit::MaxInFlight => "max_in_flight",
            Limit::TokensPerDay => "tokens_per_day",
            Limit::UsdPerMonth => "usd_per_month",
        }
    }

    fn code(self) -> u64 {
        match self {
            Limit::Rpm => 1,
            Limit::Tpm => 2,
            Limit::MaxInFlight => 3,
            Limit::TokensPerDay => 4,
            Limit::UsdPerMonth => 5,
        }
    }

    pub(crate) fn from_code(code: u64) -> Option<Limit> {
        [
            Limit::Rpm,
            Limit::Tpm,
            Limit::MaxInFlight,
            Limit::TokensPerDay,
            Limit::UsdPerMonth,
        ]
        .into_iter()
        .find(|l| l.code() == code)
    }
}

/// Why an ask was refused: the first exhausted period quota, else the rate limit that frees last.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// Index into [`Ask::meters`].
    pub meter: usize,
    pub limit: Limit,
    /// When the ask would fit (for a period quota: when the period ends).
    pub retry_after_ms: u64,
    /// What that limit has used (requests, tokens, or millionths of a dollar).
    pub used: u64,
    /// The limit itself, in the same unit.
    pub cap: u64,
    /// What this ask would have added, in the same unit.
    pub asked: u64,
    /// Every meter's usage, same order as the ask.
    pub usage: Vec<MeterUsage>,
}

/// An admitted ask: what it charged where, to be settled with the real numbers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    pub meters: Vec<MeterKey>,
    /// The window bucket, UTC day and month the charge went to (store time).
    pub second: u64,
    pub day: u64,
    pub month: u64,
    pub tokens: u64,
    pub micro_usd: u64,
    /// Its entry among the requests in flight.
    pub member: u64,
    /// Every meter's usage including this charge, same order as the ask.
    pub usage: Vec<MeterUsage>,
    /// Made in the shared store (else in an instance's own memory): settled where it was made.
    pub shared: bool,
}

impl Reservation {
    /// The part of this reservation that lies in the rolling minute: settling it at zero takes
    /// the charge out of the minute's window (and, with `release`, out of flight) and leaves the
    /// UTC day's and month's counts as they are, since day and month 0 (January 1970) are no
    /// store's bucket on a real clock. A charge held for later (a batch against
    /// `tokens_per_day`) is not this minute's load.
    pub fn minute_part(&self) -> Reservation {
        Reservation {
            day: 0,
            month: 0,
            ..self.clone()
        }
    }

    /// The part of this reservation in its UTC day and month: settling it replaces those
    /// charges and leaves every rolling-minute window as it is, since second 0 is in none on a
    /// real clock. For a
    /// charge whose minute part was settled already.
    pub fn period_part(&self) -> Reservation {
        Reservation {
            second: 0,
            ..self.clone()
        }
    }
}

/// A reservation's final numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settlement {
    pub tokens: u64,
    pub micro_usd: u64,
    /// The request is over: it no longer counts in flight.
    pub release: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Admitted(Reservation),
    Refused(Refusal),
}

/// The rolling minute as sixty one-second buckets of (second, requests, tokens).
#[derive(Debug, Clone)]
pub(crate) struct Window {
    buckets: [(u64, u64, u64); WINDOW_SECONDS as usize],
    /// The minute's sum as of one second, kept up to date by the charges and corrections of
    /// that second: every request of a second reads it instead of summing sixty buckets.
    sum: Cell<Option<Sum>>,
}

/// The requests and tokens of the minute that ends with `second`.
#[derive(Debug, Clone, Copy)]
struct Sum {
    second: u64,
    requests: u64,
    tokens: u64,
}

impl Default for Window {
    fn default() -> Self {
        Window {
            buckets: [(u64::MAX, 0, 0); WINDOW_SECONDS as usize],
            sum: Cell::new(None),
        }
    }
}

fn live(bucket_second: u64, second: u64) -> bool {
    bucket_second != u64::MAX && bucket_second <= second && bucket_second + WINDOW_SECONDS > second
}

impl Window {
    /// The requests and tokens of the minute that ends with `second`.
    pub fn used(&self, second: u64) -> (u64, u64) {
        if let Some(sum) = self.sum.get().filter(|sum| sum.second == second) {
            return (sum.requests, sum.tokens);
        }
        let (requests, tokens) = self.summed(second);
        self.sum.set(Some(Sum {
            second,
            requests,
            tokens,
        }));
        (requests, tokens)
    }

    /// The requests and tokens of the short window that ends with `second`: its bucket and the
    /// ten before it.
    pub fn recent(&self, second: u64) -> (u64, u64) {
        (second.saturating_sub(SHORT_WINDOW_SECONDS)..=second).fold((0, 0), |(r, t), s| match self
            .buckets[(s % WINDOW_SECONDS) as usize]
        {
            (held, br, bt) if held == s => (r + br, t + bt),
            _ => (r, t),
        })
    }

    /// The minute's sum, bucket by bucket.
    fn summed(&self, second: u64) -> (u64, u64) {
        // Without a branch a bucket, so the sum over the minute compiles to straight-line code.
        self.buckets.iter().fold((0, 0), |(r, t), (s, br, bt)| {
            let counted = u64::from(live(*s, second));
            (r + br * counted, t + bt * counted)
        })
    }

    pub fn add(&mut self, second: u64, requests: u64, tokens: u64) {
        let slot = &mut self.buckets[(second % WINDOW_SECONDS) as usize];
        // A bucket taken over held a second at least a minute away from `second`: outside the
        // minute that ends with it, so that minute's sum only gains the charge. Any other
        // minute's sum may lose the old bucket, and is summed again when next read.
        if slot.0 != second {
            *slot = (second, 0, 0);
        }
        slot.1 += requests;
        slot.2 += tokens;
        let sum = self.sum.get_mut();
        match sum {
            Some(sum) if sum.second == second => {
                sum.requests += requests;
                sum.tokens += tokens;
            }
            _ => *sum = None,
        }
    }

    /// Changes the tokens charged in `second` by `delta`, if that bucket is still in the window.
    pub fn adjust(&mut self, second: u64, delta: i64) {
        let slot = &mut self.buckets[(second % WINDOW_SECONDS) as usize];
        if slot.0 != second {
            return;
        }
        let before = slot.2;
        slot.2 = before.saturating_add_signed(delta);
        let after = slot.2;
        if let Some(sum) = self
            .sum
            .get_mut()
            .as_mut()
            .filter(|s| live(second, s.second))
        {
            sum.tokens = sum.tokens - before + after;
        }
    }

    /// Milliseconds from `now_ms` until the window has room for `requests` more under `cap`
    /// (or `tokens` more, with `tokens_mode`): when the oldest buckets that must go have left it.
    pub fn frees_in(&self, now_ms: u64, cap: u64, asked: u64, tokens_mode: bool) -> u64 {
        let second = now_ms / 1000;
        let mut live: Vec<(u64, u64)> = self
            .buckets
            .iter()
            .filter(|(s, _, _)| live(*s, second))
            .map(|(s, r, t)| (*s, if tokens_mode { *t } else { *r }))
            .collect();
        live.sort_unstable();
        let mut used: u64 = live.iter().map(|(_, v)| v).sum();
        for (s, v) in live {
            used -= v;
            if used + asked <= cap {
                return ((s + WINDOW_SECONDS) * 1000).saturating_sub(now_ms).max(1);
            }
        }
        WINDOW_SECONDS * 1000
    }
}

/// The UTC day number of a time.
pub fn day_of(now_ms: u64) -> u64 {
    now_ms / DAY_MS
}

/// `year * 12 + month - 1` of a UTC day number.
pub fn month_of(day: u64) -> u64 {
    let (y, m, _) = civil_from_days(day as i64);
    (y * 12 + m - 1) as u64
}

/// Milliseconds until the UTC day of `now_ms` ends.
pub fn day_ends_in(now_ms: u64) -> u64 {
    (day_of(now_ms) + 1) * DAY_MS - now_ms
}

/// Milliseconds until the UTC month of `now_ms` ends.
pub fn month_ends_in(now_ms: u64) -> u64 {
    let month = month_of(day_of(now_ms)) as i64 + 1;
    let next = days_from_civil(month / 12, month % 12 + 1, 1);
    (next as u64 * DAY_MS).saturating_sub(now_ms)
}

/// (year, month 1-12, day 1-31) of a day count since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The refusal for one meter, if any: period quotas first, then rate limits.
pub(crate) struct Check {
    pub limit: Limit,
    pub retry_after_ms: u64,
    pub used: u64,
    pub cap: u64,
    pub asked: u64,
}

/// Picks the refusal an ask gets from every failing check: the first period quota, else the
/// rate limit that frees last.
pub(crate) fn pick(failing: Vec<(usize, Check)>) -> Option<(usize, Check)> {
    let mut rate: Option<(usize, Check)> = None;
    for (meter, check) in failing {
        if check.limit.is_period() {
            return Some((meter, check));
        }
        if rate
            .as_ref()
            .is_none_or(|(_, r)| check.retry_after_ms > r.retry_after_ms)
        {
            rate = Some((meter, check));
        }
    }
    rate
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kept_sum_of_the_minute_is_always_the_sum_of_its_buckets() {
        // A long random walk of charges, corrections and reads, seconds mostly moving on (a
        // few at a time, sometimes a minute or more, sometimes back): every read must equal
        // the sum over the buckets.
        let mut w = Window::default();
        let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut random = move |n: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % n
        };
        let mut second = 1_000u64;
        for _ in 0..200_000 {
            match random(100) {
                0..=39 => w.add(second, 1, random(500)),
                40..=59 => {
                    let back = random(70);
                    w.adjust(second.saturating_sub(back), random(600) as i64 - 300);
                }
                60..=89 => {
                    let at = second.saturating_sub(random(3));
                    assert_eq!(w.used(at), w.summed(at), "at second {at}");
                }
                90..=97 => second += random(3),
                98 => second += 55 + random(10),
                _ => second = second.saturating_sub(random(5)),
            }
        }
    }

    #[test]
    fn a_charge_leaves_the_window_sixty_seconds_after_its_second() {
        let mut w = Window::default();
        w.add(100, 1, 50);
        w.add(130, 1, 20);
        assert_eq!(w.used(159), (2, 70));
        assert_eq!(w.used(160), (1, 20));
        // Room for 40 more tokens under 100 comes when second 100 leaves: at 160.000 s.
        assert_eq!(w.frees_in(159_500, 100, 40, true), 500);
        assert_eq!(w.frees_in(159_500, 100, 90, true), 30_500);
        assert_eq!(w.frees_in(159_500, 10, 11, true), 60_000);
        w.adjust(130, -15);
        w.adjust(99, 1000);
        assert_eq!(w.used(159), (2, 55));
    }

    #[test]
    fn a_charge_counts_in_the_short_window_for_its_second_and_the_ten_after() {
        let mut w = Window::default();
        w.add(100, 1, 50);
        w.add(105, 2, 20);
        assert_eq!(w.recent(105), (3, 70));
        assert_eq!(w.recent(110), (3, 70));
        assert_eq!(w.recent(111), (2, 20));
        assert_eq!(w.recent(116), (0, 0));
        w.adjust(105, 5);
        assert_eq!(w.recent(115), (2, 25));
        // A bucket reused a minute later holds the new second only.
        w.add(160, 1, 1);
        assert_eq!(w.recent(160), (1, 1));
    }

    #[test]
    fn days_and_months_are_utc_calendar_periods() {
        // 2026-12-01T10:00Z
        let t = 1_796_119_200_000;
        assert_eq!(month_of(day_of(t)), 2026 * 12 + 11);
        assert_eq!(day_ends_in(t), 14 * 3_600_000);
        // December has 31 days: the month ends 30 days and 14 hours later.
        assert_eq!(month_ends_in(t), (30 * 24 + 14) * 3_600_000);
        // 2024-02-29 is a leap day; March follows.
        let leap = days_from_civil(2024, 2, 29);
        assert_eq!(civil_from_days(leap), (2024, 2, 29));
        assert_eq!(civil_from_days(leap + 1), (2024, 3, 1));
        assert_eq!(days_from_civil(1970, 1, 1), 0);
    }
}
