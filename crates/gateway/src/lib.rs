//! The onedoor gateway: listeners and surfaces, auth, routing and failover, provider adapters,
//! streaming, and the admin API. It runs on a compiled config [`Snapshot`] and keeps its learned
//! state behind the `onedoor_state::State` trait.

mod access_log;
mod activity;
mod admin;
mod admission;
mod affinity;
mod attempt;
mod auth;
mod batch;
pub mod body;
mod boxing;
mod breaker;
mod client_keys;
mod dashboard;
mod errors;
mod failover;
mod fleet;
mod headroom;
mod health;
mod identity;
mod idle_poll;
mod jwt;
mod lanes;
mod messages;
mod metrics;
mod outcome;
mod pipeline;
pub mod process;
mod provider;
mod readiness;
mod realtime;
mod recording;
mod redaction;
mod reload;
mod request;
mod router;
mod runtime;
mod server;
mod session_token;
mod stamp;
mod stopping;
mod stream;
mod surface;
mod telemetry;
pub mod tokens;
mod trace;
pub mod translate;
mod upstream;
pub mod usage;
#[cfg(test)]
mod wire_damage;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use onedoor_config::{OnStoreError, Problem, Snapshot, StateConfig, StoreKind};
use onedoor_state::{OnError, RedisConfig, Store};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::reload::Live;
use crate::runtime::Runtime;

pub use crate::idle_poll::configure_from_env as configure_idle_poll;
pub use crate::lanes::set_housekeeping as set_lane_housekeeping;
pub use crate::reload::{ReloadError, Summary};
pub use crate::server::framing_refusal;

/// How long a stop waits for realtime sessions to finish their close handshakes once
/// `shutdown.timeout` has sent them their close frames.
const SESSIONS_CLOSE: Duration = Duration::from_secs(5);

/// A running gateway: its bound addresses, and the handles that reload and stop it.
pub struct Running {
    addr: SocketAddr,
    admin_addr: SocketAddr,
    live: Arc<Live>,
    /// Raised when the client listener closes: the health probes, the file watch and the
    /// activity sampler stop.
    shutdown: watch::Sender<bool>,
    clients: JoinHandle<()>,
    admins: JoinHandle<()>,
    tasks: Vec<JoinHandle<()>>,
    /// Kept until realtime sessions have closed: they run on the lanes, and the client listener,
    /// which holds the lanes too, ends as soon as no HTTP connection is open.
    lanes: Arc<lanes::Lanes>,
}

/// Why a gateway did not start from its config file.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("the config file has {} problem(s)", .0.len())]
    Config(Vec<Problem>),
    #[error("cannot listen: {0}")]
    Listen(#[from] std::io::Error),
}

impl Running {
    /// The client-facing address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// Re-reads the config file (what `POST /admin/reload` and SIGHUP do): a valid one serves
    /// new requests at once, an invalid one is refused and the running config stays.
    pub async fn reload(&self) -> Result<Summary, ReloadError> {
        self.live.reload().await
    }

    /// Stops as a load balancer or Kubernetes expects (what SIGTERM does): `/readyz` answers
    /// 503 at once while the listeners go on accepting for `shutdown.drain_delay`, each HTTP/1.1
    /// answer saying `connection: close` and each h2 connection getting GOAWAY; then as
    /// [`Running::shutdown`]. The settings are the running config's when this is called.
    pub async fn drain_and_shutdown(self) {
        let settings = self.live.current().snapshot.shutdown;
        self.stop(settings.drain_delay).await;
    }

    /// Stops without a drain delay: the client listener closes at once; requests under way
    /// (open streams included) and realtime sessions get `shutdown.timeout`, then are cut
    /// (sessions with a 1001 close); then the health probes and the file watch stop, the usage
    /// records still buffered are written out (to the store, or to the journal the next start
    /// replays), and it returns when all is done.
    pub async fn shutdown(self) {
        self.stop(Duration::ZERO).await;
    }

    async fn stop(self, drain_delay: Duration) {
        let runtime = self.live.current();
        let stopping = runtime.stopping.clone();
        let timeout = runtime.snapshot.shutdown.timeout;
        stopping.drain();
        if !drain_delay.is_zero() {
            tracing::info!(
                ?drain_delay,
                "draining: /readyz answers 503; still accepting"
            );
            tokio::time::sleep(drain_delay).await;
        }
        tracing::info!(
            ?timeout,
            "the client listener closes; requests under way may finish"
        );
        let deadline = tokio::time::Instant::now() + timeout;
        let _ = self.shutdown.send(true);
        stopping.close_clients(self.clients, deadline).await;
        close_sessions(&runtime.sessions, deadline).await;
        // The sessions ran on the lanes; a lane stopped before would have dropped its sessions
        // without their close frames.
        drop(self.lanes);
        // What the last requests owe the shared store would otherwise wait for a task of a lane.
        runtime.state.settle_queued().await;
        stopping.close_admin(self.admins).await;
        for task in self.tasks {
            let _ = task.await;
        }
        self.live.stop().await;
        if !self.live.current().recorder.close().await {
            tracing::warn!("usage records wait in the journal: the usage store did not take them; the next start replays them");
        }
        if let Some(telemetry) = self.live.current().telemetry.clone() {
            telemetry.close().await;
        }
        crate::access_log::flush();
    }
}

/// Lets realtime sessions end on their own until `deadline`, then sends those still open a
/// 1001 close and waits for the handshakes.
async fn close_sessions(sessions: &realtime::Sessions, deadline: tokio::time::Instant) {
    let left = deadline.saturating_duration_since(tokio::time::Instant::now());
    if sessions.open() == 0 || sessions.drained(left).await {
        sessions.close_all();
        return;
    }
    sessions.close_all();
    if !sessions.drained(SESSIONS_CLOSE).await {
        tracing::warn!(
            open = sessions.open(),
            "realtime sessions still open after their close frames; dropping them"
        );
    }
}

/// Binds the snapshot's `listen` and `admin.listen` addresses and starts serving. Reloads are
/// refused: there is no file to re-read (see [`start_from_file`]).
pub async fn start(snapshot: Snapshot) -> std::io::Result<Running> {
    let (client, admin) = bind(&snapshot).await?;
    Ok(start_on(snapshot, client, admin))
}

/// Starts serving on listeners the caller bound (tests bind port 0), without a file to reload.
pub fn start_on(snapshot: Snapshot, client: TcpListener, admin: TcpListener) -> Running {
    launch(snapshot, client, admin, None)
}

/// Loads the config file at `path`, binds its addresses and starts serving. Reloads re-read
/// `path`, and a change of its content is picked up within about a second.
pub async fn start_from_file(path: &Path) -> Result<Running, StartError> {
    let seen = reload::fingerprint(path);
    let snapshot = onedoor_config::load(path).map_err(StartError::Config)?;
    let (client, admin) = bind(&snapshot).await?;
    let source = Source {
        path: path.to_path_buf(),
        seen,
    };
    Ok(launch(snapshot, client, admin, Some(source)))
}

/// [`start_on`] for a snapshot loaded from a file: reloads re-read `snapshot.source`, which is
/// also watched for changes (from its content at this call).
pub fn start_on_file(snapshot: Snapshot, client: TcpListener, admin: TcpListener) -> Running {
    let source = Source {
        seen: reload::fingerprint(&snapshot.source),
        path: snapshot.source.clone(),
    };
    launch(snapshot, client, admin, Some(source))
}

/// The config file a gateway reloads from, and the digest of its content when it was read.
struct Source {
    path: PathBuf,
    seen: Option<[u8; 32]>,
}

async fn bind(snapshot: &Snapshot) -> std::io::Result<(TcpListener, TcpListener)> {
    Ok((listen(snapshot.listen)?, listen(snapshot.admin.listen)?))
}

/// Connections a listener's kernel queue holds before they are accepted (the kernel's
/// `net.core.somaxconn` may lower it): a burst of connects waits there instead of being dropped.
const BACKLOG: u32 = 4096;

fn listen(address: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = match address {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    socket.bind(address)?;
    socket.listen(BACKLOG)
}

fn launch(
    snapshot: Snapshot,
    client: TcpListener,
    admin: TcpListener,
    source: Option<Source>,
) -> Running {
    let state = Arc::new(store_for(&snapshot.state));
    let (shutdown, watcher) = watch::channel(false);
    let mut runtime = Runtime::new(Arc::new(snapshot), state);
    let stopping = runtime.stopping.clone();
    admission::load_vocabularies(&runtime.snapshot);
    runtime.recorder = recording::start(&runtime.snapshot);
    runtime.telemetry = telemetry::start(&runtime.snapshot);
    runtime.key_sets.warm(&runtime.snapshot);
    let destination = onedoor_usage::Destination::of(&runtime.snapshot.usage).ok();
    let key_store = destination
        .map(|d| d.store)
        .filter(|s| *s != onedoor_usage::StoreUrl::Off);
    let notices = client_keys::notices(&runtime.snapshot.state);
    runtime.client_keys = Arc::new(client_keys::ClientKeys::new(key_store, notices));
    let seen = source.as_ref().map(|s| s.seen);
    let live = Arc::new(Live::new(runtime, source.map(|s| s.path), watcher.clone()));
    let addr = local_addr(&client);
    let admin_addr = local_addr(&admin);
    let for_clients = live.clone();
    let lanes = Arc::new(lanes::Lanes::start());
    let limit_of = live.clone();
    server::raise_descriptor_limit();
    let client_limits = server::Limits {
        max_connections: server::connection_cap(live.current().snapshot.max_connections),
        timeouts: live.current().snapshot.client_timeouts,
    };
    let clients = tokio::spawn(server::serve(
        client,
        move |request| pipeline::handle(for_clients.clone(), request),
        Arc::new(move |headers: &http::HeaderMap| {
            // A large body is read only for a caller with a known key (or a token that checks
            // with cached keys); a stranger's request comes to the pipeline unread, which
            // refuses it at its credential.
            let runtime = limit_of.current();
            let max = runtime.snapshot.max_request_body;
            match auth::known(&runtime, headers) {
                true => max,
                false => max.min(server::SMALL_BODY),
            }
        }),
        client_limits,
        stopping.client(),
        Some(lanes.clone()),
    ));
    let for_admins = live.clone();
    let admins = tokio::spawn(server::serve(
        admin,
        move |request| admin::handle(for_admins.clone(), request),
        Arc::new(|_: &http::HeaderMap| admin::MAX_BODY),
        admin::LIMITS,
        stopping.admin(),
        None,
    ));
    let activity = live.current().metrics.activity.clone();
    let sampler = tokio::spawn(activity::sample(activity, watcher.clone()));
    let batches = tokio::spawn(batch::poll(live.clone(), watcher.clone()));
    let keys = client_keys::keep_in_sync(live.current().client_keys.clone(), watcher.clone());
    let mut tasks = vec![sampler, batches, tokio::spawn(keys)];
    if let Some(seen) = seen {
        tasks.push(tokio::spawn(reload::watch_file(
            live.clone(),
            seen,
            watcher,
        )));
    }
    Running {
        addr,
        admin_addr,
        live,
        shutdown,
        clients,
        admins,
        tasks,
        lanes,
    }
}

/// The state store `state` asks for. Redis connects lazily, so an unreachable Redis at start is
/// an outage handled by `on_store_error`, not a failure to start.
fn store_for(state: &StateConfig) -> Store {
    match (state.store, &state.redis_url) {
        (StoreKind::Redis, Some(url)) => Store::redis(&RedisConfig {
            url: url.clone(),
            ca_file: state.redis_ca_file.clone(),
            key_prefix: state.key_prefix.clone(),
            on_error: match state.on_store_error {
                OnStoreError::FailOpen => OnError::FailOpen,
                OnStoreError::FailClosed => OnError::FailClosed,
            },
        }),
        _ => Store::memory(),
    }
}

fn local_addr(listener: &TcpListener) -> SocketAddr {
    listener
        .local_addr()
        .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)))
}
