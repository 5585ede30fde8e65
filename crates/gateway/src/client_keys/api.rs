//! The admin API of runtime keys: `/admin/keys` (list, create), `/admin/keys/{id}` (read,
//! change, delete), `/admin/keys/{id}/rotate`, `/admin/audit`, and the OpenAPI description of
//! the admin API at `/admin/openapi.json`. A secret is in one answer only, the one that made it.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use onedoor_config::Tenant;
use onedoor_state::{MeterKey, State};
use onedoor_usage::{Change, KeyStore, KeyStoreError, KeyWrite, StoredKey};
use rand::Rng;
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

use super::settings::{timestamp, Settings};
use super::{ClientKeys, Entry, StoreMissing};
use crate::body::{full, Body, RequestBody};
use crate::runtime::Runtime;

/// The admin API described, kept true by a test that calls every route it names.
pub const OPENAPI: &str = include_str!("openapi.json");

/// How long a call just after a start waits for the store to be opened.
const STORE_WAIT: Duration = Duration::from_secs(5);

/// Audit records an answer holds at most.
const MAX_AUDIT: i64 = 1000;

/// The longest grace a rotated secret may keep.
const MAX_GRACE: Duration = Duration::from_secs(30 * 24 * 3600);

/// A refusal: status and message (and the field it is about).
struct Refusal {
    status: StatusCode,
    message: String,
}

type Answer = Result<(StatusCode, Value), Refusal>;

fn bad(message: impl Into<String>) -> Refusal {
    Refusal {
        status: StatusCode::BAD_REQUEST,
        message: message.into(),
    }
}

/// The answer for a request to one of these routes; `None` for any other path.
pub async fn handle(
    runtime: &Runtime,
    request: Request<RequestBody>,
    actor: String,
) -> Option<Response<Body>> {
    let path = request.uri().path().to_owned();
    let rest = path.strip_prefix("/admin/keys");
    let audit = path == "/admin/audit";
    if rest.is_none() && !audit {
        return None;
    }
    runtime.client_keys.ready(STORE_WAIT).await;
    let method = request.method().clone();
    let query = request.uri().query().unwrap_or("").to_owned();
    let body = match request.into_body() {
        RequestBody::Whole(bytes) => bytes,
        RequestBody::TooLarge => Bytes::new(),
    };
    let call = Call {
        runtime,
        keys: &runtime.client_keys,
        actor,
    };
    let answer = match (method, rest) {
        (Method::GET, None) => call.audit(&query).await,
        (Method::GET, Some("" | "/")) => call.list().await,
        (Method::POST, Some("" | "/")) => call.create(&body).await,
        (method, Some(rest)) => match rest.trim_start_matches('/').split_once('/') {
            Some((id, "rotate")) if method == Method::POST => call.rotate(id, &body).await,
            None if method == Method::GET => call.show(rest.trim_start_matches('/')).await,
            None if method == Method::PATCH => {
                call.change(rest.trim_start_matches('/'), &body).await
            }
            None if method == Method::DELETE => call.delete(rest.trim_start_matches('/')).await,
            _ => Err(Refusal {
                status: StatusCode::NOT_FOUND,
                message: "no such admin endpoint; GET /admin/openapi.json lists them".into(),
            }),
        },
        _ => Err(Refusal {
            status: StatusCode::METHOD_NOT_ALLOWED,
            message: "GET /admin/audit only".into(),
        }),
    };
    Some(respond(answer))
}

fn respond(answer: Answer) -> Response<Body> {
    let (status, body) = match answer {
        Ok(ok) => ok,
        Err(refusal) => {
            let kind = match refusal.status.as_u16() {
                404 => "not_found_error",
                400..=499 => "invalid_request_error",
                _ => "server_error",
            };
            let code = match refusal.status.as_u16() {
                404 => "not_found",
                409 => "conflict",
                400..=499 => "invalid_request",
                _ => "key_store_unavailable",
            };
            let body = json!({"error": {"message": refusal.message, "type": kind, "param": null, "code": code}});
            (refusal.status, body)
        }
    };
    let mut response = Response::new(full(Bytes::from(body.to_string())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// The OpenAPI description (no data of the gateway's: served without the token).
pub fn openapi() -> Response<Body> {
    let mut response = Response::new(full(Bytes::from_static(OPENAPI.as_bytes())));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

struct Call<'a> {
    runtime: &'a Runtime,
    keys: &'a Arc<ClientKeys>,
    actor: String,
}

impl Call<'_> {
    fn store(&self) -> Result<&KeyStore, Refusal> {
        self.keys.store().map_err(|missing| match missing {
            StoreMissing::Off => Refusal {
                status: StatusCode::CONFLICT,
                message: "runtime keys are kept in the usage store, and `usage.store` is off: set it to sqlite://PATH or postgres://...".into(),
            },
            StoreMissing::NotYet => Refusal {
                status: StatusCode::SERVICE_UNAVAILABLE,
                message: "the key store (the usage store's database) has not been reached yet; retry shortly".into(),
            },
        })
    }

    /// Makes `write` with its audit record, then reads the keys again so this instance has the
    /// change at once.
    async fn write(&self, write: KeyWrite, detail: Value) -> Result<(), Refusal> {
        let change = Change {
            write,
            actor: self.actor.clone(),
            at_ms: onedoor_state::now_ms() as i64,
            detail: detail.to_string(),
        };
        let seq = self
            .store()?
            .apply(change)
            .await
            .map_err(|error| match error {
                KeyStoreError::NoSuchKey(id) => not_found(&id),
                KeyStoreError::Store(error) => unavailable(&error),
            })?;
        self.keys.refresh(true).await.map_err(|e| unavailable(&e))?;
        self.keys.announce(seq).await;
        Ok(())
    }

    /// Every key, as the store has them now (a change made on another instance a moment ago
    /// included).
    async fn list(&self) -> Answer {
        self.store()?;
        self.keys
            .refresh(false)
            .await
            .map_err(|e| unavailable(&e))?;
        let entries = self.keys.entries();
        let spend = spend(self.runtime, &entries).await;
        let now = onedoor_state::now_ms();
        let list: Vec<Value> = entries
            .iter()
            .zip(spend)
            .map(|(entry, spent)| view(entry, spent, now))
            .collect();
        Ok((StatusCode::OK, json!({ "keys": list })))
    }

    /// The key `id`, read from the store again when this instance has not seen it yet (it was
    /// made on another one a moment ago).
    async fn entry(&self, id: &str) -> Result<Arc<Entry>, Refusal> {
        if let Some(entry) = self.keys.entry(id) {
            return Ok(entry);
        }
        self.keys.refresh(true).await.map_err(|e| unavailable(&e))?;
        self.keys.entry(id).ok_or_else(|| not_found(id))
    }

    async fn show(&self, id: &str) -> Answer {
        self.store()?;
        let entry = self.entry(id).await?;
        let spent = spend(self.runtime, std::slice::from_ref(&entry)).await;
        let now = onedoor_state::now_ms();
        Ok((
            StatusCode::OK,
            view(&entry, spent.first().copied().flatten(), now),
        ))
    }

    async fn create(&self, body: &[u8]) -> Answer {
        self.store()?;
        let mut fields = object(body)?;
        let tenant = self.tenant(fields.remove("tenant"))?;
        let now = onedoor_state::now_ms();
        let settings = Settings::default().apply(&fields).map_err(bad)?;
        settings
            .check(tenant, &self.runtime.snapshot, now, true)
            .map_err(bad)?;
        let id = self.fresh_id();
        let secret = new_secret();
        let stored = StoredKey {
            id: id.clone(),
            tenant: tenant.name.to_string(),
            name: settings.name.clone(),
            settings: serde_json::to_string(&settings).map_err(|e| bad(e.to_string()))?,
            created_at_ms: now as i64,
            updated_at_ms: now as i64,
            last_used_ms: None,
        };
        let detail = json!({"tenant": tenant.name, "settings": settings.view()});
        let write = KeyWrite::Create {
            key: stored,
            sha256: sha256_hex(&secret),
        };
        self.write(write, detail).await?;
        let entry = self.entry(&id).await?;
        let mut answer = view(&entry, Some(0.0), now);
        answer["key"] = secret.into();
        Ok((StatusCode::CREATED, answer))
    }

    async fn change(&self, id: &str, body: &[u8]) -> Answer {
        self.store()?;
        let entry = self.entry(id).await?;
        let fields = object(body)?;
        if fields.contains_key("tenant") {
            return Err(bad(
                "a key's `tenant` cannot change: create a key for the other tenant",
            ));
        }
        let tenant = self.tenant(Some(Value::from(entry.stored.tenant.clone())))?;
        let now = onedoor_state::now_ms();
        let settings = entry.settings.apply(&fields).map_err(bad)?;
        let setting_expiry = fields.get("expires_at").is_some_and(|v| !v.is_null());
        settings
            .check(tenant, &self.runtime.snapshot, now, setting_expiry)
            .map_err(bad)?;
        let write = KeyWrite::Update {
            id: id.to_owned(),
            name: settings.name.clone(),
            settings: serde_json::to_string(&settings).map_err(|e| bad(e.to_string()))?,
        };
        self.write(write, json!({ "changed": fields })).await?;
        self.show(id).await
    }

    async fn rotate(&self, id: &str, body: &[u8]) -> Answer {
        self.store()?;
        self.entry(id).await?;
        let fields = match body.iter().all(u8::is_ascii_whitespace) {
            true => Map::new(),
            false => object(body)?,
        };
        let grace = grace(&fields)?;
        let now = onedoor_state::now_ms();
        let until = now + grace.as_millis() as u64;
        let secret = new_secret();
        let write = KeyWrite::Rotate {
            id: id.to_owned(),
            sha256: sha256_hex(&secret),
            old_valid_until_ms: until as i64,
        };
        let detail =
            json!({"grace_ms": grace.as_millis() as u64, "previous_valid_until": timestamp(until)});
        self.write(write, detail).await?;
        let (status, mut answer) = self.show(id).await?;
        answer["key"] = secret.into();
        answer["previous_valid_until"] = timestamp(until).into();
        Ok((status, answer))
    }

    async fn delete(&self, id: &str) -> Answer {
        self.store()?;
        self.write(KeyWrite::Delete { id: id.to_owned() }, json!({}))
            .await?;
        Ok((StatusCode::OK, json!({"id": id, "deleted": true})))
    }

    async fn audit(&self, query: &str) -> Answer {
        let limit = match query_value(query, "limit") {
            None => 100,
            Some(text) => text
                .parse::<i64>()
                .ok()
                .filter(|n| (1..=MAX_AUDIT).contains(n))
                .ok_or_else(|| {
                    bad(format!(
                        "`limit` must be a whole number from 1 to {MAX_AUDIT}"
                    ))
                })?,
        };
        let records = self
            .store()?
            .audit(limit)
            .await
            .map_err(|e| unavailable(&e))?;
        let list: Vec<Value> = records
            .into_iter()
            .map(|r| {
                let detail = serde_json::from_str::<Value>(&r.detail).unwrap_or(Value::Null);
                json!({
                    "seq": r.seq,
                    "at": timestamp(r.at_ms.max(0) as u64),
                    "actor": r.actor,
                    "action": r.action,
                    "key_id": r.key_id,
                    "detail": detail,
                })
            })
            .collect();
        Ok((StatusCode::OK, json!({ "audit": list })))
    }

    fn tenant(&self, name: Option<Value>) -> Result<&Tenant, Refusal> {
        let tenants = &self.runtime.snapshot.tenants;
        let known = || {
            let names: Vec<&str> = tenants.iter().map(|t| &*t.name).collect();
            names.join(", ")
        };
        let name = name.as_ref().and_then(Value::as_str).ok_or_else(|| {
            bad(format!(
                "`tenant` is required: the name of a tenant of the config ({})",
                known()
            ))
        })?;
        tenants
            .iter()
            .find(|t| &*t.name == name)
            .ok_or_else(|| bad(format!("unknown tenant `{name}` (known: {})", known())))
    }

    /// An id no config key or principal has, nor another runtime key.
    fn fresh_id(&self) -> String {
        loop {
            let id = format!("key-{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff);
            let in_config = self
                .runtime
                .snapshot
                .tenants
                .iter()
                .flat_map(|t| t.callers())
                .any(|k| *k.id == *id);
            if !in_config && self.keys.entry(&id).is_none() {
                return id;
            }
        }
    }
}

/// Each key's spend this UTC month, as its meter counts it (`None` when the store is away).
async fn spend(runtime: &Runtime, entries: &[Arc<Entry>]) -> Vec<Option<f64>> {
    let meters: Vec<MeterKey> = entries
        .iter()
        .map(|e| MeterKey::key(&e.stored.tenant, &e.stored.id))
        .collect();
    match runtime.state.usage(&meters).await {
        Ok(usage) => usage
            .iter()
            .map(|u| Some(u.month_micro_usd as f64 / 1e6))
            .collect(),
        Err(_) => vec![None; entries.len()],
    }
}

fn view(entry: &Entry, spent: Option<f64>, now_ms: u64) -> Value {
    let mut view = entry.settings.view();
    let stored = &entry.stored;
    let more = json!({
        "id": stored.id,
        "tenant": stored.tenant,
        "state": entry.state(now_ms),
        "spend_usd": spent,
        "spend_period": "UTC month",
        "created_at": timestamp(stored.created_at_ms.max(0) as u64),
        "updated_at": timestamp(stored.updated_at_ms.max(0) as u64),
        "last_used_at": entry.last_used_ms().map(timestamp),
        "rotated_secrets_valid_until": entry.rotated_until_ms.iter().filter(|&&u| u > now_ms).map(|&u| timestamp(u)).collect::<Vec<_>>(),
    });
    if let (Some(view), Value::Object(more)) = (view.as_object_mut(), more) {
        view.extend(more);
    }
    view
}

fn object(body: &[u8]) -> Result<Map<String, Value>, Refusal> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(bad("the body must be a JSON object")),
        Err(error) => Err(bad(format!("the body is not JSON: {error}"))),
    }
}

/// A rotation's `grace`: how long the secrets in use so far stay valid (`"0s"` when left out).
fn grace(fields: &Map<String, Value>) -> Result<Duration, Refusal> {
    if let Some(other) = fields.keys().find(|k| *k != "grace") {
        return Err(bad(format!("unknown field `{other}` (known: grace)")));
    }
    let Some(value) = fields.get("grace") else {
        return Ok(Duration::ZERO);
    };
    let text = value
        .as_str()
        .ok_or_else(|| bad("`grace` must be a duration such as \"10m\" or \"24h\""))?;
    let grace = humantime::parse_duration(text).map_err(|_| {
        bad(format!(
            "`grace` must be a duration such as \"10m\" or \"24h\", found \"{text}\""
        ))
    })?;
    match grace <= MAX_GRACE {
        true => Ok(grace),
        false => Err(bad("`grace` may be at most 30 days")),
    }
}

fn query_value<'q>(query: &'q str, name: &str) -> Option<&'q str> {
    query
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .find(|(key, _)| *key == name)
        .map(|(_, value)| value)
}

fn not_found(id: &str) -> Refusal {
    Refusal {
        status: StatusCode::NOT_FOUND,
        message: format!("no runtime key with id `{id}`; GET /admin/keys lists them"),
    }
}

fn unavailable(error: &dyn std::fmt::Display) -> Refusal {
    Refusal {
        status: StatusCode::SERVICE_UNAVAILABLE,
        message: format!("the key store cannot be used: {error}"),
    }
}

const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";

/// A fresh secret like `onedoor keys new` makes: `od-` and 40 base62 characters.
fn new_secret() -> String {
    let mut rng = rand::rng();
    let body: String = (0..40)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
        .collect();
    format!("od-{body}")
}

fn sha256_hex(secret: &str) -> String {
    hex::encode(Sha256::digest(secret.as_bytes()))
}
