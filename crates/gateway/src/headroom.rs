//! Headroom: how much of its quota each backend has used in the current minute (from our own
//! accounting and from the upstream's `x-ratelimit-remaining-*` headers), how many requests are
//! in flight, how fast it answers, and whether it is ramping up after a failure streak. The router
//! passes over a backend without headroom before it starts answering 429.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use http::HeaderMap;
use onedoor_config::Limits;

/// A backend that failed this many times in a row and then answered ramps up instead of taking
/// its full share at once.
const STREAK_BEFORE_RAMP: u64 = 3;
const RAMP: Duration = Duration::from_secs(20);
/// The smallest share a ramping backend gets, so it still sees traffic to prove itself.
const RAMP_FLOOR: f64 = 0.1;
/// Upstream-reported remaining quota is trusted for this long after it was seen.
const REMAINING_FRESH_MS: u64 = 10_000;
const WINDOW_SECONDS: usize = 60;

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
        let oldest = (now_ms / 1000).saturating_sub(WINDOW_SECONDS as u64 - 1);
        self.buckets
            .iter()
            .filter(|(second, _, _)| *second >= oldest && *second <= now_ms / 1000)
            .fold((0, 0), |(r, t), (_, br, bt)| (r + br, t + bt))
    }
}

/// What the upstream last said it has left.
#[derive(Debug, Default, Clone, Copy)]
struct Remaining {
    requests: Option<u64>,
    tokens: Option<u64>,
    seen_ms: u64,
}

/// The load of one backend, kept across config reloads while the backend exists.
#[derive(Debug, Default)]
pub struct Load {
    in_flight: AtomicU64,
    window: Mutex<Window>,
    remaining: Mutex<Remaining>,
    latency_ewma_us: AtomicU64,
    failure_streak: AtomicU64,
    ramp_from_ms: AtomicU64,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn header_number(headers: &HeaderMap, name: &str) -> Option<u64> {
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

impl Load {
    /// Counts a request against the window and in flight until the returned guard drops.
    pub fn begin(self: &Arc<Self>, estimated_tokens: u64, now_ms: u64) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        lock(&self.window).add(now_ms, 1, estimated_tokens as i64);
        InFlight {
            load: self.clone(),
            estimated_tokens,
        }
    }

    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Whether a request of `tokens` fits under the backend's limits and what it last reported.
    pub fn fits(&self, limits: &Limits, tokens: u64, now_ms: u64) -> bool {
        if limits
            .max_in_flight
            .is_some_and(|cap| self.in_flight() >= cap)
        {
            return false;
        }
        let (requests, used_tokens) = lock(&self.window).used(now_ms);
        if limits.rpm.is_some_and(|rpm| requests + 1 > rpm)
            || limits.tpm.is_some_and(|tpm| used_tokens + tokens > tpm)
        {
            return false;
        }
        let remaining = *lock(&self.remaining);
        let fresh = now_ms.saturating_sub(remaining.seen_ms) < REMAINING_FRESH_MS;
        !(fresh && (remaining.requests == Some(0) || remaining.tokens.is_some_and(|t| t < tokens)))
    }

    /// Reads `x-ratelimit-remaining-requests` / `-tokens` from an upstream answer.
    pub fn observe(&self, headers: &HeaderMap, now_ms: u64) {
        let requests = header_number(headers, "x-ratelimit-remaining-requests");
        let tokens = header_number(headers, "x-ratelimit-remaining-tokens");
        if requests.is_some() || tokens.is_some() {
            *lock(&self.remaining) = Remaining {
                requests,
                tokens,
                seen_ms: now_ms,
            };
        }
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

    /// The operator's view for `/admin/backends`.
    pub fn view(&self, limits: &Limits, now_ms: u64) -> serde_json::Value {
        let (requests, tokens) = lock(&self.window).used(now_ms);
        let remaining = *lock(&self.remaining);
        let headroom = |limit: Option<u64>, used: u64| limit.map(|l| l.saturating_sub(used));
        serde_json::json!({
            "in_flight": self.in_flight(),
            "max_in_flight": limits.max_in_flight,
            "window": {
                "requests": requests, "tokens": tokens,
                "rpm_limit": limits.rpm, "tpm_limit": limits.tpm,
                "requests_headroom": headroom(limits.rpm, requests),
                "tokens_headroom": headroom(limits.tpm, tokens),
            },
            "upstream_remaining": {
                "requests": remaining.requests, "tokens": remaining.tokens,
                "age_ms": (remaining.seen_ms > 0).then(|| now_ms.saturating_sub(remaining.seen_ms)),
            },
            "latency_ewma_ms": self.latency_ewma_us.load(Ordering::Relaxed) as f64 / 1000.0,
            "share": self.share(now_ms),
        })
    }
}

/// One request counted in flight; settles its token estimate against the measured usage.
#[derive(Debug)]
pub struct InFlight {
    load: Arc<Load>,
    estimated_tokens: u64,
}

impl InFlight {
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
        assert!(!load.fits(&tpm, 400, start + 1000));
        assert!(load.fits(&tpm, 300, start + 1000));
        assert!(load.fits(&tpm, 400, start + 60_000));
    }

    #[test]
    fn in_flight_is_counted_until_the_guard_drops() {
        let load = Arc::new(Load::default());
        let cap = limits(None, None, Some(1));
        let guard = load.begin(1, 0);
        assert!(!load.fits(&cap, 1, 0));
        drop(guard);
        assert!(load.fits(&cap, 1, 0));
    }

    #[test]
    fn an_upstream_reporting_no_tokens_left_is_passed_over_while_that_is_fresh() {
        let load = Load::default();
        let mut headers = HeaderMap::new();
        headers.insert(
            "x-ratelimit-remaining-tokens",
            http::HeaderValue::from_static("50"),
        );
        load.observe(&headers, 5_000);
        assert!(!load.fits(&Limits::default(), 100, 6_000));
        assert!(load.fits(&Limits::default(), 100, 5_000 + REMAINING_FRESH_MS));
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
