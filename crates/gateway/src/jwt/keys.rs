//! Issuers' signing keys: each issuer's JWKS (from its `jwks_url`, or the `jwks_uri` of its
//! `/.well-known/openid-configuration`) fetched once and cached for every runtime of the gateway.
//! A token whose `kid` the cache lacks refetches them (a rotation), at most once per the issuer's
//! `refetch_interval` however many such tokens come, so forged kids cannot hammer the issuer; one
//! fetch at a time, which every waiting request then reads.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty, Limited};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use jsonwebtoken::jwk::{AlgorithmParameters, Jwk};
use jsonwebtoken::DecodingKey;
use onedoor_config::{JwtIssuer, Snapshot};
use serde_json::Value;
use tokio::time::Instant;

use super::Refusal;

/// How long one fetch (discovery and key set together) may take.
const FETCH_TIMEOUT: Duration = Duration::from_secs(5);
/// Larger answers are not a key set anyone publishes.
const MAX_ANSWER: usize = 1 << 20;
/// Cached keys older than this are refetched in the background, so a key the issuer withdrew
/// stops being trusted even when no new kid comes.
const MAX_AGE: Duration = Duration::from_secs(3600);

/// One public key of an issuer, ready to verify with.
pub struct SigningKey {
    pub kid: Option<String>,
    pub key: DecodingKey,
}

struct KeySet {
    keys: Vec<Arc<SigningKey>>,
    fetched: Instant,
}

impl KeySet {
    /// The keys a token with `kid` may be signed with: the one with that kid, or every key
    /// when the token names none.
    fn matching(&self, kid: Option<&str>) -> Vec<Arc<SigningKey>> {
        self.keys
            .iter()
            .filter(|k| kid.is_none() || k.kid.as_deref() == kid)
            .cloned()
            .collect()
    }
}

/// The cached keys of one issuer, and the lock that makes its fetches take turns.
struct IssuerKeys {
    current: ArcSwapOption<KeySet>,
    /// When the last fetch started; `None` before the first.
    last_fetch: tokio::sync::Mutex<Option<Instant>>,
    fetches: AtomicU64,
}

/// Where an issuer's keys come from: its identifier and its `jwks_url`, if given.
type Source = (String, Option<String>);

/// Every issuer's keys, shared by every runtime of the gateway (a reload keeps them).
#[derive(Default)]
pub struct KeySets {
    by_source: Mutex<HashMap<Source, Arc<IssuerKeys>>>,
    client: OnceLock<Client<HttpsConnector<HttpConnector>, Empty<Bytes>>>,
}

impl KeySets {
    /// The keys that may have signed a token of `issuer` with `kid`, fetching them when none
    /// are cached or none has that kid (and the issuer's refetch interval allows).
    pub async fn keys_for(
        self: &Arc<Self>,
        issuer: &JwtIssuer,
        kid: Option<&str>,
    ) -> Result<Vec<Arc<SigningKey>>, Refusal> {
        let entry = self.entry(issuer);
        if let Some(found) = self.usable(&entry, issuer, kid) {
            return Ok(found);
        }
        let mut last = entry.last_fetch.lock().await;
        // Another request may have fetched while this one waited.
        if let Some(found) = self.usable(&entry, issuer, kid) {
            return Ok(found);
        }
        let cached = entry.current.load_full();
        let allowed = last.is_none_or(|at| at.elapsed() >= issuer.refetch_interval);
        if allowed {
            *last = Some(Instant::now());
            match self.fetch(&entry, issuer).await {
                Ok(set) => {
                    let found = set.matching(kid);
                    entry.current.store(Some(Arc::new(set)));
                    return not_empty(found, kid);
                }
                Err(why) if cached.is_none() => return Err(Refusal::KeysUnavailable(why)),
                Err(why) => {
                    tracing::warn!(issuer = %issuer.issuer, "cannot refetch the issuer's signing keys: {why}")
                }
            }
        }
        match cached {
            Some(set) => not_empty(set.matching(kid), kid),
            None => Err(Refusal::KeysUnavailable(
                "the last fetch failed; it is retried after the refetch interval".to_owned(),
            )),
        }
    }

    /// The cached keys for `kid`, without fetching; `None` when none fits.
    pub fn cached(&self, issuer: &JwtIssuer, kid: Option<&str>) -> Option<Vec<Arc<SigningKey>>> {
        let entry = self.entry(issuer);
        let set = entry.current.load_full()?;
        Some(set.matching(kid)).filter(|keys| !keys.is_empty())
    }

    /// Fetches, in the background, the keys of every issuer of `snapshot` not cached yet, so the
    /// first token of each does not wait for them.
    pub fn warm(self: &Arc<Self>, snapshot: &Snapshot) {
        for issuer in &snapshot.client_auth.jwt {
            if self.entry(issuer).current.load().is_some() {
                continue;
            }
            let (sets, issuer) = (self.clone(), issuer.clone());
            tokio::spawn(async move {
                let _ = sets.keys_for(&issuer, None).await;
            });
        }
    }

    /// The cached keys for `kid` when they need no fetch; an aged set is refetched in the
    /// background while it still serves.
    fn usable(
        self: &Arc<Self>,
        entry: &Arc<IssuerKeys>,
        issuer: &JwtIssuer,
        kid: Option<&str>,
    ) -> Option<Vec<Arc<SigningKey>>> {
        let set = entry.current.load_full()?;
        if set.fetched.elapsed() >= MAX_AGE {
            self.refresh_in_background(entry, issuer);
        }
        Some(set.matching(kid)).filter(|keys| !keys.is_empty())
    }

    fn refresh_in_background(self: &Arc<Self>, entry: &Arc<IssuerKeys>, issuer: &JwtIssuer) {
        let Ok(mut last) = entry.last_fetch.try_lock() else {
            return;
        };
        if last.is_some_and(|at| at.elapsed() < issuer.refetch_interval) {
            return;
        }
        *last = Some(Instant::now());
        drop(last);
        let (sets, entry, issuer) = (self.clone(), entry.clone(), issuer.clone());
        tokio::spawn(async move {
            if let Ok(set) = sets.fetch(&entry, &issuer).await {
                entry.current.store(Some(Arc::new(set)));
            }
        });
    }

    fn entry(&self, issuer: &JwtIssuer) -> Arc<IssuerKeys> {
        let source = (issuer.issuer.clone(), issuer.jwks_url.clone());
        let mut by_source = self
            .by_source
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        by_source
            .entry(source)
            .or_insert_with(|| {
                Arc::new(IssuerKeys {
                    current: ArcSwapOption::empty(),
                    last_fetch: tokio::sync::Mutex::new(None),
                    fetches: AtomicU64::new(0),
                })
            })
            .clone()
    }

    async fn fetch(&self, entry: &IssuerKeys, issuer: &JwtIssuer) -> Result<KeySet, String> {
        entry.fetches.fetch_add(1, Ordering::Relaxed);
        let fetching = async {
            let jwks_url = match &issuer.jwks_url {
                Some(url) => url.clone(),
                None => self.jwks_uri(issuer).await?,
            };
            let set = self.get_json(&jwks_url).await?;
            key_set(&set)
        };
        match tokio::time::timeout(FETCH_TIMEOUT, fetching).await {
            Ok(fetched) => fetched,
            Err(_) => Err(format!(
                "the issuer did not answer within {}s",
                FETCH_TIMEOUT.as_secs()
            )),
        }
    }

    /// The `jwks_uri` of the issuer's OpenID configuration.
    async fn jwks_uri(&self, issuer: &JwtIssuer) -> Result<String, String> {
        let discovery = format!(
            "{}/.well-known/openid-configuration",
            issuer.issuer.trim_end_matches('/')
        );
        let document = self.get_json(&discovery).await?;
        let uri = document
            .get("jwks_uri")
            .and_then(Value::as_str)
            .ok_or_else(|| format!("{discovery} has no jwks_uri"))?;
        // Keys over plain http only from an issuer that is itself on loopback http.
        if uri.starts_with("https://") || issuer.issuer.starts_with("http://") {
            return Ok(uri.to_owned());
        }
        Err(format!("{discovery} names a jwks_uri that is not https"))
    }

    async fn get_json(&self, url: &str) -> Result<Value, String> {
        let client = self.client.get_or_init(|| {
            Client::builder(TokioExecutor::new())
                .build(crate::upstream::connector(FETCH_TIMEOUT, false))
        });
        let request = Request::get(url)
            .header(http::header::ACCEPT, "application/json")
            .body(Empty::new())
            .map_err(|e| format!("{url}: {e}"))?;
        let response = client
            .request(request)
            .await
            .map_err(|e| format!("{url}: {e}"))?;
        if response.status() != StatusCode::OK {
            return Err(format!("{url} answered {}", response.status().as_u16()));
        }
        let body = Limited::new(response.into_body(), MAX_ANSWER)
            .collect()
            .await
            .map_err(|e| format!("{url}: {e}"))?
            .to_bytes();
        serde_json::from_slice(&body).map_err(|e| format!("{url} is not JSON: {e}"))
    }
}

/// The signature keys of a JWKS document: RSA and EC ones; others (and ones meant for
/// encryption) are left out, one at a time, so one odd key does not lose the rest.
fn key_set(document: &Value) -> Result<KeySet, String> {
    let listed = document
        .get("keys")
        .and_then(Value::as_array)
        .ok_or("the key set has no keys list")?;
    let keys: Vec<Arc<SigningKey>> = listed
        .iter()
        .filter(|k| k.get("use").is_none_or(|u| u == "sig"))
        .filter_map(|k| serde_json::from_value::<Jwk>(k.clone()).ok())
        .filter(|jwk| {
            matches!(
                jwk.algorithm,
                AlgorithmParameters::RSA(_) | AlgorithmParameters::EllipticCurve(_)
            )
        })
        .filter_map(|jwk| {
            let key = DecodingKey::from_jwk(&jwk).ok()?;
            Some(Arc::new(SigningKey {
                kid: jwk.common.key_id,
                key,
            }))
        })
        .collect();
    if keys.is_empty() {
        return Err("the key set has no RSA or EC signing key".to_owned());
    }
    Ok(KeySet {
        keys,
        fetched: Instant::now(),
    })
}

fn not_empty(
    keys: Vec<Arc<SigningKey>>,
    kid: Option<&str>,
) -> Result<Vec<Arc<SigningKey>>, Refusal> {
    match (keys.is_empty(), kid) {
        (false, _) => Ok(keys),
        (true, Some(kid)) => Err(Refusal::UnknownKid(super::shortened(kid))),
        (true, None) => Err(Refusal::NoKeyFits),
    }
}
