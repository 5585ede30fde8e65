//! `POST /v1/batches`: the batch's file is read again, its tokens estimated and held against
//! the tenant's period quotas (refused before anything leaves the gateway), then it is placed:
//! on each candidate in turn the file is uploaded (lines rewritten for that target) and the
//! batch created. A backend that refuses for capacity or health (429, 5xx, Azure's enqueued-token
//! limit) loses the batch to the next candidate; one that refuses its content answers the caller.

use bytes::Bytes;
use http::{Response, StatusCode};
use onedoor_config::{Alias, Limits, Price};
use onedoor_state::{
    Ask, Charge, Limit, MeterKey, MeterLimits, Refusal, Reservation, Settlement, State, Verdict,
};
use serde_json::{json, Value};

use super::holder::{self, Holder};
use super::input::{self, Input};
use super::ledger::{self, BatchRecord, FileRecord, Held};
use super::{json, new_id, now_s, objects, tenant_of, Served};
use crate::admission;
use crate::auth::Caller;
use crate::body::Body;
use crate::errors::GatewayError;
use crate::pipeline::{passthrough, resolve};
use crate::router::{self, Candidate};
use crate::runtime::Runtime;
use crate::surface::Dialect;
use crate::upstream::Failure;

/// What the caller asked for.
struct Order {
    input_file_id: String,
    endpoint: String,
    completion_window: String,
    metadata: Value,
}

fn order(body: &Bytes) -> Result<Order, GatewayError> {
    let invalid = |why: &str| GatewayError::InvalidRequest(why.to_owned());
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        GatewayError::InvalidRequest(format!("the request body is not valid JSON: {e}"))
    })?;
    let text = |key: &str| value.get(key).and_then(Value::as_str).map(str::to_owned);
    let order = Order {
        input_file_id: text("input_file_id")
            .ok_or_else(|| invalid("missing required field `input_file_id`"))?,
        endpoint: text("endpoint").ok_or_else(|| invalid("missing required field `endpoint`"))?,
        completion_window: text("completion_window").unwrap_or_else(|| "24h".into()),
        metadata: value.get("metadata").cloned().unwrap_or(Value::Null),
    };
    if order.completion_window != "24h" {
        return Err(invalid("completion_window must be \"24h\""));
    }
    Ok(order)
}

pub async fn create(
    runtime: &Runtime,
    caller: &Caller<'_>,
    dialect: Dialect,
    body: &Bytes,
    served: &mut Served,
) -> Result<Response<Body>, GatewayError> {
    let order = order(body)?;
    let (file, input) = read_input(runtime, caller, &order).await?;
    let snapshot = &runtime.snapshot;
    let (alias, _) = resolve(snapshot, &input.alias, caller.tenant, &caller.key)?;
    let counted = quotas(&caller.tenant.limits).is_some() || quotas(&caller.key.limits).is_some();
    let estimator = counted.then(|| admission::estimator(alias, &input.alias));
    let default_max_tokens = snapshot.routing.default_max_tokens;
    let (prompt, completion) = input::estimate(&input, estimator, default_max_tokens).await;
    let lines = input.lines.len();
    let reservation = hold(runtime, caller, alias, prompt, completion, lines).await?;
    let placing = Placing {
        runtime,
        input: &input,
        file: &file,
        order: &order,
    };
    let placed = match placing.place(alias, caller, served).await {
        Ok(placed) => placed,
        Err(refusal) => {
            if let Some(reservation) = &reservation {
                release(runtime, reservation).await;
            }
            return refusal.answer(runtime, dialect);
        }
    };
    let record = BatchRecord {
        key_id: caller.key.id.to_string(),
        alias: input.alias.clone(),
        lines: lines as u64,
        estimated_tokens: prompt + completion,
        reservation: reservation.as_ref().map(Held::of),
        attempts: served.trail.header(),
        ..placed.record(runtime, order.endpoint, file.id)
    };
    open(runtime, tenant_of(caller), &record).await?;
    Ok(json(StatusCode::OK, &objects::batch(&record)))
}

/// The caller's input file the order names, read and checked again, and its lines.
async fn read_input(
    runtime: &Runtime,
    caller: &Caller<'_>,
    order: &Order,
) -> Result<(FileRecord, Input), GatewayError> {
    let tenant = tenant_of(caller);
    let file = ledger::find_file(runtime, tenant, &order.input_file_id).await?;
    if file.purpose != "batch" {
        let message = format!("the file {} is not a batch input file", file.id);
        return Err(GatewayError::InvalidRequest(message));
    }
    let text = ledger::content(runtime, tenant, &file.id).await?;
    let input = input::read(&text, &runtime.snapshot.batch)?;
    if input::operation_of(&order.endpoint) != Some(input.operation) {
        return Err(GatewayError::InvalidRequest(format!(
            "the endpoint {:?} is not the url of the file's lines",
            order.endpoint
        )));
    }
    Ok((file, input))
}

/// Keeps the new batch and puts it on the open list the poller follows.
async fn open(runtime: &Runtime, tenant: &str, record: &BatchRecord) -> Result<(), GatewayError> {
    ledger::keep_batch(runtime, tenant, record).await?;
    runtime.metrics.batch_placed(record.estimated_tokens);
    let state = &runtime.state;
    state
        .keep(ledger::OPEN, &record.id, tenant)
        .await
        .map_err(|_| GatewayError::StateUnavailable)
}

/// Where a batch went: the candidate that took it, its upload's id there, its batch object.
struct Placed {
    candidate: Candidate,
    upload: String,
    batch: Value,
}

impl Placed {
    /// A new record of the batch, with what its placement decided; the caller fills in the rest.
    fn record(self, runtime: &Runtime, endpoint: String, input_file_id: String) -> BatchRecord {
        let backend = runtime.snapshot.backends.get(self.candidate.backend);
        BatchRecord {
            id: new_id("batch_"),
            key_id: String::new(),
            alias: String::new(),
            endpoint,
            input_file_id,
            created_at: now_s(),
            backend: backend.map(|b| b.name.to_string()).unwrap_or_default(),
            deployment: self.candidate.deployment.to_string(),
            upstream_id: self.batch["id"].as_str().unwrap_or_default().to_owned(),
            upstream_input_file: self.upload,
            upstream: self.batch,
            output_file_id: None,
            error_file_id: None,
            lines: 0,
            estimated_tokens: 0,
            reservation: None,
            attempts: String::new(),
            settled: false,
        }
    }
}

/// Why no backend took the batch.
enum Refused {
    /// A backend refused its content: its answer goes back as it came.
    Upstream(usize, Failure),
    Gateway(GatewayError),
}

impl Refused {
    fn answer(self, runtime: &Runtime, dialect: Dialect) -> Result<Response<Body>, GatewayError> {
        match self {
            Refused::Upstream(backend, failure) => {
                let redaction = runtime.redaction(backend).map(|r| &**r);
                Ok(passthrough(failure, dialect, redaction))
            }
            Refused::Gateway(error) => Err(error),
        }
    }
}

/// One batch on its way to a backend.
struct Placing<'a> {
    runtime: &'a Runtime,
    input: &'a Input,
    file: &'a FileRecord,
    order: &'a Order,
}

impl Placing<'_> {
    /// Where the batch went, or why it went nowhere.
    async fn place(
        &self,
        alias: &Alias,
        caller: &Caller<'_>,
        served: &mut Served,
    ) -> Result<Placed, Refused> {
        let runtime = self.runtime;
        let plan = router::plan_batch(
            runtime,
            alias,
            &self.input.alias,
            caller.tenant,
            self.input.operation,
        )
        .await
        .map_err(|_| Refused::Gateway(GatewayError::StateUnavailable))?;
        let candidates = in_turn(plan.candidates);
        if candidates.is_empty() {
            return Err(Refused::Gateway(GatewayError::NoBackendAvailable(format!(
                "no backend this key may reach takes batches for `{}` now",
                self.input.alias
            ))));
        }
        let attempts = runtime.snapshot.routing.max_attempts as usize;
        for candidate in candidates.into_iter().take(attempts.max(1)) {
            let Some(holder) = Holder::new(runtime, candidate.backend) else {
                continue;
            };
            served.backend = Some(candidate.backend);
            let name = holder.backend.name.clone();
            match self.try_on(&holder, &candidate.deployment).await {
                Ok((upload, batch)) => {
                    served.trail.attempts.push((name, "200".into()));
                    let placed = Placed {
                        candidate,
                        upload,
                        batch,
                    };
                    return Ok(placed);
                }
                Err(Attempted::Elsewhere(outcome, _)) => {
                    served.trail.attempts.push((name, outcome))
                }
                Err(Attempted::Refused(failure)) => {
                    served.trail.attempts.push((name, failure.label()));
                    return Err(Refused::Upstream(candidate.backend, failure));
                }
            }
        }
        served.backend = None;
        Err(Refused::Gateway(GatewayError::UpstreamFailed(
            self.input.alias.clone(),
        )))
    }

    /// Uploads the file to `holder` and creates the batch there. A 429 on the way cools the
    /// target down for its Retry-After, as a synchronous call's would.
    async fn try_on(
        &self,
        holder: &Holder<'_>,
        deployment: &str,
    ) -> Result<(String, Value), Attempted> {
        let tried = self.upload_and_create(holder, deployment).await;
        if let Err(Attempted::Elsewhere(_, Some(wait))) = &tried {
            let key = onedoor_state::TargetKey::new(holder.name(), deployment);
            let state = &self.runtime.state;
            state.cool_down(&key, wait.as_millis() as u64).await;
        }
        tried
    }

    async fn upload_and_create(
        &self,
        holder: &Holder<'_>,
        deployment: &str,
    ) -> Result<(String, Value), Attempted> {
        let lines = input::rewrite(self.input, deployment, holder.backend.provider);
        let uploaded = holder
            .upload(&self.file.filename, lines)
            .await
            .map_err(Attempted::of)?;
        let Some(upload) = uploaded["id"].as_str().map(str::to_owned) else {
            return Err(Attempted::elsewhere("bad_answer"));
        };
        let request = json!({
            "input_file_id": upload,
            "endpoint": endpoint_for(holder, self.input.operation),
            "completion_window": self.order.completion_window,
            "metadata": self.order.metadata,
        });
        let created = holder.create(&request).await;
        let batch = match created {
            Ok(batch) if holder::refused_at_creation(&batch) => {
                Err(Attempted::elsewhere("token_limit_exceeded"))
            }
            Ok(batch) if batch["id"].is_string() => Ok(batch),
            Ok(_) => Err(Attempted::elsewhere("bad_answer")),
            Err(failure) => Err(Attempted::of(failure)),
        };
        if batch.is_err() {
            holder.delete_file(&upload).await;
        }
        batch.map(|batch| (upload, batch))
    }
}

/// How one backend's attempt ended, when it did not take the batch.
enum Attempted {
    /// Try the next candidate: the outcome word for `x-onedoor-attempts`, and a 429's wait.
    Elsewhere(crate::upstream::Outcome, Option<std::time::Duration>),
    Refused(Failure),
}

impl Attempted {
    fn elsewhere(outcome: &'static str) -> Attempted {
        Attempted::Elsewhere(outcome.into(), None)
    }

    fn of(failure: Failure) -> Attempted {
        if !holder::moves_elsewhere(&failure) {
            return Attempted::Refused(failure);
        }
        match &failure {
            Failure::Status { body, .. } if holder::token_limit(body) => {
                Attempted::elsewhere("token_limit_exceeded")
            }
            Failure::Status {
                status, headers, ..
            } if *status == StatusCode::TOO_MANY_REQUESTS => {
                let wait = crate::outcome::retry_after(headers)
                    .unwrap_or(crate::outcome::DEFAULT_COOLDOWN);
                Attempted::Elsewhere(failure.label(), Some(wait))
            }
            _ => Attempted::Elsewhere(failure.label(), None),
        }
    }
}

/// The batch endpoint as the backend's dialect names it.
fn endpoint_for(holder: &Holder<'_>, operation: crate::request::Operation) -> String {
    match holder.backend.provider {
        onedoor_config::Provider::Azure => format!("/{}", operation.path()),
        _ => format!("/v1/{}", operation.path()),
    }
}

/// The candidates in the order they are asked: priority groups first, and inside a group one
/// after another drawn by weight.
fn in_turn(mut candidates: Vec<Candidate>) -> Vec<Candidate> {
    candidates.sort_by_key(|c| c.priority);
    let mut ordered = Vec::with_capacity(candidates.len());
    while let Some(top) = candidates.first().map(|c| c.priority) {
        let group = candidates.iter().take_while(|c| c.priority == top).count();
        let total: u64 = candidates[..group]
            .iter()
            .map(|c| u64::from(c.weight.max(1)))
            .sum();
        let mut draw = rand::random::<u64>() % total.max(1);
        let mut chosen = 0;
        for (i, candidate) in candidates[..group].iter().enumerate() {
            let weight = u64::from(candidate.weight.max(1));
            if draw < weight {
                chosen = i;
                break;
            }
            draw -= weight;
        }
        ordered.push(candidates.remove(chosen));
    }
    ordered
}

/// Only the period quotas of a tenant's or key's limits: a batch runs later, not in this minute.
fn quotas(limits: &Limits) -> Option<MeterLimits> {
    let all = admission::meter_limits(limits)?;
    let quotas = MeterLimits {
        tokens_per_day: all.tokens_per_day,
        micro_usd_per_month: all.micro_usd_per_month,
        ..MeterLimits::default()
    };
    (quotas != MeterLimits::default()).then_some(quotas)
}

/// The dearest batch price among the alias's targets: what the batch may cost at most.
fn dearest(alias: &Alias) -> Option<Price> {
    alias
        .targets
        .iter()
        .filter_map(|t| t.price.or(alias.price))
        .map(|p| p.for_batches())
        .max_by(|a, b| {
            (a.input_per_1m + a.output_per_1m).total_cmp(&(b.input_per_1m + b.output_per_1m))
        })
}

/// Holds the batch's estimate against the tenant's and key's `tokens_per_day` and
/// `usd_per_month`, or refuses it; `None` for a caller without such quotas.
async fn hold(
    runtime: &Runtime,
    caller: &Caller<'_>,
    alias: &Alias,
    prompt: u64,
    completion: u64,
    lines: usize,
) -> Result<Option<Reservation>, GatewayError> {
    let (tenant, key) = (caller.tenant, &*caller.key);
    let mut meters = Vec::new();
    if let Some(limits) = quotas(&tenant.limits) {
        meters.push((MeterKey::tenant(&tenant.name), limits));
    }
    if let Some(limits) = quotas(&key.limits) {
        meters.push((MeterKey::key(&tenant.name, &key.id), limits));
    }
    if meters.is_empty() {
        return Ok(None);
    }
    let price = dearest(alias);
    let charge = Charge {
        tokens: prompt + completion,
        micro_usd: admission::micro_usd(price.as_ref(), prompt, completion),
        lease_ms: 1,
    };
    let ask = Ask {
        meters,
        charge,
        enforce: true,
    };
    let state = &runtime.state;
    match state
        .admit(&ask)
        .await
        .map_err(|_| GatewayError::StateUnavailable)?
    {
        Verdict::Admitted(reservation) => {
            // Nothing of a batch is in flight or in this minute: only its period charge stays,
            // until it ends.
            let nothing = Settlement {
                tokens: 0,
                micro_usd: 0,
                release: true,
            };
            state.settle(&reservation.minute_part(), nothing).await;
            Ok(Some(reservation))
        }
        Verdict::Refused(refusal) => Err(over_quota(caller, &refusal, prompt, completion, lines)),
    }
}

fn over_quota(
    caller: &Caller<'_>,
    refusal: &Refusal,
    prompt: u64,
    completion: u64,
    lines: usize,
) -> GatewayError {
    let scope = match refusal.meter {
        0 if quotas(&caller.tenant.limits).is_some() => format!("tenant `{}`", caller.tenant.name),
        _ => format!("key `{}`", caller.key.id),
    };
    let wait = std::time::Duration::from_millis(refusal.retry_after_ms);
    let estimate =
        format!("(prompt estimate {prompt} + completion budget {completion} over {lines} lines)");
    let message = match refusal.limit {
        Limit::UsdPerMonth => format!(
            "quota exceeded: the {scope}'s usd_per_month of ${:.2} has ${:.4} used and this batch may cost up to ${:.4} at batch prices {estimate}; nothing was submitted",
            refusal.cap as f64 / 1e6, refusal.used as f64 / 1e6, refusal.asked as f64 / 1e6
        ),
        _ => format!(
            "quota exceeded: the {scope}'s tokens_per_day of {} has {} used and this batch reserves {} {estimate}; nothing was submitted",
            refusal.cap, refusal.used, refusal.asked
        ),
    };
    GatewayError::QuotaExceeded {
        message,
        period_ends_in: wait,
    }
}

/// Gives back a reservation whose batch was never placed.
async fn release(runtime: &Runtime, reservation: &Reservation) {
    let state = &runtime.state;
    let nothing = Settlement {
        tokens: 0,
        micro_usd: 0,
        release: false,
    };
    state.settle(&reservation.period_part(), nothing).await;
}
