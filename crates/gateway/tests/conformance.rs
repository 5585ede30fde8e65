//! How the client port speaks HTTP/1.1, proved with exact bytes on raw sockets: the deadlines a
//! connection lives under (`client_timeouts`), the connection cap (`max_connections`), requests
//! whose framing is malformed or ambiguous (refused and closed, nothing smuggled to the
//! upstream), and the everyday framing that must keep working.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use common::raw::{answers, statuses, Conn, Ending};
use common::*;

const ROUTES: &str = "backends:\n  - { name: a, provider: azure, region: swedencentral, url: \"{url:a}\" }\nmodels:\n  - name: chat\n    targets:\n      - { backend: a, deployment: gpt-4o }\n";

const CHAT: &str = r#"{"model":"chat","messages":[{"role":"user","content":"Hello"}]}"#;
const STREAMED_CHAT: &str =
    r#"{"model":"chat","stream":true,"messages":[{"role":"user","content":"Hello"}]}"#;
const HEALTHZ: &str = "GET /healthz HTTP/1.1\r\nHost: gw\r\n\r\n";

/// A deadline past which a timeout that should have fired is taken as never firing.
const SLACK: Duration = Duration::from_secs(2);

fn fleet(behavior: Behavior) -> Vec<EndpointSpec> {
    vec![EndpointSpec::azure("a", "swedencentral")
        .deployment(DeploymentSpec::new("gpt-4o"))
        .behavior(behavior)]
}

/// A gateway with one backend `a` behind the alias `chat`, `settings` ahead of its routes.
async fn gateway(settings: &str) -> Harness {
    Harness::start(fleet(Behavior::default()), &format!("{settings}{ROUTES}")).await
}

fn client_timeouts(head: &str, idle: &str, write: &str) -> String {
    format!("client_timeouts: {{ head: {head}, idle: {idle}, body: 60s, write: {write} }}\n")
}

/// A chat completion's request line and usual headers on `version`, then `lines` (each ending
/// in CRLF) and the blank line.
fn chat_head(version: &str, lines: &str) -> String {
    format!("POST /v1/chat/completions {version}\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n{lines}\r\n")
}

/// A well-formed chat completion on HTTP/1.1 with a length.
fn chat() -> String {
    let length = CHAT.len();
    chat_head(
        "HTTP/1.1",
        &format!("Host: gw\r\nContent-Length: {length}\r\n"),
    ) + CHAT
}

/// `body` as one chunk and the last chunk.
fn chunked(body: &str) -> String {
    format!("{:x}\r\n{body}\r\n0\r\n\r\n", body.len())
}

/// Sends each request with a well-formed chat completion pipelined behind it (what a smuggler
/// would hide there) and holds that its one answer is `status`, that the connection then
/// closes, and that the upstream saw no request; every request that does otherwise is told.
async fn assert_refused(h: &Harness, requests: &[String], status: u16) {
    let mut problems = Vec::new();
    for request in requests {
        let before = h.endpoint("a").total_requests();
        let mut conn = Conn::open(h.gateway.addr()).await;
        let _ = conn.send(format!("{request}{}", chat())).await;
        let (closed, bytes) = match conn.until_closed(SLACK).await {
            Ending::Closed(bytes) => (true, bytes),
            Ending::Open(bytes) => (false, bytes),
        };
        let answered = statuses(&answers(&bytes));
        let upstream = h.endpoint("a").total_requests() - before;
        if !closed || answered != [status] || upstream != 0 {
            problems.push(format!(
                "{request:?}: answered {answered:?}, {}, {upstream} upstream requests",
                if closed { "closed" } else { "left open" }
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "{} of {} not refused with {status} and closed:\n{}",
        problems.len(),
        requests.len(),
        problems.join("\n")
    );
}

/// The ending of a connection cut by a deadline: closed, with nothing sent or a lone 408.
fn assert_timed_out(ending: Ending, within: Duration) {
    match ending {
        Ending::Closed(bytes) => {
            let sent = answers(&bytes);
            assert!(
                bytes.is_empty() || statuses(&sent) == [408],
                "closed after sending {:?}",
                String::from_utf8_lossy(&bytes)
            );
        }
        Ending::Open(bytes) => panic!(
            "still open after {within:?}, having sent {:?}",
            String::from_utf8_lossy(&bytes)
        ),
    }
}

/// Holds that `conn` is cut by a deadline (see [`assert_timed_out`]) `deadline` from now: not
/// 100 ms or more before it, nor later than [`SLACK`] after it.
async fn assert_closed_at(conn: &mut Conn, deadline: Duration, what: &str) {
    let started = Instant::now();
    let within = deadline + SLACK;
    assert_timed_out(conn.until_closed(within).await, within);
    assert!(
        started.elapsed() >= deadline - Duration::from_millis(100),
        "closed after {:?}, before the {what}",
        started.elapsed()
    );
}

/// The team's requests under way, from the admin port's metrics.
async fn in_flight(h: &Harness) -> f64 {
    let scrape = h.admin_get("/metrics", Some(ADMIN_TOKEN)).await;
    assert_eq!(scrape.status, 200, "{}", scrape.body);
    scrape
        .body
        .lines()
        .find(|l| l.starts_with("onedoor_tenant_in_flight{") && l.contains("tenant=\"team\""))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// Polls the in-flight count every 100 ms until it is 0 or `within` passes; the time it took.
async fn drained(h: &Harness, within: Duration) -> Option<Duration> {
    let started = Instant::now();
    while started.elapsed() < within {
        if in_flight(h).await == 0.0 {
            return Some(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

// Deadlines.

#[tokio::test]
async fn a_connection_that_sends_nothing_is_closed_after_the_head_timeout() {
    let h = gateway(&client_timeouts("1s", "30s", "60s")).await;
    let mut conn = Conn::open(h.gateway.addr()).await;
    assert_closed_at(&mut conn, Duration::from_secs(1), "head timeout").await;
}

#[tokio::test]
async fn an_idle_keep_alive_connection_is_closed_after_the_idle_timeout() {
    let h = gateway(&client_timeouts("30s", "1s", "60s")).await;
    let mut conn = Conn::open(h.gateway.addr()).await;
    conn.send(chat()).await.unwrap();
    assert_eq!(conn.answer().await.status, 200);
    assert_closed_at(&mut conn, Duration::from_secs(1), "idle timeout").await;
}

#[tokio::test]
async fn a_head_sent_a_byte_at_a_time_is_cut_off_at_the_head_timeout_though_bytes_keep_coming() {
    let h = gateway(&client_timeouts("1s", "30s", "60s")).await;
    let head = format!(
        "GET /healthz HTTP/1.1\r\nHost: gw\r\nX-Pad: {}\r\n\r\n",
        "a".repeat(200)
    );
    let mut conn = Conn::open(h.gateway.addr()).await;
    let started = Instant::now();
    let mut got = Vec::new();
    let mut closed = false;
    for byte in head.bytes() {
        if started.elapsed() > Duration::from_secs(1) + SLACK {
            break;
        }
        if conn.send([byte]).await.is_err() {
            if let Ending::Closed(rest) = conn.until_closed(SLACK).await {
                got.extend(rest);
                closed = true;
            }
            break;
        }
        match conn.until_closed(Duration::from_millis(200)).await {
            Ending::Closed(rest) => {
                got.extend(rest);
                closed = true;
                break;
            }
            Ending::Open(rest) => got.extend(rest),
        }
    }
    let text = String::from_utf8_lossy(&got);
    assert!(
        closed,
        "still open {:?} after the first byte: {text:?}",
        started.elapsed()
    );
    assert!(
        got.is_empty() || statuses(&answers(&got)) == [408],
        "answered {text:?}"
    );
}

#[tokio::test]
async fn past_the_connection_cap_a_new_connection_gets_503_and_is_served_again_once_others_close() {
    let h = gateway(&format!(
        "max_connections: 8\n{}",
        client_timeouts("30s", "30s", "60s")
    ))
    .await;
    let mut held = Vec::new();
    for _ in 0..8 {
        let mut conn = Conn::open(h.gateway.addr()).await;
        conn.send(HEALTHZ).await.unwrap();
        assert_eq!(conn.answer().await.status, 200);
        held.push(conn);
    }

    let mut over = Conn::open(h.gateway.addr()).await;
    let _ = over.send(HEALTHZ).await;
    let refused = over.answers_then_close().await;
    assert_eq!(statuses(&refused), [503], "{refused:?}");
    assert_eq!(
        refused[0].code(),
        "gateway_overloaded",
        "{}",
        refused[0].text()
    );

    let health = h.admin_get("/healthz", None).await;
    assert_eq!(health.status, 200, "the admin port answers at the cap");

    drop(held);
    let started = Instant::now();
    loop {
        let mut conn = Conn::open(h.gateway.addr()).await;
        let _ = conn.send(HEALTHZ).await;
        let served = conn.until_closed(Duration::from_millis(500)).await;
        let bytes = match served {
            Ending::Closed(bytes) | Ending::Open(bytes) => bytes,
        };
        if statuses(&answers(&bytes)).first() == Some(&200) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "still refused after the held connections closed: {:?}",
            String::from_utf8_lossy(&bytes)
        );
    }
}

/// A gateway whose upstream streams without end as fast as it is read, and a streamed chat
/// completion on a socket whose reader stops once the answer's head is in.
async fn stalled_stream(settings: &str) -> (Harness, Conn) {
    let behavior = Behavior {
        endless: true,
        ..Behavior::default()
    };
    let h = Harness::start(fleet(behavior), &format!("{settings}{ROUTES}")).await;
    let mut conn = Conn::open_with_small_window(h.gateway.addr()).await;
    let length = STREAMED_CHAT.len();
    let request = chat_head(
        "HTTP/1.1",
        &format!("Host: gw\r\nContent-Length: {length}\r\n"),
    ) + STREAMED_CHAT;
    conn.send(request).await.unwrap();
    let head = conn.head().await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert_eq!(in_flight(&h).await, 1.0, "the stream is under way");
    (h, conn)
}

#[tokio::test]
async fn a_stream_the_client_stops_reading_is_ended_by_the_total_timeout_and_releases_its_upstream()
{
    let (h, _conn) = stalled_stream("routing: { timeouts: { total: 3s } }\n").await;
    let took = drained(&h, Duration::from_secs(3) + SLACK).await;
    assert!(took.is_some(), "still in flight past the total timeout");
    assert!(
        eventually(|| h.endpoint("a").cancelled() == 1).await,
        "the upstream stream was not released before its end"
    );
}

#[tokio::test]
async fn a_stream_the_client_stops_reading_is_ended_by_the_write_timeout_and_its_connection_closed()
{
    let settings = format!(
        "routing: {{ timeouts: {{ total: 60s }} }}\n{}",
        client_timeouts("20s", "75s", "1s")
    );
    let (h, mut conn) = stalled_stream(&settings).await;
    let took = drained(&h, Duration::from_secs(1) + SLACK + SLACK).await;
    assert!(took.is_some(), "still in flight past the write timeout");
    assert!(
        eventually(|| h.endpoint("a").cancelled() == 1).await,
        "the upstream stream was not released before its end"
    );
    assert!(
        matches!(conn.until_closed(SLACK).await, Ending::Closed(_)),
        "the connection is still open"
    );
}

#[tokio::test]
async fn an_h2_stream_the_client_stops_reading_is_ended_by_the_total_timeout_and_releases_its_upstream(
) {
    let behavior = Behavior {
        endless: true,
        ..Behavior::default()
    };
    let settings = format!("routing: {{ timeouts: {{ total: 3s }} }}\n{ROUTES}");
    let h = Harness::start(fleet(behavior), &settings).await;
    let stream = tokio::net::TcpStream::connect(h.gateway.addr())
        .await
        .unwrap();
    let (mut sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .unwrap();
    tokio::spawn(connection);
    let request = http::Request::post(h.url("/v1/chat/completions"))
        .header("authorization", format!("Bearer {KEY}"))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from_static(
            STREAMED_CHAT.as_bytes(),
        )))
        .unwrap();
    // The answer's head is taken; its body never is, so the stream's window shuts.
    let answer = sender.send_request(request).await.unwrap();
    assert_eq!(answer.status(), 200);
    assert_eq!(in_flight(&h).await, 1.0, "the stream is under way");
    let took = drained(&h, Duration::from_secs(3) + SLACK).await;
    assert!(took.is_some(), "still in flight past the total timeout");
    assert!(
        eventually(|| h.endpoint("a").cancelled() == 1).await,
        "the upstream stream was not released before its end"
    );
    drop(answer);
}

#[tokio::test]
async fn a_stream_the_client_reads_whole_is_ended_at_the_total_timeout_with_an_error_event() {
    let behavior = Behavior {
        endless: true,
        ..Behavior::default()
    };
    let settings = format!("routing: {{ timeouts: {{ total: 2s }} }}\n{ROUTES}");
    let h = Harness::start(fleet(behavior), &settings).await;
    let mut conn = Conn::open(h.gateway.addr()).await;
    let length = STREAMED_CHAT.len();
    let request = chat_head(
        "HTTP/1.1",
        &format!("Host: gw\r\nContent-Length: {length}\r\n"),
    ) + STREAMED_CHAT;
    conn.send(request).await.unwrap();
    // Kept alive after its answer: what came within twice the total timeout is all there is.
    let (Ending::Closed(bytes) | Ending::Open(bytes)) =
        conn.until_closed(Duration::from_secs(4)).await;
    let tail = String::from_utf8_lossy(&bytes[bytes.len().saturating_sub(600)..]).into_owned();
    assert!(
        tail.ends_with("\r\n0\r\n\r\n"),
        "the answer did not end: ...{tail}"
    );
    assert!(
        tail.contains("total timeout"),
        "no error event told the cut: ...{tail}"
    );
    assert!(
        eventually(|| h.endpoint("a").cancelled() == 1).await,
        "the upstream stream was not released"
    );
}

// Malformed requests: refused, closed, nothing reaches the upstream.

#[tokio::test]
async fn a_content_length_that_is_not_plain_digits_gets_400_and_the_connection_closes() {
    let h = gateway("").await;
    let length = CHAT.len();
    let requests: Vec<String> = [
        format!("+{length}"),
        "-1".to_owned(),
        format!("x{length}"),
        format!("\x0b{length}"),
        format!("0x{length:x}"),
    ]
    .iter()
    .map(|value| {
        chat_head(
            "HTTP/1.1",
            &format!("Host: gw\r\nContent-Length: {value}\r\n"),
        ) + CHAT
    })
    .collect();
    assert_refused(&h, &requests, 400).await;
}

#[tokio::test]
async fn an_http_1_1_request_needs_exactly_one_valid_host() {
    let h = gateway("").await;
    let length = CHAT.len();
    let mut problems = Vec::new();
    for hosts in ["", "Host: gw\r\nHost: other\r\n", "Host: a b@c\r\n"] {
        let request = chat_head("HTTP/1.1", &format!("{hosts}Content-Length: {length}\r\n")) + CHAT;
        let mut conn = Conn::open(h.gateway.addr()).await;
        conn.send(&request).await.unwrap();
        let answer = conn.answer().await;
        if answer.status != 400 {
            problems.push(format!("{request:?}: answered {}", answer.status));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    assert_eq!(h.endpoint("a").total_requests(), 0);
}

#[tokio::test]
async fn an_http_1_0_request_with_transfer_encoding_gets_400_and_what_follows_is_never_served() {
    let h = gateway("").await;
    let request = chat_head("HTTP/1.0", "Transfer-Encoding: chunked\r\n") + &chunked(CHAT);
    assert_refused(&h, &[request], 400).await;
}

#[tokio::test]
async fn a_transfer_coding_other_than_chunked_gets_501_and_the_connection_closes() {
    let h = gateway("").await;
    let request = chat_head(
        "HTTP/1.1",
        "Host: gw\r\nTransfer-Encoding: gzip, chunked\r\n",
    ) + &chunked(CHAT);
    assert_refused(&h, &[request], 501).await;
}

/// Chat completions whose one chunk's size line is `line` in place of the plain size.
fn chunk_lines(lines: &[String]) -> Vec<String> {
    let head = chat_head("HTTP/1.1", "Host: gw\r\nTransfer-Encoding: chunked\r\n");
    lines
        .iter()
        .map(|line| format!("{head}{line}\r\n{CHAT}\r\n0\r\n\r\n"))
        .collect()
}

#[tokio::test]
async fn a_chunk_line_with_a_bare_cr_or_spaces_before_its_size_gets_400() {
    let h = gateway("").await;
    let size = format!("{:x}", CHAT.len());
    let requests = chunk_lines(&[format!("{size};ext\rx"), format!("  {size}")]);
    assert_refused(&h, &requests, 400).await;
}

/// RFC 9112 6.3: such a request is read by its Transfer-Encoding alone (or refused), and its
/// connection closes after the answer whatever its headers say, so nothing can follow it.
#[tokio::test]
async fn content_length_together_with_transfer_encoding_is_read_as_chunked_and_ends_its_connection()
{
    let h = gateway("").await;
    let body = chunked(CHAT);
    for length in [body.len(), 5] {
        let both =
            format!("Host: gw\r\nContent-Length: {length}\r\nTransfer-Encoding: chunked\r\n");
        let before = h.endpoint("a").total_requests();
        let mut conn = Conn::open(h.gateway.addr()).await;
        let _ = conn
            .send(format!(
                "{}{}",
                chat_head("HTTP/1.1", &both) + &body,
                chat()
            ))
            .await;
        let Ending::Closed(bytes) = conn.until_closed(SLACK).await else {
            panic!("length {length}: the connection was left open");
        };
        assert_eq!(statuses(&answers(&bytes)), [200], "length {length}");
        assert_eq!(
            h.endpoint("a").total_requests() - before,
            1,
            "length {length}"
        );
    }
}

#[tokio::test]
async fn two_different_content_lengths_get_400_and_nothing_is_smuggled() {
    let h = gateway("").await;
    let (length, longer) = (CHAT.len(), CHAT.len() + 5);
    let requests: Vec<String> = [
        format!("Content-Length: {length}\r\nContent-Length: {longer}\r\n"),
        format!("Content-Length: {length}, {longer}\r\n"),
    ]
    .iter()
    .map(|lengths| chat_head("HTTP/1.1", &format!("Host: gw\r\n{lengths}")) + CHAT)
    .collect();
    assert_refused(&h, &requests, 400).await;
}

#[tokio::test]
async fn an_obfuscated_transfer_encoding_gets_400_and_nothing_is_smuggled() {
    let h = gateway("").await;
    let body = chunked(CHAT);
    // Each beside a Content-Length: a reader that overlooks the disguised coding would go by
    // the length and serve the request.
    let requests: Vec<String> = [
        "Transfer-Encoding : chunked\r\n",
        "Transfer-Encoding: xchunked\r\n",
        "Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n",
        "Transfer-Encoding\t: chunked\r\n",
        "Transfer-Encoding: \x0bchunked\r\n",
        "Transfer-Encoding: chunked\x0b\r\n",
        "Transfer-Encoding:\r\n chunked\r\n",
    ]
    .iter()
    .map(|coding| {
        let lines = format!("Host: gw\r\nContent-Length: {}\r\n{coding}", body.len());
        chat_head("HTTP/1.1", &lines) + &body
    })
    .collect();
    assert_refused(&h, &requests, 400).await;
}

#[tokio::test]
async fn chunk_sizes_with_a_prefix_or_a_sign_get_400_and_nothing_is_smuggled() {
    let h = gateway("").await;
    let size = format!("{:x}", CHAT.len());
    let requests = chunk_lines(&[format!("0x{size}"), format!("+{size}")]);
    assert_refused(&h, &requests, 400).await;
}

#[tokio::test]
async fn a_header_folded_onto_the_next_line_gets_400_and_nothing_is_smuggled() {
    let h = gateway("").await;
    let length = CHAT.len();
    let lines = format!("Host: gw\r\nX-Note: one\r\n two\r\nContent-Length: {length}\r\n");
    assert_refused(&h, &[chat_head("HTTP/1.1", &lines) + CHAT], 400).await;
}

// Everyday framing that must keep working.

#[tokio::test]
async fn a_keep_alive_connection_serves_two_requests_one_after_the_other() {
    let h = gateway("").await;
    let mut conn = Conn::open(h.gateway.addr()).await;
    for _ in 0..2 {
        conn.send(chat()).await.unwrap();
        let answer = conn.answer().await;
        assert_eq!(answer.status, 200, "{}", answer.text());
    }
    assert_eq!(h.endpoint("a").total_requests(), 2);
}

#[tokio::test]
async fn two_requests_pipelined_in_one_write_are_answered_in_order() {
    let h = gateway("").await;
    let mut conn = Conn::open(h.gateway.addr()).await;
    conn.send(format!("{}{HEALTHZ}", chat())).await.unwrap();
    let first = conn.answer().await;
    let second = conn.answer().await;
    assert_eq!(first.status, 200, "{}", first.text());
    assert!(first.text().contains("chat.completion"), "{}", first.text());
    assert_eq!(second.status, 200);
    assert_eq!(second.text(), r#"{"status":"ok"}"#);
}

#[tokio::test]
async fn expect_100_continue_gets_100_continue_and_then_the_answer() {
    let h = gateway("").await;
    let mut conn = Conn::open(h.gateway.addr()).await;
    let length = CHAT.len();
    let head = chat_head(
        "HTTP/1.1",
        &format!("Host: gw\r\nContent-Length: {length}\r\nExpect: 100-continue\r\n"),
    );
    conn.send(head).await.unwrap();
    assert_eq!(conn.answer().await.status, 100);
    conn.send(CHAT).await.unwrap();
    let answer = conn.answer().await;
    assert_eq!(answer.status, 200, "{}", answer.text());
}

#[tokio::test]
async fn a_chunked_request_body_is_served() {
    let h = gateway("").await;
    let mut conn = Conn::open(h.gateway.addr()).await;
    let head = chat_head("HTTP/1.1", "Host: gw\r\nTransfer-Encoding: chunked\r\n");
    let (start, end) = CHAT.split_at(20);
    let body = format!(
        "{:x}\r\n{start}\r\n{:x};note=split\r\n{end}\r\n0\r\n\r\n",
        start.len(),
        end.len()
    );
    conn.send(head + &body).await.unwrap();
    let answer = conn.answer().await;
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert_eq!(h.endpoint("a").total_requests(), 1);
}

#[tokio::test]
async fn an_http_1_0_request_without_host_is_answered_and_the_connection_closed() {
    let h = gateway("").await;
    let mut conn = Conn::open(h.gateway.addr()).await;
    let length = CHAT.len();
    let request = chat_head("HTTP/1.0", &format!("Content-Length: {length}\r\n")) + CHAT;
    conn.send(request).await.unwrap();
    let answers = conn.answers_then_close().await;
    assert_eq!(statuses(&answers), [200], "{answers:?}");
    assert!(answers[0].text().contains("chat.completion"), "{answers:?}");
}

/// What curl says of an h2 (prior knowledge) upload of `bytes` zero bytes: the status it read
/// and its exit code (92 is "stream error": a reset where it expected the answer).
async fn curl_h2_upload(url: String, key: Option<&str>, bytes: usize) -> (String, i32) {
    let file = std::env::temp_dir().join(format!("onedoor-upload-{}-{bytes}", std::process::id()));
    std::fs::write(&file, vec![b'0'; bytes]).unwrap();
    let mut curl = std::process::Command::new("curl");
    curl.args([
        "-s",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        "--http2-prior-knowledge",
    ])
    .args(["--max-time", "20", "-X", "POST", "--data-binary"])
    .arg(format!("@{}", file.display()));
    if let Some(key) = key {
        curl.args(["-H", &format!("authorization: Bearer {key}")]);
    }
    curl.arg(url);
    let ran = tokio::task::spawn_blocking(move || curl.output())
        .await
        .unwrap();
    let output = ran.unwrap_or_else(|e| {
        panic!("curl did not run ({e}): install it with `apt-get install curl`")
    });
    let _ = std::fs::remove_file(&file);
    let code = output.status.code().unwrap_or(-1);
    (String::from_utf8_lossy(&output.stdout).into_owned(), code)
}

#[tokio::test]
async fn an_early_refusal_on_h2_reaches_a_client_still_uploading_as_its_status() {
    let h = gateway("max_request_body: 1MiB\n").await;
    let url = h.url("/v1/chat/completions");
    // A stranger's 5 MB: refused at its key; the caller's 5 MB: over max_request_body.
    assert_eq!(
        curl_h2_upload(url.clone(), None, 5 << 20).await,
        ("401".into(), 0)
    );
    assert_eq!(
        curl_h2_upload(url, Some(KEY), 5 << 20).await,
        ("413".into(), 0)
    );
}
