//! Headroom: how much of its quota each backend has used in the current minute and in the last
//! ten seconds (from the accounting in the state store, the same numbers on every instance, and
//! from the upstream's `x-ratelimit-remaining-*` headers, trusted until the reset the upstream
//! gave), how many requests are in flight, how fast it answers, and whether it is ramping up after
//! a failure streak. The router passes over a backend without headroom before it starts answering
//! 429. A backend without `limits` is counted here only.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use http::{HeaderMap, HeaderName};
use onedoor_config::{Backend, Limits};
use onedoor_state::{
    Ask, Charge, Detached, MeterKey, MeterLimits, MeterUsage, Settlement, Store,
    SHORT_WINDOW_SECONDS,
};

use crate::outcome;

/// A backend that failed this many times in a row and then answered ramps up instead of taking
/// its full share at once.
const STREAK_BEFORE_RAMP: u64 = 3;
const RAMP: Duration = Duration::from_secs(20);
/// The smallest share a ramping backend gets, so it still sees traffic to prove itself.
const RAMP_FLOOR: f64 = 0.1;
/// Upstream-reported remaining quota is trusted for this long after it was seen when the
/// upstream said neither when it resets nor when to retry.
const REMAINING_FRESH_MS: u64 = 10_000;
const WINDOW_SECONDS: usize = 60;
/// Azure enforces a sixth of a deployment's per-minute limits in any ten seconds.
const SHORT_WINDOWS_A_MINUTE: u64 = 6;

/// Requests and tokens per second over the last minute, as a ring of one-second buckets.
#[derive(Debug, Default)]
struct Window {
    buckets: Vec<(u64, u64, u64)>,
}

impl Window {
    fn bucket(&mut self, now_ms: u64) -> &mut (u64, u64, u64) {
        if self.buckets.is_empty() {
            self.buckets = vec![(0, 0, 0); WINDOW_SECONDS];
        }
        let second = now_ms / 1000;
        let slot = &mut self.buckets[(second as usize) % WINDOW_SECONDS];
        if slot.0 != second {
            *slot = (second, 0, 0);
        }
        slot
    }

    fn add(&mut self, now_ms: u64, requests: u64, tokens: i64) {
        let bucket = self.bucket(now_ms);
        bucket.1 += requests;
        bucket.2 = bucket.2.saturating_add_signed(tokens);
    }

    /// (requests, tokens) in the minute ending now.
    fn used(&self, now_ms: u64) -> (u64, u64) {
        self.since(now_ms, WINDOW_SECONDS as u64 - 1)
    }

    /// (requests, tokens) in the short window ending now: this second and the ten before, as
    /// the state store counts it.
    fn recent(&self, now_ms: u64) -> (u64, u64) {
        self.since(now_ms, SHORT_WINDOW_SECONDS)
    }

    /// (requests, tokens) of the current second and the `seconds` before it.
    fn since(&self, now_ms: u64, seconds: u64) -> (u64, u64) {
        let now = now_ms / 1000;
        let oldest = now.saturating_sub(seconds);
        self.buckets
            .iter()
            .filter(|(second, _, _)| *second >= oldest && *second <= now)
            .fold((0, 0), |(r, t), (_, br, bt)| (r + br, t + bt))
    }
}

/// What a backend has used, in its windows, as headroom compares it with its limits.
#[derive(Debug, Clone, Copy)]
struct Used {
    in_flight: u64,
    requests: u64,
    tokens: u64,
    requests_10s: u64,
    tokens_10s: u64,
}

impl Used {
    /// Whether one more request of `tokens` stays under every limit: the minute's, and a sixth
    /// of it in the last ten seconds. A request alone in its ten seconds always fits there, so a
    /// request larger than a sixth of `tpm` still goes to an idle backend.
    fn fits(&self, limits: &Limits, tokens: u64) -> bool {
        let short = |limit: u64| (limit / SHORT_WINDOWS_A_MINUTE).max(1);
        let in_flight = limits.max_in_flight.is_none_or(|cap| self.in_flight < cap);
        let minute = limits.rpm.is_none_or(|rpm| self.requests < rpm)
            && limits.tpm.is_none_or(|tpm| self.tokens + tokens <= tpm);
        let ten_seconds = limits.rpm.is_none_or(|rpm| self.requests_10s < short(rpm))
            && limits
                .tpm
                .is_none_or(|tpm| self.tokens_10s == 0 || self.tokens_10s + tokens <= short(tpm));
        in_flight && minute && ten_seconds
    }
}

/// What the upstream last said it has left, and until when each reading holds.
#[derive(Debug, Default, Clone, Copy)]
struct Remaining {
    requests: Option<u64>,
    tokens: Option<u64>,
    seen_ms: u64,
    requests_until_ms: u64,
    tokens_until_ms: u64,
}

impl Remaining {
    /// Whether a request of `tokens` is more than the upstream said it has left, at `now_ms`.
    fn refuses(&self, tokens: u64, now_ms: u64) -> bool {
        let no_requests = self.requests == Some(0) && now_ms < self.requests_until_ms;
        let few_tokens = self.tokens.is_some_and(|t| t < tokens) && now_ms < self.tokens_until_ms;
        no_requests || few_tokens
    }

    /// The operator's view of one reading: its value and how long it still holds.
    fn view(value: Option<u64>, until_ms: u64, now_ms: u64) -> (Option<u64>, Option<u64>) {
        let left = value.map(|_| until_ms.saturating_sub(now_ms));
        (value, left)
    }
}

/// The load of one backend, kept across config reloads while the backend exists.
#[derive(Default)]
pub struct Load {
    /// Requests this instance has in flight, and its own window (for operators).
    in_flight: AtomicU64,
    window: Mutex<Window>,
    remaining: Mutex<Remaining>,
    latency_ewma_us: AtomicU64,
    failure_streak: AtomicU64,
    ramp_from_ms: AtomicU64,
    /// The backend's meter in the state store, when it has limits.
    meter: ArcSwapOption<Meter>,
    /// Malformed upstream stream events dropped by relays (for metrics).
    malformed_events: AtomicU64,
}

/// Where a backend with limits is counted for every instance.
struct Meter {
    store: Arc<Store>,
    key: MeterKey,
    /// How long a request counts in flight if its instance dies first.
    lease_ms: u64,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The headers in which a backend says what is left of its quota: requests, then tokens.
pub const REMAINING_REQUESTS: HeaderName =
    HeaderName::from_static("x-ratelimit-remaining-requests");
pub const REMAINING_TOKENS: HeaderName = HeaderName::from_static("x-ratelimit-remaining-tokens");
/// The headers in which a backend says when each of those counts resets: requests, then tokens.
pub const RESET_REQUESTS: HeaderName = HeaderName::from_static("x-ratelimit-reset-requests");
pub const RESET_TOKENS: HeaderName = HeaderName::from_static("x-ratelimit-reset-tokens");

fn header_number(headers: &HeaderMap, name: &HeaderName) -> Option<u64> {
    let value = headers
        .get(name)?
        .to_str()
        .ok()?
        .trim()
        .parse::<i64>()
        .ok()?;
    // Azure sometimes reports -1 for "unknown".
    u64::try_from(value).ok()
}

/// A reset as an upstream writes it: OpenAI's Go durations (`20ms`, `1s`, `1.5s`, `6m0s`), or
/// Azure's plain seconds (`60`, `0.5`).
fn reset_after(value: &str) -> Option<Duration> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<f64>() {
        return Duration::try_from_secs_f64(seconds).ok();
    }
    let mut rest = value;
    let mut total = Duration::ZERO;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit() && c != '.')
            .filter(|&at| at > 0)?;
        let number: f64 = rest[..digits].parse().ok()?;
        let unit_len = rest[digits..]
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len() - digits);
        let unit = match &rest[digits..digits + unit_len] {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "us" | "µs" => 1e-6,
            "ns" => 1e-9,
            _ => return None,
        };
        total += Duration::try_from_secs_f64(number * unit).ok()?;
        rest = &rest[digits + unit_len..];
    }
    Some(total)
}

fn header_reset(headers: &HeaderMap, name: &HeaderName) -> Option<Duration> {
    reset_after(headers.get(name)?.to_str().ok()?)
}

impl Load {
    /// Counts `backend` in `store` when it has limits (and stops when it has none), so headroom
    /// sees what every instance sends it. Called for each config the backend appears in.
    pub fn meter_in(&self, store: &Arc<Store>, backend: &Backend) {
        let limits = &backend.limits;
        let metered =
            limits.rpm.is_some() || limits.tpm.is_some() || limits.max_in_flight.is_some();
        let meter = metered.then(|| {
            Arc::new(Meter {
                store: store.clone(),
                key: MeterKey::backend(&backend.name),
                lease_ms: backend.timeouts.total.as_millis() as u64 + 5_000,
            })
        });
        self.meter.store(meter);
    }

    /// Whether the backend is counted in the state store (the routing view reads its usage).
    pub fn metered(&self) -> bool {
        self.meter.load().is_some()
    }

    /// Counts a request against the window and in flight until the returned guard drops.
    pub fn begin(self: &Arc<Self>, estimated_tokens: u64, now_ms: u64) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        lock(&self.window).add(now_ms, 1, estimated_tokens as i64);
        let shared = self.meter.load_full().map(|meter| {
            let ask = Ask {
                meters: vec![(meter.key.clone(), MeterLimits::default())],
                charge: Charge {
                    tokens: estimated_tokens,
                    micro_usd: 0,
                    lease_ms: meter.lease_ms,
                },
                enforce: false,
            };
            let charged = meter.store.admit_detached(ask);
            (meter, charged)
        });
        InFlight {
            load: self.clone(),
            estimated_tokens,
            shared,
        }
    }

    /// Malformed upstream stream events dropped on this backend so far.
    pub fn malformed_events(&self) -> u64 {
        self.malformed_events.load(Ordering::Relaxed)
    }

    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Whether a request of `tokens` fits under the backend's limits and what it last reported.
    /// `shared` is the backend's usage across instances (from the routing view) when it is
    /// metered; without it this instance's own counts decide.
    pub fn fits(
        &self,
        limits: &Limits,
        shared: Option<MeterUsage>,
        tokens: u64,
        now_ms: u64,
    ) -> bool {
        self.used(shared, now_ms).fits(limits, tokens)
            && !lock(&self.remaining).refuses(tokens, now_ms)
    }

    /// The shared usage when there is one, else this instance's own windows.
    fn used(&self, shared: Option<MeterUsage>, now_ms: u64) -> Used {
        match shared {
            Some(usage) => Used {
                in_flight: usage.in_flight,
                requests: usage.requests,
                tokens: usage.tokens,
                requests_10s: usage.requests_10s,
                tokens_10s: usage.tokens_10s,
            },
            None => {
                let window = lock(&self.window);
                let ((requests, tokens), (requests_10s, tokens_10s)) =
                    (window.used(now_ms), window.recent(now_ms));
                Used {
                    in_flight: self.in_flight(),
                    requests,
                    tokens,
                    requests_10s,
                    tokens_10s,
                }
            }
        }
    }

    /// Reads `x-ratelimit-remaining-requests` / `-tokens` from an upstream answer (`throttled`:
    /// a 429). Each reading holds until the reset the upstream gave for it
    /// (`x-ratelimit-reset-*`), else until its Retry-After, else for [`REMAINING_FRESH_MS`]; a
    /// 429's never past the cooldown it causes, after which the backend is asked again.
    pub fn observe(&self, headers: &HeaderMap, throttled: bool, now_ms: u64) {
        let requests = header_number(headers, &REMAINING_REQUESTS);
        let tokens = header_number(headers, &REMAINING_TOKENS);
        if requests.is_none() && tokens.is_none() {
            return;
        }
        let retry_after = outcome::retry_after(headers);
        let cooldown = throttled.then(|| retry_after.unwrap_or(outcome::DEFAULT_COOLDOWN));
        let until = |reset: Option<Duration>| {
            let holds = reset
                .or(retry_after)
                .unwrap_or(Duration::from_millis(REMAINING_FRESH_MS));
            let holds = cooldown.map_or(holds, |cooldown| holds.min(cooldown));
            now_ms.saturating_add(holds.as_millis() as u64)
        };
        *lock(&self.remaining) = Remaining {
            requests,
            tokens,
            seen_ms: now_ms,
            requests_until_ms: until(header_reset(headers, &RESET_REQUESTS)),
            tokens_until_ms: until(header_reset(headers, &RESET_TOKENS)),
        };
    }

    pub fn succeeded(&self, latency: Duration, now_ms: u64) {
        let sample = latency.as_micros() as u64;
        let old = self.latency_ewma_us.load(Ordering::Relaxed);
        let ewma = if old == 0 {
            sample
        } else {
            (old * 4 + sample) / 5
        };
        self.latency_ewma_us.store(ewma, Ordering::Relaxed);
        if self.failure_streak.swap(0, Ordering::Relaxed) >= STREAK_BEFORE_RAMP {
            self.ramp_from_ms.store(now_ms, Ordering::Relaxed);
        }
    }

    pub fn failed(&self) {
        self.failure_streak.fetch_add(1, Ordering::Relaxed);
    }

    /// The fraction of its weight this backend gets now: below 1 while it ramps up.
    pub fn share(&self, now_ms: u64) -> f64 {
        let from = self.ramp_from_ms.load(Ordering::Relaxed);
        if from == 0 {
            return 1.0;
        }
        let elapsed = now_ms.saturating_sub(from) as f64 / RAMP.as_millis() as f64;
        elapsed.clamp(RAMP_FLOOR, 1.0)
    }

    /// The operator's view for `/admin/backends`: the shared counts when the backend is
    /// metered, else this instance's.
    pub fn view(
        &self,
        limits: &Limits,
        shared: Option<MeterUsage>,
        now_ms: u64,
    ) -> serde_json::Value {
        let (local_requests, local_tokens) = lock(&self.window).used(now_ms);
        let used = self.used(shared, now_ms);
        let remaining = *lock(&self.remaining);
        let (remaining_requests, requests_valid_for_ms) =
            Remaining::view(remaining.requests, remaining.requests_until_ms, now_ms);
        let (remaining_tokens, tokens_valid_for_ms) =
            Remaining::view(remaining.tokens, remaining.tokens_until_ms, now_ms);
        let headroom = |limit: Option<u64>, used: u64| limit.map(|l| l.saturating_sub(used));
        let short = |limit: Option<u64>| limit.map(|l| (l / SHORT_WINDOWS_A_MINUTE).max(1));
        serde_json::json!({
            "counted": if shared.is_some() { "shared" } else { "this_instance" },
            "this_instance": { "in_flight": self.in_flight(), "requests": local_requests, "tokens": local_tokens },
            "in_flight": used.in_flight,
            "max_in_flight": limits.max_in_flight,
            "window": {
                "requests": used.requests, "tokens": used.tokens,
                "rpm_limit": limits.rpm, "tpm_limit": limits.tpm,
                "requests_headroom": headroom(limits.rpm, used.requests),
                "tokens_headroom": headroom(limits.tpm, used.tokens),
            },
            "window_10s": {
                "requests": used.requests_10s, "tokens": used.tokens_10s,
                "requests_limit": short(limits.rpm), "tokens_limit": short(limits.tpm),
                "requests_headroom": headroom(short(limits.rpm), used.requests_10s),
                "tokens_headroom": headroom(short(limits.tpm), used.tokens_10s),
            },
            "upstream_remaining": {
                "requests": remaining_requests, "tokens": remaining_tokens,
                "age_ms": (remaining.seen_ms > 0).then(|| now_ms.saturating_sub(remaining.seen_ms)),
                "requests_valid_for_ms": requests_valid_for_ms,
                "tokens_valid_for_ms": tokens_valid_for_ms,
            },
            "latency_ewma_ms": self.latency_ewma_us.load(Ordering::Relaxed) as f64 / 1000.0,
            "share": self.share(now_ms),
        })
    }
}

/// One request counted in flight; settles its token estimate against the measured usage.
pub struct InFlight {
    load: Arc<Load>,
    estimated_tokens: u64,
    /// Its charge on the backend's shared meter.
    shared: Option<(Arc<Meter>, Detached)>,
}

impl InFlight {
    /// A relay of this request dropped a malformed upstream event.
    pub fn dropped_event(&self) {
        self.load.malformed_events.fetch_add(1, Ordering::Relaxed);
    }

    /// Charges the window with what the upstream measured when that is more than the estimate.
    /// Never less: upstreams charge their rate limits with the completion budget at admission
    /// (Azure counts `max_tokens` up front), so the estimate is what the backend's quota saw.
    pub fn settle(&mut self, measured_tokens: u64, now_ms: u64) {
        if measured_tokens > self.estimated_tokens {
            let delta = (measured_tokens - self.estimated_tokens) as i64;
            lock(&self.load.window).add(now_ms, 0, delta);
            self.estimated_tokens = measured_tokens;
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.load.in_flight.fetch_sub(1, Ordering::Relaxed);
        if let Some((meter, charged)) = self.shared.take() {
            let settlement = Settlement {
                tokens: self.estimated_tokens,
                micro_usd: 0,
                release: true,
            };
            meter.store.settle_after(charged, settlement);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(rpm: Option<u64>, tpm: Option<u64>, max_in_flight: Option<u64>) -> Limits {
        Limits {
            rpm,
            tpm,
            max_in_flight,
            ..Limits::default()
        }
    }

    #[test]
    fn a_backend_near_its_tpm_has_no_headroom_until_the_minute_rolls() {
        let load = Arc::new(Load::default());
        let tpm = limits(None, Some(1000), None);
        let start = 1_000_000;
        let mut first = load.begin(600, start);
        first.settle(700, start);
        first.settle(100, start);
        // Past the ten seconds, the minute decides.
        assert!(!load.fits(&tpm, None, 400, start + 11_000));
        assert!(load.fits(&tpm, None, 300, start + 11_000));
        assert!(load.fits(&tpm, None, 400, start + 60_000));
    }

    #[test]
    fn in_flight_is_counted_until_the_guard_drops() {
        let load = Arc::new(Load::default());
        let cap = limits(None, None, Some(1));
        let guard = load.begin(1, 0);
        assert!(!load.fits(&cap, None, 1, 0));
        drop(guard);
        assert!(load.fits(&cap, None, 1, 0));
        // Across instances, the shared count decides.
        let busy = MeterUsage {
            in_flight: 1,
            ..MeterUsage::default()
        };
        assert!(!load.fits(&cap, Some(busy), 1, 0));
    }

    #[test]
    fn an_upstream_reporting_no_tokens_left_is_passed_over_while_that_is_fresh() {
        let load = Load::default();
        let mut headers = HeaderMap::new();
        headers.insert(
            "x-ratelimit-remaining-tokens",
            http::HeaderValue::from_static("50"),
        );
        load.observe(&headers, false, 5_000);
        assert!(!load.fits(&Limits::default(), None, 100, 6_000));
        assert!(load.fits(&Limits::default(), None, 100, 5_000 + REMAINING_FRESH_MS));
    }

    fn answer(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(name, value)| {
                (
                    HeaderName::from_static(name),
                    http::HeaderValue::from_static(value),
                )
            })
            .collect()
    }

    #[test]
    fn a_reading_holds_until_the_reset_the_upstream_gave_for_it() {
        let load = Load::default();
        let headers = answer(&[
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-reset-requests", "1.5s"),
            ("x-ratelimit-remaining-tokens", "0"),
            ("x-ratelimit-reset-tokens", "6m0s"),
        ]);
        load.observe(&headers, false, 1_000);
        let none = Limits::default();
        // Out of requests for 1.5 s; out of tokens for six minutes, past the default.
        assert!(!load.fits(&none, None, 0, 2_499));
        assert!(load.fits(&none, None, 0, 2_500));
        assert!(!load.fits(&none, None, 1, 1_000 + 359_999));
        assert!(load.fits(&none, None, 1, 1_000 + 360_000));
    }

    #[test]
    fn a_429s_reading_ends_with_the_cooldown_it_causes() {
        let load = Load::default();
        let none = Limits::default();
        let throttled = answer(&[
            ("retry-after", "3"),
            ("x-ratelimit-remaining-tokens", "0"),
            ("x-ratelimit-reset-tokens", "30s"),
        ]);
        load.observe(&throttled, true, 10_000);
        assert!(!load.fits(&none, None, 1, 12_999));
        assert!(load.fits(&none, None, 1, 13_000));
        let view = load.view(&none, None, 12_000);
        assert_eq!(view["upstream_remaining"]["tokens_valid_for_ms"], 1_000);
        // Without a Retry-After, the cooldown is the default one.
        load.observe(
            &answer(&[("x-ratelimit-remaining-tokens", "0")]),
            true,
            20_000,
        );
        let cooldown = outcome::DEFAULT_COOLDOWN.as_millis() as u64;
        assert!(!load.fits(&none, None, 1, 20_000 + cooldown - 1));
        assert!(load.fits(&none, None, 1, 20_000 + cooldown));
        // A success's reading without a reset holds for the default time.
        load.observe(
            &answer(&[("x-ratelimit-remaining-tokens", "0")]),
            false,
            30_000,
        );
        assert!(!load.fits(&none, None, 1, 30_000 + REMAINING_FRESH_MS - 1));
    }

    #[test]
    fn resets_read_as_openai_and_azure_write_them() {
        let ms = |value: &str| reset_after(value).map(|d| d.as_millis());
        assert_eq!(ms("20ms"), Some(20));
        assert_eq!(ms("1s"), Some(1_000));
        assert_eq!(ms("1.5s"), Some(1_500));
        assert_eq!(ms("6m0s"), Some(360_000));
        assert_eq!(ms("114h18m0s"), Some(411_480_000));
        assert_eq!(ms("60"), Some(60_000));
        assert_eq!(ms(" 0.25 "), Some(250));
        assert_eq!(ms("soon"), None);
        assert_eq!(ms("5x"), None);
        assert_eq!(ms("-1"), None);
    }

    #[test]
    fn a_sixth_of_the_minute_in_ten_seconds_is_the_short_window_headroom() {
        let load = Arc::new(Load::default());
        let both = limits(Some(60), Some(6_000), None);
        let start = 1_000_000;
        let guards: Vec<InFlight> = (0..9).map(|_| load.begin(10, start)).collect();
        assert!(load.fits(&both, None, 10, start + 500));
        let tenth = load.begin(10, start + 500);
        assert!(!load.fits(&both, None, 10, start + 900));
        // The burst leaves the short window after ten to eleven seconds.
        assert!(!load.fits(&both, None, 10, start + 10_999));
        assert!(load.fits(&both, None, 10, start + 11_000));
        drop((guards, tenth));
        // Tokens likewise: 1000 a ten seconds, but an idle backend takes a larger request.
        let tokens = Arc::new(Load::default());
        assert!(tokens.fits(&both, None, 1_500, start));
        let _big = tokens.begin(900, start);
        assert!(tokens.fits(&both, None, 100, start));
        assert!(!tokens.fits(&both, None, 101, start));
    }

    #[test]
    fn a_backend_back_from_a_failure_streak_ramps_up() {
        let load = Load::default();
        for _ in 0..STREAK_BEFORE_RAMP {
            load.failed();
        }
        load.succeeded(Duration::from_millis(5), 10_000);
        assert!((load.share(10_000) - RAMP_FLOOR).abs() < 1e-9);
        assert!((load.share(10_000 + RAMP.as_millis() as u64 / 2) - 0.5).abs() < 1e-9);
        assert_eq!(load.share(10_000 + RAMP.as_millis() as u64), 1.0);
    }
}
