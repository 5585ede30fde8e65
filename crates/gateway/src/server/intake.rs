//! How a request comes in on either protocol: its framing checked (HTTP/1.x), its body read whole
//! up to its limit within `client_timeouts.body` before the handler runs, and its answer wrapped
//! so the connection knows when it is done.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderValue};
use http::{HeaderMap, Request, Response, StatusCode};
use http_body::{Body as _, Frame, SizeHint};
use hyper::body::Incoming;
use onedoor_config::ClientTimeouts;

use super::framing;
use super::guard::{Busy, Watch};
use crate::body::{Body, BoxError, RequestBody};
use crate::errors::GatewayError;
use crate::idle_poll;
use crate::stamp::Stamp;
use crate::surface;

/// How large the body of a request with these headers may be, asked only of a body that may be
/// larger than [`SMALL_BODY`] (a larger length, or chunked): the client port reads such a body
/// only for a caller whose key it knows, so a stranger cannot make it hold megabytes.
pub type BodyLimit = Arc<dyn Fn(&HeaderMap) -> u64 + Send + Sync>;

/// Bodies up to this size are read without asking their [`BodyLimit`].
pub const SMALL_BODY: u64 = 64 * 1024;

/// After an answer on h2 to a request whose body was not read (over its limit), the rest is read
/// and dropped for this long (or this much) so the client reads the answer instead of a reset.
const DRAIN: Duration = Duration::from_millis(500);
const DRAIN_BYTES: usize = 1024 * 1024;

/// The deadline of a request's answer, which its handler puts in the answer's extensions: an
/// HTTP/1.1 connection ends at it when the client stops taking the answer.
#[derive(Debug, Clone, Copy)]
pub struct AnswerBy(pub tokio::time::Instant);

/// What every connection of a listener serves with.
pub struct Front<H> {
    pub handler: H,
    pub limit: BodyLimit,
    pub timeouts: ClientTimeouts,
}

impl<H, F> Front<H>
where
    H: Fn(Request<RequestBody>) -> F + Send + Sync + 'static,
    F: Future<Output = Response<Body>> + Send + 'static,
{
    /// Answers one request; `watch` is its HTTP/1.1 connection's (none on h2).
    pub async fn answer(
        self: Arc<Self>,
        request: Request<Incoming>,
        watch: Option<Arc<Watch>>,
    ) -> Response<Answer> {
        idle_poll::worked();
        let busy = watch.as_ref().map(Watch::busy);
        if watch.is_some() {
            if let Some(refusal) = framing::refusal(&request) {
                return refused(refusal, request.uri().path(), busy);
            }
        }
        let (parts, incoming) = request.into_parts();
        let (body, unread) = match self.read(incoming, &parts.headers).await {
            Ok(Ok(Read::Whole(bytes))) => (RequestBody::Whole(bytes), None),
            Ok(Ok(Read::TooLarge(unread))) => (RequestBody::TooLarge, Some(unread)),
            Ok(Err(refusal)) => return refused(refusal, parts.uri.path(), busy),
            Err(_) => return refused(body_late(), parts.uri.path(), busy),
        };
        let request = Request::from_parts(parts, body);
        let mut response = crate::boxing::in_place(&self.handler, request).await;
        Stamp::into_headers(&mut response);
        if let Some(watch) = &watch {
            if response.status() == StatusCode::SWITCHING_PROTOCOLS {
                watch.upgraded();
            } else if let Some(by) = response.extensions().get::<AnswerBy>() {
                watch.answer_by(by.0);
            }
        }
        if watch.is_none() {
            kept_to_deadline(&mut response);
        }
        match (unread, &watch) {
            (None, _) => {}
            (Some(_), Some(watch)) => {
                watch.linger();
                close(response.headers_mut());
            }
            (Some(unread), None) => {
                tokio::spawn(drain(unread));
            }
        }
        response.map(|body| Answer { body, _busy: busy })
    }
}

impl<H> Front<H> {
    /// The body within `client_timeouts.body`; one already there whole is taken without a timer.
    async fn read(
        &self,
        incoming: Incoming,
        headers: &HeaderMap,
    ) -> Result<Result<Read, GatewayError>, tokio::time::error::Elapsed> {
        let mut read = std::pin::pin!(read_whole(incoming, headers, &self.limit));
        let at_once = std::future::poll_fn(|cx| Poll::Ready(read.as_mut().poll(cx))).await;
        match at_once {
            Poll::Ready(read) => Ok(read),
            Poll::Pending => tokio::time::timeout(self.timeouts.body, read).await,
        }
    }
}

fn body_late() -> GatewayError {
    GatewayError::RequestTimeout(
        "the request body did not come whole within client_timeouts.body".to_owned(),
    )
}

/// A request's body as read: whole, or over its limit with the rest not read.
enum Read {
    Whole(Bytes),
    TooLarge(Incoming),
}

async fn read_whole(
    mut incoming: Incoming,
    headers: &HeaderMap,
    limit: &BodyLimit,
) -> Result<Read, GatewayError> {
    let declared = incoming.size_hint().exact();
    let limit = match declared {
        Some(length) if length <= SMALL_BODY => SMALL_BODY,
        _ => limit(headers),
    };
    match declared {
        Some(0) => return Ok(Read::Whole(Bytes::new())),
        Some(length) if length > limit => return Ok(Read::TooLarge(incoming)),
        _ => {}
    }
    let mut first = Bytes::new();
    let mut more = BytesMut::new();
    while let Some(frame) = std::future::poll_fn(|cx| Pin::new(&mut incoming).poll_frame(cx)).await
    {
        let Ok(data) = frame.map_err(|_| body_malformed())?.into_data() else {
            continue;
        };
        if (first.len() + more.len() + data.len()) as u64 > limit {
            return Ok(Read::TooLarge(incoming));
        }
        match (first.is_empty(), more.is_empty()) {
            (true, true) => first = data,
            (false, true) => {
                more.extend_from_slice(&first);
                more.extend_from_slice(&data);
            }
            _ => more.extend_from_slice(&data),
        }
    }
    Ok(Read::Whole(match more.is_empty() {
        true => first,
        false => more.freeze(),
    }))
}

fn body_malformed() -> GatewayError {
    GatewayError::InvalidRequest("the request body is not framed as its head says".to_owned())
}

/// Reads and drops the rest of a body nobody reads, for a moment.
async fn drain(mut unread: Incoming) {
    let reading = async {
        let mut read = 0;
        while let Some(Ok(frame)) =
            std::future::poll_fn(|cx| Pin::new(&mut unread).poll_frame(cx)).await
        {
            read += frame.data_ref().map_or(0, Bytes::len);
            if read > DRAIN_BYTES {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(DRAIN, reading).await;
}

/// On h2, a streamed answer's deadline keeps its own time: a stream whose client stops reading has
/// a shut flow-control window, so hyper stops polling its body and a deadline inside the body
/// would never fire. At [`AnswerBy`] a timer drops the body, which releases its upstream and its
/// in-flight slot; hyper resets the stream when it next asks for a frame.
fn kept_to_deadline(response: &mut Response<Body>) {
    let Some(&AnswerBy(by)) = response.extensions().get::<AnswerBy>() else {
        return;
    };
    if response.body().size_hint().exact().is_some() {
        return;
    }
    let body = std::mem::replace(response.body_mut(), crate::body::empty());
    let slot = Arc::new(Mutex::new(Some(body)));
    let timer = tokio::spawn({
        let slot = Arc::clone(&slot);
        async move {
            tokio::time::sleep_until(by).await;
            let overdue = lock(&slot).take();
            drop(overdue);
        }
    });
    *response.body_mut() = http_body_util::BodyExt::boxed_unsync(Deadlined {
        slot,
        timer: timer.abort_handle(),
    });
}

/// A streamed h2 answer whose body a timer takes away at its deadline.
struct Deadlined {
    slot: Arc<Mutex<Option<Body>>>,
    timer: tokio::task::AbortHandle,
}

fn lock(slot: &Mutex<Option<Body>>) -> std::sync::MutexGuard<'_, Option<Body>> {
    slot.lock().unwrap_or_else(PoisonError::into_inner)
}

#[derive(Debug)]
struct Overdue;

impl std::fmt::Display for Overdue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the answer was not taken within the request's total timeout")
    }
}

impl std::error::Error for Overdue {}

impl http_body::Body for Deadlined {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match lock(&self.slot).as_mut() {
            Some(body) => Pin::new(body).poll_frame(cx),
            None => Poll::Ready(Some(Err(Box::new(Overdue)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        lock(&self.slot)
            .as_ref()
            .is_some_and(http_body::Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        lock(&self.slot)
            .as_ref()
            .map_or_else(SizeHint::default, http_body::Body::size_hint)
    }
}

impl Drop for Deadlined {
    fn drop(&mut self) {
        self.timer.abort();
    }
}

/// Asks the connection to close after this answer.
pub(super) fn close(headers: &mut HeaderMap) {
    headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
}

/// The answer to a request that cannot be read, in the dialect of its path; the connection
/// closes after it.
fn refused(refusal: GatewayError, path: &str, busy: Option<Busy>) -> Response<Answer> {
    let mut response = refusal.into_response_in(surface::dialect_of(path));
    close(response.headers_mut());
    response.map(|body| Answer { body, _busy: busy })
}

/// An answer's body, holding its request's place on the connection until it is done.
pub struct Answer {
    body: Body,
    _busy: Option<Busy>,
}

impl http_body::Body for Answer {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl Drop for Answer {
    fn drop(&mut self) {
        idle_poll::worked();
    }
}
