//! The Azure OpenAI wire format: deployment URLs, its own error envelope next to OpenAI's,
//! APIM headers, and content-filter annotations on bodies and stream chunks.

use hyper::{HeaderMap, Method, StatusCode};
use serde_json::{json, Value};

use crate::dialect::{self, Ctx, Op, Payload, Reject, Route, Wire};
use crate::ident;
use crate::openai;
use crate::quota::{Kind, Snapshot};
use crate::reply::Reply;
use crate::request::Chat;
use crate::response::put;

pub struct Azure;

impl Wire for Azure {
    fn route(&self, method: &Method, path: &str, query: Option<&str>) -> Result<Route, Reject> {
        if method != Method::POST {
            return Err(Reject::NoRoute);
        }
        if let Some(rest) = path.strip_prefix("/openai/v1/") {
            // The v1 surface takes the deployment from the body and needs no dated api-version.
            let op = match rest {
                "responses" => Op::Responses,
                other => operation(other)?,
            };
            return Ok(Route {
                op,
                deployment: None,
                api_version: Some("v1".to_owned()),
            });
        }
        let rest = path
            .strip_prefix("/openai/deployments/")
            .ok_or(Reject::NoRoute)?;
        let (deployment, op) = rest.split_once('/').ok_or(Reject::NoRoute)?;
        let api_version = query
            .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("api-version=")))
            .filter(|v| !v.is_empty())
            .ok_or(Reject::NoRoute)?;
        Ok(Route {
            op: operation(op)?,
            deployment: Some(deployment.to_owned()),
            api_version: Some(api_version.to_owned()),
        })
    }

    fn check_headers(&self, headers: &HeaderMap, key: Option<&str>) -> Result<(), Reject> {
        let api_key = headers.get("api-key").and_then(|v| v.to_str().ok());
        dialect::check_key(key, api_key.or_else(|| dialect::bearer(headers)))
    }

    fn parse_chat(&self, body: &Value) -> Result<Chat, Reject> {
        let chat = Chat::openai(body)?;
        if chat.flagged {
            return Err(Reject::ContentFilter);
        }
        Ok(chat)
    }

    fn request_id(&self) -> String {
        ident::uuid()
    }

    fn reject(&self, reject: &Reject, ctx: &Ctx) -> (StatusCode, Value) {
        match reject {
            Reject::NoRoute => azure_error(StatusCode::NOT_FOUND, "404", "Resource not found"),
            Reject::Unauthorized(_) => unauthorized(),
            Reject::TokenRefused { audience, .. } => azure_error(
                StatusCode::UNAUTHORIZED,
                "401",
                &format!("Access token is missing, invalid, audience is incorrect ({audience}), or have expired."),
            ),
            Reject::UnknownDeployment(_) => deployment_not_found(),
            Reject::Missing(field) => openai::missing(field),
            Reject::Invalid(message) => (
                StatusCode::BAD_REQUEST,
                openai::envelope(message, Some("invalid_request_error"), None, None),
            ),
            Reject::ContentFilter => content_filtered(),
            Reject::ContextTooLong { limit, tokens } => openai::context_too_long(*limit, *tokens),
            Reject::RateLimited {
                throttle,
                retry_after_s,
            } => {
                let kind = throttle.as_ref().map_or(Kind::Tokens, |t| t.kind);
                rate_limited(ctx, kind, *retry_after_s)
            }
            Reject::Status(status) => injected(*status, ctx),
            Reject::UnknownResponse(id) => openai::unknown_response(id),
        }
    }

    fn decorate(&self, h: &mut HeaderMap, ctx: &Ctx, quota: Option<&Snapshot>, retry: Option<u64>) {
        put(h, "apim-request-id", &ctx.request_id);
        put(h, "x-request-id", ident::uuid());
        put(h, "x-ms-region", &ctx.region);
        match &ctx.client_request_id {
            Some(echo) => {
                h.insert("x-ms-client-request-id", echo.clone());
            }
            None => put(h, "x-ms-client-request-id", &ctx.request_id),
        }
        // Azure only ever reported the remaining counts; unlimited deployments report nothing.
        if let Some(remaining) = quota.and_then(|q| q.remaining_requests) {
            put(h, "x-ratelimit-remaining-requests", remaining);
        }
        if let Some(remaining) = quota.and_then(|q| q.remaining_tokens) {
            put(h, "x-ratelimit-remaining-tokens", remaining);
        }
        if let Some(s) = retry {
            put(h, "retry-after", s);
            put(h, "retry-after-ms", s * 1000);
        }
    }

    fn chat(&self, chat: &Chat, reply: &Reply, model: &str) -> Payload {
        if chat.stream {
            Payload::Stream(annotated_chunks(chat, reply, model).script())
        } else {
            let mut body = openai::completion(chat, reply, model);
            body["prompt_filter_results"] = prompt_filter_results();
            annotate(&mut body, output_filter_results());
            Payload::Json(body)
        }
    }
}

fn operation(tail: &str) -> Result<Op, Reject> {
    match tail {
        "chat/completions" => Ok(Op::Chat),
        "embeddings" => Ok(Op::Embeddings),
        _ => Err(Reject::NoRoute),
    }
}

/// Azure's own envelope, where `code` is a string even when it is a status.
fn azure_error(status: StatusCode, code: &str, message: &str) -> (StatusCode, Value) {
    (status, json!({"error": {"code": code, "message": message}}))
}

fn unauthorized() -> (StatusCode, Value) {
    azure_error(
        StatusCode::UNAUTHORIZED,
        "401",
        "Access denied due to invalid subscription key or wrong API endpoint. Make sure to provide a valid key for an active subscription and use a correct regional API endpoint for your resource.",
    )
}

fn deployment_not_found() -> (StatusCode, Value) {
    azure_error(
        StatusCode::NOT_FOUND,
        "DeploymentNotFound",
        "The API deployment for this resource does not exist. If you created the deployment within the last 5 minutes, please wait a moment and try again.",
    )
}

fn rate_limited(ctx: &Ctx, kind: Kind, retry_after_s: u64) -> (StatusCode, Value) {
    let operation = match ctx.op {
        Some(Op::Embeddings) => "Embeddings_Create",
        _ => "ChatCompletions_Create",
    };
    let limit = match kind {
        Kind::Requests => "call rate limit",
        Kind::Tokens => "token rate limit",
    };
    let version = ctx.api_version.as_deref().unwrap_or("v1");
    let message = format!(
        "Requests to the {operation} Operation under Azure OpenAI API version {version} have exceeded {limit} of your current OpenAI S0 pricing tier. Please retry after {retry_after_s} seconds. Please go here: https://aka.ms/oai/quotaincrease if you would like to further increase the default rate limit."
    );
    azure_error(StatusCode::TOO_MANY_REQUESTS, "429", &message)
}

fn content_filtered() -> (StatusCode, Value) {
    let body = json!({"error": {
        "message": "The response was filtered due to the prompt triggering Azure OpenAI's content management policy. Please modify your prompt and retry. To learn more about our content filtering policies please read our documentation: https://go.microsoft.com/fwlink/?linkid=2198766",
        "type": null,
        "param": "prompt",
        "code": "content_filter",
        "status": 400,
        "innererror": {
            "code": "ResponsibleAIPolicyViolation",
            "content_filter_result": {
                "hate": {"filtered": false, "severity": "safe"},
                "jailbreak": {"filtered": false, "detected": false},
                "self_harm": {"filtered": false, "severity": "safe"},
                "sexual": {"filtered": false, "severity": "safe"},
                "violence": {"filtered": true, "severity": "high"}
            }
        }
    }});
    (StatusCode::BAD_REQUEST, body)
}

fn injected(status: u16, ctx: &Ctx) -> (StatusCode, Value) {
    let code = dialect::status_code(status);
    match code.as_u16() {
        400 => content_filtered(),
        401 => unauthorized(),
        404 => deployment_not_found(),
        500 => (code, server_error(&ctx.request_id)),
        503 => (
            code,
            openai::envelope(
                "The service is temporarily unable to process your request. Please try again later.",
                Some("server_error"),
                None,
                None,
            ),
        ),
        n => azure_error(code, &n.to_string(), dialect::reason(code)),
    }
}

/// Azure's 5xx comes from the model layer, so it is in the OpenAI envelope.
fn server_error(request_id: &str) -> Value {
    let message = format!(
        "The server had an error while processing your request. Sorry about that! You can retry your request, or contact us through an Azure support request at: https://go.microsoft.com/fwlink/?linkid=2213926 if the error persists. (Please include the request ID {request_id} in your message.)"
    );
    openai::envelope(&message, Some("server_error"), None, None)
}

fn prompt_filter_results() -> Value {
    json!([{"prompt_index": 0, "content_filter_results": {
        "hate": {"filtered": false, "severity": "safe"},
        "jailbreak": {"filtered": false, "detected": false},
        "self_harm": {"filtered": false, "severity": "safe"},
        "sexual": {"filtered": false, "severity": "safe"},
        "violence": {"filtered": false, "severity": "safe"}
    }}])
}

fn output_filter_results() -> Value {
    json!({
        "hate": {"filtered": false, "severity": "safe"},
        "protected_material_code": {"filtered": false, "detected": false},
        "protected_material_text": {"filtered": false, "detected": false},
        "self_harm": {"filtered": false, "severity": "safe"},
        "sexual": {"filtered": false, "severity": "safe"},
        "violence": {"filtered": false, "severity": "safe"}
    })
}

/// Adds `content_filter_results` to every choice of a body or chunk.
fn annotate(value: &mut Value, results: Value) {
    if let Some(choices) = value.get_mut("choices").and_then(Value::as_array_mut) {
        for choice in choices {
            choice["content_filter_results"] = results.clone();
        }
    }
}

/// OpenAI's chunks, led by the filter-only chunk (empty choices, blank id) that Azure sends
/// first, with filter results on content chunks and empty ones on the role and finish chunks.
fn annotated_chunks(chat: &Chat, reply: &Reply, model: &str) -> openai::Chunks {
    let mut chunks = openai::chunks(chat, reply, model);
    for chunk in chunks.preamble.iter_mut().chain(chunks.tail.iter_mut()) {
        annotate(chunk, json!({}));
    }
    for chunk in &mut chunks.content {
        annotate(chunk, output_filter_results());
    }
    let filter_only = json!({
        "id": "", "choices": [], "created": 0, "model": "", "object": "",
        "system_fingerprint": null, "prompt_filter_results": prompt_filter_results(),
    });
    chunks.preamble.insert(0, filter_only);
    chunks
}
