//! A simulated OIDC issuer (an Entra ID tenant, or any other): OpenID discovery at
//! `/.well-known/openid-configuration`, its signing keys (one RSA, one EC P-256) at `/keys`, and
//! a control surface to mint tokens (`POST /_mock/tokens`), rotate the keys (`POST /_mock/rotate`)
//! and count what was fetched (`GET /_mock/stats`). It signs with ring directly, not with the
//! gateway's JWT library, so the two check each other.
//!
//! The RSA keys are fixed test keys (ring cannot generate RSA keys); the EC key is made anew at
//! start and at every rotation. They sign simulated tokens only.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use base64::Engine;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use ring::rand::SystemRandom;
use ring::rsa::PublicKeyComponents;
use ring::signature::{self, EcdsaKeyPair, KeyPair, RsaKeyPair};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use tokio::net::TcpListener;
use tokio::task::{JoinHandle, JoinSet};

/// The fixed RSA keys, PKCS#1 DER in base64; rotation moves to the next.
const RSA_KEYS: [&str; 2] = [
    include_str!("oidc/rsa-1.der.b64"),
    include_str!("oidc/rsa-2.der.b64"),
];

/// The audience a minted token carries unless asked otherwise.
pub const DEFAULT_AUDIENCE: &str = "api://onedoor";

/// What `POST /_mock/tokens` (and [`Issuer::mint`]) takes; every field is optional.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Mint {
    /// Claims added to (or, when `null`, taken from) the defaults: `iss` (this issuer), `aud`
    /// ([`DEFAULT_AUDIENCE`]), `sub`, `iat`, `nbf` (now) and `exp`.
    #[serde(default)]
    pub claims: Map<String, Value>,
    /// Seconds until `exp` (default 3600); negative mints an expired token.
    pub lifetime: Option<i64>,
    /// `rsa` (RS256, the default) or `ec` (ES256).
    pub key: Option<String>,
    /// The `kid` written in the header instead of the signing key's own.
    pub kid: Option<String>,
}

/// A running issuer on loopback.
pub struct Issuer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: JoinHandle<()>,
}

struct Shared {
    url: String,
    keys: Mutex<Keys>,
    rng: SystemRandom,
    discovery_fetches: AtomicU64,
    jwks_fetches: AtomicU64,
    minted: AtomicU64,
}

/// The keys the issuer signs with now, each with its kid.
struct Keys {
    generation: usize,
    rsa: (String, RsaKeyPair),
    ec: (String, EcdsaKeyPair),
}

impl Issuer {
    /// Starts an issuer on `listen` (127.0.0.1 on an ephemeral port when `None`).
    pub async fn start(listen: Option<SocketAddr>) -> std::io::Result<Issuer> {
        let listener =
            TcpListener::bind(listen.unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0))))
                .await?;
        let addr = listener.local_addr()?;
        let rng = SystemRandom::new();
        let keys = Keys::generation(0, &rng).map_err(std::io::Error::other)?;
        let shared = Arc::new(Shared {
            url: format!("http://{addr}"),
            keys: Mutex::new(keys),
            rng,
            discovery_fetches: AtomicU64::new(0),
            jwks_fetches: AtomicU64::new(0),
            minted: AtomicU64::new(0),
        });
        let task = tokio::spawn(accept_loop(listener, shared.clone()));
        Ok(Issuer { addr, shared, task })
    }

    /// The issuer identifier (`iss`), which is also its base URL.
    pub fn url(&self) -> String {
        self.shared.url.clone()
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// A signed token, as `POST /_mock/tokens` mints it.
    pub fn mint(&self, ask: &Mint) -> Result<String, String> {
        self.shared.mint(ask)
    }

    /// New keys (and kids) replace the published ones; returns the new kids.
    pub fn rotate(&self) -> Result<Vec<String>, String> {
        self.shared.rotate()
    }

    /// How often the key set (`/keys`) was fetched.
    pub fn jwks_fetches(&self) -> u64 {
        self.shared.jwks_fetches.load(Ordering::Relaxed)
    }

    pub fn shutdown(self) {
        self.task.abort();
    }
}

impl Drop for Issuer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Keys {
    fn generation(generation: usize, rng: &SystemRandom) -> Result<Keys, String> {
        let der = STANDARD
            .decode(RSA_KEYS[generation % RSA_KEYS.len()].trim())
            .map_err(|e| e.to_string())?;
        let rsa = RsaKeyPair::from_der(&der).map_err(|e| e.to_string())?;
        let alg = &signature::ECDSA_P256_SHA256_FIXED_SIGNING;
        let pkcs8 = EcdsaKeyPair::generate_pkcs8(alg, rng).map_err(|e| e.to_string())?;
        let ec = EcdsaKeyPair::from_pkcs8(alg, pkcs8.as_ref(), rng).map_err(|e| e.to_string())?;
        let n = generation + 1;
        Ok(Keys {
            generation,
            rsa: (format!("rsa-{n}"), rsa),
            ec: (format!("ec-{n}"), ec),
        })
    }

    fn jwks(&self) -> Value {
        let public = PublicKeyComponents::<Vec<u8>>::from(self.rsa.1.public());
        let point = self.ec.1.public_key().as_ref();
        // An uncompressed P-256 point: 0x04, then x and y of 32 bytes each.
        let coordinates = point.get(1..).unwrap_or_default();
        let (x, y) = coordinates.split_at(coordinates.len() / 2);
        json!({"keys": [
            {"kty": "RSA", "use": "sig", "alg": "RS256", "kid": self.rsa.0,
             "n": URL_SAFE_NO_PAD.encode(&public.n), "e": URL_SAFE_NO_PAD.encode(&public.e)},
            {"kty": "EC", "use": "sig", "alg": "ES256", "crv": "P-256", "kid": self.ec.0,
             "x": URL_SAFE_NO_PAD.encode(x), "y": URL_SAFE_NO_PAD.encode(y)},
        ]})
    }
}

impl Shared {
    fn keys(&self) -> std::sync::MutexGuard<'_, Keys> {
        self.keys.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn mint(&self, ask: &Mint) -> Result<String, String> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64);
        let mut claims = Map::new();
        claims.insert("iss".into(), json!(self.url));
        claims.insert("aud".into(), json!(DEFAULT_AUDIENCE));
        claims.insert("sub".into(), json!("mock-subject"));
        claims.insert("iat".into(), json!(now));
        claims.insert("nbf".into(), json!(now));
        claims.insert("exp".into(), json!(now + ask.lifetime.unwrap_or(3600)));
        for (name, value) in &ask.claims {
            match value {
                Value::Null => claims.remove(name),
                v => claims.insert(name.clone(), v.clone()),
            };
        }
        let keys = self.keys();
        let ec = match ask.key.as_deref() {
            None | Some("rsa") => false,
            Some("ec") => true,
            Some(other) => return Err(format!("unknown key {other:?}: rsa or ec")),
        };
        let (alg, own_kid) = match ec {
            true => ("ES256", &keys.ec.0),
            false => ("RS256", &keys.rsa.0),
        };
        let kid = ask.kid.as_ref().unwrap_or(own_kid);
        let header = json!({"alg": alg, "typ": "JWT", "kid": kid});
        let message = format!(
            "{}.{}",
            URL_SAFE_NO_PAD.encode(header.to_string()),
            URL_SAFE_NO_PAD.encode(Value::Object(claims).to_string())
        );
        let signature = match ec {
            true => keys
                .ec
                .1
                .sign(&self.rng, message.as_bytes())
                .map_err(|e| e.to_string())?
                .as_ref()
                .to_vec(),
            false => {
                let mut out = vec![0; keys.rsa.1.public().modulus_len()];
                keys.rsa
                    .1
                    .sign(
                        &signature::RSA_PKCS1_SHA256,
                        &self.rng,
                        message.as_bytes(),
                        &mut out,
                    )
                    .map_err(|e| e.to_string())?;
                out
            }
        };
        self.minted.fetch_add(1, Ordering::Relaxed);
        Ok(format!("{message}.{}", URL_SAFE_NO_PAD.encode(signature)))
    }

    fn rotate(&self) -> Result<Vec<String>, String> {
        let mut keys = self.keys();
        *keys = Keys::generation(keys.generation + 1, &self.rng)?;
        Ok(vec![keys.rsa.0.clone(), keys.ec.0.clone()])
    }

    fn answer(&self, method: &Method, path: &str, body: &[u8]) -> Response<Full<Bytes>> {
        match (method, path) {
            (&Method::GET, "/.well-known/openid-configuration") => {
                self.discovery_fetches.fetch_add(1, Ordering::Relaxed);
                reply(
                    StatusCode::OK,
                    &json!({
                        "issuer": self.url,
                        "jwks_uri": format!("{}/keys", self.url),
                        "token_endpoint": format!("{}/_mock/tokens", self.url),
                        "response_types_supported": ["token"],
                        "subject_types_supported": ["public"],
                        "id_token_signing_alg_values_supported": ["RS256", "ES256"],
                    }),
                )
            }
            (&Method::GET, "/keys") => {
                self.jwks_fetches.fetch_add(1, Ordering::Relaxed);
                reply(StatusCode::OK, &self.keys().jwks())
            }
            (&Method::POST, "/_mock/tokens") => self.minted_answer(body),
            (&Method::POST, "/_mock/rotate") => match self.rotate() {
                Ok(kids) => reply(StatusCode::OK, &json!({"kids": kids})),
                Err(e) => reply(StatusCode::INTERNAL_SERVER_ERROR, &json!({"error": e})),
            },
            (&Method::GET, "/_mock/stats") => reply(
                StatusCode::OK,
                &json!({
                    "discovery_fetches": self.discovery_fetches.load(Ordering::Relaxed),
                    "jwks_fetches": self.jwks_fetches.load(Ordering::Relaxed),
                    "tokens_minted": self.minted.load(Ordering::Relaxed),
                }),
            ),
            _ => reply(
                StatusCode::NOT_FOUND,
                &json!({"error": "unknown route; try GET /.well-known/openid-configuration, GET /keys, POST /_mock/tokens, POST /_mock/rotate, GET /_mock/stats"}),
            ),
        }
    }

    /// Mints a token as an OAuth token endpoint answers: `access_token`, `expires_in`.
    fn minted_answer(&self, body: &[u8]) -> Response<Full<Bytes>> {
        let ask: Result<Mint, String> = match body.is_empty() {
            true => Ok(Mint::default()),
            false => serde_json::from_slice(body).map_err(|e| e.to_string()),
        };
        match ask.and_then(|ask| Ok((self.mint(&ask)?, ask.lifetime.unwrap_or(3600)))) {
            Ok((token, lifetime)) => reply(
                StatusCode::OK,
                &json!({
                    "access_token": token,
                    "token_type": "Bearer",
                    "expires_in": lifetime,
                }),
            ),
            Err(e) => reply(StatusCode::BAD_REQUEST, &json!({"error": e})),
        }
    }
}

fn reply(status: StatusCode, body: &Value) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body.to_string())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    response
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let shared = shared.clone();
                connections.spawn(async move {
                    let service = service_fn(move |request| answer(shared.clone(), request));
                    let _ = http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
                });
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

async fn answer(
    shared: Arc<Shared>,
    request: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let (parts, body) = request.into_parts();
    let body = body
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    Ok(shared.answer(&parts.method, parts.uri.path(), &body))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn parts(token: &str) -> (Value, Value, Vec<u8>, String) {
        let pieces: Vec<&str> = token.split('.').collect();
        let json = |s: &str| serde_json::from_slice(&URL_SAFE_NO_PAD.decode(s).unwrap()).unwrap();
        let signature = URL_SAFE_NO_PAD.decode(pieces[2]).unwrap();
        (
            json(pieces[0]),
            json(pieces[1]),
            signature,
            format!("{}.{}", pieces[0], pieces[1]),
        )
    }

    #[tokio::test]
    async fn minted_tokens_verify_with_the_published_keys_until_a_rotation() {
        let issuer = Issuer::start(None).await.unwrap();
        let jwks = issuer.shared.keys().jwks();
        let ask = Mint {
            lifetime: Some(-5),
            ..Mint::default()
        };
        let (header, claims, signature, message) = parts(&issuer.mint(&ask).unwrap());
        assert_eq!(
            (header["alg"].as_str(), header["kid"].as_str()),
            (Some("RS256"), Some("rsa-1"))
        );
        assert_eq!(claims["iss"], json!(issuer.url()));
        assert_eq!(claims["aud"], DEFAULT_AUDIENCE);
        assert!(claims["exp"].as_i64() < claims["nbf"].as_i64());
        let rsa = &jwks["keys"][0];
        let bytes = |v: &Value| URL_SAFE_NO_PAD.decode(v.as_str().unwrap()).unwrap();
        let public = signature::RsaPublicKeyComponents {
            n: bytes(&rsa["n"]),
            e: bytes(&rsa["e"]),
        };
        public
            .verify(
                &signature::RSA_PKCS1_2048_8192_SHA256,
                message.as_bytes(),
                &signature,
            )
            .unwrap();

        let ec = Mint {
            key: Some("ec".into()),
            kid: Some("forged".into()),
            claims: serde_json::from_value(json!({"azp": "app", "sub": null})).unwrap(),
            ..Mint::default()
        };
        let (header, claims, signature, message) = parts(&issuer.mint(&ec).unwrap());
        assert_eq!(
            (header["alg"].as_str(), header["kid"].as_str()),
            (Some("ES256"), Some("forged"))
        );
        assert_eq!(claims["azp"], "app");
        assert!(claims.get("sub").is_none());
        let point = [
            vec![4u8],
            bytes(&jwks["keys"][1]["x"]),
            bytes(&jwks["keys"][1]["y"]),
        ]
        .concat();
        signature::UnparsedPublicKey::new(&signature::ECDSA_P256_SHA256_FIXED, &point)
            .verify(message.as_bytes(), &signature)
            .unwrap();

        assert_eq!(issuer.rotate().unwrap(), ["rsa-2", "ec-2"]);
        let rotated = issuer.shared.keys().jwks();
        assert_ne!(rotated["keys"][0]["n"], rsa["n"]);
        assert_ne!(rotated["keys"][1]["x"], jwks["keys"][1]["x"]);
        assert!(issuer
            .mint(&Mint {
                key: Some("dsa".into()),
                ..Mint::default()
            })
            .is_err());
    }
}
