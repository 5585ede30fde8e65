//! The gateway's Prometheus metrics (`GET /metrics` on the admin port, documented in
//! `docs/metrics.md`): counters and histograms the request path bumps, and gauges read from the
//! learned state when scraped. One set per gateway, carried over reloads with the recorder.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use onedoor_state::{now_ms, State};
use onedoor_usage::{RecorderStats, UsageRecord};
use prometheus_client::encoding::{text, EncodeLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::breaker::BreakerState;
use crate::process::ProcessCollector;
use crate::runtime::Runtime;

/// What `GET /metrics` answers with: the Prometheus text format, OpenMetrics flavour.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    tenant: String,
    alias: String,
    status: u16,
    code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AttemptLabels {
    backend: String,
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TokenLabels {
    tenant: String,
    alias: String,
    kind: &'static str,
    source: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantAlias {
    tenant: String,
    alias: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AliasLabel {
    alias: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BackendLabels {
    backend: String,
    region: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HeadroomLabels {
    backend: String,
    kind: &'static str,
}

/// One breaker: a backend's own (`deployment` empty) or one of its targets'.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BreakerLabels {
    backend: String,
    region: String,
    deployment: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TransitionLabels {
    backend: String,
    deployment: String,
    to: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantLabel {
    tenant: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusLabel {
    status: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PurposeLabel {
    purpose: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

type Seconds = Family<AliasLabel, Histogram, fn() -> Histogram>;

fn latency_buckets() -> Histogram {
    // 5 ms to about 82 s.
    Histogram::new(exponential_buckets(0.005, 2.0, 15))
}

fn overhead_buckets() -> Histogram {
    // 10 µs to about 164 ms: the gateway's own time is small or a bug.
    Histogram::new(exponential_buckets(0.000_01, 2.0, 15))
}

fn per_token_buckets() -> Histogram {
    // 1 ms to about 1 s per output token.
    Histogram::new(exponential_buckets(0.001, 2.0, 11))
}

/// Every metric of one gateway, and the registry that encodes them.
pub struct Metrics {
    registry: Registry,
    /// The standard `process_*` metrics, without the `onedoor_` prefix.
    process: Registry,
    /// What they encode, read anew at each scrape.
    process_reading: std::sync::Arc<ProcessCollector>,
    requests: Family<RequestLabels, Counter>,
    attempts: Family<AttemptLabels, Counter>,
    tokens: Family<TokenLabels, Counter>,
    cost: Family<TenantAlias, Counter<f64, AtomicU64>>,
    duration: Seconds,
    ttft: Seconds,
    per_token: Seconds,
    overhead: Histogram,
    rejections: Family<KindLabel, Counter>,
    reloads: Family<OutcomeLabel, Counter>,
    in_flight: Family<BackendLabels, Gauge>,
    breaker: Family<BreakerLabels, Gauge>,
    headroom: Family<HeadroomLabels, Gauge>,
    not_served: Gauge,
    usage_records: Family<OutcomeLabel, Gauge>,
    spans: Family<OutcomeLabel, Gauge>,
    tenant_in_flight: Family<TenantLabel, Gauge>,
    transitions: Family<TransitionLabels, Counter>,
    malformed: Family<BackendLabels, Counter>,
    batches: Family<StatusLabel, Gauge>,
    batch_files: Family<PurposeLabel, Gauge>,
    batch_tokens: Family<KindLabel, Counter>,
    /// The same answers, tokens and cost as totals over time, for the dashboard.
    pub activity: std::sync::Arc<crate::activity::Activity>,
    /// Tells this gateway's metrics from another's in a thread's [`recent`] series.
    id: u64,
}

/// A request counted in its tenant's in-flight gauge until dropped (a stream's at its end).
pub struct Entered(Gauge);

impl Drop for Entered {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("onedoor");
        let seconds = || Seconds::new_with_constructor(latency_buckets as fn() -> Histogram);
        let metrics = Metrics {
            requests: Family::default(),
            attempts: Family::default(),
            tokens: Family::default(),
            cost: Family::default(),
            duration: seconds(),
            ttft: seconds(),
            per_token: Seconds::new_with_constructor(per_token_buckets as fn() -> Histogram),
            overhead: overhead_buckets(),
            rejections: Family::default(),
            reloads: Family::default(),
            in_flight: Family::default(),
            breaker: Family::default(),
            headroom: Family::default(),
            not_served: Gauge::default(),
            usage_records: Family::default(),
            spans: Family::default(),
            tenant_in_flight: Family::default(),
            transitions: Family::default(),
            malformed: Family::default(),
            batches: Family::default(),
            batch_files: Family::default(),
            batch_tokens: Family::default(),
            activity: std::sync::Arc::default(),
            registry: Registry::default(),
            process: Registry::default(),
            process_reading: std::sync::Arc::default(),
            id: recent::new_owner(),
        };
        let m = &metrics;
        let r = &mut registry;
        r.register(
            "requests",
            "Client requests answered, by status and error code (`-` for none)",
            m.requests.clone(),
        );
        r.register(
            "upstream_attempts",
            "Upstream attempts by backend and outcome (status code or failure kind)",
            m.attempts.clone(),
        );
        r.register(
            "tokens",
            "Tokens by kind (input, output, cached) and source (measured, estimated)",
            m.tokens.clone(),
        );
        r.register(
            "cost_usd",
            "Cost of answered requests in US dollars",
            m.cost.clone(),
        );
        r.register(
            "request_duration_seconds",
            "Time from arrival to the end of the answer (a stream's last byte)",
            m.duration.clone(),
        );
        r.register(
            "time_to_first_token_seconds",
            "Time from arrival to a stream's first byte",
            m.ttft.clone(),
        );
        r.register(
            "time_per_output_token_seconds",
            "Streams: time after the first byte per output token",
            m.per_token.clone(),
        );
        r.register(
            "gateway_overhead_seconds",
            "Time spent in onedoor itself up to the response head, upstream waits excluded",
            m.overhead.clone(),
        );
        r.register(
            "limiter_rejections",
            "Requests refused by the caller's own limits, by kind",
            m.rejections.clone(),
        );
        r.register(
            "config_reloads",
            "Config reloads by outcome (applied, refused)",
            m.reloads.clone(),
        );
        r.register(
            "backend_in_flight",
            "Requests in flight on a backend from this instance",
            m.in_flight.clone(),
        );
        r.register(
            "breaker_state",
            "Circuit breaker state per backend (deployment empty) and per target: 0 closed, 1 half-open, 2 open",
            m.breaker.clone(),
        );
        r.register("backend_headroom", "What a backend's rpm and tpm limits still allow in the window (kind requests or tokens)", m.headroom.clone());
        r.register(
            "not_served_entries",
            "Targets in the not-served cache",
            m.not_served.clone(),
        );
        r.register(
            "usage_records",
            "Usage records by fate (written, spilled, replayed, lost, buffered) since start",
            m.usage_records.clone(),
        );
        r.register(
            "spans",
            "OpenTelemetry spans of the running exporter by fate (exported, dropped, failed, queued)",
            m.spans.clone(),
        );
        r.register(
            "tenant_in_flight",
            "Requests of a tenant under way on this instance (streams until they end)",
            m.tenant_in_flight.clone(),
        );
        r.register("breaker_transitions", "Circuit breaker transitions this instance made, by backend, target deployment (empty: the backend's own breaker) and new state (open, half_open, reopen, close)", m.transitions.clone());
        r.register(
            "stream_events_dropped",
            "Malformed upstream stream events dropped (never forwarded), by backend",
            m.malformed.clone(),
        );
        r.register(
            "batches",
            "Batches the tenants hold, by status as last seen (validating, in_progress, finalizing, completed, failed, expired, cancelling, cancelled)",
            m.batches.clone(),
        );
        r.register(
            "batch_files",
            "Files the tenants hold, by purpose (batch, batch_output, batch_error)",
            m.batch_files.clone(),
        );
        r.register(
            "batch_tokens",
            "Batch tokens by kind: estimated (held at creation), input and output (measured when a batch ends), counted by the instance that saw it",
            m.batch_tokens.clone(),
        );
        let mut process = Registry::default();
        process.register_collector(Box::new(metrics.process_reading.clone()));
        Metrics {
            registry,
            process,
            ..metrics
        }
    }

    /// A request of `tenant` begins; it counts in flight until the guard is dropped.
    pub fn enter(&self, tenant: &str) -> Entered {
        let mut gauge = None;
        recent::with(self.id, |r| {
            gauge = Some(
                r.in_flight
                    .find(
                        |l| l.tenant == tenant,
                        || {
                            let labels = TenantLabel {
                                tenant: tenant.to_owned(),
                            };
                            let gauge = self.tenant_in_flight.get_or_create(&labels).clone();
                            (labels, gauge)
                        },
                    )
                    .clone(),
            )
        });
        // `with` runs its closure exactly once: the gauge is always there.
        let gauge = gauge.unwrap_or_default();
        gauge.inc();
        Entered(gauge)
    }

    /// A request whose response head is ready.
    pub fn answered(&self, tenant: &str, alias: &str, status: u16, code: Option<&str>) {
        let code_label = code.unwrap_or("-");
        recent::with(self.id, |r| {
            r.requests
                .find(
                    |l| {
                        l.status == status
                            && l.tenant == tenant
                            && l.alias == alias
                            && l.code == code_label
                    },
                    || {
                        let labels = RequestLabels {
                            tenant: tenant.to_owned(),
                            alias: alias.to_owned(),
                            status,
                            code: code_label.to_owned(),
                        };
                        let counter = self.requests.get_or_create(&labels).clone();
                        (labels, counter)
                    },
                )
                .inc();
        });
        if let Some(kind) = code.and_then(limit_kind) {
            self.rejections.get_or_create(&KindLabel { kind }).inc();
        }
    }

    /// Every upstream attempt of a request, as `x-onedoor-attempts` lists them.
    pub fn attempted(&self, attempts: &[(Arc<str>, crate::upstream::Outcome)]) {
        for (backend, outcome) in attempts {
            recent::with(self.id, |r| {
                r.attempts
                    .find(
                        |l| *l.backend == **backend && l.outcome == *outcome,
                        || {
                            let labels = AttemptLabels {
                                backend: backend.to_string(),
                                outcome: outcome.to_string(),
                            };
                            let counter = self.attempts.get_or_create(&labels).clone();
                            (labels, counter)
                        },
                    )
                    .inc();
            });
        }
    }

    /// The gateway's own share of a request's time to its response head.
    pub fn overhead(&self, total: Duration, upstream: Duration) {
        self.overhead
            .observe(total.saturating_sub(upstream).as_secs_f64());
    }

    /// A finished request's usage record: tokens, cost and timings.
    pub fn finished(&self, record: &UsageRecord) {
        let tokens = &record.tokens;
        self.activity
            .finished(tokens.input, tokens.output, record.cost_usd);
        let source = record.tokens.source.as_str();
        let (tenant, alias) = (&*record.tenant, &*record.alias);
        for (kind, count) in [
            ("input", record.tokens.input),
            ("output", record.tokens.output),
            ("cached", record.tokens.cached),
        ] {
            if count > 0 {
                recent::with(self.id, |r| {
                    r.tokens
                        .find(
                            |l| {
                                l.kind == kind
                                    && l.source == source
                                    && l.tenant == tenant
                                    && l.alias == alias
                            },
                            || {
                                let labels = TokenLabels {
                                    tenant: tenant.to_owned(),
                                    alias: alias.to_owned(),
                                    kind,
                                    source,
                                };
                                let counter = self.tokens.get_or_create(&labels).clone();
                                (labels, counter)
                            },
                        )
                        .inc_by(count);
                });
            }
        }
        recent::with(self.id, |r| {
            if record.cost_usd > 0.0 {
                r.costs
                    .find(
                        |l| l.tenant == tenant && l.alias == alias,
                        || {
                            let labels = TenantAlias {
                                tenant: tenant.to_owned(),
                                alias: alias.to_owned(),
                            };
                            let counter = self.cost.get_or_create(&labels).clone();
                            (labels, counter)
                        },
                    )
                    .inc_by(record.cost_usd);
            }
            let seconds = |ms: u64| ms as f64 / 1000.0;
            let by_alias = |family: &Seconds| {
                let labels = AliasLabel {
                    alias: alias.to_owned(),
                };
                let histogram = family.get_or_create(&labels).clone();
                (labels, histogram)
            };
            r.durations
                .find(|l| l.alias == alias, || by_alias(&self.duration))
                .observe(seconds(record.duration_ms));
            let (true, Some(ttft)) = (record.stream, record.ttft_ms) else {
                return;
            };
            r.ttfts
                .find(|l| l.alias == alias, || by_alias(&self.ttft))
                .observe(seconds(ttft));
            if record.tokens.output > 0 {
                let after = record.duration_ms.saturating_sub(ttft);
                r.per_token
                    .find(|l| l.alias == alias, || by_alias(&self.per_token))
                    .observe(seconds(after) / record.tokens.output as f64);
            }
        });
    }

    /// A config reload, applied or refused.
    /// A batch was placed with `estimated` tokens held.
    pub fn batch_placed(&self, estimated: u64) {
        let kind = KindLabel { kind: "estimated" };
        self.batch_tokens.get_or_create(&kind).inc_by(estimated);
    }

    /// A batch ended, having used these tokens.
    pub fn batch_ended(&self, input: u64, output: u64) {
        for (kind, tokens) in [("input", input), ("output", output)] {
            self.batch_tokens
                .get_or_create(&KindLabel { kind })
                .inc_by(tokens);
        }
    }

    pub fn reloaded(&self, applied: bool) {
        let outcome = if applied { "applied" } else { "refused" };
        self.reloads.get_or_create(&OutcomeLabel { outcome }).inc();
    }

    /// The text exposition, with the gauges read from `runtime` now.
    pub async fn scrape(&self, runtime: &Runtime) -> String {
        self.read_gauges(runtime).await;
        self.process_reading.refresh().await;
        self.read_recorder(runtime.recorder.stats());
        if let Some(telemetry) = &runtime.telemetry {
            self.read_spans(telemetry.stats());
        }
        let mut out = String::new();
        let encoded = text::encode_registry(&mut out, &self.process)
            .and_then(|()| text::encode_registry(&mut out, &self.registry))
            .and_then(|()| text::encode_eof(&mut out));
        if encoded.is_err() {
            out.clear();
        }
        out
    }

    async fn read_gauges(&self, runtime: &Runtime) {
        let now = now_ms();
        for (i, backend) in runtime.snapshot.backends.iter().enumerate() {
            let labels = BackendLabels {
                backend: backend.name.to_string(),
                region: backend.region.to_string(),
            };
            for (deployment, transitions) in runtime.breakers.transitions(i) {
                for (to, total) in crate::breaker::TRANSITIONS.into_iter().zip(transitions) {
                    let labels = TransitionLabels {
                        backend: backend.name.to_string(),
                        deployment: deployment.as_deref().unwrap_or("").to_owned(),
                        to,
                    };
                    catch_up(&self.transitions.get_or_create(&labels), total);
                }
            }
            if let Some(load) = runtime.load(i) {
                catch_up(
                    &self.malformed.get_or_create(&labels),
                    load.malformed_events(),
                );
                let in_flight = i64::try_from(load.in_flight()).unwrap_or(i64::MAX);
                self.in_flight.get_or_create(&labels).set(in_flight);
                let view = load.view(&backend.limits, None, now);
                for (kind, field) in [
                    ("requests", "requests_headroom"),
                    ("tokens", "tokens_headroom"),
                ] {
                    if let Some(left) = view["window"][field].as_i64() {
                        let labels = HeadroomLabels {
                            backend: backend.name.to_string(),
                            kind,
                        };
                        self.headroom.get_or_create(&labels).set(left);
                    }
                }
            }
            self.read_breakers(runtime, i, &labels, now).await;
        }
        if let Ok(entries) = runtime.state.not_served().await {
            self.not_served
                .set(i64::try_from(entries.len()).unwrap_or(i64::MAX));
        }
        self.read_batches(runtime).await;
    }

    /// The tenants' batches by status and files by purpose, from the state store.
    async fn read_batches(&self, runtime: &Runtime) {
        let Some(census) = crate::batch::census(runtime).await else {
            return;
        };
        let known = [
            "validating",
            "in_progress",
            "finalizing",
            "completed",
            "failed",
            "expired",
            "cancelling",
            "cancelled",
        ];
        for status in known
            .iter()
            .map(|s| s.to_string())
            .chain(census.batches.keys().cloned())
        {
            let count = census.batches.get(&status).copied().unwrap_or(0);
            self.batches
                .get_or_create(&StatusLabel { status })
                .set(count);
        }
        for purpose in ["batch", "batch_output", "batch_error"] {
            let count = census.files.get(purpose).copied().unwrap_or(0);
            let labels = PurposeLabel {
                purpose: purpose.to_owned(),
            };
            self.batch_files.get_or_create(&labels).set(count);
        }
    }

    /// The state of backend `i`'s own breaker and its targets' (always closed without a policy).
    async fn read_breakers(&self, runtime: &Runtime, i: usize, backend: &BackendLabels, now: u64) {
        let views = match runtime.breakers.view(i, now).await {
            Some(view) => std::iter::once(view.own).chain(view.targets).collect(),
            None => Vec::new(),
        };
        let closed = (views.is_empty()).then_some((None, BreakerState::Closed));
        let states = views.into_iter().map(|v| (v.deployment, v.state));
        for (deployment, state) in states.chain(closed) {
            let labels = BreakerLabels {
                backend: backend.backend.clone(),
                region: backend.region.clone(),
                deployment: deployment.as_deref().unwrap_or("").to_owned(),
            };
            self.breaker.get_or_create(&labels).set(match state {
                BreakerState::Closed => 0,
                BreakerState::HalfOpen => 1,
                BreakerState::Open => 2,
            });
        }
    }

    fn read_recorder(&self, stats: RecorderStats) {
        let count = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        for (outcome, n) in [
            ("written", count(stats.written)),
            ("spilled", count(stats.spilled)),
            ("replayed", count(stats.replayed)),
            ("lost", count(stats.lost)),
            (
                "buffered",
                i64::try_from(stats.buffered).unwrap_or(i64::MAX),
            ),
        ] {
            self.usage_records
                .get_or_create(&OutcomeLabel { outcome })
                .set(n);
        }
    }

    fn read_spans(&self, stats: crate::telemetry::SpanStats) {
        let count = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        for (outcome, n) in [
            ("exported", count(stats.exported)),
            ("dropped", count(stats.dropped)),
            ("failed", count(stats.failed)),
            ("queued", i64::try_from(stats.queued).unwrap_or(i64::MAX)),
        ] {
            self.spans.get_or_create(&OutcomeLabel { outcome }).set(n);
        }
    }
}

/// Brings a counter kept elsewhere (a breaker's, a backend load's) up to its `total`. One that
/// was replaced on reload and counts from zero again catches up once past the old total.
fn catch_up(counter: &Counter, total: u64) {
    counter.inc_by(total.saturating_sub(counter.get()));
}

/// The limit kind behind a refusal code, for `onedoor_limiter_rejections_total`.
fn limit_kind(code: &str) -> Option<&'static str> {
    match code {
        "rate_limited" => Some("rate"),
        "quota_exceeded" => Some("quota"),
        "gateway_overloaded" => Some("gateway"),
        "request_too_large" => Some("body_size"),
        _ => None,
    }
}

/// The series each thread bumped last, found by comparing labels rather than building and
/// hashing a label set per request (each `get_or_create` allocated the label strings and took
/// the family's lock): a request's series are nearly always among the last few of its lane.
mod recent {
    use std::cell::RefCell;
    use std::sync::atomic::{AtomicU64, Ordering};

    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::gauge::Gauge;
    use prometheus_client::metrics::histogram::Histogram;

    use super::{AliasLabel, AttemptLabels, RequestLabels, TenantAlias, TenantLabel, TokenLabels};

    /// Series kept per family and thread.
    const KEPT: usize = 8;

    #[derive(Default)]
    pub struct Recent {
        /// The [`super::Metrics`] these series belong to.
        owner: u64,
        pub requests: Ring<RequestLabels, Counter>,
        pub attempts: Ring<AttemptLabels, Counter>,
        pub tokens: Ring<TokenLabels, Counter>,
        pub durations: Ring<AliasLabel, Histogram>,
        pub ttfts: Ring<AliasLabel, Histogram>,
        pub per_token: Ring<AliasLabel, Histogram>,
        pub costs: Ring<TenantAlias, Counter<f64, AtomicU64>>,
        pub in_flight: Ring<TenantLabel, Gauge>,
    }

    pub struct Ring<L, M> {
        series: Vec<(L, M)>,
        next: usize,
    }

    impl<L, M> Default for Ring<L, M> {
        fn default() -> Self {
            Ring {
                series: Vec::new(),
                next: 0,
            }
        }
    }

    impl<L, M> Ring<L, M> {
        /// The series whose labels `matches`, or the one `create` makes (and keeps).
        pub fn find(
            &mut self,
            matches: impl Fn(&L) -> bool,
            create: impl FnOnce() -> (L, M),
        ) -> &M {
            let at = match self.series.iter().position(|(labels, _)| matches(labels)) {
                Some(at) => at,
                None if self.series.len() < KEPT => {
                    self.series.push(create());
                    self.series.len() - 1
                }
                None => {
                    let at = self.next;
                    self.series[at] = create();
                    self.next = (at + 1) % KEPT;
                    at
                }
            };
            &self.series[at].1
        }
    }

    thread_local! {
        static RECENT: RefCell<Recent> = RefCell::new(Recent::default());
    }

    /// A new owner id for a [`super::Metrics`].
    pub fn new_owner() -> u64 {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        NEXT.fetch_add(1, Ordering::Relaxed)
    }

    /// Runs `f` on this thread's series of `owner` (those of another owner are dropped first);
    /// on series of its own while the thread's cannot be had (its end, or a nested call).
    pub fn with(owner: u64, f: impl FnOnce(&mut Recent)) {
        let mut f = Some(f);
        let _ = RECENT.try_with(|recent| {
            if let Ok(mut recent) = recent.try_borrow_mut() {
                if recent.owner != owner {
                    *recent = Recent {
                        owner,
                        ..Recent::default()
                    };
                }
                if let Some(f) = f.take() {
                    f(&mut recent);
                }
            }
        });
        if let Some(f) = f {
            f(&mut Recent::default());
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn text(metrics: &Metrics) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &metrics.registry).unwrap();
        out
    }

    fn requests(text: &str, tenant: &str) -> String {
        let series = format!(
            "onedoor_requests_total{{tenant=\"{tenant}\",alias=\"a\",status=\"200\",code=\"-\"}} "
        );
        text.lines()
            .find_map(|line| line.strip_prefix(&series))
            .unwrap_or("none")
            .to_owned()
    }

    fn finished_stream(tenant: &str, alias: &str, cost_usd: f64) -> UsageRecord {
        UsageRecord {
            request_id: "r".into(),
            at_ms: 0,
            tenant: tenant.into(),
            key_id: "k".into(),
            alias: alias.into(),
            backend: None,
            model: None,
            region: None,
            status: 200,
            tokens: onedoor_usage::Tokens {
                input: 3,
                output: 4,
                cached: 0,
                cache_write: 0,
                source: onedoor_usage::Source::Measured,
            },
            estimated_tokens: 7,
            cost_usd,
            duration_ms: 500,
            ttft_ms: Some(100),
            attempts: String::new(),
            stream: true,
            stream_cut: false,
            error: None,
            lines: None,
        }
    }

    fn sample(text: &str, series: &str) -> String {
        text.lines()
            .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
            .unwrap_or("none")
            .to_owned()
    }

    #[test]
    fn costs_and_stream_timings_are_counted_by_their_labels() {
        let metrics = Metrics::new();
        for _ in 0..3 {
            metrics.finished(&finished_stream("t", "a", 0.25));
        }
        metrics.finished(&finished_stream("u", "a", 0.5));
        metrics.finished(&finished_stream("t", "b", 0.0));
        let text = text(&metrics);
        let cost = |tenant, alias| {
            let series = format!("onedoor_cost_usd_total{{tenant=\"{tenant}\",alias=\"{alias}\"}}");
            sample(&text, &series)
        };
        assert_eq!(cost("t", "a"), "0.75");
        assert_eq!(cost("u", "a"), "0.5");
        assert_eq!(cost("t", "b"), "none");
        for family in [
            "time_to_first_token_seconds",
            "time_per_output_token_seconds",
        ] {
            let count = |alias| {
                sample(
                    &text,
                    &format!("onedoor_{family}_count{{alias=\"{alias}\"}}"),
                )
            };
            assert_eq!(
                (count("a"), count("b")),
                ("4".to_owned(), "1".to_owned()),
                "{family}"
            );
        }
        let per_token = "onedoor_time_per_output_token_seconds_sum{alias=\"b\"}";
        assert_eq!(sample(&text, per_token), "0.1");
    }

    #[test]
    fn series_remembered_by_a_thread_count_for_their_own_gateway_and_labels() {
        let (first, second) = (Metrics::new(), Metrics::new());
        for _ in 0..3 {
            first.answered("t", "a", 200, None);
        }
        second.answered("t", "a", 200, None);
        first.answered("t", "a", 200, None);
        for tenant in 0..20 {
            for _ in 0..=tenant % 3 {
                first.answered(&format!("t{tenant}"), "a", 200, None);
            }
        }
        first.answered("t", "a", 200, None);
        let (first, second) = (text(&first), text(&second));
        assert_eq!(requests(&first, "t"), "5");
        assert_eq!(requests(&second, "t"), "1");
        for tenant in 0..20 {
            assert_eq!(
                requests(&first, &format!("t{tenant}")),
                (tenant % 3 + 1).to_string()
            );
        }
    }
}
