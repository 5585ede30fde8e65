//! Active health checks: every backend with a `health_check` is probed each interval (GET
//! `{url}{path}` with its own credential, on its own upstream client); a 2xx passes. The results
//! go into the backend's [`Flags`], which the router reads. Probes are planned per runtime and
//! replanned on reload; they stop on shutdown.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::BodyExt;
use onedoor_config::{Backend, HealthCheck};
use onedoor_state::now_ms;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::MissedTickBehavior;

use crate::fleet::{Check, Flags};
use crate::identity::TokenCache;
use crate::provider::Header;
use crate::runtime::Runtime;
use crate::upstream::{Failure, Pool};

/// A probe answer longer than this is not read to its end.
const PROBE_BODY_LIMIT: usize = 64 * 1024;

/// The probing tasks of one runtime. Dropping it stops them.
pub struct Probes {
    tasks: JoinSet<()>,
}

/// Everything one probe loop needs, taken from the runtime it was planned for.
struct Probe {
    name: String,
    uri: String,
    headers: Vec<Header>,
    /// The token cache of a backend reached by identity.
    tokens: Option<Arc<TokenCache>>,
    client: Pool,
    interval: Duration,
    /// A probe that takes longer than this failed.
    timeout: Duration,
    flags: Arc<Flags>,
}

impl Probes {
    /// Starts one probe loop per backend of `runtime` that has a health check.
    pub fn plan(runtime: &Runtime, shutdown: watch::Receiver<bool>) -> Probes {
        let mut tasks = JoinSet::new();
        for (id, backend) in runtime.snapshot.backends.iter().enumerate() {
            let Some(check) = &backend.health_check else {
                continue;
            };
            let (Some(client), Some(flags)) = (runtime.clients.get(id), runtime.fleet.get(id))
            else {
                continue;
            };
            let stamp = runtime.stamps.get(id).cloned().unwrap_or_default();
            let mut probe = Probe::new(backend, check, stamp, client.here().clone(), flags.clone());
            probe.tokens = runtime.credentials.of(id).cloned();
            tasks.spawn(probe.run(shutdown.clone()));
        }
        Probes { tasks }
    }

    /// Stops every probe and waits until they are gone.
    pub async fn stop(mut self) {
        self.tasks.shutdown().await;
    }
}

impl Probe {
    fn new(
        backend: &Backend,
        check: &HealthCheck,
        headers: Vec<Header>,
        client: Pool,
        flags: Arc<Flags>,
    ) -> Self {
        Probe {
            name: backend.name.to_string(),
            uri: format!("{}{}", backend.url, check.path),
            headers,
            tokens: None,
            client,
            interval: check.interval,
            timeout: check.interval.min(backend.timeouts.first_token),
            flags,
        }
    }

    /// Probes at once, then every interval, until shutdown.
    async fn run(self, mut shutdown: watch::Receiver<bool>) {
        let mut ticker = tokio::time::interval(self.interval);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticker.tick() => self.once().await,
                _ = shutdown.changed() => return,
            }
            if *shutdown.borrow() {
                return;
            }
        }
    }

    async fn once(&self) {
        let outcome = self.outcome().await;
        let check = Check {
            at_ms: now_ms(),
            passed: outcome.is_ok(),
            outcome: outcome.unwrap_or_else(|failure| failure),
        };
        let outcome = check.outcome.clone();
        match self.flags.record(check) {
            Some(false) => {
                tracing::warn!(backend = %self.name, %outcome, "health check failed twice in a row: the backend leaves rotation until a probe passes")
            }
            Some(true) => {
                tracing::info!(backend = %self.name, %outcome, "health check passed: the backend is back in rotation")
            }
            None => tracing::debug!(backend = %self.name, %outcome, "health check"),
        }
    }

    /// `Ok(status)` on a 2xx, `Err(outcome)` otherwise.
    async fn outcome(&self) -> Result<String, String> {
        let mut request = Request::get(&self.uri);
        for (name, value) in &self.headers {
            request = request.header(name, value.clone());
        }
        if let Some(tokens) = &self.tokens {
            let by = tokio::time::Instant::now() + self.timeout;
            let token = tokens.header(by).await.map_err(|_| "auth_unavailable")?;
            request = request.header(http::header::AUTHORIZATION, token);
        }
        let request = request
            .body(Bytes::new())
            .map_err(|_| "invalid_url".to_owned())?;
        let response = tokio::time::timeout(self.timeout, self.client.request(request))
            .await
            .map_err(|_| "timeout".to_owned())?
            .map_err(|failure| match failure {
                Failure::ConnectError(_) | Failure::ConnectTimeout => "connect_error".to_owned(),
                _ => "reset".to_owned(),
            })?;
        let status = response.status();
        // The body is not needed, but reading a short one to its end keeps the connection for
        // the next probe; a long or slow one is dropped, which closes the connection.
        let body = http_body_util::Limited::new(response.into_body(), PROBE_BODY_LIMIT);
        let _ = tokio::time::timeout(self.timeout, body.collect()).await;
        if status.is_success() {
            Ok(status.as_u16().to_string())
        } else {
            Err(status.as_u16().to_string())
        }
    }
}
