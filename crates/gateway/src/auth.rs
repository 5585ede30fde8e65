//! Client authentication: the credential from any of the three accepted headers, a JWT (see
//! `jwt`) or a client key (the config's, or one made at runtime, see `client_keys`), which is
//! looked up by its sha256 digest so the gateway never holds client keys in the clear.

use std::ops::Deref;
use std::sync::Arc;

use http::{HeaderMap, HeaderName};
use onedoor_config::{Key, Snapshot, Tenant};
use sha2::{Digest, Sha256};

use crate::errors::GatewayError;
use crate::jwt;
use crate::runtime::Runtime;

/// The authenticated caller of one request.
pub struct Caller<'a> {
    pub tenant: &'a Tenant,
    pub key: CallerKey<'a>,
}

/// A caller's key: one of the config's (or a JWT principal's), or one made at runtime.
pub enum CallerKey<'a> {
    Config(&'a Key),
    Runtime(Arc<Key>),
}

impl Deref for CallerKey<'_> {
    type Target = Key;

    fn deref(&self) -> &Key {
        match self {
            CallerKey::Config(key) => key,
            CallerKey::Runtime(key) => key,
        }
    }
}

/// The client key from `Authorization: Bearer`, `api-key` or `x-api-key`. Upstream requests are
/// built from scratch, so none of these headers is ever forwarded.
pub fn presented_key(headers: &HeaderMap) -> Option<&str> {
    if let Some(value) = headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    {
        let token = value
            .strip_prefix("Bearer ")
            .or_else(|| value.strip_prefix("bearer "))
            .unwrap_or(value)
            .trim();
        if !token.is_empty() {
            return Some(token);
        }
    }
    const API_KEY: HeaderName = HeaderName::from_static("api-key");
    const X_API_KEY: HeaderName = HeaderName::from_static("x-api-key");
    [API_KEY, X_API_KEY]
        .iter()
        .filter_map(|name| headers.get(name).and_then(|v| v.to_str().ok()))
        .map(str::trim)
        .find(|v| !v.is_empty())
}

/// The caller of a request: the principal of a JWT (when `client_auth.jwt` is configured and
/// the credential has a JWT's shape), else the owner of a client key.
pub async fn identify<'a>(
    runtime: &'a Runtime,
    headers: &HeaderMap,
) -> Result<Caller<'a>, GatewayError> {
    let credential = presented_key(headers).ok_or(GatewayError::MissingKey)?;
    if jwt::applies(&runtime.snapshot, credential) {
        // Boxed: its key fetch would otherwise grow every request's future.
        return Box::pin(jwt::caller(runtime, credential)).await;
    }
    caller_of(runtime, credential)
}

/// Whether the request's credential is known without waiting: a key, or a token that checks
/// with the keys already cached.
pub fn known(runtime: &Runtime, headers: &HeaderMap) -> bool {
    let Some(credential) = presented_key(headers) else {
        return false;
    };
    match jwt::applies(&runtime.snapshot, credential) {
        true => jwt::cached_caller(runtime, credential).is_some(),
        false => caller_of(runtime, credential).is_ok(),
    }
}

/// The caller a client key belongs to, wherever it was presented (a header, or the realtime
/// `openai-insecure-api-key.` subprotocol of browsers that cannot set headers): a config key
/// first, then a runtime one, so a runtime key never shadows the config.
pub fn caller_of<'a>(runtime: &'a Runtime, key: &str) -> Result<Caller<'a>, GatewayError> {
    let digest: [u8; 32] = Sha256::digest(key.as_bytes()).into();
    let snapshot = &runtime.snapshot;
    if let Some(caller) = config_caller(snapshot, &digest) {
        return Ok(caller);
    }
    let entry = runtime
        .client_keys
        .find(&digest, onedoor_state::now_ms())
        .ok_or(GatewayError::UnknownKey)??;
    let tenant = snapshot
        .tenants
        .iter()
        .find(|t| *t.name == *entry.stored.tenant)
        .ok_or(GatewayError::UnknownKey)?;
    Ok(Caller {
        tenant,
        key: CallerKey::Runtime(entry.key.clone()),
    })
}

fn config_caller<'a>(snapshot: &'a Snapshot, digest: &[u8; 32]) -> Option<Caller<'a>> {
    let (tenant_id, key_index) = snapshot.keys_by_hash.get(digest)?;
    let tenant = snapshot.tenants.get(*tenant_id)?;
    let key = tenant.keys.get(*key_index)?;
    Some(Caller {
        tenant,
        key: CallerKey::Config(key),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn a_key_is_found_in_each_accepted_header() {
        for name in ["authorization", "api-key", "x-api-key"] {
            let mut headers = HeaderMap::new();
            let value = if name == "authorization" {
                "Bearer k1"
            } else {
                "k1"
            };
            headers.insert(name, HeaderValue::from_static(value));
            assert_eq!(presented_key(&headers), Some("k1"), "{name}");
        }
        assert_eq!(presented_key(&HeaderMap::new()), None);
    }
}
