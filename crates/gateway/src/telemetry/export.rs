//! The span exporter: a bounded queue that requests put finished spans into, and the task that
//! sends them to the collector in batches over OTLP/HTTP, through the gateway's own hyper and
//! rustls client. A full queue drops spans and counts them; nothing here ever makes a request wait.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full, Limited};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use onedoor_config::{Otlp, Snapshot};
use opentelemetry::trace::TraceId;
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_http::{HttpClient, HttpError};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::trace::{SpanData, SpanExporter};
use opentelemetry_sdk::Resource;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;

/// Spans sent in one export at most.
const MAX_BATCH: usize = 512;
/// A collector's answer to an export is a few bytes; more is not read.
const MAX_COLLECTOR_ANSWER: usize = 1 << 20;

/// The gateway's span exporter: the queue requests put finished spans into, and the task that
/// sends them to the collector. Shared by every runtime of the gateway while `telemetry.otlp`
/// stays the same.
pub struct Telemetry {
    settings: Otlp,
    queue: mpsc::Sender<SpanData>,
    counts: Arc<Counts>,
    /// A new trace is sampled when the low 63 bits of its id are below this.
    threshold: u64,
    pub(super) scope: InstrumentationScope,
    stop: Mutex<Option<oneshot::Sender<()>>>,
    worker: Mutex<Option<JoinHandle<()>>>,
}

/// The exporter a snapshot asks for; `None` when it has no `telemetry.otlp` (or, logged, when
/// the exporter cannot be built).
pub fn start(snapshot: &Snapshot) -> Option<Arc<Telemetry>> {
    let settings = snapshot.telemetry.otlp.as_ref()?;
    match Telemetry::start(settings) {
        Ok(telemetry) => Some(Arc::new(telemetry)),
        Err(error) => {
            tracing::error!(%error, "traces are off: the OTLP exporter cannot be built");
            None
        }
    }
}

/// The exporter a reloaded `snapshot` runs with: the running one while `telemetry.otlp` is
/// unchanged. A replaced exporter sends what it still holds once the last request using it ends.
pub fn carry_over(running: &Option<Arc<Telemetry>>, snapshot: &Snapshot) -> Option<Arc<Telemetry>> {
    match (running, &snapshot.telemetry.otlp) {
        (Some(running), Some(next)) if running.settings == *next => Some(running.clone()),
        _ => start(snapshot),
    }
}

impl Telemetry {
    fn start(settings: &Otlp) -> Result<Telemetry, opentelemetry_otlp::ExporterBuildError> {
        let headers = settings
            .headers
            .iter()
            .map(|(name, value)| (name.clone(), value.expose().to_owned()))
            .collect();
        let mut builder = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(Transport::new(settings.timeout))
            .with_protocol(Protocol::HttpBinary)
            .with_timeout(settings.timeout)
            .with_headers(headers);
        if let Some(endpoint) = &settings.endpoint {
            builder = builder.with_endpoint(endpoint.clone());
        }
        let mut exporter = builder.build()?;
        exporter.set_resource(
            &Resource::builder_empty()
                .with_service_name(settings.service_name.clone())
                .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
                .build(),
        );
        let (queue, queued) = mpsc::channel(settings.max_queue.max(1));
        let (stop, stopped) = oneshot::channel();
        let counts = Arc::new(Counts::default());
        let worker = tokio::spawn(export(
            exporter,
            queued,
            settings.export_interval,
            stopped,
            counts.clone(),
        ));
        // The rule of the SDK's ratio sampler, so a trace sampled here is sampled by every
        // service that uses the same ratio.
        let threshold = (settings.sample_ratio.clamp(0.0, 1.0) * (1u64 << 63) as f64) as u64;
        Ok(Telemetry {
            settings: settings.clone(),
            queue,
            counts,
            threshold,
            scope: InstrumentationScope::builder("onedoor")
                .with_version(env!("CARGO_PKG_VERSION"))
                .build(),
            stop: Mutex::new(Some(stop)),
            worker: Mutex::new(Some(worker)),
        })
    }

    /// Exports the spans still queued and stops the exporter; waits at most its timeout and a
    /// second more.
    pub async fn close(&self) {
        if let Some(stop) = locked(&self.stop).take() {
            let _ = stop.send(());
        }
        let Some(worker) = locked(&self.worker).take() else {
            return;
        };
        let wait = self.settings.timeout + Duration::from_secs(1);
        if tokio::time::timeout(wait, worker).await.is_err() {
            tracing::warn!("spans still queued at shutdown were dropped: the collector did not take them in time");
        }
    }

    pub(super) fn samples(&self, trace: TraceId) -> bool {
        let bytes = trace.to_bytes();
        let mut low = [0u8; 8];
        low.copy_from_slice(&bytes[8..]);
        (u64::from_be_bytes(low) >> 1) < self.threshold
    }

    pub(super) fn push(&self, span: SpanData) {
        if self.queue.try_send(span).is_err() {
            self.counts.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// What became of this exporter's spans so far, for `/metrics`.
    pub fn stats(&self) -> SpanStats {
        let read = |n: &AtomicU64| n.load(Ordering::Relaxed);
        SpanStats {
            exported: read(&self.counts.exported),
            dropped: read(&self.counts.dropped),
            failed: read(&self.counts.failed),
            queued: self.settings.max_queue.max(1) - self.queue.capacity(),
        }
    }
}

/// The spans of one exporter: `exported` (the collector took them), `dropped` (the queue was
/// full), `failed` (their export failed), and `queued` now.
pub struct SpanStats {
    pub exported: u64,
    pub dropped: u64,
    pub failed: u64,
    pub queued: usize,
}

#[derive(Default)]
struct Counts {
    exported: AtomicU64,
    dropped: AtomicU64,
    failed: AtomicU64,
}

fn locked<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The export task: a batch goes out when it is full, every `interval`, and at the stop.
async fn export(
    exporter: opentelemetry_otlp::SpanExporter,
    mut queued: mpsc::Receiver<SpanData>,
    interval: Duration,
    mut stop: oneshot::Receiver<()>,
    counts: Arc<Counts>,
) {
    let mut outbox = Outbox {
        exporter,
        batch: Vec::with_capacity(MAX_BATCH),
        failing: false,
        counts,
        dropped_seen: 0,
    };
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        let room = MAX_BATCH - outbox.batch.len();
        tokio::select! {
            _ = tick.tick() => {}
            received = queued.recv_many(&mut outbox.batch, room) => {
                if received == 0 {
                    break;
                }
                if outbox.batch.len() < MAX_BATCH {
                    continue;
                }
            }
            _ = &mut stop => break,
        }
        outbox.send().await;
    }
    queued.close();
    while let Ok(span) = queued.try_recv() {
        outbox.batch.push(span);
        if outbox.batch.len() >= MAX_BATCH {
            outbox.send().await;
        }
    }
    outbox.send().await;
}

/// The batch being filled, and what has been said in the log about export trouble.
struct Outbox {
    exporter: opentelemetry_otlp::SpanExporter,
    batch: Vec<SpanData>,
    failing: bool,
    counts: Arc<Counts>,
    dropped_seen: u64,
}

impl Outbox {
    async fn send(&mut self) {
        let dropped = self.counts.dropped.load(Ordering::Relaxed);
        if dropped > self.dropped_seen {
            tracing::warn!(
                spans = dropped - self.dropped_seen,
                total = dropped,
                "spans dropped: the export queue (telemetry.otlp.max_queue) was full"
            );
            self.dropped_seen = dropped;
        }
        if self.batch.is_empty() {
            return;
        }
        let spans = std::mem::replace(&mut self.batch, Vec::with_capacity(MAX_BATCH));
        let count = spans.len();
        let exported = self.exporter.export(spans).await;
        let counted = match exported {
            Ok(()) => &self.counts.exported,
            Err(_) => &self.counts.failed,
        };
        counted.fetch_add(count as u64, Ordering::Relaxed);
        match exported {
            Ok(()) if self.failing => {
                tracing::info!("spans are exported again");
                self.failing = false;
            }
            Ok(()) => {}
            Err(error) if !self.failing => {
                tracing::warn!(%error, spans = count, "spans could not be exported and were dropped; later failures are not logged until an export succeeds");
                self.failing = true;
            }
            Err(_) => {}
        }
    }
}

/// The exporter's HTTP client: the same hyper and rustls stack as the upstream clients.
#[derive(Debug)]
struct Transport {
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    timeout: Duration,
}

impl Transport {
    fn new(timeout: Duration) -> Transport {
        let https = crate::upstream::connector(timeout, false);
        Transport {
            client: Client::builder(TokioExecutor::new()).build(https),
            timeout,
        }
    }
}

#[async_trait]
impl HttpClient for Transport {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let exchange = async {
            let response = self.client.request(request.map(Full::new)).await?;
            let (parts, body) = response.into_parts();
            let body = Limited::new(body, MAX_COLLECTOR_ANSWER).collect().await?;
            Ok::<_, HttpError>(Response::from_parts(parts, body.to_bytes()))
        };
        match tokio::time::timeout(self.timeout, exchange).await {
            Ok(answered) => answered,
            Err(_) => Err("the collector did not answer in time".into()),
        }
    }
}
