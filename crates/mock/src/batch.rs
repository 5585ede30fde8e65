//! Files and batches, as OpenAI (`/v1/files`, `/v1/batches`) and Azure (`/openai/files`,
//! `/openai/batches`, `/openai/v1/...`) serve them: uploads of JSONL input files, and batches
//! that walk validating, in_progress, finalizing to completed (or failed, cancelling, cancelled)
//! on an accelerated clock (`Behavior::batch_ms` for the whole run), then give an output file of
//! chat completions or embeddings with usage, and an error file for lines that name no
//! deployment here. `Behavior::enqueued_token_limit` fails a batch at creation the way Azure
//! does when a deployment's enqueued tokens would pass its quota.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use hyper::http::request::Parts;
use hyper::{Method, Response, StatusCode};
use serde_json::{json, Value};

use crate::dialect::{self, Payload};
use crate::ident::{token, unix_now};
use crate::openai::envelope;
use crate::reply::Reply;
use crate::request::Chat;
use crate::response::{self, plain_json};
use crate::state::{lock, Shared};
use crate::stream::{self, Body, Watch};
use crate::{embeddings, Behavior, Dialect};

/// How long a batch runs when the behaviour does not say.
const DEFAULT_RUN_MS: u64 = 2_000;

struct File {
    object: Value,
    content: Bytes,
}

struct Batch {
    object: Value,
    started: Instant,
    run: Duration,
    lines: Vec<Value>,
    /// When a cancel came, and how far the run was then (0..1).
    cancelled: Option<(Instant, f64)>,
    finished: bool,
}

/// What one endpoint holds.
#[derive(Default)]
pub struct Holdings {
    files: HashMap<String, File>,
    batches: HashMap<String, Batch>,
}

/// The files or batches path `path` names on this dialect, as (kind, rest), if it is one.
pub fn route(dialect: Dialect, path: &str) -> Option<(&str, Vec<&str>)> {
    let rest = match dialect {
        Dialect::OpenAi => path.strip_prefix("/v1/"),
        Dialect::Azure => path
            .strip_prefix("/openai/v1/")
            .or_else(|| path.strip_prefix("/openai/")),
        Dialect::Anthropic => None,
    }?;
    let mut segments = rest.trim_end_matches('/').split('/');
    let kind = segments
        .next()
        .filter(|k| matches!(*k, "files" | "batches"))?;
    Some((kind, segments.collect()))
}

pub async fn answer(shared: &Shared, parts: &Parts, body: &Bytes) -> Response<Body> {
    let Some((kind, rest)) = route(shared.spec.dialect, parts.uri.path()) else {
        return error(StatusCode::NOT_FOUND, "Invalid URL", "not_found");
    };
    let wire = dialect::wire(shared.spec.dialect);
    if crate::identity::check(shared, wire, &parts.headers).is_err() {
        return error(
            StatusCode::UNAUTHORIZED,
            "Access denied due to invalid subscription key.",
            "401",
        );
    }
    let behavior = shared.behavior_for(None);
    if let Some(refusal) = fault(&behavior) {
        return refusal;
    }
    shared.count(None);
    let uploaded = match (kind, rest.as_slice(), &parts.method) {
        ("files", [], &Method::POST) => form(parts, body.clone()).await,
        _ => None,
    };
    let mut holdings = lock(&shared.batches);
    match (kind, rest.as_slice(), &parts.method) {
        ("files", [], &Method::POST) => upload(&mut holdings, uploaded),
        ("files", [], &Method::GET) => list(holdings.files.values().map(|f| f.object.clone())),
        ("files", [id], &Method::GET) => match holdings.files.get(*id) {
            Some(file) => plain_json(StatusCode::OK, &file.object),
            None => missing("file", id),
        },
        ("files", [id, "content"], &Method::GET) => match holdings.files.get(*id) {
            Some(file) => response::with_body(
                StatusCode::OK,
                "application/octet-stream",
                stream::full(file.content.clone(), Watch::detached()),
            ),
            None => missing("file", id),
        },
        ("files", [id], &Method::DELETE) => match holdings.files.remove(*id) {
            Some(_) => plain_json(
                StatusCode::OK,
                &json!({"id": id, "object": "file", "deleted": true}),
            ),
            None => missing("file", id),
        },
        ("batches", [], &Method::POST) => create(&mut holdings, &behavior, body),
        ("batches", [], &Method::GET) => {
            let ids: Vec<String> = holdings.batches.keys().cloned().collect();
            let objects: Vec<Value> = ids
                .iter()
                .filter_map(|id| look(shared, &mut holdings, id))
                .collect();
            list(objects.into_iter())
        }
        ("batches", [id], &Method::GET) => match look(shared, &mut holdings, id) {
            Some(object) => plain_json(StatusCode::OK, &object),
            None => missing("batch", id),
        },
        ("batches", [id, "cancel"], &Method::POST) => {
            if let Some(batch) = holdings.batches.get_mut(*id) {
                if batch.cancelled.is_none() && !batch.finished {
                    batch.cancelled = Some((Instant::now(), progress(batch)));
                }
            }
            match look(shared, &mut holdings, id) {
                Some(object) => plain_json(StatusCode::OK, &object),
                None => missing("batch", id),
            }
        }
        _ => error(StatusCode::NOT_FOUND, "Invalid URL", "not_found"),
    }
}

/// A throttled or broken endpoint refuses batch calls as it refuses model calls.
fn fault(behavior: &Behavior) -> Option<Response<Body>> {
    let status = behavior.status?;
    let mut refusal = match status {
        429 => error(
            StatusCode::TOO_MANY_REQUESTS,
            "Rate limit reached; please retry.",
            "429",
        ),
        status => error(
            dialect::status_code(status),
            dialect::reason(dialect::status_code(status)),
            "server_error",
        ),
    };
    if status == 429 {
        response::put(
            refusal.headers_mut(),
            "retry-after",
            behavior.retry_after_s.unwrap_or(1),
        );
    }
    Some(refusal)
}

fn error(status: StatusCode, message: &str, code: &str) -> Response<Body> {
    plain_json(
        status,
        &envelope(message, Some("invalid_request_error"), None, Some(code)),
    )
}

fn missing(what: &str, id: &str) -> Response<Body> {
    error(
        StatusCode::NOT_FOUND,
        &format!("No such {what}: {id}"),
        "not_found",
    )
}

fn list(objects: impl Iterator<Item = Value>) -> Response<Body> {
    let mut data: Vec<Value> = objects.collect();
    data.sort_by_key(|o| std::cmp::Reverse(o["created_at"].as_u64().unwrap_or(0)));
    plain_json(
        StatusCode::OK,
        &json!({"object": "list", "data": data, "has_more": false}),
    )
}

fn upload(holdings: &mut Holdings, uploaded: Option<(String, String, Bytes)>) -> Response<Body> {
    let Some((purpose, filename, content)) = uploaded else {
        return error(
            StatusCode::BAD_REQUEST,
            "A multipart form with `file` and `purpose` is required.",
            "invalid_request",
        );
    };
    let id = token("file-", 24);
    let object = json!({
        "id": id, "object": "file", "bytes": content.len(), "created_at": unix_now(),
        "filename": filename, "purpose": purpose, "status": "processed",
    });
    holdings.files.insert(
        id,
        File {
            object: object.clone(),
            content,
        },
    );
    plain_json(StatusCode::OK, &object)
}

async fn form(parts: &Parts, body: Bytes) -> Option<(String, String, Bytes)> {
    let content_type = parts.headers.get("content-type")?.to_str().ok()?;
    let boundary = multer::parse_boundary(content_type).ok()?;
    let stream = futures_util::stream::once(async move { Ok::<Bytes, std::io::Error>(body) });
    let mut multipart = multer::Multipart::new(stream, boundary);
    let (mut purpose, mut file) = (None, None);
    while let Ok(Some(field)) = multipart.next_field().await {
        let name = field.name().unwrap_or_default().to_owned();
        let filename = field.file_name().unwrap_or("input.jsonl").to_owned();
        let value = field.bytes().await.ok()?;
        match name.as_str() {
            "purpose" => purpose = Some(String::from_utf8_lossy(&value).into_owned()),
            "file" => file = Some((filename, value)),
            _ => {}
        }
    }
    let (filename, content) = file?;
    Some((purpose?, filename, content))
}

fn create(holdings: &mut Holdings, behavior: &Behavior, body: &Bytes) -> Response<Body> {
    let Ok(request) = serde_json::from_slice::<Value>(body) else {
        return error(
            StatusCode::BAD_REQUEST,
            "The body is not JSON.",
            "invalid_request",
        );
    };
    let input = request["input_file_id"].as_str().unwrap_or_default();
    let Some(file) = holdings.files.get(input) else {
        return missing("file", input);
    };
    let lines: Vec<Value> = file
        .content
        .split(|b| *b == b'\n')
        .filter_map(|line| serde_json::from_slice(line).ok())
        .collect();
    let id = token("batch_", 24);
    let now = unix_now();
    let mut object = json!({
        "id": id, "object": "batch", "endpoint": request["endpoint"], "errors": null,
        "input_file_id": input, "completion_window": request["completion_window"],
        "status": "validating", "output_file_id": null, "error_file_id": null,
        "created_at": now, "in_progress_at": null, "expires_at": now + 86_400,
        "finalizing_at": null, "completed_at": null, "failed_at": null, "expired_at": null,
        "cancelling_at": null, "cancelled_at": null,
        "request_counts": {"total": lines.len(), "completed": 0, "failed": 0},
        "metadata": request["metadata"],
    });
    let enqueued: u64 = lines.iter().map(line_tokens).sum();
    if let Some(limit) = behavior
        .enqueued_token_limit
        .filter(|&limit| enqueued > limit)
    {
        let deployment = lines
            .first()
            .and_then(|l| l["body"]["model"].as_str())
            .unwrap_or("unknown");
        object["status"] = json!("failed");
        object["failed_at"] = json!(now);
        object["errors"] = json!({"object": "list", "data": [{"code": "token_limit_exceeded", "message": format!("The number of enqueued tokens has surpassed the configured limit of {limit} for the deployment '{deployment}'. Please either increase the limit or try again once the current jobs have finished."), "line": null, "param": null}]});
    }
    let run = Duration::from_millis(behavior.batch_ms.unwrap_or(DEFAULT_RUN_MS));
    let finished = object["status"] == "failed";
    holdings.batches.insert(
        id.clone(),
        Batch {
            object: object.clone(),
            started: Instant::now(),
            run,
            lines,
            cancelled: None,
            finished,
        },
    );
    plain_json(StatusCode::OK, &object)
}

/// A line's tokens as an enqueued-token quota counts them: its prompt and its completion budget.
fn line_tokens(line: &Value) -> u64 {
    let body = &line["body"];
    let prompt = Chat::openai(body).map_or(0, |chat| chat.prompt_tokens);
    prompt + body["max_tokens"].as_u64().unwrap_or(0)
}

fn progress(batch: &Batch) -> f64 {
    let run = batch.run.as_secs_f64().max(0.001);
    (batch.started.elapsed().as_secs_f64() / run).min(1.0)
}

/// The batch object as it stands now, moving it along its states first.
fn look(shared: &Shared, holdings: &mut Holdings, id: &str) -> Option<Value> {
    let batch = holdings.batches.get_mut(id)?;
    if batch.finished {
        return Some(batch.object.clone());
    }
    let stage = advance(batch);
    if !matches!(stage, "completed" | "cancelled") {
        return Some(batch.object.clone());
    }
    batch.finished = true;
    let total = batch.lines.len();
    let done = batch.object["request_counts"]["completed"]
        .as_u64()
        .unwrap_or(0) as usize;
    let lines: Vec<Value> = batch.lines.iter().take(done).cloned().collect();
    let mut object = batch.object.clone();
    let (output, errors, failed) = run_lines(shared, &lines);
    object["request_counts"] =
        json!({"total": total, "completed": lines.len() - failed, "failed": failed});
    if !output.is_empty() {
        object["output_file_id"] = json!(keep_file(holdings, id, "batch_output", output));
    }
    if !errors.is_empty() {
        object["error_file_id"] = json!(keep_file(holdings, id, "batch_error", errors));
    }
    if let Some(batch) = holdings.batches.get_mut(id) {
        batch.object = object.clone();
    }
    Some(object)
}

/// Moves the batch to the state its clock says, stamping the times of the states it entered;
/// the state it is in now.
fn advance(batch: &mut Batch) -> &'static str {
    let now = unix_now();
    let done = progress(batch);
    let stage = match batch.cancelled {
        Some((at, _)) if at.elapsed() >= batch.run / 10 => "cancelled",
        Some(_) => "cancelling",
        None if done >= 1.0 => "completed",
        None if done >= 0.8 => "finalizing",
        None if done >= 0.1 => "in_progress",
        None => "validating",
    };
    let stamps: &[&str] = match stage {
        "in_progress" => &["in_progress_at"],
        "finalizing" => &["in_progress_at", "finalizing_at"],
        "completed" => &["in_progress_at", "finalizing_at", "completed_at"],
        "cancelling" => &["cancelling_at"],
        "cancelled" => &["cancelling_at", "cancelled_at"],
        _ => &[],
    };
    let object = &mut batch.object;
    object["status"] = json!(stage);
    for field in stamps {
        if object[*field].is_null() {
            object[*field] = json!(now);
        }
    }
    let total = batch.lines.len() as f64;
    let share = batch.cancelled.map_or(done, |(_, at)| at);
    object["request_counts"]["completed"] = json!((total * share) as u64);
    stage
}

fn keep_file(holdings: &mut Holdings, batch: &str, purpose: &str, content: Vec<u8>) -> String {
    let id = token("file-", 24);
    let object = json!({
        "id": id, "object": "file", "bytes": content.len(), "created_at": unix_now(),
        "filename": format!("{batch}_{purpose}.jsonl"), "purpose": purpose, "status": "processed",
    });
    holdings.files.insert(
        id.clone(),
        File {
            object,
            content: Bytes::from(content),
        },
    );
    id
}

/// Answers every line as the deployment it names would: the output lines, the error lines, and
/// how many failed.
fn run_lines(shared: &Shared, lines: &[Value]) -> (Vec<u8>, Vec<u8>, usize) {
    let (mut output, mut errors, mut failed) = (Vec::new(), Vec::new(), 0);
    for line in lines {
        let custom_id = &line["custom_id"];
        let model = line["body"]["model"].as_str().unwrap_or_default();
        let answer = match shared.deployment(model) {
            Some(deployment) => answer_line(shared, line, &deployment.spec.model),
            None => None,
        };
        let (target, record) = match answer {
            Some(body) => (
                &mut output,
                json!({"id": token("batch_req_", 24), "custom_id": custom_id, "response": {"status_code": 200, "request_id": token("req_", 24), "body": body}, "error": null}),
            ),
            None => {
                failed += 1;
                (
                    &mut errors,
                    json!({"id": token("batch_req_", 24), "custom_id": custom_id, "response": null, "error": {"code": "model_not_found", "message": format!("The model `{model}` does not exist here.")}}),
                )
            }
        };
        if serde_json::to_writer(&mut *target, &record).is_ok() {
            target.push(b'\n');
        }
    }
    (output, errors, failed)
}

fn answer_line(shared: &Shared, line: &Value, model: &str) -> Option<Value> {
    let body = &line["body"];
    if line["url"]
        .as_str()
        .is_some_and(|url| url.ends_with("/embeddings"))
    {
        let inputs = embeddings::inputs(body).ok()?;
        return Some(embeddings::response(&inputs, model));
    }
    let mut chat = Chat::openai(body).ok()?;
    chat.stream = false;
    let who = format!("{}/{model}", shared.spec.name);
    let reply = Reply::answer(&who, None, &chat);
    match dialect::wire(Dialect::OpenAi).chat(&chat, &reply, model) {
        Payload::Json(value) => Some(value),
        Payload::Stream(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_dialect_has_its_batch_paths() {
        assert_eq!(route(Dialect::OpenAi, "/v1/files"), Some(("files", vec![])));
        assert_eq!(
            route(Dialect::Azure, "/openai/batches/b1/cancel"),
            Some(("batches", vec!["b1", "cancel"]))
        );
        assert_eq!(
            route(Dialect::Azure, "/openai/v1/files/f1"),
            Some(("files", vec!["f1"]))
        );
        assert_eq!(route(Dialect::OpenAi, "/v1/chat/completions"), None);
        assert_eq!(route(Dialect::Anthropic, "/v1/files"), None);
    }
}
