//! Following a batch to its end: each client read of a batch, and a poll of every open batch at
//! `batch.poll_interval`, asks its backend how it stands. Its output and error files become the
//! tenant's files (gateway ids, content read from the backend); when it ends, its usage is
//! measured from its output file, recorded as one usage record at batch prices, and its
//! reservation settled with that usage, by exactly one instance.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use onedoor_state::{Settlement, State};
use onedoor_usage::{Source, Tokens, UsageRecord};
use serde_json::Value;
use tokio::sync::watch;

use super::holder::Holder;
use super::ledger::{self, BatchRecord, FileRecord};
use super::{json, now_s, objects, tenant_of, Served};
use crate::auth::Caller;
use crate::body::{full, Body};
use crate::errors::GatewayError;
use crate::pipeline::passthrough;
use crate::reload::Live;
use crate::runtime::Runtime;
use crate::surface::Dialect;
use crate::upstream::Failure;

/// The states a batch does not leave.
const ENDED: &[&str] = &["completed", "failed", "expired", "cancelled"];

fn ended(record: &BatchRecord) -> bool {
    record.upstream["status"]
        .as_str()
        .is_some_and(|status| ENDED.contains(&status))
}

/// `GET /v1/batches/{id}`: the batch as its backend says now (as last seen, when it cannot be
/// asked).
pub async fn batch(
    runtime: &Runtime,
    caller: &Caller<'_>,
    id: &str,
    served: &mut Served,
) -> Result<Response<Body>, GatewayError> {
    let tenant = tenant_of(caller);
    let mut record = ledger::find_batch(runtime, tenant, id).await?;
    served.backend = runtime
        .snapshot
        .backend_by_name
        .get(&record.backend)
        .copied();
    refresh(runtime, tenant, &mut record).await;
    Ok(json(StatusCode::OK, &objects::batch(&record)))
}

/// `POST /v1/batches/{id}/cancel`.
pub async fn cancel(
    runtime: &Runtime,
    caller: &Caller<'_>,
    id: &str,
    dialect: Dialect,
    served: &mut Served,
) -> Result<Response<Body>, GatewayError> {
    let tenant = tenant_of(caller);
    let mut record = ledger::find_batch(runtime, tenant, id).await?;
    let holder = Holder::named(runtime, &record.backend).ok_or_else(|| gone(&record))?;
    served.backend = Some(holder.id);
    match holder.cancel(&record.upstream_id).await {
        Ok(batch) if batch.is_object() => record.upstream = batch,
        Ok(_) => {}
        Err(failure) => {
            let redaction = runtime.redaction(holder.id).map(|r| &**r);
            return Ok(passthrough(failure, dialect, redaction));
        }
    }
    learn(runtime, tenant, &mut record).await?;
    Ok(json(StatusCode::OK, &objects::batch(&record)))
}

/// `GET /v1/files/{id}/content`: an input file as the tenant uploaded it, an output or error
/// file as its backend has it.
pub async fn file_content(
    runtime: &Runtime,
    caller: &Caller<'_>,
    id: &str,
    served: &mut Served,
) -> Result<Response<Body>, GatewayError> {
    let tenant = tenant_of(caller);
    let file = ledger::find_file(runtime, tenant, id).await?;
    let content = match &file.held {
        None => Bytes::from(ledger::content(runtime, tenant, id).await?),
        Some((backend, upstream)) => {
            let holder = Holder::named(runtime, backend).ok_or_else(|| ledger::no_such_file(id))?;
            served.backend = Some(holder.id);
            holder.content(upstream).await.map_err(|failure| {
                GatewayError::UpstreamFailed(format!("{id} ({})", failure.detail()))
            })?
        }
    };
    let mut response = Response::new(full(content));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    Ok(response)
}

fn gone(record: &BatchRecord) -> GatewayError {
    GatewayError::NoBackendAvailable(format!(
        "the batch {} is held by a backend that is no longer configured",
        record.id
    ))
}

/// Asks the batch's backend how it stands and learns from the answer; a batch already settled,
/// or a backend that cannot be asked, leaves the record as it was.
async fn refresh(runtime: &Runtime, tenant: &str, record: &mut BatchRecord) {
    if record.settled {
        return;
    }
    let Some(holder) = Holder::named(runtime, &record.backend) else {
        return;
    };
    match holder.batch(&record.upstream_id).await {
        Ok(batch) if batch.is_object() => record.upstream = batch,
        Ok(_) => return,
        // Gone from its backend (deleted, or past the backend's retention): it has ended there.
        Err(Failure::Status { status, .. }) if status == StatusCode::NOT_FOUND => {
            lost(record);
        }
        Err(failure) => {
            tracing::debug!(batch = %record.id, backend = holder.name(), detail = failure.detail(), "an open batch could not be read");
            return;
        }
    }
    if let Err(error) = learn(runtime, tenant, record).await {
        tracing::warn!(batch = %record.id, %error, "a batch's new state was not kept");
    }
}

/// Marks a batch its backend no longer has as failed, so it is settled and polled no more.
fn lost(record: &mut BatchRecord) {
    record.upstream["status"] = Value::from("failed");
    record.upstream["failed_at"] = Value::from(now_s());
    record.upstream["errors"] = serde_json::json!({"object": "list", "data": [{
        "code": "batch_lost", "message": "the backend that held this batch no longer has it",
        "line": null, "param": null,
    }]});
}

/// Keeps what the backend's latest batch object says: its output and error files as the
/// tenant's, and, once it has ended, its usage.
async fn learn(
    runtime: &Runtime,
    tenant: &str,
    record: &mut BatchRecord,
) -> Result<(), GatewayError> {
    if record.output_file_id.is_none() {
        record.output_file_id =
            adopt(runtime, tenant, record, "output_file_id", "batch_output").await?;
    }
    if record.error_file_id.is_none() {
        record.error_file_id =
            adopt(runtime, tenant, record, "error_file_id", "batch_error").await?;
    }
    if ended(record) && !record.settled {
        settle(runtime, tenant, record).await?;
    }
    ledger::keep_batch(runtime, tenant, record).await
}

/// A file the backend made for the batch, as a file of the tenant's; its gateway id.
async fn adopt(
    runtime: &Runtime,
    tenant: &str,
    record: &BatchRecord,
    field: &str,
    purpose: &str,
) -> Result<Option<String>, GatewayError> {
    let Some(upstream) = record.upstream[field].as_str().filter(|id| !id.is_empty()) else {
        return Ok(None);
    };
    let file = FileRecord {
        id: derived_id(&record.id, purpose),
        filename: format!(
            "{}_{}.jsonl",
            record.id,
            purpose.trim_start_matches("batch_")
        ),
        purpose: purpose.to_owned(),
        bytes: 0,
        created_at: now_s(),
        held: Some((record.backend.clone(), upstream.to_owned())),
    };
    ledger::keep_file(runtime, tenant, &file).await?;
    Ok(Some(file.id))
}

/// The gateway id of a batch's output or error file: the same on every instance and every
/// read, so two that adopt it at once keep one file.
fn derived_id(batch: &str, purpose: &str) -> String {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest([batch, ":", purpose].concat().as_bytes());
    format!("file-{}", &hex::encode(digest)[..24])
}

/// What an output file says the batch used.
#[derive(Debug, Default, PartialEq, Eq)]
struct Measured {
    lines: u64,
    input: u64,
    output: u64,
    cached: u64,
}

fn measure(output: &[u8]) -> Measured {
    let mut measured = Measured::default();
    for line in output.split(|b| *b == b'\n') {
        let Ok(line) = serde_json::from_slice::<Value>(line) else {
            continue;
        };
        let usage = &line["response"]["body"]["usage"];
        measured.lines += 1;
        measured.input += usage["prompt_tokens"].as_u64().unwrap_or(0);
        measured.output += usage["completion_tokens"].as_u64().unwrap_or(0);
        measured.cached += usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
    }
    measured
}

/// Records the ended batch's usage and settles its reservation, unless another instance (or an
/// earlier call) has taken it off the open list first.
async fn settle(
    runtime: &Runtime,
    tenant: &str,
    record: &mut BatchRecord,
) -> Result<(), GatewayError> {
    let state = &runtime.state;
    let mine = state
        .forget(ledger::OPEN, &record.id)
        .await
        .map_err(|_| GatewayError::StateUnavailable)?;
    record.settled = true;
    if !mine {
        return Ok(());
    }
    let measured = match (
        record.upstream["output_file_id"].as_str(),
        Holder::named(runtime, &record.backend),
    ) {
        (Some(file), Some(holder)) if !file.is_empty() => match holder.content(file).await {
            Ok(output) => measure(&output),
            Err(failure) => {
                tracing::warn!(batch = %record.id, detail = failure.detail(), "a batch's output file could not be read; its usage is recorded as none");
                Measured::default()
            }
        },
        _ => Measured::default(),
    };
    let usage = usage_record(runtime, tenant, record, &measured);
    tracing::info!(batch = %record.id, tenant, backend = %record.backend, lines = measured.lines, input = measured.input, output = measured.output, "a batch ended; its usage is recorded");
    if let Some(held) = &record.reservation {
        let settlement = Settlement {
            tokens: usage.tokens.total(),
            micro_usd: (usage.cost_usd * 1e6).ceil() as u64,
            release: false,
        };
        state
            .settle(&held.reservation().period_part(), settlement)
            .await;
    }
    runtime.metrics.batch_ended(measured.input, measured.output);
    runtime.recorder.record(usage);
    Ok(())
}

fn usage_record(
    runtime: &Runtime,
    tenant: &str,
    record: &BatchRecord,
    measured: &Measured,
) -> UsageRecord {
    let snapshot = &runtime.snapshot;
    let backend = snapshot
        .backend_by_name
        .get(&record.backend)
        .and_then(|&id| Some((id, snapshot.backends.get(id)?)));
    let alias = crate::recording::alias_of(snapshot, &record.alias);
    let price = match (alias, backend) {
        (Some(alias), Some((id, _))) => {
            onedoor_usage::price_of(alias, id, &record.deployment).map(|p| p.for_batches())
        }
        _ => None,
    };
    let tokens = Tokens {
        input: measured.input,
        output: measured.output,
        cached: measured.cached,
        cache_write: 0,
        source: Source::Measured,
    };
    let now = onedoor_usage::now_ms();
    UsageRecord {
        request_id: record.id.clone(),
        at_ms: now,
        tenant: Arc::from(tenant),
        key_id: Arc::from(record.key_id.as_str()),
        alias: Arc::from(record.alias.as_str()),
        backend: backend.map(|(_, b)| b.name.clone()),
        model: Some(Arc::from(record.deployment.as_str())),
        region: backend.map(|(_, b)| b.region.clone()),
        status: 200,
        tokens,
        estimated_tokens: record.estimated_tokens,
        cost_usd: onedoor_usage::cost_of(price.as_ref(), &tokens),
        duration_ms: now.saturating_sub(record.created_at * 1000),
        ttft_ms: None,
        attempts: record.attempts.clone(),
        stream: false,
        stream_cut: false,
        error: record.upstream["status"]
            .as_str()
            .filter(|s| *s != "completed")
            .map(|s| format!("batch {s}")),
        lines: Some(record.lines),
    }
}

/// Polls every open batch each `batch.poll_interval` (of the config running then) until
/// `shutdown` is raised.
pub async fn poll(live: Arc<Live>, mut shutdown: watch::Receiver<bool>) {
    loop {
        let interval = live.current().snapshot.batch.poll_interval;
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            changed = shutdown.changed() => if changed.is_err() || *shutdown.borrow() { return },
        }
        if *shutdown.borrow() {
            return;
        }
        let runtime = live.current();
        poll_once(&runtime).await;
    }
}

async fn poll_once(runtime: &Runtime) {
    let state = &runtime.state;
    let Ok(open) = state.records(ledger::OPEN).await else {
        return;
    };
    for (id, tenant) in open {
        let Ok(mut record) = ledger::find_batch(runtime, &tenant, &id).await else {
            continue;
        };
        // A slow backend must not hold up the rest of the round for long.
        let _ = tokio::time::timeout(
            Duration::from_secs(30),
            refresh(runtime, &tenant, &mut record),
        )
        .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_output_file_measures_every_line_with_usage() {
        let output = br#"{"custom_id":"a","response":{"status_code":200,"body":{"usage":{"prompt_tokens":10,"completion_tokens":5}}}}
{"custom_id":"b","response":{"status_code":200,"body":{"usage":{"prompt_tokens":7,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":2}}}}}
"#;
        let measured = measure(output);
        assert_eq!(
            measured,
            Measured {
                lines: 2,
                input: 17,
                output: 8,
                cached: 2
            }
        );
    }
}
