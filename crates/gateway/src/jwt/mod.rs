//! Callers with JWTs (`client_auth.jwt`): a bearer credential of three base64url segments is a
//! token, checked against its issuer's signing keys (signature, `iss`, `aud`, `exp`, `nbf`) and
//! matched to a tenant's principal, which then counts exactly as a key does. A credential is told
//! from a key by its shape alone, so a key caller's request never comes here.

mod keys;

use std::time::Duration;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::{Algorithm, Validation};
use onedoor_config::{JwtIssuer, Snapshot};
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::auth::Caller;
use crate::errors::GatewayError;
use crate::runtime::Runtime;

pub use keys::KeySets;

/// The clock skew allowed on `exp` and `nbf`.
const LEEWAY: Duration = Duration::from_secs(60);

/// Whether `credential` is to be checked as a JWT: issuers are configured and it has a JWT's
/// shape (a base64url JSON header, `eyJ`, and three segments). Client keys never have one.
pub fn applies(snapshot: &Snapshot, credential: &str) -> bool {
    !snapshot.client_auth.jwt.is_empty()
        && credential.starts_with("eyJ")
        && credential.bytes().filter(|b| *b == b'.').count() == 2
}

/// Why a token was refused: the message of its `invalid_token` answer.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error("it is not a well-formed JWT ({0})")]
    Malformed(&'static str),
    #[error("alg \"none\" (an unsigned token) is refused")]
    Unsigned,
    #[error(
        "HMAC-signed tokens ({0}) are refused: only the issuer's published public keys are trusted"
    )]
    Hmac(String),
    #[error("alg {0:?} is not supported (RS256, RS384, RS512, PS256, PS384, PS512, ES256 and ES384 are)")]
    UnsupportedAlg(String),
    #[error("wrong issuer: {0:?} is not an issuer in client_auth.jwt")]
    WrongIssuer(String),
    #[error("unknown kid {0:?}: none of the issuer's signing keys has it")]
    UnknownKid(String),
    #[error("none of the issuer's keys fits its alg and kid")]
    NoKeyFits,
    #[error("the issuer's signing keys could not be fetched ({0}); retry shortly")]
    KeysUnavailable(String),
    /// Which key: `key "KID"`, or `keys` for a token without a kid.
    #[error("bad signature: it does not verify with the issuer's {0}")]
    BadSignature(String),
    #[error("expired: its exp is past (allowing {}s of clock skew)", LEEWAY.as_secs())]
    Expired,
    #[error("not yet valid: its nbf is ahead (allowing {}s of clock skew)", LEEWAY.as_secs())]
    NotYetValid,
    #[error("wrong audience: its aud names none of {0}")]
    WrongAudience(String),
    #[error("it lacks the claim {0:?}")]
    MissingClaim(String),
    #[error("its claims are malformed ({0})")]
    MalformedClaims(String),
    #[error("no tenant's principal matches it (principals name its {0})")]
    NoPrincipal(String),
    #[error("its roles claim holds none of admin.jwt_roles ({0})")]
    NoAdminRole(String),
}

impl From<Refusal> for GatewayError {
    fn from(refusal: Refusal) -> Self {
        GatewayError::InvalidToken(refusal.to_string())
    }
}

/// The caller a token is, fetching its issuer's keys when they are not cached (or lack its kid).
pub async fn caller<'a>(runtime: &'a Runtime, token: &str) -> Result<Caller<'a>, GatewayError> {
    let snapshot = &runtime.snapshot;
    let seen = Unverified::read(token)?;
    let (index, issuer) = issuer_of(snapshot, &seen.iss)?;
    let keys = runtime
        .key_sets
        .keys_for(issuer, seen.kid.as_deref())
        .await?;
    let claims = verify(token, &seen, issuer, &keys)?;
    Ok(principal(snapshot, index, &claims)?)
}

/// Who an admin API token is (for the audit: `jwt SUBJECT (ISSUER)`), when its `roles` claim
/// holds one of `admin.jwt_roles`.
pub async fn admin(runtime: &Runtime, token: &str) -> Result<String, GatewayError> {
    let snapshot = &runtime.snapshot;
    let seen = Unverified::read(token)?;
    let (_, issuer) = issuer_of(snapshot, &seen.iss)?;
    let keys = runtime
        .key_sets
        .keys_for(issuer, seen.kid.as_deref())
        .await?;
    let claims = verify(token, &seen, issuer, &keys)?;
    let allowed = &snapshot.admin.jwt_roles;
    let roles: Vec<&str> = match claims.get("roles") {
        Some(Value::Array(items)) => items.iter().filter_map(Value::as_str).collect(),
        Some(Value::String(role)) => vec![role.as_str()],
        _ => Vec::new(),
    };
    if !roles.iter().any(|role| allowed.iter().any(|a| a == role)) {
        return Err(Refusal::NoAdminRole(allowed.join(", ")).into());
    }
    let subject = ["oid", "sub", "azp", "appid"]
        .iter()
        .find_map(|claim| claims.get(*claim).and_then(Value::as_str))
        .unwrap_or("unknown");
    Ok(format!("jwt {} ({})", shortened(subject), issuer.issuer))
}

/// The caller a token is, from cached keys only (no fetch): `None` when it is not known now.
pub fn cached_caller<'a>(runtime: &'a Runtime, token: &str) -> Option<Caller<'a>> {
    let snapshot = &runtime.snapshot;
    let seen = Unverified::read(token).ok()?;
    let (index, issuer) = issuer_of(snapshot, &seen.iss).ok()?;
    let keys = runtime.key_sets.cached(issuer, seen.kid.as_deref())?;
    let claims = verify(token, &seen, issuer, &keys).ok()?;
    principal(snapshot, index, &claims).ok()
}

/// What a token says before its signature is checked: enough to pick the issuer and key.
struct Unverified {
    alg: Algorithm,
    kid: Option<String>,
    iss: String,
}

#[derive(Deserialize)]
struct Header {
    alg: String,
    kid: Option<String>,
}

#[derive(Deserialize)]
struct Issued {
    iss: Option<Value>,
}

impl Unverified {
    fn read(token: &str) -> Result<Unverified, Refusal> {
        let mut parts = token.split('.');
        let (Some(header), Some(payload)) = (parts.next(), parts.next()) else {
            return Err(Refusal::Malformed("three segments are needed"));
        };
        let header: Header = decoded(header).ok_or(Refusal::Malformed("its header"))?;
        let alg = algorithm(&header.alg)?;
        let issued: Issued = decoded(payload).ok_or(Refusal::Malformed("its payload"))?;
        let iss = match issued.iss {
            Some(Value::String(iss)) => iss,
            Some(_) => return Err(Refusal::MalformedClaims("iss is not a string".to_owned())),
            None => return Err(Refusal::MissingClaim("iss".to_owned())),
        };
        Ok(Unverified {
            alg,
            kid: header.kid,
            iss,
        })
    }
}

fn decoded<T: for<'de> Deserialize<'de>>(segment: &str) -> Option<T> {
    let bytes = URL_SAFE_NO_PAD.decode(segment).ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// The signature algorithms of public keys; `none` and HMAC are refused by name.
fn algorithm(alg: &str) -> Result<Algorithm, Refusal> {
    Ok(match alg {
        "RS256" => Algorithm::RS256,
        "RS384" => Algorithm::RS384,
        "RS512" => Algorithm::RS512,
        "PS256" => Algorithm::PS256,
        "PS384" => Algorithm::PS384,
        "PS512" => Algorithm::PS512,
        "ES256" => Algorithm::ES256,
        "ES384" => Algorithm::ES384,
        a if a.eq_ignore_ascii_case("none") => return Err(Refusal::Unsigned),
        a if a.starts_with("HS") => return Err(Refusal::Hmac(a.to_owned())),
        a => return Err(Refusal::UnsupportedAlg(shortened(a))),
    })
}

fn issuer_of<'a>(snapshot: &'a Snapshot, iss: &str) -> Result<(usize, &'a JwtIssuer), Refusal> {
    snapshot
        .client_auth
        .jwt
        .iter()
        .enumerate()
        .find(|(_, issuer)| issuer.issuer == iss)
        .ok_or_else(|| Refusal::WrongIssuer(shortened(iss)))
}

/// Checks the token's signature with `keys` (those its kid names, or every key of the issuer
/// when it has none) and its claims; the claims, once they pass.
fn verify(
    token: &str,
    seen: &Unverified,
    issuer: &JwtIssuer,
    keys: &[std::sync::Arc<keys::SigningKey>],
) -> Result<Map<String, Value>, Refusal> {
    let validation = validation(seen.alg, issuer);
    let mut last = Refusal::NoKeyFits;
    for key in keys {
        match jsonwebtoken::decode::<Map<String, Value>>(token, &key.key, &validation) {
            Ok(data) => return typed_times(data.claims),
            Err(error) => last = refusal(error.into_kind(), issuer, key, seen),
        }
        if !matches!(last, Refusal::BadSignature(_) | Refusal::NoKeyFits) {
            break;
        }
    }
    Err(last)
}

fn validation(alg: Algorithm, issuer: &JwtIssuer) -> Validation {
    let mut validation = Validation::new(alg);
    validation.leeway = LEEWAY.as_secs();
    validation.validate_nbf = true;
    validation.set_issuer(&[&issuer.issuer]);
    validation.set_audience(&issuer.audiences);
    validation.set_required_spec_claims(&["exp", "iss", "aud"]);
    validation
}

fn refusal(
    kind: ErrorKind,
    issuer: &JwtIssuer,
    key: &keys::SigningKey,
    seen: &Unverified,
) -> Refusal {
    match kind {
        ErrorKind::InvalidSignature => Refusal::BadSignature(match (&seen.kid, &key.kid) {
            (Some(_), Some(kid)) => format!("key {:?}", shortened(kid)),
            _ => "keys".to_owned(),
        }),
        ErrorKind::ExpiredSignature => Refusal::Expired,
        ErrorKind::ImmatureSignature => Refusal::NotYetValid,
        ErrorKind::InvalidAudience => Refusal::WrongAudience(issuer.audiences.join(", ")),
        ErrorKind::InvalidIssuer => Refusal::WrongIssuer(shortened(&seen.iss)),
        ErrorKind::MissingRequiredClaim(claim) => Refusal::MissingClaim(claim),
        // The key's type does not fit the alg (an RSA key for ES256): not this key.
        ErrorKind::InvalidAlgorithm | ErrorKind::InvalidEcdsaKey | ErrorKind::InvalidRsaKey(_) => {
            Refusal::NoKeyFits
        }
        ErrorKind::Json(e) => Refusal::MalformedClaims(e.to_string()),
        ErrorKind::Base64(_) | ErrorKind::Utf8(_) | ErrorKind::InvalidToken => {
            Refusal::Malformed("its encoding")
        }
        other => Refusal::MalformedClaims(format!("{other:?}")),
    }
}

/// `exp` and `nbf` must be numbers: the library skips a time it cannot read, so a string
/// `nbf` would otherwise pass unchecked.
fn typed_times(claims: Map<String, Value>) -> Result<Map<String, Value>, Refusal> {
    for time in ["exp", "nbf"] {
        if claims.get(time).is_some_and(|v| !v.is_number()) {
            return Err(Refusal::MalformedClaims(format!("{time} is not a number")));
        }
    }
    Ok(claims)
}

/// The first principal (in file order) that the token's claims pick, of a principal that
/// accepts tokens of issuer `index`.
fn principal<'a>(
    snapshot: &'a Snapshot,
    index: usize,
    claims: &Map<String, Value>,
) -> Result<Caller<'a>, Refusal> {
    let by_claim = &snapshot.client_auth.principals;
    let mut best: Option<(usize, usize)> = None;
    for (claim, values) in by_claim {
        let texts: Vec<&str> = match claims.get(&**claim) {
            Some(Value::String(s)) => vec![s.as_str()],
            Some(Value::Array(items)) => items.iter().filter_map(Value::as_str).collect(),
            _ => continue,
        };
        let picked = texts
            .into_iter()
            .filter_map(|text| values.get(text))
            .flatten()
            .copied()
            .filter(|&(t, p)| accepts(snapshot, t, p, index));
        best = best.into_iter().chain(picked).min();
    }
    let (t, p) = best.ok_or_else(|| {
        let names: Vec<&str> = by_claim.iter().map(|(c, _)| &**c).collect();
        Refusal::NoPrincipal(names.join(" or "))
    })?;
    let tenant = snapshot
        .tenants
        .get(t)
        .ok_or(Refusal::NoPrincipal(String::new()))?;
    let principal = tenant
        .principals
        .get(p)
        .ok_or(Refusal::NoPrincipal(String::new()))?;
    Ok(Caller {
        tenant,
        key: crate::auth::CallerKey::Config(&principal.key),
    })
}

fn accepts(snapshot: &Snapshot, tenant: usize, principal: usize, issuer: usize) -> bool {
    snapshot
        .tenants
        .get(tenant)
        .and_then(|t| t.principals.get(principal))
        .is_some_and(|p| p.issuer.is_none_or(|i| i == issuer))
}

/// A value the caller sent, cut short for a message.
fn shortened(text: &str) -> String {
    text.chars().take(100).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_three_segment_json_header_is_taken_for_a_jwt() {
        let snapshot = onedoor_config::parse(
            "client_auth: { jwt: [{ issuer: \"https://idp.example.com\", audience: a }] }\n",
            std::path::Path::new("t.yaml"),
            &|_| None,
        )
        .unwrap();
        assert!(applies(&snapshot, "eyJhbGciOiJSUzI1NiJ9.eyJ9.c2ln"));
        assert!(!applies(
            &snapshot,
            "od-AbCdEfGhIjKlMnOpQrStUvWxYz0123456789abcd"
        ));
        assert!(!applies(&snapshot, "eyJhbGciOiJSUzI1NiJ9.eyJ9"));
        let keys_only =
            onedoor_config::parse("", std::path::Path::new("t.yaml"), &|_| None).unwrap();
        assert!(!applies(&keys_only, "eyJhbGciOiJSUzI1NiJ9.eyJ9.c2ln"));
    }

    #[test]
    fn none_and_hmac_are_refused_by_name() {
        assert!(matches!(algorithm("none"), Err(Refusal::Unsigned)));
        assert!(matches!(algorithm("NONE"), Err(Refusal::Unsigned)));
        assert!(matches!(algorithm("HS256"), Err(Refusal::Hmac(_))));
        assert!(matches!(
            algorithm("EdDSA"),
            Err(Refusal::UnsupportedAlg(_))
        ));
        assert!(matches!(algorithm("ES256"), Ok(Algorithm::ES256)));
    }

    #[test]
    fn a_time_that_is_not_a_number_is_malformed() {
        let claims: Map<String, Value> =
            serde_json::from_str(r#"{"exp": 4102444800, "nbf": "9999999999"}"#).unwrap();
        assert!(matches!(
            typed_times(claims),
            Err(Refusal::MalformedClaims(_))
        ));
    }
}
