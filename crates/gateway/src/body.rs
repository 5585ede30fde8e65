//! The response body type every answer uses, whether a whole buffer or a relayed stream, and the
//! request body handlers get.

use bytes::Bytes;
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Full};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub type Body = UnsyncBoxBody<Bytes, BoxError>;

pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

pub fn empty() -> Body {
    full(Bytes::new())
}

/// A request's body as handlers get it: read whole by the server before the request is handed
/// over (see `server::intake`).
pub enum RequestBody {
    Whole(Bytes),
    /// More than the body limit allows (declared, or seen while reading): not read, and the
    /// connection closes after the answer.
    TooLarge,
}

/// A [`RequestBody::TooLarge`] body read as a body.
#[derive(Debug)]
pub struct TooLarge;

impl std::fmt::Display for TooLarge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the request body is larger than the limit")
    }
}

impl std::error::Error for TooLarge {}

impl http_body::Body for RequestBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        use std::task::Poll;
        match self.get_mut() {
            RequestBody::Whole(bytes) if bytes.is_empty() => Poll::Ready(None),
            RequestBody::Whole(bytes) => {
                Poll::Ready(Some(Ok(http_body::Frame::data(std::mem::take(bytes)))))
            }
            RequestBody::TooLarge => Poll::Ready(Some(Err(Box::new(TooLarge)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            RequestBody::Whole(bytes) => bytes.is_empty(),
            RequestBody::TooLarge => false,
        }
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match self {
            RequestBody::Whole(bytes) => http_body::SizeHint::with_exact(bytes.len() as u64),
            RequestBody::TooLarge => http_body::SizeHint::default(),
        }
    }
}
