//! Changing the config while serving. [`Live`] holds the runtime requests start on; a reload
//! (`POST /admin/reload`, SIGHUP through [`crate::Running::reload`], or a change of the file)
//! re-reads the file, and either swaps in the next runtime whole or refuses the file and keeps
//! the running one. Requests already under way finish on the runtime they started with.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use onedoor_config::{Problem, Snapshot};
use sha2::{Digest, Sha256};
use tokio::sync::{watch, Mutex};

use crate::health::Probes;
use crate::runtime::Runtime;

/// How often the config file is checked for a change.
const POLL: Duration = Duration::from_secs(1);

/// The runtime new requests start on, and what replaces it.
pub struct Live {
    runtime: ArcSwap<Runtime>,
    /// The config file reloads re-read; `None` when the gateway was started from a snapshot.
    source: Option<PathBuf>,
    /// The health probes of the current runtime. The lock also makes reloads take turns.
    probes: Mutex<Option<Probes>>,
    shutdown: watch::Receiver<bool>,
}

/// What a successful reload put in place.
#[derive(Debug, Clone)]
pub struct Summary {
    /// The paragraph `onedoor validate` prints for the config now running.
    pub text: String,
    pub backends: usize,
    pub aliases: usize,
    pub tenants: usize,
    /// Settings the file changes that only apply after a restart (`listen`, `admin.listen`,
    /// `state`); the running values stay until then.
    pub needs_restart: Vec<&'static str>,
}

/// Why a reload left the running config in place.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ReloadError {
    #[error("the gateway was started without a config file, so there is nothing to re-read")]
    NoSource,
    #[error("the config file has {} problem(s); the running config stays", .0.len())]
    Invalid(Vec<Problem>),
}

impl Live {
    /// Starts serving `runtime` (and its health probes); `source` is the file reloads re-read.
    pub fn new(runtime: Runtime, source: Option<PathBuf>, shutdown: watch::Receiver<bool>) -> Self {
        let probes = Probes::plan(&runtime, shutdown.clone());
        Live {
            runtime: ArcSwap::from_pointee(runtime),
            source,
            probes: Mutex::new(Some(probes)),
            shutdown,
        }
    }

    /// The runtime a request starting now runs on.
    pub fn current(&self) -> Arc<Runtime> {
        self.runtime.load_full()
    }

    pub fn source(&self) -> Option<&Path> {
        self.source.as_deref()
    }

    /// Re-reads the config file. A valid one replaces the running config at once for new
    /// requests; an invalid one is refused, its problems logged, and the running config stays.
    pub async fn reload(&self) -> Result<Summary, ReloadError> {
        let path = self.source.clone().ok_or(ReloadError::NoSource)?;
        let mut probes = self.probes.lock().await;
        let mut snapshot = match read(path).await {
            Ok(snapshot) => snapshot,
            Err(problems) => {
                for problem in &problems {
                    tracing::warn!(%problem, "config problem");
                }
                let error = ReloadError::Invalid(problems);
                tracing::error!("reload refused: {error}");
                self.current().metrics.reloaded(false);
                return Err(error);
            }
        };
        let current = self.current();
        let needs_restart = keep_bound(&current.snapshot, &mut snapshot);
        for setting in &needs_restart {
            tracing::warn!(
                setting,
                "the config changes `{setting}`, which only applies after a restart; the rest applies now"
            );
        }
        let next = current.next(Arc::new(snapshot));
        crate::admission::load_vocabularies(&next.snapshot);
        next.key_sets.warm(&next.snapshot);
        if let Some(old) = probes.take() {
            old.stop().await;
        }
        if !*self.shutdown.borrow() {
            *probes = Some(Probes::plan(&next, self.shutdown.clone()));
        }
        let summary = Summary::of(&next.snapshot, needs_restart);
        next.metrics.reloaded(true);
        self.runtime.store(Arc::new(next));
        tracing::info!(summary = %summary.text, "config reloaded");
        Ok(summary)
    }

    /// Stops the health probes (on shutdown).
    pub async fn stop(&self) {
        if let Some(probes) = self.probes.lock().await.take() {
            probes.stop().await;
        }
    }
}

impl Summary {
    fn of(snapshot: &Snapshot, needs_restart: Vec<&'static str>) -> Self {
        Summary {
            text: onedoor_config::summary(snapshot),
            backends: snapshot.backends.len(),
            aliases: snapshot.aliases.len() + usize::from(snapshot.wildcard.is_some()),
            tenants: snapshot.tenants.len(),
            needs_restart,
        }
    }
}

/// Loads the config off the async threads (it reads the file and any `file:` secrets).
async fn read(path: PathBuf) -> Result<Snapshot, Vec<Problem>> {
    let file = path.display().to_string();
    match tokio::task::spawn_blocking(move || onedoor_config::load(&path)).await {
        Ok(loaded) => loaded,
        Err(error) => Err(vec![Problem {
            file,
            line: 1,
            col: 1,
            message: format!("the config could not be read: {error}"),
        }]),
    }
}

/// Keeps what a running process cannot change (its bound listeners, its state store) and names
/// each such setting the new config changes.
fn keep_bound(running: &Snapshot, next: &mut Snapshot) -> Vec<&'static str> {
    let mut kept = Vec::new();
    if next.listen != running.listen {
        kept.push("listen");
        next.listen = running.listen;
    }
    if next.admin.listen != running.admin.listen {
        kept.push("admin.listen");
        next.admin.listen = running.admin.listen;
    }
    if next.max_connections != running.max_connections {
        kept.push("max_connections");
        next.max_connections = running.max_connections;
    }
    if next.client_timeouts != running.client_timeouts {
        kept.push("client_timeouts");
        next.client_timeouts = running.client_timeouts;
    }
    if next.state.store != running.state.store
        || next.state.redis_url != running.state.redis_url
        || next.state.key_prefix != running.state.key_prefix
        || next.state.on_store_error != running.state.on_store_error
    {
        kept.push("state");
        next.state = running.state.clone();
    }
    kept
}

/// Reloads whenever the content of `live`'s config file differs from `seen` (what it was when the
/// running config was read), checking every second, until shutdown. A file that cannot be read
/// (for a moment, while it is replaced) is waited out. Secrets read through `file:` are not
/// watched; SIGHUP or `POST /admin/reload` picks them up.
pub async fn watch_file(
    live: Arc<Live>,
    mut seen: Option<[u8; 32]>,
    mut shutdown: watch::Receiver<bool>,
) {
    let Some(path) = live.source().map(Path::to_path_buf) else {
        return;
    };
    let mut ticker = tokio::time::interval(POLL);
    ticker.tick().await;
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = shutdown.changed() => return,
        }
        let now = fingerprint_off_thread(&path).await;
        if now.is_none() || now == seen {
            continue;
        }
        seen = now;
        tracing::info!(file = %path.display(), "the config file changed; reloading");
        // Success and refusal are both logged by the reload itself.
        let _ = live.reload().await;
    }
}

/// The digest of the file's content, `None` when it cannot be read.
pub fn fingerprint(path: &Path) -> Option<[u8; 32]> {
    let bytes = std::fs::read(path).ok()?;
    Some(Sha256::digest(&bytes).into())
}

async fn fingerprint_off_thread(path: &Path) -> Option<[u8; 32]> {
    let path = path.to_path_buf();
    tokio::task::spawn_blocking(move || fingerprint(&path))
        .await
        .ok()
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot(yaml: &str) -> Snapshot {
        onedoor_config::parse(yaml, Path::new("t.yaml"), &|_| None).unwrap()
    }

    #[test]
    fn a_changed_listen_address_is_kept_and_named() {
        let running = snapshot("listen: 127.0.0.1:8080\nadmin: { listen: 127.0.0.1:9090 }\n");
        let mut next = snapshot("listen: 127.0.0.1:8081\nadmin: { listen: 127.0.0.1:9090 }\n");
        assert_eq!(keep_bound(&running, &mut next), vec!["listen"]);
        assert_eq!(next.listen, running.listen);
        assert!(keep_bound(&running, &mut next).is_empty());
    }
}
