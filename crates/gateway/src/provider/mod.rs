//! Provider adapters: each turns a client request for one target into that provider's wire
//! request, and its answer, error body or event stream back into the gateway's OpenAI shape.
//! Dialects live here and nowhere else. Where the client speaks the backend's dialect there is
//! nothing to translate: an OpenAI or Azure body goes out with its `model` set, an Anthropic
//! client's Messages body ([`crate::messages::Native`]) likewise, and their answers come back as
//! the upstream wrote them, their usage read on the way.

pub mod anthropic;
mod azure;
mod openai;
pub mod openai_shaped;
pub mod responses;

use bytes::Bytes;
use http::header::HeaderName;
use http::{HeaderMap, HeaderValue, Uri};
use onedoor_config::{Backend, Provider, Snapshot};
use serde_json::Value;

use crate::affinity::ResponsePin;
use crate::request::{ClientRequest, Operation};
use crate::stream::EventKind;
use crate::upstream::Failure;
use crate::usage::{estimate_tokens, Usage};

/// A request ready for the upstream client.
pub struct WireRequest {
    pub uri: Uri,
    pub headers: HeaderMap,
    pub body: Bytes,
}

/// Why a target cannot be sent a request at all.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Unsendable {
    #[error("the backend URL does not form a valid request URL")]
    BadUrl,
    /// The request cannot be said in the provider's dialect; the caller gets a 400.
    #[error("{0}")]
    Invalid(String),
}

/// Turns one provider's stream events into the events the relay classifies and sends: OpenAI
/// chat chunks for chat streams (whatever the upstream spoke), Responses events as they came.
pub trait EventTranslator: Send {
    /// The events to relay for one upstream event (none, one or several), each with its kind.
    fn translate(&mut self, event: Bytes, out: &mut Vec<(EventKind, Bytes)>);
    /// The events that end a stream the upstream closed cleanly after its finish but without
    /// its own terminal event.
    fn finish(&mut self, out: &mut Vec<(EventKind, Bytes)>);
    /// The event that tells the caller the stream failed after content reached it.
    fn failure_event(&self, message: &str) -> Bytes;
    /// The stream's usage so far: measured when the upstream reported it, else estimated.
    fn usage(&self) -> Usage;
    /// The answer's id and latest finish reason, as far as the stream told them (for traces).
    fn answer_so_far(&self) -> StreamAnswer<'_> {
        StreamAnswer::default()
    }
    /// Whether the events are the upstream's own, in the client's dialect (an Anthropic
    /// client's Anthropic stream): they go to the caller as they came, never re-encoded.
    fn passes_through(&self) -> bool {
        false
    }
}

/// What a stream said about its answer: the id it gave the answer and its latest finish reason
/// (OpenAI's words: `stop`, `length`, `tool_calls` ...).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamAnswer<'a> {
    pub id: Option<&'a str>,
    pub finish_reason: Option<&'a str>,
}

/// One header: its name and its value.
pub type Header = (HeaderName, HeaderValue);

/// The header that carries an Anthropic backend's API version.
pub const ANTHROPIC_VERSION: HeaderName = HeaderName::from_static("anthropic-version");
/// The header with which an Anthropic client asks for beta features; passed on to Anthropic
/// backends with its request.
pub const ANTHROPIC_BETA: HeaderName = HeaderName::from_static("anthropic-beta");

/// The headers every request to `backend` carries, made once per snapshot so a request parses
/// none of them: its credential (marked sensitive, so it is never printed) and, on Anthropic, its
/// API version.
pub fn stamp(backend: &Backend) -> Vec<Header> {
    let version = (backend.provider == Provider::Anthropic)
        .then(|| HeaderValue::from_str(&backend.anthropic_version).ok())
        .flatten()
        .map(|version| (ANTHROPIC_VERSION, version));
    credential(backend).into_iter().chain(version).collect()
}

/// The backend's credential as a header.
fn credential(backend: &Backend) -> Option<Header> {
    const API_KEY: HeaderName = HeaderName::from_static("api-key");
    const X_API_KEY: HeaderName = HeaderName::from_static("x-api-key");
    let key = backend.api_key.as_ref()?;
    let (name, value) = match backend.provider {
        Provider::Azure => (API_KEY, key.expose().to_owned()),
        Provider::Anthropic => (X_API_KEY, key.expose().to_owned()),
        Provider::OpenAi => (
            http::header::AUTHORIZATION,
            format!("Bearer {}", key.expose()),
        ),
    };
    let mut value = HeaderValue::from_str(&value).ok()?;
    value.set_sensitive(true);
    Some((name, value))
}

/// Whether targets on this backend can take `operation`: Anthropic serves chat only.
pub fn supports(backend: &Backend, operation: Operation) -> bool {
    match backend.provider {
        Provider::Anthropic => operation == Operation::ChatCompletions,
        Provider::Azure | Provider::OpenAi => true,
    }
}

/// Whether a complete stream from this backend always carries its usage (Azure with the
/// `include_usage` the gateway asks for, Anthropic always); OpenAI-compatible servers may not.
pub fn reports_stream_usage(backend: &Backend) -> bool {
    matches!(backend.provider, Provider::Azure | Provider::Anthropic)
}

/// The [`uri`] of every configured target for every operation, made once per config, so a
/// request to a configured deployment clones its URL instead of formatting and parsing it.
pub struct Uris {
    /// Per backend (same index as `snapshot.backends`): deployment, operation, URL.
    known: Vec<Vec<(String, Operation, Uri)>>,
}

impl Uris {
    pub fn new(snapshot: &Snapshot) -> Uris {
        let mut known: Vec<Vec<(String, Operation, Uri)>> =
            snapshot.backends.iter().map(|_| Vec::new()).collect();
        let targets = snapshot.aliases.iter().flat_map(|alias| &alias.targets);
        for target in targets {
            let (Some(backend), Some(deployment), Some(slot)) = (
                snapshot.backends.get(target.backend),
                target.deployment.as_deref(),
                known.get_mut(target.backend),
            ) else {
                continue;
            };
            if slot.iter().any(|(known, ..)| known == deployment) {
                continue;
            }
            for operation in Operation::ALL {
                if let Ok(uri) = uri(backend, deployment, operation) {
                    slot.push((deployment.to_owned(), operation, uri));
                }
            }
        }
        Uris { known }
    }

    /// The URL made for `deployment` and `operation` on `backend`, if it is a configured one.
    pub fn get(&self, backend: usize, deployment: &str, operation: Operation) -> Option<Uri> {
        self.known
            .get(backend)?
            .iter()
            .find(|(known, op, _)| *op == operation && known == deployment)
            .map(|(.., uri)| uri.clone())
    }
}

/// Where a request for `deployment` and `operation` goes on `backend`.
pub fn uri(backend: &Backend, deployment: &str, operation: Operation) -> Result<Uri, Unsendable> {
    let url = match backend.provider {
        Provider::Azure => azure::url(backend, deployment, operation),
        Provider::OpenAi => openai::url(backend, operation),
        Provider::Anthropic => anthropic::url(backend),
    };
    url.parse().map_err(|_| Unsendable::BadUrl)
}

/// The request `backend` gets for `request`, sent to `deployment` (its model name on OpenAI and
/// Anthropic backends), with the backend's [`stamp`]; `known` is its [`uri`] when the caller has
/// it made already.
pub fn build(
    backend: &Backend,
    stamp: &[Header],
    deployment: &str,
    operation: Operation,
    request: &ClientRequest,
    known: Option<Uri>,
) -> Result<WireRequest, Unsendable> {
    let native = request.native.as_deref();
    if let Some(why) = native.and_then(|n| n.untranslatable.as_deref()) {
        if backend.provider != Provider::Anthropic {
            return Err(Unsendable::Invalid(why.to_owned()));
        }
    }
    let body = match (backend.provider, native) {
        (Provider::Azure, _) => azure::body(deployment, operation, request),
        (Provider::OpenAi, _) => openai_body(request, Some(deployment), operation),
        (Provider::Anthropic, Some(native)) => with_model(&native.body, deployment),
        (Provider::Anthropic, None) => anthropic::body(deployment, request)?,
    };
    let uri = match known {
        Some(uri) => uri,
        None => uri(backend, deployment, operation)?,
    };
    let mut headers = HeaderMap::with_capacity(4);
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if request.stream {
        headers.insert(
            http::header::ACCEPT,
            HeaderValue::from_static("text/event-stream"),
        );
    }
    for (name, value) in stamp {
        headers.insert(name.clone(), value.clone());
    }
    if let (Provider::Anthropic, Some(beta)) =
        (backend.provider, native.and_then(|n| n.beta.as_ref()))
    {
        headers.insert(ANTHROPIC_BETA, beta.clone());
    }
    Ok(WireRequest { uri, headers, body })
}

/// Whether the answer to `request` from `backend` is in the client's own dialect as the
/// upstream wrote it: an Anthropic client's, from an Anthropic backend. (OpenAI-shaped answers
/// are in the dialect of every client that is not Anthropic's.)
pub fn passes_through(backend: &Backend, request: &ClientRequest) -> bool {
    backend.provider == Provider::Anthropic && request.native.is_some()
}

/// The body with `model` in it: the body as it came when it names that model already.
fn with_model(request: &ClientRequest, model: &str) -> Bytes {
    match request.model.as_deref() == Some(model) {
        true => request.raw().clone(),
        false => request.with_model(model),
    }
}

/// The body an OpenAI-shaped backend gets: `model` replaced when given and different, and on a
/// chat stream `stream_options.include_usage` asked for, so the usage is measured; the client's
/// body as it came when neither applies.
pub fn openai_body(request: &ClientRequest, model: Option<&str>, operation: Operation) -> Bytes {
    let model = model.filter(|m| request.model.as_deref() != Some(*m));
    let ask_usage =
        operation == Operation::ChatCompletions && request.stream && !request.include_usage;
    match (model, ask_usage) {
        (None, false) => request.raw().clone(),
        (Some(model), false) => request.with_model(model),
        (model, true) => {
            let mut changes = vec![("stream_options", request.stream_options_with_usage())];
            changes.extend(model.map(|m| ("model", Value::from(m).to_string())));
            request.with_fields(&changes)
        }
    }
}

/// A successful whole answer in the OpenAI shape, with its usage (estimated when the upstream
/// reported none).
pub fn answer(
    backend: &Backend,
    operation: Operation,
    request: &ClientRequest,
    body: Bytes,
    created: u64,
) -> (Bytes, Usage) {
    let (body, usage, chars) = match (backend.provider, operation) {
        (Provider::Anthropic, _) if passes_through(backend, request) => {
            let (usage, chars) = anthropic::read_answer(&body);
            (body, usage, chars)
        }
        (Provider::Anthropic, _) => {
            let (body, usage) = anthropic::answer(body, created);
            let chars = answer_chars(&body, operation);
            (body, usage, chars)
        }
        (_, Operation::ChatCompletions) => openai_shaped::completion(body),
        _ => {
            let usage = Usage::of_body(&body);
            let chars = answer_chars(&body, operation);
            (body, usage, chars)
        }
    };
    let usage = usage
        .unwrap_or_else(|| Usage::estimated(request.prompt_estimate(), estimate_tokens(chars)));
    (body, usage)
}

fn answer_chars(body: &[u8], operation: Operation) -> usize {
    let Ok(value) = serde_json::from_slice::<Value>(body) else {
        return 0;
    };
    match operation {
        Operation::Responses => responses::output_chars(&value),
        Operation::ChatCompletions => value["choices"][0]["message"]["content"]
            .as_str()
            .map_or(0, |t| t.chars().count()),
        Operation::Embeddings => 0,
    }
}

/// A failed attempt with its error body in the OpenAI envelope (Anthropic errors translated),
/// so routing and the caller read one shape.
pub fn failure(backend: &Backend, failure: Failure) -> Failure {
    match (backend.provider, failure) {
        (
            Provider::Anthropic,
            Failure::Status {
                status,
                headers,
                body,
            },
        ) => {
            let body = anthropic::error_body(&body).unwrap_or(body);
            Failure::Status {
                status,
                headers,
                body,
            }
        }
        (_, failure) => failure,
    }
}

/// The request could not be translated: a 400 in the OpenAI envelope, as if the upstream had
/// refused it, so it is returned to the caller and never retried elsewhere.
pub fn refusal(message: &str) -> Failure {
    let body = serde_json::json!({"error": {"message": message, "type": "invalid_request_error", "param": null, "code": "unsupported_by_backend"}});
    let mut headers = HeaderMap::new();
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Failure::Status {
        status: http::StatusCode::BAD_REQUEST,
        headers,
        body: Bytes::from(body.to_string()),
    }
}

/// The translator for a stream from this backend.
pub fn events(
    backend: &Backend,
    operation: Operation,
    request: &ClientRequest,
    created: u64,
    pin: Option<ResponsePin>,
) -> Box<dyn EventTranslator> {
    let prompt = request.prompt_estimate();
    match (backend.provider, operation) {
        (_, Operation::Responses) => Box::new(responses::ResponsesEvents::new(prompt, pin)),
        (Provider::Anthropic, _) if passes_through(backend, request) => {
            Box::new(anthropic::PassedEvents::new(prompt))
        }
        (Provider::Anthropic, _) => Box::new(anthropic::AnthropicEvents::new(
            request.include_usage,
            prompt,
            created,
        )),
        _ => Box::new(openai_shaped::ChatEvents::new(
            request.include_usage,
            prompt,
        )),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn snapshot() -> Snapshot {
        let yaml = "backends:
  - { name: se, provider: azure, url: 'https://se.example.com', region: se, api_key: k, api_version: 2024-10-21 }
  - { name: local, provider: openai, url: 'http://127.0.0.1:8000/v1', region: se, api_key: k }
  - { name: claude, provider: anthropic, url: 'https://api.anthropic.com', region: us, api_key: k }
models:
  - name: chat
    targets:
      - { backend: se, deployment: gpt-4o }
      - { backend: local, model: llama }
      - { backend: claude, model: claude-sonnet }
";
        onedoor_config::parse(yaml, std::path::Path::new("t.yaml"), &|_| None).unwrap()
    }

    #[test]
    fn a_configured_target_gets_the_url_it_would_have_been_given() {
        let snapshot = snapshot();
        let uris = Uris::new(&snapshot);
        let targets = [(0, "gpt-4o"), (1, "llama"), (2, "claude-sonnet")];
        for (backend, deployment) in targets {
            for operation in Operation::ALL {
                let made = uri(&snapshot.backends[backend], deployment, operation).unwrap();
                assert_eq!(uris.get(backend, deployment, operation), Some(made));
            }
        }
        assert_eq!(
            uris.get(0, "gpt-4o", Operation::ChatCompletions)
                .unwrap()
                .to_string(),
            "https://se.example.com/openai/deployments/gpt-4o/chat/completions?api-version=2024-10-21"
        );
    }

    #[test]
    fn a_deployment_no_target_names_is_made_on_demand() {
        let uris = Uris::new(&snapshot());
        assert_eq!(uris.get(0, "gpt-4o-mini", Operation::ChatCompletions), None);
        assert_eq!(uris.get(1, "gpt-4o", Operation::ChatCompletions), None);
        assert_eq!(uris.get(9, "gpt-4o", Operation::ChatCompletions), None);
    }

    #[test]
    fn each_provider_stamps_its_own_credential_and_anthropic_its_version() {
        let snapshot = snapshot();
        let stamps: Vec<Vec<(String, String)>> = snapshot
            .backends
            .iter()
            .map(|backend| {
                let stamp = stamp(backend);
                assert!(stamp.first().is_some_and(|(_, key)| key.is_sensitive()));
                stamp
                    .iter()
                    .map(|(n, v)| (n.to_string(), v.to_str().unwrap().to_owned()))
                    .collect()
            })
            .collect();
        let pair = |n: &str, v: &str| (n.to_owned(), v.to_owned());
        assert_eq!(stamps[0], [pair("api-key", "k")]);
        assert_eq!(stamps[1], [pair("authorization", "Bearer k")]);
        assert_eq!(
            stamps[2],
            [
                pair("x-api-key", "k"),
                pair("anthropic-version", "2023-06-01")
            ]
        );
    }

    #[test]
    fn a_built_request_carries_the_stamp_once() {
        let snapshot = snapshot();
        let claude = &snapshot.backends[2];
        let body =
            Bytes::from_static(br#"{"model":"chat","messages":[{"role":"user","content":"hi"}]}"#);
        let request = ClientRequest::parse(body, Operation::ChatCompletions).unwrap();
        let stamp = stamp(claude);
        let wire = build(
            claude,
            &stamp,
            "claude-sonnet",
            Operation::ChatCompletions,
            &request,
            None,
        )
        .unwrap();
        assert_eq!(wire.headers.get_all("x-api-key").iter().count(), 1);
        assert_eq!(wire.headers["anthropic-version"], "2023-06-01");
        assert_eq!(wire.headers["content-type"], "application/json");
    }
}
