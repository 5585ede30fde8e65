//! Client connections over HTTP/1.1, on hyper's connection: keep-alive, pipelining,
//! `Expect: 100-continue`, chunked request bodies, HTTP/1.0 clients and upgrades (the realtime
//! WebSocket handshake) are hyper's; the gateway adds the deadlines of [`super::guard`], the
//! framing rules hyper leaves to its user ([`super::framing`]) and requests read whole before
//! their handler runs ([`super::intake`]). A client that goes away cancels its request.

use std::future::Future;
use std::sync::Arc;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::sync::watch;

use super::guard::{Guarded, Watch};
use super::intake::Front;
use crate::body::{Body, RequestBody};
use crate::stopping::Phase;

/// Request heads (request line and headers) larger than this get 431.
pub const MAX_HEAD_BYTES: usize = 64 * 1024;
pub const MAX_HEADERS: usize = 128;

/// Serves requests on `stream` until the client closes it, a deadline or an answer ends it, or
/// the listener closes (a request under way is answered first). From a drain on, every answer
/// carries `connection: close`, so the client's next request opens a new connection (to this
/// gateway while it still accepts, or to another).
pub async fn serve<H, F>(
    stream: TcpStream,
    front: Arc<Front<H>>,
    phase: &mut watch::Receiver<Phase>,
) where
    H: Fn(Request<RequestBody>) -> F + Send + Sync + 'static,
    F: Future<Output = Response<Body>> + Send + 'static,
{
    let watch = Watch::new();
    let io = Guarded::new(stream, watch.clone(), front.timeouts);
    // Only ever raised: a change is a stop under way, read without the signal's lock. A
    // connection that begins while draining starts out changed.
    let mut stopping = phase.clone();
    if *stopping.borrow() > Phase::Serving {
        stopping.mark_changed();
    }
    let fresh = watch.clone();
    let service = service_fn(move |request: Request<Incoming>| {
        let answer = front.clone().answer(request, Some(watch.clone()));
        let stopping = stopping.clone();
        async move {
            let mut response = answer.await;
            // A realtime handshake's 101 keeps its `connection: upgrade`.
            if stopping.has_changed().unwrap_or(true)
                && response.status() != http::StatusCode::SWITCHING_PROTOCOLS
            {
                super::intake::close(response.headers_mut());
            }
            Ok::<_, std::convert::Infallible>(response)
        }
    });
    let connection = builder()
        .serve_connection(TokioIo::new(io), service)
        .with_upgrades();
    // hyper's graceful shutdown closes a connection it has read nothing from; one accepted just
    // before the listener closed may have its first request on the way.
    let delay = move || match fresh.fresh() {
        true => super::FIRST_BYTES_AFTER_CLOSE,
        false => std::time::Duration::ZERO,
    };
    super::until_ended(
        connection,
        |c| c.graceful_shutdown(),
        phase,
        Phase::Closing,
        delay,
    )
    .await;
}

fn builder() -> http1::Builder {
    let mut builder = http1::Builder::new();
    builder
        .max_header_size(MAX_HEAD_BYTES)
        .max_headers(MAX_HEADERS)
        // The connection's own deadlines keep time (`guard`), without hyper's timer.
        .header_read_timeout(None);
    builder
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use std::net::SocketAddr;
    use std::sync::atomic::{AtomicBool, Ordering};

    use http_body_util::{BodyExt, StreamBody};
    use tokio::net::TcpListener;
    use tokio::sync::mpsc;

    use std::sync::Mutex;
    use std::time::Duration;

    use bytes::Bytes;
    use http::header::{self, HeaderValue};
    use http::{HeaderMap, StatusCode};
    use onedoor_config::ClientTimeouts;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;
    use crate::body::{full, BoxError};
    use crate::server::{Limits, OnUpgrade, SMALL_BODY};

    /// How long a begun request may wait for its next bytes here (head and body).
    const BEGUN_REQUEST_WAIT: Duration = Duration::from_millis(400);

    /// A gateway listener serving `handler`; a body larger than [`SMALL_BODY`] is read up to 1 MiB
    /// for a request with `x-known: yes`, not at all for others.
    async fn listen<H, F>(handler: H) -> (SocketAddr, watch::Sender<Phase>)
    where
        H: Fn(Request<RequestBody>) -> F + Send + Sync + 'static,
        F: Future<Output = Response<Body>> + Send + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let (stop, shutdown) = watch::channel(Phase::Serving);
        tokio::spawn(crate::server::serve(
            listener,
            handler,
            Arc::new(
                |headers: &HeaderMap| match headers.contains_key("x-known") {
                    true => 1 << 20,
                    false => SMALL_BODY,
                },
            ),
            Limits {
                max_connections: 64,
                timeouts: ClientTimeouts {
                    head: BEGUN_REQUEST_WAIT,
                    body: BEGUN_REQUEST_WAIT,
                    ..ClientTimeouts::DEFAULT
                },
            },
            shutdown,
            None,
        ));
        (address, stop)
    }

    /// Answers with the method, target and body it got (`413` for a body over the limit).
    async fn echo(request: Request<RequestBody>) -> Response<Body> {
        let said = format!("{} {} ", request.method(), request.uri());
        match request.into_body() {
            RequestBody::Whole(body) => {
                let mut answer = said.into_bytes();
                answer.extend_from_slice(&body);
                Response::new(full(answer))
            }
            _ => {
                let mut answer = Response::new(full("too large"));
                *answer.status_mut() = StatusCode::PAYLOAD_TOO_LARGE;
                answer
            }
        }
    }

    async fn connect(address: SocketAddr) -> TcpStream {
        TcpStream::connect(address).await.unwrap()
    }

    /// A client that has asked for `/`.
    async fn get(address: SocketAddr) -> TcpStream {
        let mut client = connect(address).await;
        client
            .write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        client
    }

    /// What the client reads until `needle` has come (or the connection's end).
    async fn read_until(client: &mut TcpStream, needle: &str) -> String {
        let mut seen = Vec::new();
        let reading = async {
            let mut chunk = [0u8; 4096];
            while !String::from_utf8_lossy(&seen).contains(needle) {
                match client.read(&mut chunk).await.unwrap() {
                    0 => break,
                    n => seen.extend_from_slice(&chunk[..n]),
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(5), reading)
            .await
            .expect("the answer came in time");
        String::from_utf8(seen).unwrap()
    }

    /// Whether the server closes the connection within a second.
    async fn closes(client: &mut TcpStream) -> bool {
        let mut rest = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(1), client.read_to_end(&mut rest));
        matches!(read.await, Ok(Ok(_)))
    }

    const PING: &[u8] = b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\n\r\nping";

    #[tokio::test]
    async fn keep_alive_connections_answer_request_after_request_also_after_a_pause() {
        let (address, _stop) = listen(echo).await;
        let mut client = connect(address).await;
        for _ in 0..2 {
            client.write_all(PING).await.unwrap();
            let answer = read_until(&mut client, "ping").await;
            assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
            assert!(answer.contains("content-length: 15\r\n"), "{answer}");
            assert!(answer.contains("date: "), "{answer}");
            assert!(answer.ends_with("\r\n\r\nPOST /echo ping"), "{answer}");
            tokio::time::sleep(Duration::from_millis(1300)).await;
        }
    }

    #[tokio::test]
    async fn a_request_that_arrives_in_pieces_is_read_whole() {
        let (address, _stop) = listen(echo).await;
        let mut client = connect(address).await;
        for piece in [&PING[..10], &PING[10..40], &PING[40..50], &PING[50..]] {
            client.write_all(piece).await.unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let answer = read_until(&mut client, "ping").await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }

    #[tokio::test]
    async fn a_request_whose_first_byte_comes_alone_is_served_as_http1() {
        // `P` alone could begin `POST` or h2's `PRI * HTTP/2.0` preface.
        let (address, _stop) = listen(echo).await;
        let mut client = connect(address).await;
        client.write_all(&PING[..1]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        client.write_all(&PING[1..]).await.unwrap();
        let answer = read_until(&mut client, "ping").await;
        assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
        assert!(answer.ends_with("POST /echo ping"), "{answer}");
    }

    #[tokio::test]
    async fn a_client_that_ends_after_a_lone_first_byte_is_closed_at_once() {
        let (address, _stop) = listen(echo).await;
        let mut client = connect(address).await;
        client.write_all(b"P").await.unwrap();
        client.shutdown().await.unwrap();
        // Closed with the `P` unread, so the end may come as a reset.
        let mut rest = Vec::new();
        let ended = tokio::time::timeout(Duration::from_secs(1), client.read_to_end(&mut rest));
        assert!(ended.await.is_ok(), "the connection was left open");
        assert!(rest.is_empty());
    }

    #[tokio::test]
    async fn a_request_left_unfinished_gets_408_and_the_connection_closes() {
        let (address, _stop) = listen(echo).await;
        let heads_and_bodies: [&[u8]; 2] = [
            b"POST /echo HTTP/1.1\r\nhost: x\r\n",
            b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\nabc",
        ];
        for begun in heads_and_bodies {
            let mut client = connect(address).await;
            client.write_all(begun).await.unwrap();
            let started = std::time::Instant::now();
            let answer = read_until(&mut client, "\r\n\r\n").await;
            assert!(started.elapsed() >= BEGUN_REQUEST_WAIT, "{answer}");
            assert!(
                answer.starts_with("HTTP/1.1 408 Request Timeout\r\n"),
                "{answer}"
            );
            assert!(answer.contains("connection: close\r\n"), "{answer}");
            assert!(closes(&mut client).await);
        }
    }

    #[tokio::test]
    async fn pipelined_requests_are_answered_in_order() {
        let (address, _stop) = listen(echo).await;
        let mut client = connect(address).await;
        let get = b"GET /second HTTP/1.1\r\nhost: x\r\n\r\n";
        client.write_all(&[PING, &get[..]].concat()).await.unwrap();
        let answers = read_until(&mut client, "GET /second ").await;
        let first = answers.find("POST /echo ping").unwrap();
        assert!(first < answers.find("GET /second ").unwrap(), "{answers}");
        assert_eq!(answers.matches("HTTP/1.1 200 OK").count(), 2, "{answers}");
    }

    #[tokio::test]
    async fn chunked_request_bodies_reach_the_handler_whole() {
        let (address, _stop) = listen(echo).await;
        let mut client = connect(address).await;
        let request = b"POST /c HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n\
                        4;ext=1\r\nhell\r\n3\r\no, \r\n5\r\nworld\r\n0\r\nx-trailer: 1\r\n\r\n";
        client.write_all(request).await.unwrap();
        let answer = read_until(&mut client, "world").await;
        assert!(answer.ends_with("POST /c hello, world"), "{answer}");
    }

    #[tokio::test]
    async fn expect_100_continue_gets_its_interim_answer_before_the_body_is_sent() {
        let (address, _stop) = listen(echo).await;
        let mut client = connect(address).await;
        let head =
            b"POST /e HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: 4\r\n\r\n";
        client.write_all(head).await.unwrap();
        let interim = read_until(&mut client, "\r\n\r\n").await;
        assert_eq!(interim, "HTTP/1.1 100 Continue\r\n\r\n");
        client.write_all(b"pong").await.unwrap();
        let answer = read_until(&mut client, "pong").await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }

    #[tokio::test]
    async fn unreadable_requests_get_400_or_431_and_the_connection_closes() {
        let (address, _stop) = listen(echo).await;
        let long = format!(
            "GET / HTTP/1.1\r\nhost: x\r\nx-long: {}\r\n\r\n",
            "a".repeat(70_000)
        );
        let many = format!(
            "GET / HTTP/1.1\r\nhost: x\r\n{}\r\n",
            "x-h: 1\r\n".repeat(130)
        );
        let cases = [
            (long.into_bytes(), "431 Request Header Fields Too Large"),
            (many.into_bytes(), "431 Request Header Fields Too Large"),
            (b"HELLO THERE\r\n\r\n".to_vec(), "400 Bad Request"),
            (
                b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\ncontent-length: 5\r\n\r\nabcde".to_vec(),
                "400 Bad Request",
            ),
            (
                b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: gzip\r\n\r\nxx".to_vec(),
                "400 Bad Request",
            ),
            (
                b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n".to_vec(),
                "400 Bad Request",
            ),
        ];
        for (request, status) in cases {
            let mut client = connect(address).await;
            let _ = client.write_all(&request).await;
            let answer = read_until(&mut client, "\r\n\r\n").await;
            assert!(
                answer.starts_with(&format!("HTTP/1.1 {status}\r\n")),
                "{answer}"
            );
            assert!(answer.contains("connection: close\r\n"), "{answer}");
            assert!(closes(&mut client).await);
        }
    }

    #[tokio::test]
    async fn a_large_body_is_read_only_when_its_limit_allows_and_else_the_connection_closes() {
        let (address, _stop) = listen(echo).await;
        let large = "x".repeat(70_000);
        let chunked = format!("{:X}\r\n{large}\r\n0\r\n\r\n", large.len());
        for (framing, body) in [
            (format!("content-length: {}", large.len()), &large),
            ("transfer-encoding: chunked".to_owned(), &chunked),
        ] {
            let stranger = format!("POST /big HTTP/1.1\r\nhost: x\r\n{framing}\r\n\r\n{body}");
            let mut client = connect(address).await;
            let _ = client.write_all(stranger.as_bytes()).await;
            let answer = read_until(&mut client, "too large").await;
            assert!(
                answer.starts_with("HTTP/1.1 413 Payload Too Large"),
                "{answer}"
            );
            assert!(answer.contains("connection: close\r\n"), "{answer}");
            assert!(closes(&mut client).await);
            let known =
                format!("POST /big HTTP/1.1\r\nhost: x\r\nx-known: yes\r\n{framing}\r\n\r\n{body}");
            let mut client = connect(address).await;
            client.write_all(known.as_bytes()).await.unwrap();
            let answer = read_until(&mut client, &large[..1000]).await;
            assert!(answer.starts_with("HTTP/1.1 200 OK"), "{}", &answer[..200]);
            assert!(
                answer.contains("content-length: 70010\r\n"),
                "{}",
                &answer[..200]
            );
        }
    }

    /// A handler's answer of unknown length: the events sent on `events`; `dropped` once the
    /// connection let go of it.
    struct Stream {
        events: mpsc::UnboundedSender<Bytes>,
        dropped: Arc<AtomicBool>,
    }

    fn streaming() -> (
        impl Fn(Request<RequestBody>) -> std::future::Ready<Response<Body>> + Send + Sync,
        Stream,
    ) {
        let (events, receiver) = mpsc::unbounded_channel::<Bytes>();
        let receiver = Arc::new(Mutex::new(Some(receiver)));
        let dropped = Arc::new(AtomicBool::new(false));
        let flag = dropped.clone();
        let handler = move |_request| {
            let receiver = receiver.lock().unwrap().take().unwrap();
            let guard = Guard(flag.clone());
            let frames = futures_util::stream::unfold((receiver, guard), |(mut r, g)| async move {
                let event = r.recv().await?;
                Some((Ok::<_, BoxError>(http_body::Frame::data(event)), (r, g)))
            });
            std::future::ready(Response::new(StreamBody::new(frames).boxed_unsync()))
        };
        (handler, Stream { events, dropped })
    }

    /// Sets its flag when dropped.
    struct Guard(Arc<AtomicBool>);

    impl Drop for Guard {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    #[tokio::test]
    async fn answers_of_unknown_length_are_chunked_an_event_a_chunk_and_end_with_the_last_chunk() {
        let (handler, Stream { events, .. }) = streaming();
        let (address, _stop) = listen(handler).await;
        let mut client = get(address).await;
        let head = read_until(&mut client, "\r\n\r\n").await;
        assert!(head.contains("transfer-encoding: chunked\r\n"), "{head}");
        events.send(Bytes::from_static(b"data: 1\n\n")).unwrap();
        assert_eq!(
            read_until(&mut client, "\n\n\r\n").await,
            "9\r\ndata: 1\n\n\r\n"
        );
        events.send(Bytes::from(vec![b'x'; 300])).unwrap();
        let chunk = read_until(&mut client, "x\r\n").await;
        assert!(chunk.starts_with("12C\r\nxxx"), "{chunk}");
        drop(events);
        assert_eq!(read_until(&mut client, "0\r\n\r\n").await, "0\r\n\r\n");
    }

    #[tokio::test]
    async fn data_ahead_of_a_body_failure_is_written_and_the_answer_is_left_cut() {
        let handler = |_request| {
            let frames = futures_util::stream::unfold(0, |sent| async move {
                let frame = match sent {
                    0 | 1 => Ok(http_body::Frame::data(Bytes::from(format!(
                        "data: {sent}\n\n"
                    )))),
                    2 => Err::<_, BoxError>("the upstream reset".into()),
                    _ => return None,
                };
                tokio::time::sleep(Duration::from_millis(20)).await;
                Some((frame, sent + 1))
            });
            std::future::ready(Response::new(StreamBody::new(frames).boxed_unsync()))
        };
        let (address, _stop) = listen(handler).await;
        let mut client = get(address).await;
        let answer = read_until(&mut client, "never").await;
        assert!(answer.contains("\r\n\r\n9\r\ndata: 0\n\n\r\n"), "{answer}");
        assert!(answer.ends_with("data: 1\n\n\r\n"), "{answer}");
    }

    #[tokio::test]
    async fn http_1_0_clients_get_answers_of_unknown_length_until_the_connection_closes() {
        let (handler, Stream { events, .. }) = streaming();
        let (address, _stop) = listen(handler).await;
        let mut client = connect(address).await;
        client.write_all(b"GET / HTTP/1.0\r\n\r\n").await.unwrap();
        events.send(Bytes::from_static(b"first ")).unwrap();
        events.send(Bytes::from_static(b"second")).unwrap();
        drop(events);
        let answer = read_until(&mut client, "never").await;
        assert!(answer.starts_with("HTTP/1.0 200 OK\r\n"), "{answer}");
        assert!(!answer.contains("transfer-encoding"), "{answer}");
        assert!(answer.ends_with("\r\n\r\nfirst second"), "{answer}");
    }

    #[tokio::test]
    async fn http_1_0_keep_alive_is_kept_for_answers_of_known_length() {
        let (address, _stop) = listen(echo).await;
        let mut client = connect(address).await;
        for _ in 0..2 {
            client
                .write_all(b"GET /ka HTTP/1.0\r\nconnection: keep-alive\r\n\r\n")
                .await
                .unwrap();
            let answer = read_until(&mut client, "GET /ka ").await;
            assert!(answer.contains("connection: keep-alive\r\n"), "{answer}");
        }
        client
            .write_all(b"GET /last HTTP/1.0\r\n\r\n")
            .await
            .unwrap();
        let answer = read_until(&mut client, "GET /last ").await;
        assert!(!answer.contains("connection: keep-alive"), "{answer}");
        assert!(closes(&mut client).await);
    }

    #[tokio::test]
    async fn head_requests_and_204_answers_carry_no_body() {
        let (address, _stop) = listen(|request: Request<RequestBody>| async move {
            let mut answer = Response::new(full("twelve bytes"));
            if request.uri() == "/none" {
                *answer.status_mut() = StatusCode::NO_CONTENT;
            }
            answer
        })
        .await;
        let mut client = connect(address).await;
        client
            .write_all(b"HEAD / HTTP/1.1\r\nhost: x\r\n\r\nGET /none HTTP/1.1\r\nhost: x\r\n\r\nGET / HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let answers = read_until(&mut client, "twelve bytes").await;
        let parts: Vec<&str> = answers.split("HTTP/1.1 ").collect();
        assert_eq!(parts.len(), 4, "{answers}");
        assert!(parts[1].starts_with("200 OK") && parts[1].contains("content-length: 12\r\n"));
        assert!(parts[1].ends_with("\r\n\r\n"), "{answers}");
        assert!(parts[2].starts_with("204 No Content") && !parts[2].contains("content-length"));
        assert!(parts[3].ends_with("\r\n\r\ntwelve bytes"), "{answers}");
    }

    #[tokio::test]
    async fn a_client_that_leaves_cancels_its_request() {
        let dropped = Arc::new(AtomicBool::new(false));
        let flag = dropped.clone();
        let (address, _stop) = listen(move |_request| {
            let guard = Guard(flag.clone());
            async move {
                std::future::pending::<()>().await;
                drop(guard);
                Response::new(full(""))
            }
        })
        .await;
        let mut client = connect(address).await;
        client.write_all(PING).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!dropped.load(Ordering::SeqCst));
        drop(client);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(dropped.load(Ordering::SeqCst), "the handler was dropped");
    }

    #[tokio::test]
    async fn a_client_that_leaves_mid_stream_ends_the_stream_at_once() {
        let (handler, Stream { events, dropped }) = streaming();
        let (address, _stop) = listen(handler).await;
        let mut client = connect(address).await;
        client
            .write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        events.send(Bytes::from_static(b"data: 1\n\n")).unwrap();
        read_until(&mut client, "data: 1").await;
        drop(client);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(dropped.load(Ordering::SeqCst), "the body was dropped");
    }

    /// A server whose handler answers "finished" once `release` (the third) is raised; the
    /// second stops it.
    async fn answering_once_released() -> (SocketAddr, watch::Sender<Phase>, watch::Sender<bool>) {
        let (release, released) = watch::channel(false);
        let (address, stop) = listen(move |_request| {
            let mut released = released.clone();
            async move {
                let _ = released.wait_for(|r| *r).await;
                Response::new(full("finished"))
            }
        })
        .await;
        (address, stop, release)
    }

    #[tokio::test]
    async fn shutdown_closes_idle_connections_and_answers_requests_under_way_first() {
        let (address, stop, release) = answering_once_released().await;
        let mut idle = connect(address).await;
        let mut busy = connect(address).await;
        busy.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        stop.send(Phase::Closing).unwrap();
        assert!(closes(&mut idle).await);
        release.send(true).unwrap();
        let answer = read_until(&mut busy, "finished").await;
        assert!(answer.contains("connection: close\r\n"), "{answer}");
        assert!(closes(&mut busy).await);
    }

    #[tokio::test]
    async fn a_connection_idle_after_its_requests_closes_when_shutdown_begins() {
        let (address, stop) = listen(|_request| async { Response::new(full("done")) }).await;
        let mut client = connect(address).await;
        // Its wait for the shutdown signal was polled at every request since the first.
        for _ in 0..3 {
            client
                .write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
                .await
                .unwrap();
            let answer = read_until(&mut client, "done").await;
            assert!(!answer.contains("connection: close"), "{answer}");
        }
        stop.send(Phase::Closing).unwrap();
        assert!(closes(&mut client).await);
    }

    #[tokio::test]
    async fn a_request_under_way_when_shutdown_begins_is_answered_with_connection_close() {
        let (address, stop, release) = answering_once_released().await;
        let mut client = connect(address).await;
        // An earlier request first: the connection's wait is registered before shutdown.
        release.send(true).unwrap();
        client
            .write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let first = read_until(&mut client, "finished").await;
        assert!(!first.contains("connection: close"), "{first}");
        release.send(false).unwrap();
        client
            .write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        stop.send(Phase::Closing).unwrap();
        release.send(true).unwrap();
        let second = read_until(&mut client, "finished").await;
        assert!(second.contains("connection: close\r\n"), "{second}");
        assert!(closes(&mut client).await);
    }

    #[tokio::test]
    async fn a_connection_silent_when_the_listener_closes_gets_a_second_for_its_request() {
        let (address, stop) = listen(|_request| async { Response::new(full("done")) }).await;
        let mut late = connect(address).await;
        let mut silent = connect(address).await;
        // Within the listener's head deadline here (400 ms).
        tokio::time::sleep(Duration::from_millis(50)).await;
        stop.send(Phase::Closing).unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        late.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let answer = read_until(&mut late, "done").await;
        assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
        assert!(answer.contains("connection: close\r\n"), "{answer}");
        assert!(closes(&mut silent).await, "a silent connection stayed open");
    }

    #[tokio::test]
    async fn while_draining_idle_connections_stay_and_new_ones_are_served_each_answer_closing() {
        let (address, stop) = listen(|_request| async { Response::new(full("done")) }).await;
        let mut idle = connect(address).await;
        idle.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        assert!(!read_until(&mut idle, "done")
            .await
            .contains("connection: close"));
        stop.send(Phase::Draining).unwrap();
        // The idle connection is kept: a request already on its way to it is not lost.
        assert!(
            !closes(&mut idle).await,
            "an idle connection closed while draining"
        );
        for client in [&mut idle, &mut connect(address).await] {
            client
                .write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
                .await
                .unwrap();
            let answer = read_until(client, "done").await;
            assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
            assert!(answer.contains("connection: close\r\n"), "{answer}");
            assert!(closes(client).await);
        }
        stop.send(Phase::Closing).unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            TcpStream::connect(address).await.is_err(),
            "still accepting"
        );
    }

    #[tokio::test]
    async fn an_upgrade_hands_over_the_socket_with_what_the_client_sent_after_its_handshake() {
        let (address, _stop) = listen(|mut request: Request<RequestBody>| async move {
            let upgrade = OnUpgrade::take(&mut request);
            tokio::spawn(async move {
                let mut upgraded = upgrade.await.unwrap();
                let mut got = [0u8; 5];
                upgraded.read_exact(&mut got).await.unwrap();
                upgraded.write_all(&got).await.unwrap();
            });
            let mut answer = Response::new(full(""));
            *answer.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
            answer
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
            answer
                .headers_mut()
                .insert(header::UPGRADE, HeaderValue::from_static("echo"));
            answer
        })
        .await;
        let mut client = connect(address).await;
        client
            .write_all(
                b"GET / HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: echo\r\n\r\nhel",
            )
            .await
            .unwrap();
        let head = read_until(&mut client, "\r\n\r\n").await;
        assert!(
            head.starts_with("HTTP/1.1 101 Switching Protocols\r\n"),
            "{head}"
        );
        assert!(
            head.contains("connection: upgrade\r\nupgrade: echo\r\n"),
            "{head}"
        );
        assert!(!head.contains("content-length"), "{head}");
        client.write_all(b"lo").await.unwrap();
        assert_eq!(read_until(&mut client, "hello").await, "hello");
    }

    /// A valid request to `/r` carrying `body`, framed by `content-length` or `chunked` (random
    /// chunks, an extension or a trailer now and then); a body-less GET when `body` is empty.
    fn request(rng: &mut impl rand::Rng, body: &[u8]) -> Vec<u8> {
        if body.is_empty() {
            return b"GET /r HTTP/1.1\r\nhost: x\r\n\r\n".to_vec();
        }
        let mut request = b"POST /r HTTP/1.1\r\nhost: x\r\n".to_vec();
        if rng.random_bool(0.5) {
            request.extend_from_slice(format!("content-length: {}\r\n\r\n", body.len()).as_bytes());
            request.extend_from_slice(body);
            return request;
        }
        request.extend_from_slice(b"transfer-encoding: chunked\r\n\r\n");
        for piece in body.chunks(rng.random_range(1..=body.len())) {
            let ext = if rng.random_bool(0.2) { ";a=b" } else { "" };
            request.extend_from_slice(format!("{:x}{ext}\r\n", piece.len()).as_bytes());
            request.extend_from_slice(piece);
            request.extend_from_slice(b"\r\n");
        }
        let trailer = if rng.random_bool(0.2) {
            "x-t: 1\r\n"
        } else {
            ""
        };
        request.extend_from_slice(format!("0\r\n{trailer}\r\n").as_bytes());
        request
    }

    /// What [`echo`] answers to a request [`request`] made of `body`.
    fn echoed(body: &[u8]) -> String {
        match body.is_empty() {
            true => "GET /r ".to_owned(),
            false => format!("POST /r {}", String::from_utf8_lossy(body)),
        }
    }

    #[tokio::test]
    async fn random_and_damaged_requests_get_their_answers_or_a_close_in_time() {
        use rand::{Rng, SeedableRng};
        static PANICS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let earlier = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.fetch_add(1, Ordering::SeqCst);
            earlier(info);
        }));
        let (address, _stop) = listen(echo).await;
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        for round in 0..300 {
            let bodies: Vec<Vec<u8>> = (0..rng.random_range(1..=3))
                .map(|_| {
                    (0..rng.random_range(0..2000))
                        .map(|_| rng.random_range(b'a'..=b'z'))
                        .collect()
                })
                .collect();
            let mut sent: Vec<u8> = bodies
                .iter()
                .flat_map(|body| request(&mut rng, body))
                .collect();
            let intact = rng.random_bool(0.4);
            if !intact {
                crate::wire_damage::damage(&mut rng, &mut sent);
            }
            let mut client = connect(address).await;
            let talk = async {
                let mut from = 0;
                for _ in 0..rng.random_range(1..4) {
                    let to = rng.random_range(from..=sent.len());
                    if client.write_all(&sent[from..to]).await.is_err() {
                        break;
                    }
                    from = to;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                let _ = client.write_all(&sent[from..]).await;
                // Intact requests are answered while the client still listens; a damaged one may
                // leave the server waiting for more, and the end of the sending says none comes.
                // (A client that sends its end leaves, as far as the server can tell.)
                if !intact {
                    let _ = client.shutdown().await;
                }
                let last = echoed(bodies.last().map_or(&[][..], Vec::as_slice));
                let mut answers = Vec::new();
                let mut chunk = [0u8; 4096];
                while !(intact && answers.ends_with(last.as_bytes())) {
                    match client.read(&mut chunk).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => answers.extend_from_slice(&chunk[..n]),
                    }
                }
                answers
            };
            let answers = tokio::time::timeout(Duration::from_secs(5), talk)
                .await
                .unwrap_or_else(|_| panic!("round {round}: no end within 5 s"));
            let answers = String::from_utf8_lossy(&answers);
            assert!(
                answers.is_empty() || answers.starts_with("HTTP/1.1 "),
                "round {round}: {answers}"
            );
            if intact {
                assert_eq!(
                    answers.matches("HTTP/1.1 200 OK\r\n").count(),
                    bodies.len(),
                    "round {round}: sent {:?}, answered {answers:?}",
                    String::from_utf8_lossy(&sent)
                );
                let mut rest = &answers[..];
                for body in &bodies {
                    let echoed = echoed(body);
                    let at = rest
                        .find(&echoed)
                        .unwrap_or_else(|| panic!("round {round}: {echoed} missing"));
                    rest = &rest[at + echoed.len()..];
                }
            }
        }
        assert_eq!(PANICS.load(Ordering::SeqCst), 0);
    }
}
