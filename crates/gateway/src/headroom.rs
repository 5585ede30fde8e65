//! Headroom: how much of its quota each backend has used in the current minute (from the
//! accounting in the state store, the same numbers on every instance, and from the upstream's
//! `x-ratelimit-remaining-*` headers), how many requests are in flight, how fast it answers, and
//! whether it is ramping up after a failure streak. The router passes over a backend without
//! headroom before it starts answering 429. A backend without `limits` is counted here only.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use http::{HeaderMap, HeaderName};
use onedoor_config::{Backend, Limits};
use onedoor_state::{Ask, Charge, Detached, MeterKey, MeterLimits, MeterUsage, Settlement, Store};

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
        let (in_flight, requests, used_tokens) = match shared {
            Some(usage) => (usage.in_flight, usage.requests, usage.tokens),
            None => {
                let (requests, tokens) = lock(&self.window).used(now_ms);
                (self.in_flight(), requests, tokens)
            }
        };
        if limits.max_in_flight.is_some_and(|cap| in_flight >= cap) {
            return false;
        }
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
        let requests = header_number(headers, &REMAINING_REQUESTS);
        let tokens = header_number(headers, &REMAINING_TOKENS);
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

    /// The operator's view for `/admin/backends`: the shared counts when the backend is
    /// metered, else this instance's.
    pub fn view(
        &self,
        limits: &Limits,
        shared: Option<MeterUsage>,
        now_ms: u64,
    ) -> serde_json::Value {
        let (local_requests, local_tokens) = lock(&self.window).used(now_ms);
        let (in_flight, requests, tokens) = match shared {
            Some(u) => (u.in_flight, u.requests, u.tokens),
            None => (self.in_flight(), local_requests, local_tokens),
        };
        let remaining = *lock(&self.remaining);
        let headroom = |limit: Option<u64>, used: u64| limit.map(|l| l.saturating_sub(used));
        serde_json::json!({
            "counted": if shared.is_some() { "shared" } else { "this_instance" },
            "this_instance": { "in_flight": self.in_flight(), "requests": local_requests, "tokens": local_tokens },
            "in_flight": in_flight,
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
        assert!(!load.fits(&tpm, None, 400, start + 1000));
        assert!(load.fits(&tpm, None, 300, start + 1000));
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
        load.observe(&headers, 5_000);
        assert!(!load.fits(&Limits::default(), None, 100, 6_000));
        assert!(load.fits(&Limits::default(), None, 100, 5_000 + REMAINING_FRESH_MS));
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
