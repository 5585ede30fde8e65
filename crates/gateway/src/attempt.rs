//! One attempt on one target: build the wire request, send it, then read a whole answer or open
//! the stream up to its first content event; and the continuation of a cut stream (contract
//! section 2.1, rule 5), which is an attempt with the text already sent as a prefill.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use http::{header, HeaderValue, StatusCode};
use http_body_util::BodyExt;
use onedoor_state::now_ms;
use tokio::time::Instant;

use crate::affinity::ResponsePin;
use crate::breaker::{Admission, Observed};
use crate::provider::{self, Unsendable};
use crate::redaction;
use crate::request::{ClientRequest, Operation};
use crate::router::Candidate;
use crate::runtime::Runtime;
use crate::stream::{Continuer, Identity, Relay, StreamRules};
use crate::surface::Dialect;
use crate::telemetry::{Continued, StreamTrace};
use crate::upstream::{self, Failure, LaneClients};
use crate::usage::{Usage, UsageSource};

/// A successful attempt's answer, ready to be sent: in the OpenAI shape, whatever the upstream
/// spoke, unless it passes through (an Anthropic client's answer from an Anthropic backend).
pub enum Answer {
    Whole {
        status: StatusCode,
        content_type: Option<HeaderValue>,
        body: Bytes,
        usage: Usage,
        /// The body is the upstream's own, in the client's dialect: it goes out as it came.
        native: bool,
    },
    Stream(Box<Relay>),
}

/// What every attempt of one request shares.
#[derive(Clone)]
pub struct Dispatch {
    pub runtime: Arc<Runtime>,
    pub operation: Operation,
    pub dialect: Dialect,
    /// Keep the streamed text, so a cut stream can be continued.
    pub continues_cut_streams: bool,
    /// The upstream's `traceparent`, when the request is traced over OTLP.
    pub traceparent: Option<Arc<crate::telemetry::Traceparent>>,
}

impl Dispatch {
    pub async fn attempt(
        &self,
        request: &ClientRequest,
        candidate: Candidate,
        deadline: Instant,
        continuing: Option<Identity>,
    ) -> Result<Answer, Failure> {
        let runtime = &self.runtime;
        let unknown = || Failure::ConnectError("unknown backend".into());
        let backend = runtime
            .snapshot
            .backends
            .get(candidate.backend)
            .ok_or_else(unknown)?;
        let client = runtime
            .clients
            .get(candidate.backend)
            .map(LaneClients::here)
            .ok_or_else(unknown)?;
        let stamp = runtime
            .stamps
            .get(candidate.backend)
            .map_or(&[][..], Vec::as_slice);
        let mut wire = provider::build(
            backend,
            stamp,
            &candidate.deployment,
            self.operation,
            request,
            runtime
                .uris
                .get(candidate.backend, &candidate.deployment, self.operation),
        )
        .map_err(|e| match e {
            Unsendable::Invalid(message) => provider::refusal(&message),
            other => Failure::ConnectError(other.to_string()),
        })?;
        if let Some(traceparent) = &self.traceparent {
            traceparent.stamp(&mut wire.headers);
        }
        let pin = (self.operation == Operation::Responses)
            .then(|| ResponsePin::new(runtime.state.clone(), &backend.name));
        let now = Instant::now();
        let deadline = deadline.min(now + backend.timeouts.total);
        let first_token_by = now + backend.timeouts.first_token;
        let load = runtime.load(candidate.backend).cloned().unwrap_or_default();
        let backend_index = candidate.backend;
        // Not kept across the awaits below: the attempt's future stays smaller.
        drop(candidate);
        let mut in_flight = load.begin(request.estimated_tokens(self.operation), now_ms());
        let sent = upstream::send(client, wire, first_token_by, deadline).await;
        match &sent {
            Ok(response) => load.observe(response.headers(), false, now_ms()),
            Err(Failure::Status {
                status, headers, ..
            }) => load.observe(headers, *status == StatusCode::TOO_MANY_REQUESTS, now_ms()),
            Err(_) => {}
        }
        let response = sent.map_err(|failure| provider::failure(backend, failure))?;
        let status = response.status();
        let redaction = runtime.redaction(backend_index);
        let content_type = response.headers().get(header::CONTENT_TYPE).cloned();
        let content_type =
            content_type.map(|v| redaction::scrub_header(redaction.map(|r| &**r), v));
        let is_stream = content_type
            .as_ref()
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        if request.stream && is_stream {
            let rules = StreamRules {
                idle: backend.timeouts.idle,
                deadline,
                drop_filter_chunks: self.dialect != Dialect::Azure,
                track_transcript: self.continues_cut_streams,
            };
            let body = response.into_body();
            let translator =
                provider::events(backend, self.operation, request, created(now_ms()), pin);
            let relay = match continuing {
                Some(identity) => {
                    Relay::open_continuing(body, rules, first_token_by, identity, translator)
                        .await?
                }
                None => Relay::open(body, rules, first_token_by, translator).await?,
            };
            load.succeeded(now.elapsed(), now_ms());
            let relay = relay.holding(in_flight).scrubbing(redaction.cloned());
            return Ok(Answer::Stream(Box::new(relay)));
        }
        let body = match tokio::time::timeout_at(deadline, whole(response.into_body())).await {
            Err(_) => return Err(Failure::Timeout),
            Ok(Err(error)) => return Err(Failure::Reset(error.to_string())),
            Ok(Ok(body)) => body,
        };
        // One reading of the clock for everything the whole answer settles.
        let answered_ms = now_ms();
        load.succeeded(now.elapsed(), answered_ms);
        let native = provider::passes_through(backend, request);
        let translated = backend.provider == onedoor_config::Provider::Anthropic && !native;
        let (body, usage) =
            provider::answer(backend, self.operation, request, body, created(answered_ms));
        if usage.source == UsageSource::Measured {
            in_flight.settle(usage.total_tokens(), answered_ms);
        }
        if let Some(pin) = pin {
            pin.remember_body(&body).await;
        }
        let content_type = match translated {
            true => Some(HeaderValue::from_static("application/json")),
            false => content_type,
        };
        Ok(Answer::Whole {
            status,
            content_type,
            body,
            usage,
            native,
        })
    }
}

/// A whole answer's body. An answer that arrives as one frame (most do: it is read in one go) is
/// kept as it came; more frames are joined. Trailers are not part of it.
async fn whole<B>(mut body: B) -> Result<Bytes, B::Error>
where
    B: http_body::Body<Data = Bytes> + Unpin,
{
    let mut first = Bytes::new();
    let mut joined: Option<BytesMut> = None;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else {
            continue;
        };
        match joined.as_mut() {
            Some(joined) => joined.extend_from_slice(&data),
            None if first.is_empty() => first = data,
            None => {
                let mut both = BytesMut::with_capacity(first.len() + data.len());
                both.extend_from_slice(&first);
                both.extend_from_slice(&data);
                joined = Some(both);
            }
        }
    }
    Ok(joined.map_or(first, BytesMut::freeze))
}

/// The `created` of translated answers, seconds since the Unix epoch, of a clock reading in
/// milliseconds ([`now_ms`]).
fn created(unix_ms: u64) -> u64 {
    unix_ms / 1000
}

/// The targets that may continue a cut stream: those that accept prefill, other than the one
/// that was cut, in priority order, each asked at most once.
pub struct Continuation {
    pub dispatch: Dispatch,
    pub request: ClientRequest,
    pub fallbacks: Vec<Candidate>,
    pub deadline: Instant,
    /// Where a traced request's continuation attempts are told.
    pub trace: Option<Arc<StreamTrace>>,
}

impl Continuation {
    async fn next_relay(&mut self, sent: &str, identity: Identity) -> Option<Relay> {
        let request = self.request.with_prefill(sent)?;
        while !self.fallbacks.is_empty() {
            let candidate = self.fallbacks.remove(0);
            let breakers = &self.dispatch.runtime.breakers;
            let probe = match breakers.admit(candidate.backend, now_ms()).await {
                Admission::Open { .. } => continue,
                Admission::Closed => None,
                Admission::Probe(permit) => Some(permit),
            };
            let began = Instant::now();
            let result = self
                .dispatch
                .attempt(
                    &request,
                    candidate.clone(),
                    self.deadline,
                    Some(identity.clone()),
                )
                .await;
            if let Some(trace) = &self.trace {
                let outcome = match &result {
                    Ok(Answer::Stream(_)) => Continued::Streaming,
                    Ok(Answer::Whole { status, .. }) => Continued::Unstreamed(*status),
                    Err(failure) => Continued::Failed(failure),
                };
                let traceparent = self.dispatch.traceparent.as_deref();
                trace.continuation(&candidate, began, traceparent, outcome);
            }
            let observed = match &result {
                Ok(_) => Observed::Success,
                Err(failure) => Observed::of(failure),
            };
            match probe {
                Some(permit) => permit.settle(&observed, now_ms()).await,
                None => {
                    breakers
                        .record(candidate.backend, &observed, now_ms())
                        .await
                }
            }
            match result {
                Ok(Answer::Stream(relay)) => return Some(*relay),
                Ok(Answer::Whole { status, .. }) => {
                    tracing::info!(backend = candidate.backend, %status, "a continuation did not stream")
                }
                Err(failure) => {
                    tracing::info!(backend = candidate.backend, outcome = %failure.label(), "a continuation failed")
                }
            }
        }
        None
    }
}

impl Continuer for Continuation {
    fn continue_after<'a>(
        &'a mut self,
        sent: &'a str,
        identity: Identity,
    ) -> Pin<Box<dyn Future<Output = Option<Relay>> + Send + 'a>> {
        Box::pin(self.next_relay(sent, identity))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::convert::Infallible;

    use bytes::Bytes;
    use http_body::Frame;
    use http_body_util::{Full, StreamBody};

    use super::whole;

    #[tokio::test]
    async fn a_whole_body_is_its_one_frame_or_its_frames_joined() {
        let one = Bytes::from_static(b"{\"id\":1}");
        let read = whole(Full::new(one.clone())).await.unwrap();
        assert_eq!(read, one);
        assert_eq!(read.as_ptr(), one.as_ptr(), "one frame is kept, not copied");
        let frames = ["{\"a\":", "", "1,", "\"b\":2}"]
            .map(|part| Ok::<_, Infallible>(Frame::data(Bytes::from_static(part.as_bytes()))));
        let trailers = Ok(Frame::trailers(http::HeaderMap::new()));
        let body = StreamBody::new(futures_util::stream::iter(
            frames.into_iter().chain([trailers]),
        ));
        assert_eq!(whole(body).await.unwrap(), "{\"a\":1,\"b\":2}");
    }
}
