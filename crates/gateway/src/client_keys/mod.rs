//! Client keys made at runtime through the admin API (`/admin/keys`), beside the config's: kept
//! in the usage store's database as sha256 digests, cached here as an immutable index swapped
//! whole, and brought up to date on every instance by polling the store's change number
//! ([`sync`]). A config key always wins: a runtime key is looked up only for a digest the config
//! does not know, so it can never shadow one.

pub mod api;
mod settings;
pub(crate) mod sync;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use arc_swap::ArcSwap;
use onedoor_config::Key;
use onedoor_state::Notices;
use onedoor_usage::{KeySet, KeyStore, StoreUrl, StoredKey};

use crate::errors::GatewayError;

pub use settings::Settings;
pub use sync::run as keep_in_sync;

/// The runtime keys of one gateway, shared by every runtime it has (reloads keep it).
pub struct ClientKeys {
    /// The usage store's database; `None` when `usage.store` is off (no runtime keys then).
    destination: Option<StoreUrl>,
    store: OnceLock<KeyStore>,
    index: ArcSwap<Index>,
    /// Serialises loads, so an older load never replaces a newer one.
    loading: tokio::sync::Mutex<()>,
    /// Told when the store is open and its keys loaded.
    opened: tokio::sync::Notify,
    /// Changes announced to (and by) the other instances, with a Redis state store.
    notices: Option<Notices>,
}

#[derive(Default)]
struct Index {
    version: i64,
    by_digest: HashMap<[u8; 32], Secret>,
    /// In creation order.
    keys: Vec<Arc<Entry>>,
}

struct Secret {
    entry: Arc<Entry>,
    /// The end of a rotated secret's grace period.
    valid_until_ms: Option<u64>,
}

/// One runtime key as the gateway holds it.
pub struct Entry {
    pub stored: StoredKey,
    pub settings: Settings,
    pub key: Arc<Key>,
    /// The end of the grace periods of its rotated secrets still valid.
    pub rotated_until_ms: Vec<u64>,
    /// When this instance last let a request through with it (Unix ms; 0: never).
    used_ms: AtomicU64,
    /// What of `used_ms` is already written to the store.
    flushed_ms: AtomicU64,
}

impl Entry {
    /// The latest use this instance saw or the store knows of.
    pub fn last_used_ms(&self) -> Option<u64> {
        let stored = self.stored.last_used_ms.map(|ms| ms.max(0) as u64);
        let here = Some(self.used_ms.load(Ordering::Relaxed)).filter(|&ms| ms > 0);
        stored.max(here)
    }

    /// `disabled` or `expired` when that is what the key is, else `active`.
    pub fn state(&self, now_ms: u64) -> &'static str {
        match (self.settings.disabled, self.settings.expires_at_ms) {
            (true, _) => "disabled",
            (false, Some(at)) if at <= now_ms => "expired",
            _ => "active",
        }
    }
}

impl ClientKeys {
    pub fn new(destination: Option<StoreUrl>, notices: Option<Notices>) -> ClientKeys {
        ClientKeys {
            destination,
            notices,
            store: OnceLock::new(),
            index: ArcSwap::default(),
            loading: tokio::sync::Mutex::new(()),
            opened: tokio::sync::Notify::new(),
        }
    }

    /// For a gateway without a usage store.
    pub fn none() -> ClientKeys {
        ClientKeys::new(None, None)
    }

    /// Tells the other instances that the store changed (its change number now `seq`).
    pub async fn announce(&self, seq: i64) {
        if let Some(notices) = &self.notices {
            notices.announce(&seq.to_string()).await;
        }
    }

    /// The store, once it has been opened.
    pub fn store(&self) -> Result<&KeyStore, StoreMissing> {
        match (&self.destination, self.store.get()) {
            (None, _) => Err(StoreMissing::Off),
            (Some(_), None) => Err(StoreMissing::NotYet),
            (Some(_), Some(store)) => Ok(store),
        }
    }

    /// Waits up to `within` for the store to be opened (just after a start).
    pub async fn ready(&self, within: std::time::Duration) {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let opened = self.opened.notified();
            if !matches!(self.store(), Err(StoreMissing::NotYet)) {
                return;
            }
            if tokio::time::timeout_at(deadline, opened).await.is_err() {
                return;
            }
        }
    }

    /// Keeps the opened store and loads its keys.
    async fn open(&self, store: KeyStore) {
        let _ = self.store.set(store);
        if let Err(error) = self.refresh(true).await {
            tracing::warn!(%error, "runtime keys: the store cannot be read yet");
        }
        self.opened.notify_waiters();
    }

    /// The runtime key a digest belongs to, when it is one: `Err` for a key that exists but
    /// may not be used (disabled, expired, or a rotated secret past its grace).
    pub fn find(&self, digest: &[u8; 32], now_ms: u64) -> Option<Result<Arc<Entry>, GatewayError>> {
        let index = self.index.load();
        let secret = index.by_digest.get(digest)?;
        let entry = &secret.entry;
        let refusal = match entry.state(now_ms) {
            "disabled" => Some(format!("the API key `{}` is disabled", entry.stored.id)),
            "expired" => Some(format!("the API key `{}` has expired", entry.stored.id)),
            _ if secret.valid_until_ms.is_some_and(|until| until <= now_ms) => {
                return Some(Err(GatewayError::UnknownKey))
            }
            _ => None,
        };
        if let Some(message) = refusal {
            return Some(Err(GatewayError::KeyRefused(message)));
        }
        entry.used_ms.fetch_max(now_ms, Ordering::Relaxed);
        Some(Ok(entry.clone()))
    }

    /// Every key, in creation order.
    pub fn entries(&self) -> Vec<Arc<Entry>> {
        self.index.load().keys.clone()
    }

    pub fn entry(&self, id: &str) -> Option<Arc<Entry>> {
        self.index
            .load()
            .keys
            .iter()
            .find(|e| e.stored.id == id)
            .cloned()
    }

    /// Reads the store again when its change number moved on (or `force`).
    pub async fn refresh(&self, force: bool) -> Result<(), onedoor_usage::UsageError> {
        let Ok(store) = self.store() else {
            return Ok(());
        };
        let _one_at_a_time = self.loading.lock().await;
        if !force && store.version().await? == self.index.load().version {
            return Ok(());
        }
        let set = store.load().await?;
        let next = Index::of(set, &self.index.load());
        self.index.store(Arc::new(next));
        Ok(())
    }

    /// Writes the uses this instance saw since the last flush.
    pub async fn flush_last_used(&self) {
        let Ok(store) = self.store() else {
            return;
        };
        let index = self.index.load_full();
        let used: Vec<(String, i64, &Entry)> = index
            .keys
            .iter()
            .filter_map(|e| {
                let used = e.used_ms.load(Ordering::Relaxed);
                (used > e.flushed_ms.load(Ordering::Relaxed))
                    .then(|| (e.stored.id.clone(), used as i64, e.as_ref()))
            })
            .collect();
        let writes = used.iter().map(|(id, at, _)| (id.clone(), *at)).collect();
        match store.touch(writes).await {
            Ok(()) => {
                for (_, at, entry) in &used {
                    entry.flushed_ms.fetch_max(*at as u64, Ordering::Relaxed);
                }
            }
            Err(error) => {
                tracing::warn!(%error, "could not record when runtime keys were last used")
            }
        }
    }
}

/// The notices of key changes between instances: with `state.store: redis` on one server's URL.
pub fn notices(state: &onedoor_config::StateConfig) -> Option<Notices> {
    let url = state.redis_url.as_deref()?;
    match state.store {
        onedoor_config::StoreKind::Redis => Notices::new(url, &state.key_prefix, sync::TOPIC),
        onedoor_config::StoreKind::Memory => None,
    }
}

/// Why there is no key store to talk to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreMissing {
    /// `usage.store: off`.
    Off,
    /// Not opened yet (or not reachable since the start).
    NotYet,
}

impl Index {
    /// The index of `set`, keeping what `previous` learned of each key's uses.
    fn of(set: KeySet, previous: &Index) -> Index {
        let mut by_id: HashMap<String, Vec<(String, Option<i64>)>> = HashMap::new();
        for secret in set.secrets {
            by_id
                .entry(secret.key_id)
                .or_default()
                .push((secret.sha256, secret.valid_until_ms));
        }
        let mut index = Index {
            version: set.version,
            ..Index::default()
        };
        for stored in set.keys {
            let settings = match serde_json::from_str::<Settings>(&stored.settings) {
                Ok(settings) => settings,
                Err(error) => {
                    tracing::error!(key = stored.id, %error, "a runtime key's settings do not read; it is refused");
                    continue;
                }
            };
            let secrets = by_id.remove(&stored.id).unwrap_or_default();
            let earlier = previous.keys.iter().find(|e| e.stored.id == stored.id);
            let entry = Arc::new(Entry {
                key: Arc::new(settings.key(&stored.id)),
                rotated_until_ms: secrets
                    .iter()
                    .filter_map(|(_, until)| until.map(|u| u.max(0) as u64))
                    .collect(),
                used_ms: AtomicU64::new(earlier.map_or(0, |e| e.used_ms.load(Ordering::Relaxed))),
                flushed_ms: AtomicU64::new(
                    earlier.map_or(0, |e| e.flushed_ms.load(Ordering::Relaxed)),
                ),
                settings,
                stored,
            });
            for (sha256, until) in secrets {
                let mut digest = [0u8; 32];
                if hex::decode_to_slice(&sha256, &mut digest).is_ok() {
                    index.by_digest.insert(
                        digest,
                        Secret {
                            entry: entry.clone(),
                            valid_until_ms: until.map(|u| u.max(0) as u64),
                        },
                    );
                }
            }
            index.keys.push(entry);
        }
        index
    }
}
