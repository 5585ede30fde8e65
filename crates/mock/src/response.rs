//! Building hyper responses and headers without a fallible builder.

use bytes::Bytes;
use hyper::header::{HeaderName, HeaderValue, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::{HeaderMap, Response, StatusCode};
use serde_json::Value;

use crate::stream::{self, Body, Watch};

/// Sets a header, skipping values that are not valid header text (never the case for ours).
pub fn put(headers: &mut HeaderMap, name: &'static str, value: impl ToString) {
    if let Ok(v) = HeaderValue::try_from(value.to_string()) {
        headers.insert(HeaderName::from_static(name), v);
    }
}

pub fn with_body(status: StatusCode, content_type: &'static str, body: Body) -> Response<Body> {
    let mut response = Response::new(body);
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

/// A JSON answer. `body` lets the caller withhold it (headers, then nothing) while the length
/// still promises it.
pub fn json(status: StatusCode, value: &Value, body: impl FnOnce(Bytes) -> Body) -> Response<Body> {
    let bytes = Bytes::from(value.to_string());
    let len = bytes.len();
    let mut response = with_body(status, "application/json", body(bytes));
    response
        .headers_mut()
        .insert(CONTENT_LENGTH, HeaderValue::from(len));
    response
}

/// A JSON answer sent whole, for answers no client is waiting on the pacing of.
pub fn plain_json(status: StatusCode, value: &Value) -> Response<Body> {
    json(status, value, |b| stream::full(b, Watch::detached()))
}
