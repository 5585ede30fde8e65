//! A tiny HTTP client for the tests: whole answers, streams read frame by frame, and raw sockets.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{HeaderMap, Method, Request, Response};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

pub type Error = hyper_util::client::legacy::Error;

pub struct Answer {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }
}

/// Sends a request on a fresh client, so no test reuses another's connection.
pub async fn send(
    method: Method,
    url: &str,
    headers: &[(&str, &str)],
    body: Option<&Value>,
) -> Result<Response<Incoming>, Error> {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let mut request = Request::builder().method(method).uri(url);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let bytes = body.map(|b| Bytes::from(b.to_string())).unwrap_or_default();
    client
        .request(request.body(Full::new(bytes)).unwrap())
        .await
}

pub async fn call(
    method: Method,
    url: &str,
    headers: &[(&str, &str)],
    body: Option<&Value>,
) -> Answer {
    let response = send(method, url, headers, body)
        .await
        .expect("request failed");
    let (parts, body) = response.into_parts();
    let body = body.collect().await.expect("body failed").to_bytes();
    Answer {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body,
    }
}

pub async fn post(url: &str, headers: &[(&str, &str)], body: &Value) -> Answer {
    call(Method::POST, url, headers, Some(body)).await
}

pub async fn get(url: &str) -> Answer {
    call(Method::GET, url, &[], None).await
}

/// A streamed answer: the bytes received, and whether the body ended cleanly.
pub struct Streamed {
    pub status: u16,
    pub headers: HeaderMap,
    pub text: String,
    pub clean_end: bool,
}

impl Streamed {
    /// The `data:` payloads, in order.
    pub fn data(&self) -> Vec<&str> {
        self.text
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .collect()
    }

    pub fn chunks(&self) -> Vec<Value> {
        self.data()
            .into_iter()
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str(d).unwrap())
            .collect()
    }

    /// The `event:` names, in order.
    pub fn events(&self) -> Vec<&str> {
        self.text
            .lines()
            .filter_map(|l| l.strip_prefix("event: "))
            .collect()
    }
}

pub async fn post_stream(url: &str, headers: &[(&str, &str)], body: &Value) -> Streamed {
    let response = send(Method::POST, url, headers, Some(body))
        .await
        .expect("request failed");
    let (parts, mut body) = response.into_parts();
    let mut text = String::new();
    let clean_end = loop {
        match body.frame().await {
            None => break true,
            Some(Err(_)) => break false,
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    text.push_str(std::str::from_utf8(&data).unwrap());
                }
            }
        }
    };
    Streamed {
        status: parts.status.as_u16(),
        headers: parts.headers,
        text,
        clean_end,
    }
}

/// Waits until `probe` holds, for things the server does after the client has moved on.
pub async fn eventually(mut probe: impl FnMut() -> bool) {
    for _ in 0..200 {
        if probe() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("condition never became true");
}

pub fn user(text: &str) -> Value {
    serde_json::json!({"role": "user", "content": text})
}
