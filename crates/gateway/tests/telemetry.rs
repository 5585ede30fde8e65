//! OpenTelemetry traces over OTLP/HTTP through real HTTP: an in-process collector on port 0
//! decodes what the gateway exports. A request that failed over twice is one SERVER span with
//! three CLIENT attempt spans inside it; a stream's span ends with the stream and carries its
//! measured usage, id and finish reason; a continued cut stream has a span per continuation
//! attempt; a realtime session is one span for the whole session; a caller's `traceparent` is
//! joined; without `telemetry.otlp` nothing is sent.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use common::*;
use http::{Method, Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::status::StatusCode;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use tokio::net::TcpListener;

const COLLECTOR_TOKEN: &str = "Bearer collector-token";

/// An OTLP/HTTP receiver: every span it was sent, with the `service.name` it came under and the
/// headers of the export that carried it.
#[derive(Clone, Default)]
struct Collector {
    received: Arc<Mutex<Vec<Received>>>,
}

#[derive(Clone)]
struct Received {
    span: Span,
    service: String,
    path: String,
    authorization: String,
}

impl Collector {
    async fn start() -> (Collector, SocketAddr) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let collector = Collector::default();
        let serving = collector.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let collector = serving.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |request| {
                        let collector = collector.clone();
                        async move { Ok::<_, Infallible>(collector.take(request).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        (collector, addr)
    }

    async fn take(&self, request: Request<Incoming>) -> Response<Full<Bytes>> {
        let path = request.uri().path().to_owned();
        let authorization = request
            .headers()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        let body = request.into_body().collect().await.unwrap().to_bytes();
        let export = ExportTraceServiceRequest::decode(body).expect("an OTLP protobuf export");
        let mut received = self.received.lock().unwrap();
        for resource in export.resource_spans {
            let service = resource
                .resource
                .iter()
                .flat_map(|r| r.attributes.iter())
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| kv.value.as_ref()?.value.clone());
            let service = match service {
                Some(Value::StringValue(name)) => name,
                _ => String::new(),
            };
            for scope in resource.scope_spans {
                for span in scope.spans {
                    received.push(Received {
                        span,
                        service: service.clone(),
                        path: path.clone(),
                        authorization: authorization.clone(),
                    });
                }
            }
        }
        Response::new(Full::new(Bytes::new()))
    }

    fn all(&self) -> Vec<Received> {
        self.received.lock().unwrap().clone()
    }

    /// The spans of request `id`, once `n` of them have arrived (within 5 s).
    async fn spans_of(&self, id: &str, n: usize) -> Vec<Span> {
        let of = |all: Vec<Received>| -> Vec<Span> {
            all.into_iter()
                .map(|r| r.span)
                .filter(|s| text(s, "onedoor.request_id") == id)
                .collect()
        };
        let arrived = eventually(|| of(self.all()).len() >= n).await;
        let spans = of(self.all());
        assert!(arrived, "{} of {n} spans of {id} arrived", spans.len());
        assert_eq!(spans.len(), n, "{spans:#?}");
        spans
    }
}

fn attribute(span: &Span, key: &str) -> Option<Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref()?.value.clone())
}

fn text(span: &Span, key: &str) -> String {
    match attribute(span, key) {
        Some(Value::StringValue(s)) => s,
        other => format!("<{key}: {other:?}>"),
    }
}

fn int(span: &Span, key: &str) -> i64 {
    match attribute(span, key) {
        Some(Value::IntValue(n)) => n,
        other => panic!("{key} is {other:?} in {span:#?}"),
    }
}

fn flag(span: &Span, key: &str) -> bool {
    match attribute(span, key) {
        Some(Value::BoolValue(b)) => b,
        other => panic!("{key} is {other:?} in {span:#?}"),
    }
}

fn status(span: &Span) -> (i32, String) {
    let status = span.status.clone().unwrap_or_default();
    (status.code, status.message)
}

fn is_error(span: &Span) -> bool {
    status(span).0 == StatusCode::Error as i32
}

/// The request span and its attempt spans in the order they started.
fn split(mut spans: Vec<Span>) -> (Span, Vec<Span>) {
    let server = spans
        .iter()
        .position(|s| s.kind == SpanKind::Server as i32)
        .expect("a SERVER span");
    let request = spans.remove(server);
    spans.sort_by_key(|s| s.start_time_unix_nano);
    assert!(spans.iter().all(|s| s.kind == SpanKind::Client as i32));
    (request, spans)
}

fn telemetry(collector: SocketAddr, extra: &str) -> String {
    format!(
        "telemetry:\n  otlp:\n    endpoint: http://{collector}\n    service_name: onedoor-test\n    export_interval: 20ms\n    headers: {{ Authorization: \"{COLLECTOR_TOKEN}\" }}\n{extra}"
    )
}

fn config(telemetry: &str) -> String {
    format!(
        "routing: {{ same_target_retries: 0 }}\nbackends:\n  - {{ name: first, provider: azure, region: swedencentral, url: \"{{url:first}}\" }}\n  - {{ name: second, provider: azure, region: francecentral, url: \"{{url:second}}\" }}\n  - {{ name: third, provider: azure, region: norwayeast, url: \"{{url:third}}\" }}\nmodels:\n  - name: chat\n    targets:\n      - {{ backend: first, deployment: gpt-4o, priority: 1 }}\n      - {{ backend: second, deployment: gpt-4o, priority: 2 }}\n      - {{ backend: third, deployment: gpt-4o, priority: 3 }}\n{telemetry}"
    )
}

fn fleet(first: Behavior, second: Behavior, third: Behavior) -> Vec<EndpointSpec> {
    let azure = |name: &str, region: &str, behavior: Behavior| {
        EndpointSpec::azure(name, region)
            .deployment(DeploymentSpec::new("gpt-4o"))
            .behavior(behavior)
    };
    vec![
        azure("first", "swedencentral", first),
        azure("second", "francecentral", second),
        azure("third", "norwayeast", third),
    ]
}

fn failing(status: u16) -> Behavior {
    Behavior {
        status: Some(status),
        ..Behavior::default()
    }
}

fn healthy() -> Vec<EndpointSpec> {
    fleet(
        Behavior::default(),
        Behavior::default(),
        Behavior::default(),
    )
}

async fn chat_with(h: &Harness, body: serde_json::Value, headers: &[(&str, &str)]) -> Answer {
    let auth = format!("Bearer {KEY}");
    let mut all = vec![("authorization", auth.as_str())];
    all.extend_from_slice(headers);
    h.send(
        Method::POST,
        h.url("/v1/chat/completions"),
        &all,
        Bytes::from(body.to_string()),
    )
    .await
}

fn port_of(url: &str) -> i64 {
    url.rsplit(':')
        .next()
        .unwrap()
        .trim_end_matches('/')
        .parse()
        .unwrap()
}

#[tokio::test]
async fn a_request_that_failed_over_twice_is_one_request_span_with_three_attempt_spans_inside_it() {
    let (collector, addr) = Collector::start().await;
    let h = Harness::start(
        fleet(failing(429), failing(503), Behavior::default()),
        &config(&telemetry(addr, "")),
    )
    .await;
    let mut body = chat_body("chat", false);
    body["max_tokens"] = 50.into();
    body["temperature"] = 0.25.into();
    let answer = chat_with(&h, body, &[]).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.attempts(), "first=429,second=503,third=200");
    let id = answer.header("x-onedoor-request-id").to_owned();

    let (request, attempts) = split(collector.spans_of(&id, 4).await);
    assert_eq!(request.name, "chat chat");
    assert!(
        request.parent_span_id.is_empty(),
        "a root span: {request:#?}"
    );
    assert_eq!(text(&request, "gen_ai.operation.name"), "chat");
    assert_eq!(text(&request, "gen_ai.request.model"), "chat");
    assert_eq!(text(&request, "gen_ai.provider.name"), "azure.ai.openai");
    assert_eq!(text(&request, "gen_ai.response.model"), "gpt-4o");
    assert!(text(&request, "gen_ai.response.id").starts_with("chatcmpl"));
    assert_eq!(int(&request, "gen_ai.request.max_tokens"), 50);
    assert_eq!(
        attribute(&request, "gen_ai.request.temperature"),
        Some(Value::DoubleValue(0.25))
    );
    let finish = answer.json()["choices"][0]["finish_reason"].clone();
    match attribute(&request, "gen_ai.response.finish_reasons") {
        Some(Value::ArrayValue(reasons)) => {
            assert_eq!(reasons.values.len(), 1);
            let reason = reasons.values[0].value.clone();
            assert_eq!(
                reason,
                Some(Value::StringValue(finish.as_str().unwrap().into()))
            );
        }
        other => panic!("finish reasons: {other:?}"),
    }
    let usage = &answer.json()["usage"];
    assert_eq!(
        int(&request, "gen_ai.usage.input_tokens"),
        usage["prompt_tokens"].as_i64().unwrap()
    );
    assert_eq!(
        int(&request, "gen_ai.usage.output_tokens"),
        usage["completion_tokens"].as_i64().unwrap()
    );
    assert_eq!(int(&request, "http.response.status_code"), 200);
    assert_eq!(text(&request, "onedoor.tenant"), "team");
    assert_eq!(text(&request, "onedoor.key_id"), "team-key");
    assert_eq!(text(&request, "onedoor.alias"), "chat");
    assert_eq!(text(&request, "onedoor.backend"), "third");
    assert_eq!(text(&request, "onedoor.region"), "norwayeast");
    assert_eq!(
        text(&request, "onedoor.attempts"),
        "first=429,second=503,third=200"
    );
    assert_eq!(text(&request, "onedoor.usage.source"), "measured");
    assert!(!flag(&request, "onedoor.stream"));
    assert!(matches!(
        attribute(&request, "onedoor.cost_usd"),
        Some(Value::DoubleValue(_))
    ));
    assert!(!is_error(&request));

    assert_eq!(attempts.len(), 3);
    let backends: Vec<String> = attempts
        .iter()
        .map(|a| text(a, "onedoor.backend"))
        .collect();
    assert_eq!(backends, ["first", "second", "third"]);
    for (attempt, endpoint) in attempts.iter().zip(["first", "second", "third"]) {
        assert_eq!(attempt.trace_id, request.trace_id);
        assert_eq!(attempt.parent_span_id, request.span_id);
        assert_eq!(attempt.name, "chat gpt-4o");
        assert_eq!(text(attempt, "gen_ai.request.model"), "gpt-4o");
        assert_eq!(text(attempt, "gen_ai.provider.name"), "azure.ai.openai");
        assert_eq!(text(attempt, "server.address"), "127.0.0.1");
        assert_eq!(
            int(attempt, "server.port"),
            port_of(&h.endpoint(endpoint).url())
        );
        assert!(attempt.start_time_unix_nano >= request.start_time_unix_nano);
        assert!(attempt.end_time_unix_nano <= request.end_time_unix_nano);
        assert!(attempt.start_time_unix_nano <= attempt.end_time_unix_nano);
    }
    assert!(attempts
        .windows(2)
        .all(|w| w[0].end_time_unix_nano <= w[1].start_time_unix_nano));
    assert_eq!(
        status(&attempts[0]),
        (StatusCode::Error as i32, "429 rate_limited".into())
    );
    assert_eq!(int(&attempts[0], "http.response.status_code"), 429);
    assert_eq!(text(&attempts[0], "error.type"), "429");
    assert_eq!(
        status(&attempts[1]),
        (StatusCode::Error as i32, "503 upstream_error".into())
    );
    assert_eq!(int(&attempts[1], "http.response.status_code"), 503);
    assert!(!is_error(&attempts[2]));
    assert_eq!(int(&attempts[2], "http.response.status_code"), 200);
    assert_eq!(
        int(&attempts[2], "gen_ai.usage.output_tokens"),
        usage["completion_tokens"].as_i64().unwrap()
    );

    let received = collector.all();
    assert!(received.iter().all(|r| r.service == "onedoor-test"));
    assert!(received.iter().all(|r| r.path == "/v1/traces"));
    assert!(received.iter().all(|r| r.authorization == COLLECTOR_TOKEN));
    // Never the prompt, the completion or the client's key.
    let everything = format!("{:?}", received.iter().map(|r| &r.span).collect::<Vec<_>>());
    let reply = answer.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    for secret in ["Hello there", KEY, reply.as_str()] {
        assert!(!everything.contains(secret), "{secret:?} in the spans");
    }
}

#[tokio::test]
async fn a_request_whose_every_attempt_failed_is_an_error_span_with_failed_attempts() {
    let (collector, addr) = Collector::start().await;
    let h = Harness::start(
        fleet(failing(500), failing(503), failing(502)),
        &config(&telemetry(addr, "")),
    )
    .await;
    let answer = h.chat("chat").await;
    assert_eq!(answer.status, 502, "{}", answer.body);
    let id = answer.header("x-onedoor-request-id").to_owned();
    let (request, attempts) = split(collector.spans_of(&id, 4).await);
    assert_eq!(
        status(&request),
        (StatusCode::Error as i32, "upstream_failed".into())
    );
    assert_eq!(text(&request, "error.type"), "upstream_failed");
    assert_eq!(int(&request, "http.response.status_code"), 502);
    assert!(attempts.iter().all(is_error));
}

#[tokio::test]
async fn a_streamed_answers_span_ends_with_its_stream_and_carries_measured_usage() {
    let (collector, addr) = Collector::start().await;
    let paced = Behavior {
        inter_token_ms: 25,
        reply_words: Some(8),
        ..Behavior::default()
    };
    let h = Harness::start(
        fleet(paced, Behavior::default(), Behavior::default()),
        &config(&telemetry(addr, "")),
    )
    .await;
    let answer = chat_with(&h, chat_body("chat", true), &[]).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    let id = answer.header("x-onedoor-request-id").to_owned();
    let (request, attempts) = split(collector.spans_of(&id, 2).await);
    assert!(flag(&request, "onedoor.stream"));
    assert_eq!(text(&request, "onedoor.usage.source"), "measured");
    assert!(int(&request, "gen_ai.usage.input_tokens") > 0);
    assert!(int(&request, "gen_ai.usage.output_tokens") > 0);
    assert!(int(&request, "onedoor.ttft_ms") >= 0);
    // Eight words 25 ms apart: the span lasts as long as the stream did.
    let lasted = request.end_time_unix_nano - request.start_time_unix_nano;
    assert!(lasted >= 150_000_000, "the request span lasted {lasted} ns");
    let [attempt] = &attempts[..] else {
        panic!("one attempt: {attempts:#?}");
    };
    assert_eq!(attempt.end_time_unix_nano, request.end_time_unix_nano);
    assert_eq!(
        int(attempt, "gen_ai.usage.output_tokens"),
        int(&request, "gen_ai.usage.output_tokens")
    );
    // The collector answered before the exporter counts: the count may trail a moment.
    let mut scrape = String::new();
    for _ in 0..500 {
        scrape = h.admin_get("/metrics", Some(ADMIN_TOKEN)).await.body;
        if scrape.contains("onedoor_spans{outcome=\"exported\"} 2") {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    for line in [
        "onedoor_spans{outcome=\"exported\"} 2",
        "onedoor_spans{outcome=\"dropped\"} 0",
        "onedoor_spans{outcome=\"failed\"} 0",
        "onedoor_spans{outcome=\"queued\"} 0",
    ] {
        assert!(scrape.contains(line), "{line} not in {scrape}");
    }
}

#[tokio::test]
async fn a_callers_traceparent_is_joined_and_its_sampling_decision_followed() {
    let (collector, addr) = Collector::start().await;
    // The gateway samples none of the traces it starts itself.
    let h = Harness::start(
        healthy(),
        &config(&telemetry(addr, "    sample_ratio: 0\n")),
    )
    .await;
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let parent = "00f067aa0ba902b7";
    let own = h.chat("chat").await;
    let unsampled = format!("00-{trace}-{parent}-00");
    let declined = chat_with(&h, chat_body("chat", false), &[("traceparent", &unsampled)]).await;
    let sampled = format!("00-{trace}-{parent}-01");
    let joined = chat_with(&h, chat_body("chat", false), &[("traceparent", &sampled)]).await;
    assert_eq!(joined.status, 200, "{}", joined.body);

    let id = joined.header("x-onedoor-request-id").to_owned();
    let (request, attempts) = split(collector.spans_of(&id, 2).await);
    assert_eq!(hex::encode(&request.trace_id), trace);
    assert_eq!(hex::encode(&request.parent_span_id), parent);
    assert_eq!(attempts[0].trace_id, request.trace_id);
    assert_eq!(attempts[0].parent_span_id, request.span_id);
    // Spans leave in the order requests end: the earlier requests would be in by now.
    for earlier in [&own, &declined] {
        let id = earlier.header("x-onedoor-request-id");
        assert!(
            collector
                .all()
                .iter()
                .all(|r| text(&r.span, "onedoor.request_id") != id),
            "an unsampled request was exported"
        );
    }
}

#[tokio::test]
async fn without_a_telemetry_section_no_span_is_built_or_sent() {
    let (collector, addr) = Collector::start().await;
    let h = Harness::start_from_file(healthy(), &config(&telemetry(addr, ""))).await;
    let traced = h.chat("chat").await;
    collector
        .spans_of(traced.header("x-onedoor-request-id"), 2)
        .await;

    h.write_config(&config(""));
    h.gateway.reload().await.unwrap();
    let untraced = h.chat("chat").await;
    assert_eq!(untraced.status, 200, "{}", untraced.body);

    h.write_config(&config(&telemetry(addr, "")));
    h.gateway.reload().await.unwrap();
    let traced_again = h.chat("chat").await;
    collector
        .spans_of(traced_again.header("x-onedoor-request-id"), 2)
        .await;
    let id = untraced.header("x-onedoor-request-id");
    assert!(
        collector
            .all()
            .iter()
            .all(|r| text(&r.span, "onedoor.request_id") != id),
        "a request was traced while telemetry was off"
    );
}

#[tokio::test]
async fn spans_still_queued_at_shutdown_are_exported() {
    let (collector, addr) = Collector::start().await;
    let h = Harness::start(
        healthy(),
        &config(&telemetry(addr, "").replace("export_interval: 20ms", "export_interval: 1h")),
    )
    .await;
    let answer = h.chat("chat").await;
    let id = answer.header("x-onedoor-request-id").to_owned();
    let Harness { gateway, .. } = h;
    gateway.shutdown().await;
    let received = collector.all();
    let of_request = received
        .iter()
        .filter(|r| text(&r.span, "onedoor.request_id") == id)
        .count();
    assert_eq!(of_request, 2, "{} spans arrived", received.len());
}

/// An OpenAI-compatible upstream that answers every request (as a stream when asked for one) and
/// keeps each one's `traceparent`.
async fn traced_upstream() -> (SocketAddr, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let keeping = seen.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let seen = keeping.clone();
            let service = service_fn(move |request: Request<Incoming>| {
                let seen = seen.clone();
                async move {
                    let traceparent = request
                        .headers()
                        .get("traceparent")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("none")
                        .to_owned();
                    seen.lock().unwrap().push(traceparent);
                    let asked = request.into_body().collect().await.unwrap().to_bytes();
                    let asked: serde_json::Value = serde_json::from_slice(&asked).unwrap();
                    Ok::<_, Infallible>(match asked["stream"] == true {
                        true => traced_stream(),
                        false => traced_answer(),
                    })
                }
            });
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (addr, seen)
}

fn traced_answer() -> Response<Full<Bytes>> {
    let body = serde_json::json!({
        "id": "chatcmpl-traced", "object": "chat.completion", "model": "local-model",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
    });
    let mut response = Response::new(Full::new(Bytes::from(body.to_string())));
    response
        .headers_mut()
        .insert("content-type", "application/json".parse().unwrap());
    response
}

/// Three words, a `stop` and a usage chunk of 3 completion tokens.
fn traced_stream() -> Response<Full<Bytes>> {
    let chunk = |choices: serde_json::Value, usage: serde_json::Value| {
        let chunk = serde_json::json!({
            "id": "chatcmpl-traced-stream", "object": "chat.completion.chunk", "created": 1,
            "model": "local-model", "choices": choices, "usage": usage,
        });
        format!("data: {chunk}\n\n")
    };
    let mut body = chunk(
        serde_json::json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]),
        serde_json::Value::Null,
    );
    for word in [" and", " the", " rest"] {
        body.push_str(&chunk(
            serde_json::json!([{"index": 0, "delta": {"content": word}, "finish_reason": null}]),
            serde_json::Value::Null,
        ));
    }
    body.push_str(&chunk(
        serde_json::json!([{"index": 0, "delta": {}, "finish_reason": "stop"}]),
        serde_json::Value::Null,
    ));
    body.push_str(&chunk(
        serde_json::json!([]),
        serde_json::json!({"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}),
    ));
    body.push_str("data: [DONE]\n\n");
    let mut response = Response::new(Full::new(Bytes::from(body)));
    response
        .headers_mut()
        .insert("content-type", "text/event-stream".parse().unwrap());
    response
}

#[tokio::test]
async fn each_upstream_request_carries_the_traceparent_of_its_attempt_span() {
    let (collector, addr) = Collector::start().await;
    let (upstream, seen) = traced_upstream().await;
    let config = format!(
        "routing: {{ same_target_retries: 0 }}\nbackends:\n  - {{ name: first, provider: azure, region: swedencentral, url: \"{{url:first}}\" }}\n  - {{ name: local, provider: openai, region: onprem, url: \"http://{upstream}/v1\" }}\nmodels:\n  - name: chat\n    targets:\n      - {{ backend: first, deployment: gpt-4o, priority: 1 }}\n      - {{ backend: local, model: local-model, priority: 2 }}\n{}",
        telemetry(addr, "")
    );
    let first = EndpointSpec::azure("first", "swedencentral")
        .deployment(DeploymentSpec::new("gpt-4o"))
        .behavior(failing(500));
    let h = Harness::start(vec![first], &config).await;
    let caller = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let answer = chat_with(&h, chat_body("chat", false), &[("traceparent", caller)]).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.attempts(), "first=500,local=200");
    let id = answer.header("x-onedoor-request-id").to_owned();
    let (request, attempts) = split(collector.spans_of(&id, 3).await);
    assert_eq!(text(&attempts[1], "onedoor.backend"), "local");
    assert_eq!(text(&attempts[1], "gen_ai.provider.name"), "openai");
    assert_eq!(text(&attempts[1], "gen_ai.response.id"), "chatcmpl-traced");
    let expected = format!(
        "00-{}-{}-01",
        hex::encode(&request.trace_id),
        hex::encode(&attempts[1].span_id)
    );
    assert_eq!(*seen.lock().unwrap(), [expected]);
    assert_ne!(attempts[0].span_id, attempts[1].span_id);
}

/// The data payloads of an SSE body, `[DONE]` and comments left out.
fn chunks(body: &str) -> Vec<serde_json::Value> {
    body.split("\n\n")
        .filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: ")))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

/// The id a stream's chunks carry (one for the whole stream) and its last finish reason.
fn streamed_answer(body: &str) -> (String, String) {
    let chunks = chunks(body);
    let ids: std::collections::BTreeSet<String> = chunks
        .iter()
        .filter_map(|c| c["id"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(ids.len(), 1, "one id in {body}");
    let finish = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["finish_reason"].as_str())
        .next_back()
        .expect("a finish reason");
    (
        ids.into_iter().next().unwrap().to_owned(),
        finish.to_owned(),
    )
}

fn finish_reasons(span: &Span) -> Vec<String> {
    match attribute(span, "gen_ai.response.finish_reasons") {
        Some(Value::ArrayValue(reasons)) => reasons
            .values
            .into_iter()
            .map(|v| match v.value {
                Some(Value::StringValue(s)) => s,
                other => panic!("a finish reason is {other:?}"),
            })
            .collect(),
        other => panic!("finish reasons: {other:?} in {span:#?}"),
    }
}

#[tokio::test]
async fn a_streamed_answers_spans_carry_its_id_and_finish_reason_from_azure_and_anthropic() {
    let (collector, addr) = Collector::start().await;
    let config = format!(
        "backends:\n  - {{ name: first, provider: azure, region: swedencentral, url: \"{{url:first}}\" }}\n  - {{ name: claude, provider: anthropic, region: europe, url: \"{{url:claude}}\", anthropic_version: 2023-06-01 }}\nmodels:\n  - name: chat\n    targets: [{{ backend: first, deployment: gpt-4o }}]\n  - name: claude\n    targets: [{{ backend: claude, model: claude-sonnet-4-5 }}]\n{}",
        telemetry(addr, "")
    );
    let fleet = vec![
        EndpointSpec::azure("first", "swedencentral").deployment(DeploymentSpec::new("gpt-4o")),
        EndpointSpec::anthropic("claude", "europe")
            .deployment(DeploymentSpec::new("claude-sonnet-4-5")),
    ];
    let h = Harness::start(fleet, &config).await;
    for (alias, id_prefix) in [("chat", "chatcmpl"), ("claude", "msg_")] {
        let answer = chat_with(&h, chat_body(alias, true), &[]).await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        let (id, finish) = streamed_answer(&answer.body);
        assert!(id.starts_with(id_prefix), "{id}");
        assert_eq!(finish, "stop");
        let request_id = answer.header("x-onedoor-request-id").to_owned();
        let (request, attempts) = split(collector.spans_of(&request_id, 2).await);
        for span in [&request, &attempts[0]] {
            assert_eq!(text(span, "gen_ai.response.id"), id, "{alias}");
            assert_eq!(finish_reasons(span), [finish.as_str()], "{alias}");
        }
        assert!(flag(&request, "onedoor.stream"));
    }
}

#[tokio::test]
async fn a_continued_stream_has_an_attempt_span_per_continuation_and_tells_its_upstream_the_trace()
{
    let (collector, addr) = Collector::start().await;
    let (upstream, seen) = traced_upstream().await;
    let config = format!(
        "routing: {{ same_target_retries: 0 }}\nbackends:\n  - {{ name: first, provider: azure, region: swedencentral, url: \"{{url:first}}\" }}\n  - {{ name: second, provider: azure, region: francecentral, url: \"{{url:second}}\" }}\n  - {{ name: local, provider: openai, region: onprem, url: \"http://{upstream}/v1\" }}\nmodels:\n  - name: chat\n    continue_cut_streams: true\n    targets:\n      - {{ backend: first, deployment: gpt-4o, priority: 1 }}\n      - {{ backend: second, deployment: gpt-4o, priority: 2, accepts_prefill: true }}\n      - {{ backend: local, model: local-model, priority: 3, accepts_prefill: true }}\n{}",
        telemetry(addr, "")
    );
    let cut = Behavior {
        cut_after: Some(3),
        ..Behavior::default()
    };
    let fleet = vec![
        EndpointSpec::azure("first", "swedencentral")
            .deployment(DeploymentSpec::new("gpt-4o"))
            .behavior(cut),
        EndpointSpec::azure("second", "francecentral")
            .deployment(DeploymentSpec::new("gpt-4o"))
            .behavior(failing(500)),
    ];
    let h = Harness::start(fleet, &config).await;
    let answer = chat_with(&h, chat_body("chat", true), &[]).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert!(answer.body.ends_with("data: [DONE]\n\n"), "{}", answer.body);
    let (id, finish) = streamed_answer(&answer.body);
    assert_eq!(finish, "stop");
    let request_id = answer.header("x-onedoor-request-id").to_owned();

    let (request, attempts) = split(collector.spans_of(&request_id, 4).await);
    assert!(!is_error(&request), "{request:#?}");
    assert_eq!(text(&request, "gen_ai.response.id"), id);
    assert_eq!(finish_reasons(&request), ["stop"]);
    let backends: Vec<String> = attempts
        .iter()
        .map(|a| text(a, "onedoor.backend"))
        .collect();
    assert_eq!(backends, ["first", "second", "local"]);
    for attempt in &attempts {
        assert_eq!(attempt.trace_id, request.trace_id);
        assert_eq!(attempt.parent_span_id, request.span_id);
        assert!(attempt.start_time_unix_nano <= attempt.end_time_unix_nano);
    }
    let [cut, refused, continued] = &attempts[..] else {
        panic!("three attempts: {attempts:#?}");
    };
    // The attempt loop's stream was cut: its span ends at the cut, before the continuation.
    assert!(is_error(cut));
    assert!(status(cut).1.contains("upstream stream"), "{cut:#?}");
    assert_eq!(text(cut, "error.type"), "stream_cut");
    assert_eq!(int(cut, "http.response.status_code"), 200);
    assert!(int(cut, "gen_ai.usage.output_tokens") > 0);
    assert!(cut.end_time_unix_nano <= refused.start_time_unix_nano);
    assert_eq!(
        status(refused),
        (StatusCode::Error as i32, "500 upstream_error".into())
    );
    assert_eq!(int(refused, "http.response.status_code"), 500);
    // The continuation answered: it carries the answer's id and finish, and its own usage.
    assert!(!is_error(continued), "{continued:#?}");
    assert_eq!(text(continued, "onedoor.backend"), "local");
    assert_eq!(text(continued, "gen_ai.response.id"), id);
    assert_eq!(finish_reasons(continued), ["stop"]);
    assert_eq!(int(continued, "gen_ai.usage.output_tokens"), 3);
    assert_eq!(continued.end_time_unix_nano, request.end_time_unix_nano);
    let expected = format!(
        "00-{}-{}-01",
        hex::encode(&request.trace_id),
        hex::encode(&continued.span_id)
    );
    assert_eq!(*seen.lock().unwrap(), [expected]);
}

mod realtime {
    use super::*;
    use futures_util::{SinkExt, StreamExt};
    use tokio::net::TcpStream;
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
    use tokio_tungstenite::tungstenite::protocol::CloseFrame;
    use tokio_tungstenite::tungstenite::Message;
    use tokio_tungstenite::WebSocketStream;

    type Socket = WebSocketStream<TcpStream>;

    const UPSTREAM_KEY: &str = "upstream-secret";

    fn endpoint(name: &str, behavior: Behavior) -> EndpointSpec {
        EndpointSpec::azure(name, "swedencentral")
            .api_key(UPSTREAM_KEY)
            .deployment(DeploymentSpec::new("gpt-rt").model("gpt-4o-realtime-preview"))
            .behavior(behavior)
    }

    async fn event(socket: &mut Socket) -> serde_json::Value {
        loop {
            let message = tokio::time::timeout(std::time::Duration::from_secs(10), socket.next())
                .await
                .expect("a frame within 10 s")
                .expect("the socket is open")
                .expect("a valid frame");
            match message {
                Message::Text(text) => return serde_json::from_str(text.as_str()).unwrap(),
                Message::Ping(_) | Message::Pong(_) => {}
                other => panic!("expected a text event, got {other:?}"),
            }
        }
    }

    /// One `response.create` answered up to its `response.done`: its (input, output) tokens.
    async fn respond(socket: &mut Socket) -> (i64, i64) {
        let create = serde_json::json!({"type": "response.create"}).to_string();
        socket.send(Message::text(create)).await.unwrap();
        loop {
            let event = event(socket).await;
            if event["type"] == "response.done" {
                let usage = &event["response"]["usage"];
                return (
                    usage["input_tokens"].as_i64().unwrap(),
                    usage["output_tokens"].as_i64().unwrap(),
                );
            }
        }
    }

    #[tokio::test]
    async fn a_realtime_session_is_one_server_span_with_its_usage_and_close_code_over_its_attempts()
    {
        let (collector, addr) = Collector::start().await;
        let config = format!(
            "routing: {{ same_target_retries: 0 }}\nbackends:\n  - {{ name: rt-a, provider: azure, region: swedencentral, url: \"{{url:rt-a}}\", api_key: {UPSTREAM_KEY} }}\n  - {{ name: rt-b, provider: azure, region: swedencentral, url: \"{{url:rt-b}}\", api_key: {UPSTREAM_KEY} }}\nmodels:\n  - name: voice\n    targets:\n      - {{ backend: rt-a, deployment: gpt-rt, priority: 1 }}\n      - {{ backend: rt-b, deployment: gpt-rt, priority: 2 }}\n{}",
            telemetry(addr, "")
        );
        let fleet = vec![
            endpoint("rt-a", failing(503)),
            endpoint("rt-b", Behavior::default()),
        ];
        let h = Harness::start(fleet, &config).await;
        let path = "/openai/realtime?api-version=2024-10-01-preview&deployment=voice";
        let mut request = format!("ws://{}{path}", h.gateway.addr())
            .into_client_request()
            .unwrap();
        request
            .headers_mut()
            .insert("api-key", KEY.parse().unwrap());
        let stream = TcpStream::connect(h.gateway.addr()).await.unwrap();
        let opened = std::time::Instant::now();
        let (mut socket, head) = tokio_tungstenite::client_async(request, stream)
            .await
            .expect("the gateway upgrades");
        let id = head.headers()["x-onedoor-request-id"]
            .to_str()
            .unwrap()
            .to_owned();
        assert_eq!(event(&mut socket).await["type"], "session.created");
        let (mut input, mut output) = (0, 0);
        for _ in 0..2 {
            let (i, o) = respond(&mut socket).await;
            input += i;
            output += o;
        }
        // The session lasts a while: its span lasts as long.
        tokio::time::sleep(std::time::Duration::from_millis(150)).await;
        let bye = CloseFrame {
            code: CloseCode::from(4001),
            reason: "user hung up".into(),
        };
        socket.close(Some(bye)).await.unwrap();
        while let Some(Ok(message)) = socket.next().await {
            if let Message::Close(_) = message {
                break;
            }
        }
        let lasted = opened.elapsed();

        let (session, attempts) = split(collector.spans_of(&id, 3).await);
        assert_eq!(session.name, "realtime voice");
        assert_eq!(text(&session, "gen_ai.operation.name"), "realtime");
        assert_eq!(text(&session, "gen_ai.request.model"), "voice");
        assert_eq!(text(&session, "onedoor.alias"), "voice");
        assert_eq!(text(&session, "onedoor.backend"), "rt-b");
        assert_eq!(text(&session, "gen_ai.provider.name"), "azure.ai.openai");
        assert_eq!(text(&session, "onedoor.attempts"), "rt-a=503,rt-b=200");
        assert_eq!(int(&session, "http.response.status_code"), 101);
        assert_eq!(int(&session, "gen_ai.usage.input_tokens"), input);
        assert_eq!(int(&session, "gen_ai.usage.output_tokens"), output);
        assert_eq!(text(&session, "onedoor.usage.source"), "measured");
        assert_eq!(int(&session, "onedoor.realtime.close_code"), 4001);
        assert_eq!(text(&session, "onedoor.realtime.ended_by"), "client");
        assert_eq!(int(&session, "onedoor.realtime.responses"), 2);
        assert!(!is_error(&session), "{session:#?}");
        let duration = session.end_time_unix_nano - session.start_time_unix_nano;
        assert!(
            duration >= 150_000_000,
            "the session span lasted {duration} ns"
        );
        // The span starts after the client connected; it ends when the gateway has finished the
        // session, which may be a moment after the client read the close frame.
        assert!(
            u128::from(duration) <= (lasted + std::time::Duration::from_millis(50)).as_nanos(),
            "{duration} ns against {lasted:?}"
        );

        let [refused, upstream] = &attempts[..] else {
            panic!("two attempts: {attempts:#?}");
        };
        for attempt in &attempts {
            assert_eq!(attempt.trace_id, session.trace_id);
            assert_eq!(attempt.parent_span_id, session.span_id);
            assert_eq!(attempt.name, "realtime gpt-rt");
        }
        assert_eq!(text(refused, "onedoor.backend"), "rt-a");
        assert_eq!(
            status(refused),
            (StatusCode::Error as i32, "503 upstream_error".into())
        );
        // The upstream connection that served the session lasts as long as it.
        assert_eq!(text(upstream, "onedoor.backend"), "rt-b");
        assert!(!is_error(upstream));
        assert_eq!(int(upstream, "http.response.status_code"), 101);
        assert_eq!(upstream.end_time_unix_nano, session.end_time_unix_nano);
        let handshake = h.endpoint("rt-b").last_realtime_handshake().unwrap();
        let expected = format!(
            "00-{}-{}-01",
            hex::encode(&session.trace_id),
            hex::encode(&upstream.span_id)
        );
        assert_eq!(handshake.traceparent, Some(expected));
    }
}
