//! Session affinity (contract section 2, `session_affinity: true`): an alias whose conversations
//! live on one backend gives its caller a session token with the first answer (header
//! `x-onedoor-session` and cookie `onedoor-session`), and every later request that carries it
//! (either one) goes to that backend and no other. When that backend cannot take it (removed,
//! no longer a target, drained, failing its health check, behind an open breaker), the caller is
//! told the session cannot continue; it is never moved to a backend that lacks its state.
//!
//! A token is a random 128-bit id. The backend it stands for is a pin in the shared state under
//! `sessions/{tenant}/{id}`, so a token means nothing to another tenant (the lookup misses), it
//! works on every instance that shares the state, and it lasts [`SESSION_TTL`] after its last
//! use. With `state.store: memory` a restart forgets every session, and their tokens are then
//! refused as unknown; with Redis they survive restarts.

use std::time::Duration;

use http::{header, HeaderMap, HeaderName, HeaderValue, Response};
use onedoor_config::{Alias, BackendId, Tenant};
use onedoor_state::{now_ms, State};

use crate::body::Body;
use crate::errors::GatewayError;
use crate::router::{Excluded, Plan};
use crate::runtime::Runtime;

pub const HEADER: &str = "x-onedoor-session";
/// [`HEADER`] as a header name, made once: a name given as text is checked at every lookup.
const HEADER_NAME: HeaderName = HeaderName::from_static(HEADER);
pub const COOKIE: &str = "onedoor-session";
/// A session is forgotten this long after its last request.
pub const SESSION_TTL: Duration = Duration::from_secs(24 * 3600);
/// Tokens are this prefix and 32 hex digits.
const PREFIX: &str = "ods_";

/// The session token a request carries: the header, else the cookie.
pub fn presented(headers: &HeaderMap) -> Option<String> {
    if let Some(token) = headers.get(HEADER_NAME).and_then(|v| v.to_str().ok()) {
        return Some(token.trim().to_owned());
    }
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|pair| {
            let (name, value) = pair.trim().split_once('=')?;
            (name == COOKIE).then(|| value.trim().to_owned())
        })
}

/// Where a request stands with respect to its session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Session {
    /// The alias has no session affinity; a token, if any, is ignored.
    Free,
    /// The first request of a session: the backend that answers gets it.
    New { tenant: String },
    /// A request of a session: it goes to its backend only.
    Pinned { tenant: String, token: String },
}

fn key(tenant: &str, token: &str) -> String {
    format!("sessions/{tenant}/{token}")
}

fn well_formed(token: &str) -> bool {
    token
        .strip_prefix(PREFIX)
        .is_some_and(|hex| hex.len() == 32 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Keeps only the session's backend among `plan`'s candidates, or says why the session cannot
/// continue.
pub async fn follow(
    runtime: &Runtime,
    alias: &Alias,
    tenant: &Tenant,
    presented: Option<&str>,
    plan: &mut Plan,
) -> Result<Session, GatewayError> {
    if !alias.session_affinity {
        return Ok(Session::Free);
    }
    let Some(token) = presented else {
        return Ok(Session::New {
            tenant: tenant.name.to_string(),
        });
    };
    let unknown = || {
        GatewayError::InvalidRequest(format!(
            "the session token in `{HEADER}` (or the `{COOKIE}` cookie) is not a session of this key's tenant: it expired ({}h after its last use), was never issued, or was forgotten when a gateway without shared state restarted; this session cannot continue, so send the request without the token to start a new one",
            SESSION_TTL.as_secs() / 3600
        ))
    };
    if !well_formed(token) {
        return Err(unknown());
    }
    let holder = runtime
        .state
        .pinned(&key(&tenant.name, token))
        .await
        .map_err(|_| GatewayError::StateUnavailable)?
        .ok_or_else(unknown)?;
    let backend = runtime.snapshot.backend_by_name.get(&holder).copied();
    pin_to(plan, backend, &holder, &alias.name)?;
    Ok(Session::Pinned {
        tenant: tenant.name.to_string(),
        token: token.to_owned(),
    })
}

/// Restricts `plan` to `backend`, or names why that backend cannot take the request.
fn pin_to(
    plan: &mut Plan,
    backend: Option<BackendId>,
    name: &str,
    alias: &str,
) -> Result<(), GatewayError> {
    let cannot = |why: String| {
        GatewayError::NoBackendAvailable(format!(
            "this session lives on the backend `{name}`, which {why}; the session cannot continue on another backend (its state is not there): start a new session by sending the request without the `{HEADER}` header and `{COOKIE}` cookie"
        ))
    };
    let Some(backend) = backend else {
        return Err(cannot("is no longer configured".into()));
    };
    if plan.candidates.iter().any(|c| c.backend == backend) {
        plan.candidates.retain(|c| c.backend == backend);
        return Ok(());
    }
    let reason = plan
        .excluded
        .iter()
        .find(|(c, _)| c.backend == backend)
        .map(|(_, reason)| *reason);
    let now = now_ms();
    let seconds = |until_ms: u64| until_ms.saturating_sub(now).div_ceil(1000).max(1);
    Err(match reason {
        None => cannot(format!("is no longer a target of `{alias}`")),
        Some(Excluded::Drained) => cannot("is drained".into()),
        Some(Excluded::Unhealthy) => cannot("is failing its health check".into()),
        Some(Excluded::BreakerOpen { until_ms }) => cannot(format!(
            "is behind an open circuit breaker for about {}s more (retrying after that may work)",
            seconds(until_ms)
        )),
        Some(Excluded::Region) => cannot("is outside the regions this key may use".into()),
        Some(Excluded::NotServed) => cannot(format!("no longer serves `{alias}`")),
        Some(Excluded::Unsupported) => cannot("cannot serve this operation".into()),
        Some(Excluded::CoolingDown { until_ms }) => GatewayError::UpstreamRateLimited {
            alias: alias.to_owned(),
            retry_after: Duration::from_millis(until_ms.saturating_sub(now).max(1)),
        },
    })
}

impl Session {
    /// Puts the session token on a successful answer from `backend` and (re)writes its pin, so
    /// the session lasts another [`SESSION_TTL`]; other answers go out as they are.
    pub async fn stamp(
        self,
        runtime: &Runtime,
        backend: Option<BackendId>,
        answered: Result<Response<Body>, GatewayError>,
    ) -> Result<Response<Body>, GatewayError> {
        let mut response = match answered {
            Ok(response) if response.status().is_success() => response,
            other => return other,
        };
        let (tenant, token) = match self {
            Session::Free => return Ok(response),
            Session::New { tenant } => (tenant, format!("{PREFIX}{:032x}", rand::random::<u128>())),
            Session::Pinned { tenant, token } => (tenant, token),
        };
        let Some(name) = backend
            .and_then(|b| runtime.snapshot.backends.get(b))
            .map(|b| b.name.clone())
        else {
            return Ok(response);
        };
        let ttl = u64::try_from(SESSION_TTL.as_millis()).unwrap_or(u64::MAX);
        runtime.state.pin(&key(&tenant, &token), &name, ttl).await;
        let headers = response.headers_mut();
        if let Ok(value) = HeaderValue::from_str(&token) {
            headers.insert(HEADER_NAME, value);
        }
        let cookie = format!(
            "{COOKIE}={token}; Path=/; Max-Age={}; HttpOnly; SameSite=Lax",
            SESSION_TTL.as_secs()
        );
        if let Ok(value) = HeaderValue::from_str(&cookie) {
            headers.append(header::SET_COOKIE, value);
        }
        Ok(response)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::router::Candidate;

    fn candidate(backend: BackendId) -> Candidate {
        Candidate {
            backend,
            deployment: "d".into(),
            priority: 1,
            weight: 1,
            discovery: false,
            accepts_prefill: false,
        }
    }

    #[test]
    fn the_header_wins_over_the_cookie() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::COOKIE,
            HeaderValue::from_static("theme=dark; onedoor-session=ods_c"),
        );
        assert_eq!(presented(&headers).as_deref(), Some("ods_c"));
        headers.insert(HEADER, HeaderValue::from_static("ods_h"));
        assert_eq!(presented(&headers).as_deref(), Some("ods_h"));
        assert_eq!(presented(&HeaderMap::new()), None);
        assert!(well_formed(&format!("{PREFIX}{:032x}", 7u128)));
        assert!(!well_formed("ods_../../x"));
    }

    #[test]
    fn a_session_keeps_its_backend_or_says_why_it_cannot_continue() {
        let mut plan = Plan {
            candidates: vec![candidate(0), candidate(1)],
            excluded: vec![(candidate(2), Excluded::Drained)],
            usage: vec![],
        };
        pin_to(&mut plan, Some(1), "b", "assistants").unwrap();
        assert_eq!(plan.candidates.len(), 1);
        assert_eq!(plan.candidates[0].backend, 1);
        let drained = pin_to(&mut plan, Some(2), "c", "assistants").unwrap_err();
        assert_eq!(drained.code(), "no_backend_available");
        assert!(drained.to_string().contains("`c`, which is drained"));
        let removed = pin_to(&mut plan, None, "gone", "assistants").unwrap_err();
        assert!(removed.to_string().contains("no longer configured"));
        let elsewhere = pin_to(&mut plan, Some(9), "z", "assistants").unwrap_err();
        assert!(elsewhere
            .to_string()
            .contains("no longer a target of `assistants`"));
    }
}
