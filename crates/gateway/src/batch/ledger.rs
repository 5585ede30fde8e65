//! Where the gateway keeps what it knows of each tenant's files and batches: records in the
//! shared state store (`State::keep`), one collection per tenant and kind, so every instance
//! finds them and a Redis store keeps them across restarts. A lookup always names the caller's
//! tenant: another tenant's id is simply not there.

use http::{Response, StatusCode};
use onedoor_state::{MeterKey, Reservation, State};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{json, objects, tenant_of};
use crate::auth::Caller;
use crate::body::Body;
use crate::errors::GatewayError;
use crate::runtime::Runtime;

/// Every open batch of every tenant (id -> tenant): what the poller visits.
pub const OPEN: &str = "batches:open";

/// A file the gateway holds for a tenant: an input it keeps itself, or a batch's output or error
/// file, which stays on the backend that made it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FileRecord {
    pub id: String,
    pub filename: String,
    /// `batch`, `batch_output` or `batch_error`.
    pub purpose: String,
    pub bytes: u64,
    pub created_at: u64,
    /// An output file's place: (backend name, the backend's file id).
    pub held: Option<(String, String)>,
}

/// A batch as the gateway placed it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BatchRecord {
    pub id: String,
    pub key_id: String,
    pub alias: String,
    /// The endpoint in the caller's words (`/v1/chat/completions` or `/chat/completions`).
    pub endpoint: String,
    pub input_file_id: String,
    pub created_at: u64,
    pub backend: String,
    pub deployment: String,
    pub upstream_id: String,
    pub upstream_input_file: String,
    /// The backend's batch object as last read.
    pub upstream: Value,
    pub output_file_id: Option<String>,
    pub error_file_id: Option<String>,
    pub lines: u64,
    /// Tokens estimated at creation (prompts plus completion budgets).
    pub estimated_tokens: u64,
    pub reservation: Option<Held>,
    /// The attempts that placed it, as `x-onedoor-attempts` said.
    pub attempts: String,
    /// Its usage was recorded and its reservation settled.
    pub settled: bool,
}

/// A batch's reservation against its tenant's and key's period quotas, kept so that whichever
/// instance sees the batch end settles it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Held {
    meters: Vec<(String, String)>,
    second: u64,
    day: u64,
    month: u64,
    tokens: u64,
    micro_usd: u64,
    member: u64,
    shared: bool,
}

impl Held {
    pub fn of(reservation: &Reservation) -> Held {
        Held {
            meters: reservation
                .meters
                .iter()
                .map(|m| (m.tag.clone(), m.path.to_string()))
                .collect(),
            second: reservation.second,
            day: reservation.day,
            month: reservation.month,
            tokens: reservation.tokens,
            micro_usd: reservation.micro_usd,
            member: reservation.member,
            shared: reservation.shared,
        }
    }

    pub fn reservation(&self) -> Reservation {
        Reservation {
            meters: self
                .meters
                .iter()
                .map(|(tag, path)| MeterKey {
                    tag: tag.clone(),
                    path: path.clone().into(),
                })
                .collect(),
            second: self.second,
            day: self.day,
            month: self.month,
            tokens: self.tokens,
            micro_usd: self.micro_usd,
            member: self.member,
            usage: Vec::new(),
            shared: self.shared,
        }
    }
}

fn files_of(tenant: &str) -> String {
    format!("files:{tenant}")
}

fn contents_of(tenant: &str) -> String {
    format!("file-contents:{tenant}")
}

fn batches_of(tenant: &str) -> String {
    format!("batches:{tenant}")
}

fn unavailable(_: onedoor_state::Unavailable) -> GatewayError {
    GatewayError::StateUnavailable
}

fn encode<T: Serialize>(record: &T) -> Result<String, GatewayError> {
    serde_json::to_string(record).map_err(|e| GatewayError::UpstreamFailed(e.to_string()))
}

pub async fn keep_file(
    runtime: &Runtime,
    tenant: &str,
    file: &FileRecord,
) -> Result<(), GatewayError> {
    let text = encode(file)?;
    let state = &runtime.state;
    state
        .keep(&files_of(tenant), &file.id, &text)
        .await
        .map_err(unavailable)
}

pub async fn keep_content(
    runtime: &Runtime,
    tenant: &str,
    id: &str,
    content: &str,
) -> Result<(), GatewayError> {
    let state = &runtime.state;
    state
        .keep(&contents_of(tenant), id, content)
        .await
        .map_err(unavailable)
}

pub async fn content(runtime: &Runtime, tenant: &str, id: &str) -> Result<String, GatewayError> {
    let state = &runtime.state;
    let found = state
        .recall(&contents_of(tenant), id)
        .await
        .map_err(unavailable)?;
    found.ok_or_else(|| no_such_file(id))
}

pub async fn find_file(
    runtime: &Runtime,
    tenant: &str,
    id: &str,
) -> Result<FileRecord, GatewayError> {
    let state = &runtime.state;
    let text = state
        .recall(&files_of(tenant), id)
        .await
        .map_err(unavailable)?
        .ok_or_else(|| no_such_file(id))?;
    serde_json::from_str(&text).map_err(|_| no_such_file(id))
}

pub async fn keep_batch(
    runtime: &Runtime,
    tenant: &str,
    batch: &BatchRecord,
) -> Result<(), GatewayError> {
    let text = encode(batch)?;
    let state = &runtime.state;
    state
        .keep(&batches_of(tenant), &batch.id, &text)
        .await
        .map_err(unavailable)
}

pub async fn find_batch(
    runtime: &Runtime,
    tenant: &str,
    id: &str,
) -> Result<BatchRecord, GatewayError> {
    let state = &runtime.state;
    let text = state
        .recall(&batches_of(tenant), id)
        .await
        .map_err(unavailable)?
        .ok_or_else(|| no_such_batch(id))?;
    serde_json::from_str(&text).map_err(|_| no_such_batch(id))
}

pub fn no_such_file(id: &str) -> GatewayError {
    GatewayError::NoSuchObject(format!("No such file: {id}"))
}

pub fn no_such_batch(id: &str) -> GatewayError {
    GatewayError::NoSuchObject(format!("No such batch: {id}"))
}

/// `GET /v1/files/{id}`.
pub async fn file(
    runtime: &Runtime,
    caller: &Caller<'_>,
    id: &str,
) -> Result<Response<Body>, GatewayError> {
    let file = find_file(runtime, tenant_of(caller), id).await?;
    Ok(json(StatusCode::OK, &objects::file(&file)))
}

/// `GET /v1/files`: the tenant's files, newest first (`purpose` filters).
pub async fn list_files(
    runtime: &Runtime,
    caller: &Caller<'_>,
    query: Option<&str>,
) -> Result<Response<Body>, GatewayError> {
    let state = &runtime.state;
    let records = state
        .records(&files_of(tenant_of(caller)))
        .await
        .map_err(unavailable)?;
    let purpose = objects::query_value(query, "purpose");
    let mut files: Vec<FileRecord> = records
        .iter()
        .filter_map(|(_, text)| serde_json::from_str(text).ok())
        .filter(|f: &FileRecord| purpose.as_deref().is_none_or(|p| p == f.purpose))
        .collect();
    files.sort_by(|a, b| (b.created_at, &b.id).cmp(&(a.created_at, &a.id)));
    let data: Vec<Value> = files.iter().map(objects::file).collect();
    Ok(json(StatusCode::OK, &objects::page(data, query)))
}

/// `DELETE /v1/files/{id}`: the record and the content the gateway kept go; a backend's copy
/// of an output file is left to the backend's own retention.
pub async fn delete_file(
    runtime: &Runtime,
    caller: &Caller<'_>,
    id: &str,
) -> Result<Response<Body>, GatewayError> {
    let tenant = tenant_of(caller);
    find_file(runtime, tenant, id).await?;
    let state = &runtime.state;
    state
        .forget(&files_of(tenant), id)
        .await
        .map_err(unavailable)?;
    state
        .forget(&contents_of(tenant), id)
        .await
        .map_err(unavailable)?;
    let answer = serde_json::json!({"id": id, "object": "file", "deleted": true});
    Ok(json(StatusCode::OK, &answer))
}

/// How many batches (by status as last seen) and files (by purpose) the tenants hold.
#[derive(Debug, Default)]
pub struct Census {
    pub batches: std::collections::BTreeMap<String, i64>,
    pub files: std::collections::BTreeMap<String, i64>,
}

/// Counts every tenant's records; `None` when the store cannot be read.
pub async fn census(runtime: &Runtime) -> Option<Census> {
    let mut census = Census::default();
    let state = &runtime.state;
    for tenant in &runtime.snapshot.tenants {
        for (_, text) in state.records(&batches_of(&tenant.name)).await.ok()? {
            let Ok(batch) = serde_json::from_str::<BatchRecord>(&text) else {
                continue;
            };
            let status = batch.upstream["status"].as_str().unwrap_or("validating");
            *census.batches.entry(status.to_owned()).or_default() += 1;
        }
        for (_, text) in state.records(&files_of(&tenant.name)).await.ok()? {
            if let Ok(file) = serde_json::from_str::<FileRecord>(&text) {
                *census.files.entry(file.purpose).or_default() += 1;
            }
        }
    }
    Some(census)
}

/// Every open batch of every tenant as the dashboard lists it, oldest first.
pub async fn open_batches(runtime: &Runtime) -> Vec<Value> {
    let state = &runtime.state;
    let Ok(open) = state.records(OPEN).await else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for (id, tenant) in open {
        if let Ok(batch) = find_batch(runtime, &tenant, &id).await {
            found.push((tenant, batch));
        }
    }
    found.sort_by(|a, b| (a.1.created_at, &a.1.id).cmp(&(b.1.created_at, &b.1.id)));
    found
        .into_iter()
        .map(|(tenant, batch)| {
            serde_json::json!({
                "id": batch.id, "tenant": tenant, "alias": batch.alias, "backend": batch.backend,
                "status": batch.upstream["status"], "created_at": batch.created_at,
                "request_counts": batch.upstream["request_counts"], "estimated_tokens": batch.estimated_tokens,
            })
        })
        .collect()
}

/// `GET /v1/batches`: the tenant's batches, newest first, as last seen.
pub async fn list_batches(
    runtime: &Runtime,
    caller: &Caller<'_>,
    query: Option<&str>,
) -> Result<Response<Body>, GatewayError> {
    let state = &runtime.state;
    let records = state
        .records(&batches_of(tenant_of(caller)))
        .await
        .map_err(unavailable)?;
    let mut batches: Vec<BatchRecord> = records
        .iter()
        .filter_map(|(_, text)| serde_json::from_str(text).ok())
        .collect();
    batches.sort_by(|a, b| (b.created_at, &b.id).cmp(&(a.created_at, &a.id)));
    let data: Vec<Value> = batches.iter().map(objects::batch).collect();
    Ok(json(StatusCode::OK, &objects::page(data, query)))
}
