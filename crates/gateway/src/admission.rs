//! Tenant limits (contract section 2, `tenants[].limits` and `keys[].limits`): before any upstream
//! is asked, the request's estimate (prompt tokens by the tokenizer, plus `max_tokens` or
//! `routing.default_max_tokens`) and its cost at the dearest target's price are reserved against
//! the tenant's and the key's rpm, tpm, max_in_flight, tokens_per_day and usd_per_month, all at
//! once in the state store; after the answer the reservation is replaced by the measured usage
//! ([`Admission::reconcile`], the one place that does it). Rate limits answer 429 `rate_limited`,
//! period quotas 403 `quota_exceeded`. A tenant without limits costs nothing here.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::HeaderName;
use http_body::{Frame, SizeHint};
use http_body_util::BodyExt;
use onedoor_config::{Alias, Key, KeyOrigin, Limits, Price, Snapshot, Tenant};
use onedoor_state::{
    Ask, Charge, Limit, MeterKey, MeterLimits, MeterUsage, Refusal, Reservation, Settlement, State,
    Store, Unavailable, Verdict,
};

use crate::body::{Body, BoxError};
use crate::errors::GatewayError;
use crate::request::{ClientRequest, Operation};
use crate::router::{self, Candidate, Plan};
use crate::runtime::Runtime;
use crate::stamp::Stamp;
use crate::tokens::{ChatFields, Estimator};
use crate::usage::{UsageReport, UsageSource};

/// A request counts in flight for at most its total timeout and this, if its instance dies
/// before it is settled.
const LEASE_MARGIN: Duration = Duration::from_secs(5);
/// Bodies larger than this are counted off the async threads.
const COUNT_INLINE_BYTES: usize = 256 * 1024;

/// The caller's own limits as `x-ratelimit-*` headers: the tightest of tenant and key.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RateHeaders {
    /// (limit, remaining) requests per minute.
    pub requests: Option<(u64, u64)>,
    /// (limit, remaining) tokens per minute.
    pub tokens: Option<(u64, u64)>,
}

impl RateHeaders {
    /// Adds the headers whose limits the caller has to `stamp`.
    pub fn stamp(&self, stamp: &mut Stamp) {
        const LIMIT_REQUESTS: HeaderName = HeaderName::from_static("x-ratelimit-limit-requests");
        const REMAINING_REQUESTS: HeaderName =
            HeaderName::from_static("x-ratelimit-remaining-requests");
        const LIMIT_TOKENS: HeaderName = HeaderName::from_static("x-ratelimit-limit-tokens");
        const REMAINING_TOKENS: HeaderName =
            HeaderName::from_static("x-ratelimit-remaining-tokens");
        let named = [
            (LIMIT_REQUESTS, self.requests.map(|(cap, _)| cap)),
            (REMAINING_REQUESTS, self.requests.map(|(_, left)| left)),
            (LIMIT_TOKENS, self.tokens.map(|(cap, _)| cap)),
            (REMAINING_TOKENS, self.tokens.map(|(_, left)| left)),
        ];
        for (name, number) in named {
            if let Some(number) = number {
                stamp.add_number(&name, number);
            }
        }
    }

    fn of(meters: &[(MeterKey, MeterLimits)], usage: &[MeterUsage]) -> Self {
        let pairs = || meters.iter().map(|(_, limits)| limits).zip(usage);
        let tightest = |found: Vec<(u64, u64)>| found.into_iter().min_by_key(|(_, left)| *left);
        RateHeaders {
            requests: tightest(
                pairs()
                    .filter_map(|(l, u)| l.rpm.map(|cap| (cap, cap.saturating_sub(u.requests))))
                    .collect(),
            ),
            tokens: tightest(
                pairs()
                    .filter_map(|(l, u)| l.tpm.map(|cap| (cap, cap.saturating_sub(u.tokens))))
                    .collect(),
            ),
        }
    }
}

/// What admission estimated for a request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Estimate {
    /// Prompt tokens, counted by the tokenizer.
    pub prompt: u64,
    /// Completion tokens reserved: `max_tokens`, else `routing.default_max_tokens`.
    pub completion: u64,
}

/// One admitted request's reservation, settled exactly once: by [`Admission::reconcile`] with
/// the measured usage, by [`Admission::keep_estimate`], or (dropped unsettled: no upstream
/// answered) at zero.
pub struct Admission {
    pub headers: RateHeaders,
    /// `Some` when the tokenizer ran (a token limit needed it).
    pub estimate: Option<Estimate>,
    held: Option<Held>,
}

struct Held {
    store: Arc<Store>,
    reservation: Reservation,
    settled: bool,
}

impl Held {
    fn settle(&mut self, tokens: u64, micro_usd: u64) {
        if !self.settled {
            self.settled = true;
            let settlement = Settlement {
                tokens,
                micro_usd,
                release: true,
            };
            self.store.settle_detached(&self.reservation, settlement);
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.settle(0, 0);
    }
}

impl Admission {
    fn unlimited() -> Self {
        Admission {
            headers: RateHeaders::default(),
            estimate: None,
            held: None,
        }
    }

    /// Replaces the reservation with what the upstream measured, priced at the target that
    /// answered. The one place usage reconciles; streams call it when their usage is known.
    pub fn reconcile(&mut self, prompt: u64, completion: u64, price: Option<&Price>) {
        if let Some(held) = self.held.as_mut() {
            held.settle(prompt + completion, micro_usd(price, prompt, completion));
        }
    }

    /// Ends the request's time in flight and keeps its reservation as the charge (an answer
    /// without a usage block).
    pub fn keep_estimate(&mut self) {
        if let Some(held) = self.held.as_mut() {
            let (tokens, usd) = (held.reservation.tokens, held.reservation.micro_usd);
            held.settle(tokens, usd);
        }
    }

    /// A stream's body that keeps the request in flight until it ends; it is then charged at
    /// its estimate, unless [`Admission::reconcile`] ran first.
    pub fn hold(self, body: Body) -> Body {
        self.hold_reporting(body, None)
    }

    /// [`Admission::hold`] for a stream whose relay reports its usage when it ends: a measured
    /// usage reconciles the reservation (priced at `price`), anything else keeps the estimate.
    pub fn hold_until_reported(
        self,
        body: Body,
        report: UsageReport,
        price: Option<Price>,
    ) -> Body {
        self.hold_reporting(body, Some((report, price)))
    }

    fn hold_reporting(self, body: Body, report: Option<(UsageReport, Option<Price>)>) -> Body {
        if self.held.as_ref().is_none_or(|h| h.settled) {
            return body;
        }
        Holding {
            inner: body,
            admission: Some(self),
            report,
        }
        .boxed_unsync()
    }
}

/// The price of the target `candidate` stands for (its own, else its alias's).
pub fn price_of<'a>(alias: &'a Alias, candidate: &Candidate) -> Option<&'a Price> {
    onedoor_usage::price_of(alias, candidate.backend, &candidate.deployment)
}

/// Millionths of a dollar: prices are dollars per million tokens.
pub(crate) fn micro_usd(price: Option<&Price>, prompt: u64, completion: u64) -> u64 {
    price.map_or(0, |p| {
        (prompt as f64 * p.input_per_1m + completion as f64 * p.output_per_1m).ceil() as u64
    })
}

pub(crate) fn meter_limits(limits: &Limits) -> Option<MeterLimits> {
    let meter = MeterLimits {
        rpm: limits.rpm,
        tpm: limits.tpm,
        max_in_flight: limits.max_in_flight,
        tokens_per_day: limits.tokens_per_day,
        micro_usd_per_month: limits
            .usd_per_month
            .map(|usd| (usd * 1_000_000.0).round() as u64),
    };
    (meter != MeterLimits::default()).then_some(meter)
}

/// The limits of a key's own meter: a runtime key is always metered (its spend is shown), a
/// config key only when it has limits.
fn key_meter(key: &Key) -> Option<MeterLimits> {
    match key.origin {
        KeyOrigin::Runtime => Some(meter_limits(&key.limits).unwrap_or_default()),
        KeyOrigin::Config => meter_limits(&key.limits),
    }
}

pub(crate) fn needs_tokens(limits: &MeterLimits) -> bool {
    limits.tpm.is_some() || limits.tokens_per_day.is_some() || limits.micro_usd_per_month.is_some()
}

/// The estimator for an alias: the family of its first target's deployment (or, on `"*"`, the
/// requested name).
pub fn estimator(alias: &Alias, requested: &str) -> Estimator {
    let name = alias
        .targets
        .first()
        .and_then(|t| t.deployment.as_deref())
        .unwrap_or(requested);
    Estimator::for_model(name)
}

/// The estimators whose vocabularies a gateway on `snapshot` will count with: one per alias
/// when some tenant or key has a token limit, none otherwise (nothing is ever counted then).
pub fn vocabularies_needed(snapshot: &Snapshot) -> Vec<Estimator> {
    let counts_tokens = snapshot.tenants.iter().any(|tenant| {
        std::iter::once(&tenant.limits)
            .chain(tenant.callers().map(|key| &key.limits))
            .filter_map(meter_limits)
            .any(|limits| needs_tokens(&limits))
    });
    if !counts_tokens {
        return Vec::new();
    }
    let mut needed: Vec<Estimator> = Vec::new();
    for alias in &snapshot.aliases {
        let estimator = estimator(alias, &alias.name);
        if !needed.iter().any(|e| e.encoding == estimator.encoding) {
            needed.push(estimator);
        }
    }
    needed
}

/// Starts loading the vocabularies [`vocabularies_needed`] names, off the request path, so the
/// first requests after a start or a reload find them loaded instead of waiting for them.
pub fn load_vocabularies(snapshot: &Snapshot) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    for estimator in vocabularies_needed(snapshot) {
        runtime.spawn(async move { estimator.load().await });
    }
}

/// Prompt tokens of `request` by the tokenizer; the rough byte estimate when the body is in a
/// shape it does not count.
pub async fn count_prompt(
    estimator: Estimator,
    request: &ClientRequest,
    operation: Operation,
) -> u64 {
    let count = move |request: &ClientRequest| {
        let counted = match operation {
            Operation::Embeddings => request.field("input").and_then(|i| estimator.embeddings(i)),
            Operation::ChatCompletions | Operation::Responses => estimator.chat(ChatFields {
                messages: request.field("messages").or_else(|| request.field("input")),
                tools: request.field("tools"),
                functions: request.field("functions"),
                system: request.field("system"),
            }),
        };
        counted.unwrap_or_else(|| (request.raw().len() as u64).div_ceil(4))
    };
    // The first count of an encoding waits for its vocabulary, loaded off the async threads;
    // a large body is counted off them too.
    estimator.load().await;
    if request.raw().len() <= COUNT_INLINE_BYTES {
        return count(request);
    }
    let owned = request.clone();
    tokio::task::spawn_blocking(move || count(&owned))
        .await
        .unwrap_or_else(|_| (request.raw().len() as u64).div_ceil(4))
}

/// Everything admission reads about one request.
pub struct Request<'a> {
    pub snapshot: &'a Snapshot,
    pub store: &'a Arc<Store>,
    pub tenant: &'a Tenant,
    pub key: &'a Key,
    pub alias: &'a Alias,
    pub requested: &'a str,
    pub body: &'a ClientRequest,
    pub operation: Operation,
}

/// What admitting a request comes to: reserving it against its tenant's and key's limits (or
/// saying which one refuses it), and its plan of targets; both read in one round trip to the
/// state store when the tenant has limits.
pub async fn admit_and_plan(
    request: Request<'_>,
    runtime: &Runtime,
) -> (
    Result<Admission, (GatewayError, RateHeaders)>,
    Result<Plan, Unavailable>,
) {
    let (alias, requested, tenant) = (request.alias, request.requested, request.tenant);
    let Some((ask, estimate)) = ask_of(&request).await else {
        let plan = router::plan(runtime, alias, requested, tenant, request.operation).await;
        return (Ok(Admission::unlimited()), plan);
    };
    let (verdict, plan) =
        router::plan_admitting(runtime, &ask, alias, requested, tenant, request.operation).await;
    (conclude(&request, ask, estimate, verdict), plan)
}

/// The reservation `request` asks for, with the estimate it is made of; `None` for a caller
/// without limits.
async fn ask_of(request: &Request<'_>) -> Option<(Ask, Option<Estimate>)> {
    let (tenant, key) = (request.tenant, request.key);
    // Allocates only once a meter is pushed: a caller without limits costs no allocation.
    let mut meters: Vec<(MeterKey, MeterLimits)> = Vec::new();
    if let Some(limits) = meter_limits(&tenant.limits) {
        meters.push((MeterKey::tenant(&tenant.name), limits));
    }
    if let Some(limits) = key_meter(key) {
        meters.push((MeterKey::key(&tenant.name, &key.id), limits));
    }
    if meters.is_empty() {
        return None;
    }
    let estimate = match meters.iter().any(|(_, l)| needs_tokens(l)) {
        true => {
            let estimator = estimator(request.alias, request.requested);
            let prompt = count_prompt(estimator, request.body, request.operation).await;
            let completion = match request.operation {
                Operation::Embeddings => 0,
                _ => request
                    .body
                    .max_tokens
                    .unwrap_or(request.snapshot.routing.default_max_tokens),
            };
            Some(Estimate { prompt, completion })
        }
        false => None,
    };
    let charge = Charge {
        tokens: estimate.map_or(0, |e| e.prompt + e.completion),
        micro_usd: estimate.map_or(0, |e| {
            micro_usd(dearest(request.alias), e.prompt, e.completion)
        }),
        lease_ms: (request.snapshot.routing.timeouts.total + LEASE_MARGIN).as_millis() as u64,
    };
    let ask = Ask {
        meters,
        charge,
        enforce: true,
    };
    Some((ask, estimate))
}

fn conclude(
    request: &Request<'_>,
    ask: Ask,
    estimate: Option<Estimate>,
    verdict: Result<Verdict, Unavailable>,
) -> Result<Admission, (GatewayError, RateHeaders)> {
    let verdict = verdict.map_err(|_| (GatewayError::StateUnavailable, RateHeaders::default()))?;
    match verdict {
        Verdict::Admitted(reservation) => Ok(Admission {
            headers: RateHeaders::of(&ask.meters, &reservation.usage),
            estimate,
            held: Some(Held {
                store: request.store.clone(),
                reservation,
                settled: false,
            }),
        }),
        Verdict::Refused(refusal) => {
            let headers = RateHeaders::of(&ask.meters, &refusal.usage);
            Err((refused(request, &refusal, estimate), headers))
        }
    }
}

/// The price a request may cost at most: the dearest of its alias's targets.
fn dearest(alias: &Alias) -> Option<&Price> {
    alias
        .targets
        .iter()
        .filter_map(|t| t.price.as_ref().or(alias.price.as_ref()))
        .max_by(|a, b| {
            (a.input_per_1m + a.output_per_1m).total_cmp(&(b.input_per_1m + b.output_per_1m))
        })
}

fn refused(request: &Request<'_>, refusal: &Refusal, estimate: Option<Estimate>) -> GatewayError {
    let scope = match refusal.meter {
        0 if meter_limits(&request.tenant.limits).is_some() => {
            format!("tenant `{}`", request.tenant.name)
        }
        _ => format!("key `{}`", request.key.id),
    };
    let wait = Duration::from_millis(refusal.retry_after_ms);
    let reserves = match estimate {
        Some(e) => format!(
            "this request reserves {} (prompt estimate {} + completion budget {})",
            refusal.asked, e.prompt, e.completion
        ),
        None => format!("this request reserves {}", refusal.asked),
    };
    let (cap, used) = (refusal.cap, refusal.used);
    let never = refusal.asked > cap;
    let message = match refusal.limit {
        Limit::Rpm => format!(
            "rate limited: the {scope} allows {cap} requests per minute; retry after {}",
            seconds(wait)
        ),
        Limit::Tpm if never => format!(
            "rate limited: the {scope} allows {cap} tokens per minute and {reserves}: lower max_tokens or shorten the prompt"
        ),
        Limit::Tpm => format!(
            "rate limited: the {scope} allows {cap} tokens per minute, {used} are used or reserved and {reserves}; retry after {}",
            seconds(wait)
        ),
        Limit::MaxInFlight => format!(
            "rate limited: the {scope} allows {cap} requests in flight at once; retry when one finishes"
        ),
        Limit::TokensPerDay => format!(
            "quota exceeded: the {scope}'s tokens_per_day of {cap} has {used} used and {reserves}; the day renews (00:00 UTC) in {}",
            seconds(wait)
        ),
        Limit::UsdPerMonth => format!(
            "quota exceeded: the {scope}'s usd_per_month of ${:.2} has ${:.4} used and this request may cost up to ${:.4}; the month renews (UTC) in {}",
            cap as f64 / 1e6,
            used as f64 / 1e6,
            refusal.asked as f64 / 1e6,
            seconds(wait)
        ),
    };
    if let Some(budget) = spent_budget(request, refusal) {
        return budget;
    }
    match refusal.limit {
        Limit::TokensPerDay | Limit::UsdPerMonth => GatewayError::QuotaExceeded {
            message,
            period_ends_in: wait,
        },
        _ => GatewayError::RateLimited {
            message,
            retry_after: wait,
        },
    }
}

/// A refusal at a runtime key's monthly spend, when that spend is its `usd_budget` (not a
/// tighter `usd_per_month` of its own).
fn spent_budget(request: &Request<'_>, refusal: &Refusal) -> Option<GatewayError> {
    let budget = request.key.usd_budget?;
    let own_meter = refusal.meter > 0 || meter_limits(&request.tenant.limits).is_none();
    let at_budget = refusal.cap == (budget * 1_000_000.0).round() as u64;
    if refusal.limit != Limit::UsdPerMonth || !own_meter || !at_budget {
        return None;
    }
    let wait = Duration::from_millis(refusal.retry_after_ms);
    let message = format!(
        "budget exceeded: the key `{}` has spent ${:.4} of its ${:.2} budget this UTC month, and this request may cost up to ${:.4}; the budget renews in {}",
        request.key.id,
        refusal.used as f64 / 1e6,
        budget,
        refusal.asked as f64 / 1e6,
        seconds(wait)
    );
    Some(GatewayError::BudgetExceeded {
        message,
        period_ends_in: wait,
    })
}

pub(crate) fn seconds(wait: Duration) -> String {
    let secs = wait.as_millis().div_ceil(1000).max(1);
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 7200 => format!("{}m{}s", s / 60, s % 60),
        s => format!("{}h{}m", s / 3600, (s % 3600) / 60),
    }
}

/// `GET /admin/tenants`: every tenant's and key's (the config's and the runtime ones') usage
/// against each of its limits, in the current windows (rolling minute, in flight now, UTC day,
/// UTC month), from the state store.
pub async fn usage_view(runtime: &crate::runtime::Runtime) -> serde_json::Value {
    let runtime_keys = runtime.client_keys.entries();
    let callers: Vec<Vec<&Key>> = runtime
        .snapshot
        .tenants
        .iter()
        .map(|tenant| {
            let made = runtime_keys
                .iter()
                .filter(|e| *e.stored.tenant == *tenant.name)
                .map(|e| e.key.as_ref());
            tenant.callers().chain(made).collect()
        })
        .collect();
    let mut meters: Vec<(usize, Option<usize>, MeterKey, MeterLimits)> = Vec::new();
    for (t, tenant) in runtime.snapshot.tenants.iter().enumerate() {
        if let Some(limits) = meter_limits(&tenant.limits) {
            meters.push((t, None, MeterKey::tenant(&tenant.name), limits));
        }
        for (k, key) in callers.get(t).into_iter().flatten().enumerate() {
            if let Some(limits) = meter_limits(&key.limits) {
                meters.push((t, Some(k), MeterKey::key(&tenant.name, &key.id), limits));
            }
        }
    }
    let keys: Vec<MeterKey> = meters.iter().map(|(_, _, key, _)| key.clone()).collect();
    let read = runtime.state.usage(&keys).await;
    let health = runtime.state.health().await;
    let now = onedoor_state::now_ms();
    let usage = read.as_deref().unwrap_or_default();
    let of = |t: usize, k: Option<usize>| {
        meters
            .iter()
            .zip(usage)
            .find(|((mt, mk, _, _), _)| *mt == t && *mk == k)
            .map(|((_, _, _, limits), used)| limits_view(limits, used, now))
    };
    let tenants: Vec<serde_json::Value> = runtime
        .snapshot
        .tenants
        .iter()
        .enumerate()
        .map(|(t, tenant)| {
            let keys: Vec<serde_json::Value> = callers
                .get(t)
                .into_iter()
                .flatten()
                .enumerate()
                .filter_map(|(k, key)| {
                    let runtime = key.origin == KeyOrigin::Runtime;
                    of(t, Some(k)).map(|limits| serde_json::json!({"id": key.id, "limits": limits, "runtime": runtime}))
                })
                .collect();
            serde_json::json!({
                "name": tenant.name,
                "limits": of(t, None).unwrap_or_else(|| serde_json::json!({})),
                "keys": keys,
            })
        })
        .collect();
    serde_json::json!({
        "state_store": {"store": health.store, "mode": health.mode, "readable": read.is_ok()},
        "tenants": tenants,
    })
}

fn limits_view(limits: &MeterLimits, used: &MeterUsage, now_ms: u64) -> serde_json::Value {
    let mut view = serde_json::Map::new();
    let mut put = |name: &str, limit: Option<u64>, used: u64, window: &str, resets: Option<u64>| {
        if let Some(limit) = limit {
            view.insert(
                name.to_owned(),
                serde_json::json!({
                    "limit": limit, "used": used, "remaining": limit.saturating_sub(used),
                    "window": window, "resets_in_ms": resets,
                }),
            );
        }
    };
    put("rpm", limits.rpm, used.requests, "rolling minute", None);
    put("tpm", limits.tpm, used.tokens, "rolling minute", None);
    put(
        "max_in_flight",
        limits.max_in_flight,
        used.in_flight,
        "now",
        None,
    );
    let day = Some(onedoor_state::day_ends_in(now_ms));
    put(
        "tokens_per_day",
        limits.tokens_per_day,
        used.day_tokens,
        "UTC day",
        day,
    );
    if let Some(cap) = limits.micro_usd_per_month {
        let dollars = |micro: u64| micro as f64 / 1e6;
        view.insert(
            "usd_per_month".to_owned(),
            serde_json::json!({
                "limit": dollars(cap), "used": dollars(used.month_micro_usd),
                "remaining": dollars(cap.saturating_sub(used.month_micro_usd)),
                "window": "UTC month", "resets_in_ms": onedoor_state::month_ends_in(now_ms),
            }),
        );
    }
    serde_json::Value::Object(view)
}

/// A stream body that holds its request's admission until the stream ends or is dropped.
struct Holding {
    inner: Body,
    admission: Option<Admission>,
    report: Option<(UsageReport, Option<Price>)>,
}

impl Holding {
    fn settle(&mut self) {
        let Some(mut admission) = self.admission.take() else {
            return;
        };
        let reported = self
            .report
            .as_ref()
            .and_then(|(r, price)| Some((r.get()?, price)));
        match reported {
            Some((usage, price)) if usage.source == UsageSource::Measured => {
                admission.reconcile(usage.prompt_tokens, usage.completion_tokens, price.as_ref())
            }
            _ => admission.keep_estimate(),
        }
    }
}

impl http_body::Body for Holding {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(None) = polled {
            self.settle();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Holding {
    fn drop(&mut self) {
        // The caller went away mid-stream: the tokens were spent all the same.
        self.settle();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokens::Encoding;

    #[test]
    fn the_tightest_of_tenant_and_key_is_what_the_headers_say() {
        let meters = vec![
            (
                MeterKey::tenant("t"),
                MeterLimits {
                    rpm: Some(100),
                    tpm: Some(1000),
                    ..MeterLimits::default()
                },
            ),
            (
                MeterKey::key("t", "k"),
                MeterLimits {
                    rpm: Some(10),
                    ..MeterLimits::default()
                },
            ),
        ];
        let usage = [
            MeterUsage {
                requests: 50,
                tokens: 400,
                ..MeterUsage::default()
            },
            MeterUsage {
                requests: 3,
                ..MeterUsage::default()
            },
        ];
        let headers = RateHeaders::of(&meters, &usage);
        assert_eq!(headers.requests, Some((10, 7)));
        assert_eq!(headers.tokens, Some((1000, 600)));
        let mut stamp = Stamp::default();
        headers.stamp(&mut stamp);
        assert_eq!(stamp.get("x-ratelimit-remaining-tokens"), Some(&b"600"[..]));
        assert_eq!(stamp.get("x-ratelimit-limit-requests"), Some(&b"10"[..]));
    }

    #[test]
    fn cost_is_price_per_million_times_tokens_in_millionths_of_a_dollar() {
        let price = Price::new(2.5, 10.0);
        assert_eq!(micro_usd(Some(&price), 1000, 100), 3500);
        assert_eq!(micro_usd(None, 1000, 100), 0);
        assert_eq!(seconds(Duration::from_millis(59_001)), "60s");
        assert_eq!(seconds(Duration::from_secs(14 * 3600 + 60)), "14h1m");
    }

    fn gateway(tenant_limits: &str) -> Snapshot {
        let yaml = format!(
            "backends:
  - {{ name: a, provider: azure, url: https://a.example.com, region: westeurope, api_key: k }}
models:
  - {{ name: chat, targets: [{{ backend: a, deployment: gpt-4o }}] }}
  - {{ name: mini, targets: [{{ backend: a, deployment: gpt-4o-mini }}] }}
  - {{ name: old, targets: [{{ backend: a, deployment: gpt-4 }}] }}
tenants:
  - name: t
    keys: [{{ id: k, sha256: {} }}]
{tenant_limits}",
            "ab".repeat(32)
        );
        onedoor_config::parse(&yaml, std::path::Path::new("t.yaml"), &|_| None).unwrap()
    }

    #[test]
    fn vocabularies_are_needed_only_where_a_token_limit_counts_tokens() {
        let encodings = |limits: &str| -> Vec<Encoding> {
            vocabularies_needed(&gateway(limits))
                .iter()
                .map(|e| e.encoding)
                .collect()
        };
        assert!(encodings("").is_empty());
        assert!(encodings("    limits: { rpm: 10, max_in_flight: 2 }").is_empty());
        // Three aliases, two encodings: gpt-4o and gpt-4o-mini share o200k_base.
        let both = vec![Encoding::O200k, Encoding::Cl100k];
        assert_eq!(encodings("    limits: { tpm: 1000 }"), both);
        assert_eq!(encodings("    limits: { usd_per_month: 5 }"), both);
    }

    #[test]
    fn a_gateway_with_token_limits_loads_its_vocabulary_before_the_first_request() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let snapshot = gateway("    limits: { tokens_per_day: 100000 }");
        let estimator = Estimator::for_model("gpt-4");
        assert!(!estimator.ready());
        let loaded = runtime.block_on(async {
            load_vocabularies(&snapshot);
            let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
            while !estimator.ready() && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            estimator.ready()
        });
        assert!(loaded, "cl100k_base was not loaded within 30 s");
    }

    /// The blocking threads of the test's runtime, by the name it gives them.
    fn threads_named(name: &str) -> usize {
        let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
            return 0;
        };
        tasks
            .flatten()
            .filter(|task| {
                std::fs::read_to_string(task.path().join("comm")).is_ok_and(|c| c.trim() == name)
            })
            .count()
    }

    #[test]
    fn requests_that_come_while_the_vocabulary_loads_share_one_load() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .thread_name("vocab-wait")
            .build()
            .unwrap();
        let body =
            r#"{"model":"m","messages":[{"role":"user","content":"Say hello in five words."}]}"#;
        let request = ClientRequest::parse(Bytes::from(body), Operation::ChatCompletions).unwrap();
        let estimator = Estimator::for_model("gpt-4o");
        let counts = runtime.block_on(async {
            let counting: Vec<_> = (0..32)
                .map(|_| {
                    let request = request.clone();
                    tokio::spawn(async move {
                        count_prompt(estimator, &request, Operation::ChatCompletions).await
                    })
                })
                .collect();
            let mut counts = Vec::new();
            for count in counting {
                counts.push(count.await.unwrap());
            }
            counts
        });
        // 3 for the message, 1 for its role, 6 for the text, 3 to prime the reply.
        assert!(counts.iter().all(|&count| count == 13), "{counts:?}");
        // One thread loaded the vocabulary (none when an earlier test in this process had).
        assert!(threads_named("vocab-wait") <= 1);
    }
}
