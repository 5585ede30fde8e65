//! Entra ID tokens for the backends that have an `identity`: one cache per (identity, scope),
//! shared by every backend that asks the same, kept by a background task that fetches the first
//! token when it is first needed and each next one before the last expires. A request finds the
//! token as a ready `Authorization` header and clones it (a reference count, no lock, no
//! allocation); only a request that finds none (the cold start, an expired token, a 401) waits,
//! and however many wait, one token request is made for them.

mod flows;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use http::HeaderValue;
use onedoor_config::{Snapshot, TokenSource};
use tokio::sync::{watch, Notify};
use tokio::task::AbortHandle;
use tokio::time::Instant;

use crate::upstream::Failure;
use flows::{FetchError, TokenClient};

/// The first wait after a failed token request; it doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
const MAX_BACKOFF: Duration = Duration::from_secs(15);
/// The least time between two token requests of one cache.
const MIN_INTERVAL: Duration = Duration::from_millis(100);
/// A refused token is replaced at most once in this long.
const REFETCH_GUARD: Duration = Duration::from_secs(2);
/// A token is fetched again this long before it expires (at most a quarter of its life ahead).
const REFRESH_AHEAD: Duration = Duration::from_secs(300);
/// A token is not sent in the last moments of its life: the backend could see it expired.
const EXPIRY_MARGIN: Duration = Duration::from_secs(30);

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The token caches of one runtime, by backend (same index as `snapshot.backends`).
#[derive(Default)]
pub struct Credentials {
    by_backend: Vec<Option<Arc<TokenCache>>>,
}

impl Credentials {
    /// A cache for each backend with an identity; the caches of `previous` that ask for the same
    /// token are kept (with their token and task), as are caches shared by backends alike.
    pub fn new(snapshot: &Snapshot, previous: Option<&Credentials>) -> Credentials {
        let mut made: Vec<Arc<TokenCache>> = Vec::new();
        let old = previous.map_or(&[][..], |p| &p.by_backend[..]);
        let by_backend = snapshot
            .backends
            .iter()
            .map(|backend| {
                let wanted = backend.identity.as_ref()?;
                let identity = snapshot.identities.get(wanted.identity)?;
                let same =
                    |c: &&Arc<TokenCache>| c.source == identity.source && c.scope == wanted.scope;
                let found = made
                    .iter()
                    .find(same)
                    .or_else(|| old.iter().flatten().find(same))
                    .cloned();
                let cache = found.unwrap_or_else(|| {
                    Arc::new(TokenCache::new(
                        identity.name.to_string(),
                        identity.source.clone(),
                        wanted.scope.clone(),
                    ))
                });
                if !made.iter().any(|c| Arc::ptr_eq(c, &cache)) {
                    made.push(cache.clone());
                }
                Some(cache)
            })
            .collect();
        Credentials { by_backend }
    }

    /// The token cache of backend `backend`, if it authenticates with an identity.
    pub fn of(&self, backend: usize) -> Option<&Arc<TokenCache>> {
        self.by_backend.get(backend)?.as_ref()
    }
}

/// One (identity, scope)'s token and the task that keeps it fresh. Dropping the last handle
/// stops the task.
pub struct TokenCache {
    shared: Arc<Shared>,
    source: TokenSource,
    scope: String,
    task: OnceLock<AbortHandle>,
}

/// What the cache and its task share.
struct Shared {
    identity: String,
    current: ArcSwapOption<Token>,
    /// Counts finished token requests, so a waiting request knows when to look again.
    attempts: watch::Sender<u64>,
    /// Whether the last token request failed: a request that finds no valid token then fails
    /// at once instead of waiting (the task retries on its own backoff).
    failing: AtomicBool,
    /// Whether a token request is in flight: a waiting request then asks for none of its own.
    fetching: AtomicBool,
    /// When a refused token was last replaced (a rare path: a plain lock).
    replaced_at: Mutex<Option<Instant>>,
    /// Asks the task for a token now (a cold start, a token a backend refused).
    wanted: Notify,
}

struct Token {
    /// `Bearer <token>`, marked sensitive.
    header: HeaderValue,
    /// When it is no longer sent.
    usable_until: Instant,
}

impl TokenCache {
    fn new(identity: String, source: TokenSource, scope: String) -> TokenCache {
        TokenCache {
            shared: Arc::new(Shared {
                identity,
                current: ArcSwapOption::empty(),
                attempts: watch::Sender::new(0),
                failing: AtomicBool::new(false),
                fetching: AtomicBool::new(false),
                replaced_at: Mutex::new(None),
                wanted: Notify::new(),
            }),
            source,
            scope,
            task: OnceLock::new(),
        }
    }

    /// The valid token's header, if there is one: the request path's whole cost.
    pub fn cached(&self) -> Option<HeaderValue> {
        let token = self.shared.current.load();
        let token = token.as_ref()?;
        (Instant::now() < token.usable_until).then(|| token.header.clone())
    }

    /// A valid token's header, waiting (until `deadline`) for the token request in flight when
    /// there is none yet; fails at once while the identity endpoint is failing.
    pub async fn header(&self, deadline: Instant) -> Result<HeaderValue, Failure> {
        if let Some(header) = self.cached() {
            return Ok(header);
        }
        self.wait(None, deadline).await
    }

    /// A token other than `refused`, which a backend has just answered 401 to: the one fetched
    /// since, or a new one fetched now.
    pub async fn replace(
        &self,
        refused: &HeaderValue,
        deadline: Instant,
    ) -> Result<HeaderValue, Failure> {
        self.wait(Some(refused), deadline).await
    }

    async fn wait(
        &self,
        refused: Option<&HeaderValue>,
        deadline: Instant,
    ) -> Result<HeaderValue, Failure> {
        self.start();
        let fresh = || self.cached().filter(|h| Some(h) != refused);
        let mut finished = self.shared.attempts.subscribe();
        if let Some(header) = fresh() {
            return Ok(header);
        }
        if refused.is_none() && self.shared.failing.load(Ordering::Acquire) {
            return Err(self.unavailable());
        }
        if refused.is_some() && !self.may_replace() {
            // Replaced a moment ago already: the backend refuses new tokens too.
            return self.cached().ok_or_else(|| self.unavailable());
        }
        if !self.shared.fetching.load(Ordering::Acquire) {
            self.shared.wanted.notify_one();
        }
        match tokio::time::timeout_at(deadline, finished.changed()).await {
            Err(_) => Err(Failure::Timeout),
            Ok(_) => fresh().ok_or_else(|| self.unavailable()),
        }
    }

    /// Whether a refused token may be replaced now: once per [`REFETCH_GUARD`], so a backend
    /// that refuses every token cannot make the gateway hammer its identity endpoint.
    fn may_replace(&self) -> bool {
        let mut last = lock(&self.shared.replaced_at);
        match *last {
            Some(at) if at.elapsed() < REFETCH_GUARD => false,
            _ => {
                *last = Some(Instant::now());
                true
            }
        }
    }

    fn unavailable(&self) -> Failure {
        Failure::AuthUnavailable(format!(
            "no token for identity {} (its identity endpoint is failing)",
            self.shared.identity
        ))
    }

    /// Starts the task on the runtime of the first request that needs a token.
    fn start(&self) {
        self.task.get_or_init(|| {
            // The task's first token request starts as soon as it runs.
            self.shared.fetching.store(true, Ordering::Release);
            let keeper = Keeper {
                shared: self.shared.clone(),
                source: self.source.clone(),
                scope: self.scope.clone(),
                client: flows::client(),
            };
            tokio::spawn(keeper.run()).abort_handle()
        });
    }
}

impl Drop for TokenCache {
    fn drop(&mut self) {
        if let Some(task) = self.task.get() {
            task.abort();
        }
    }
}

/// The task that keeps one cache's token fresh.
struct Keeper {
    shared: Arc<Shared>,
    source: TokenSource,
    scope: String,
    client: TokenClient,
}

impl Keeper {
    async fn run(self) {
        let mut backoff = FIRST_BACKOFF;
        loop {
            let started = Instant::now();
            self.shared.fetching.store(true, Ordering::Release);
            let next = match flows::fetch(&self.client, &self.source, &self.scope).await {
                Ok(issued) => {
                    backoff = FIRST_BACKOFF;
                    self.store(started, &issued)
                }
                Err(error) => {
                    let retry = Instant::now() + backoff;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    self.failed(&error, retry)
                }
            };
            self.shared.fetching.store(false, Ordering::Release);
            self.shared.attempts.send_modify(|n| *n += 1);
            // Never a busy loop, whatever lifetime an endpoint claims.
            let next = next.max(Instant::now() + MIN_INTERVAL);
            tokio::select! {
                () = tokio::time::sleep_until(next) => {}
                () = self.shared.wanted.notified() => {}
            }
        }
    }

    /// Keeps a new token; returns when to fetch the next.
    fn store(&self, asked_at: Instant, issued: &flows::Issued) -> Instant {
        let life = issued.lifetime;
        let margin = EXPIRY_MARGIN.min(life / 10);
        let ahead = REFRESH_AHEAD.min(life / 4);
        let header = format!("Bearer {}", issued.access_token);
        let Ok(mut header) = HeaderValue::from_str(&header) else {
            return self.failed(
                &FetchError::Malformed("not a header"),
                asked_at + FIRST_BACKOFF,
            );
        };
        header.set_sensitive(true);
        let refresh_at = asked_at + life - ahead;
        self.shared.current.store(Some(Arc::new(Token {
            header,
            usable_until: asked_at + life - margin,
        })));
        self.shared.failing.store(false, Ordering::Release);
        tracing::debug!(identity = %self.shared.identity, scope = %self.scope, lifetime_s = life.as_secs(), "got a token");
        refresh_at
    }

    /// A failed token request: the old token stays while it is valid, and the next request is
    /// made at `retry` (or at once when asked).
    fn failed(&self, error: &FetchError, retry: Instant) -> Instant {
        let valid = self
            .shared
            .current
            .load()
            .as_ref()
            .map(|t| t.usable_until)
            .filter(|until| Instant::now() < *until);
        self.shared
            .failing
            .store(valid.is_none(), Ordering::Release);
        tracing::warn!(identity = %self.shared.identity, scope = %self.scope, error = %error, "token request failed");
        match valid {
            Some(until) => retry.min(until),
            None => retry,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use onedoor_config::ManagedEndpoint;

    fn cache_with_token(valid_for: Duration) -> TokenCache {
        let source = TokenSource::ManagedIdentity {
            endpoint: ManagedEndpoint::Imds {
                url: "http://127.0.0.1:1/token".into(),
            },
            client_id: None,
        };
        let cache = TokenCache::new("gw".into(), source, "s/.default".into());
        cache.shared.current.store(Some(Arc::new(Token {
            header: HeaderValue::from_maybe_shared(bytes::Bytes::from("Bearer abc".to_owned()))
                .unwrap(),
            usable_until: Instant::now() + valid_for,
        })));
        cache
    }

    #[test]
    fn a_cached_token_is_a_clone_of_one_shared_buffer() {
        let cache = cache_with_token(Duration::from_secs(60));
        let first = cache.cached().unwrap();
        let again = cache.cached().unwrap();
        assert_eq!(first, "Bearer abc");
        assert_eq!(first.as_bytes().as_ptr(), again.as_bytes().as_ptr());
        let rounds = 1_000_000u32;
        let began = std::time::Instant::now();
        for _ in 0..rounds {
            std::hint::black_box(cache.cached());
        }
        let per_call = began.elapsed() / rounds;
        println!("a cached token: {per_call:?} a request");
        assert!(per_call < Duration::from_micros(2), "{per_call:?}");
    }

    fn snapshot(scope_b: &str, endpoint: &str) -> Snapshot {
        let yaml = format!(
            "identities: {{ gw: {{ kind: managed_identity, endpoint: \"{endpoint}\" }} }}
backends:
  - {{ name: a, provider: azure, url: https://a.example.com, region: r, identity: gw }}
  - {{ name: b, provider: azure, url: https://b.example.com, region: r, identity: gw, scope: \"{scope_b}\" }}
  - {{ name: c, provider: azure, url: https://c.example.com, region: r, api_key: k }}
"
        );
        onedoor_config::parse(&yaml, std::path::Path::new("t.yaml"), &|_| None).unwrap()
    }

    #[test]
    fn caches_are_shared_by_backends_alike_and_kept_across_a_reload_while_unchanged() {
        let cognitive = "https://cognitiveservices.azure.com/.default";
        let imds = "http://127.0.0.1:1/token";
        let first = Credentials::new(&snapshot(cognitive, imds), None);
        let (a, b) = (first.of(0).unwrap(), first.of(1).unwrap());
        assert!(Arc::ptr_eq(a, b), "one (identity, scope), one cache");
        assert!(first.of(2).is_none());
        let reloaded = Credentials::new(
            &snapshot("https://ai.azure.com/.default", imds),
            Some(&first),
        );
        assert!(Arc::ptr_eq(reloaded.of(0).unwrap(), a), "unchanged: kept");
        assert!(
            !Arc::ptr_eq(reloaded.of(1).unwrap(), a),
            "another scope: its own"
        );
        let moved = Credentials::new(
            &snapshot(cognitive, "http://127.0.0.1:2/token"),
            Some(&first),
        );
        assert!(
            !Arc::ptr_eq(moved.of(0).unwrap(), a),
            "another endpoint: a new cache"
        );
    }

    #[test]
    fn an_expired_token_is_not_sent() {
        let cache = cache_with_token(Duration::ZERO);
        assert!(cache.cached().is_none());
    }
}
