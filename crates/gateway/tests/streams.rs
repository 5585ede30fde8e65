//! Streams after their first content event (contract section 2.1, rules 4 and 5): a cut is told
//! with an explicit error event, or, on an alias that continues cut streams, finished by another
//! target from a prefill so the caller receives one whole answer.

#![allow(clippy::unwrap_used)]

mod common;

use common::*;

fn config(continue_cut_streams: bool) -> String {
    format!(
        "backends:\n  - {{ name: first, provider: azure, region: swedencentral, url: \"{{url:first}}\" }}\n  - {{ name: second, provider: azure, region: francecentral, url: \"{{url:second}}\" }}\nmodels:\n  - name: chat\n    continue_cut_streams: {continue_cut_streams}\n    targets:\n      - {{ backend: first, deployment: gpt-4o, priority: 1 }}\n      - {{ backend: second, deployment: gpt-4o, priority: 2, accepts_prefill: true }}\n"
    )
}

fn fleet(cut_after: u32) -> Vec<EndpointSpec> {
    vec![
        EndpointSpec::azure("first", "swedencentral")
            .deployment(DeploymentSpec::new("gpt-4o"))
            .behavior(Behavior {
                cut_after: Some(cut_after),
                ..Behavior::default()
            }),
        EndpointSpec::azure("second", "francecentral").deployment(DeploymentSpec::new("gpt-4o")),
    ]
}

/// The data payloads of an SSE body, `[DONE]` excluded.
fn events(body: &str) -> Vec<serde_json::Value> {
    body.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

fn text(events: &[serde_json::Value]) -> String {
    events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect()
}

#[tokio::test]
async fn a_cut_stream_on_a_continuing_alias_is_finished_by_a_prefill_target_as_one_answer() {
    let h = Harness::start(fleet(3), &config(true)).await;
    let answer = h
        .post("/v1/chat/completions", chat_body("chat", true))
        .await;
    assert_eq!(answer.status, 200);
    assert!(answer.body.ends_with("data: [DONE]\n\n"), "{}", answer.body);
    let events = events(&answer.body);
    assert!(
        events.iter().all(|e| e.get("error").is_none()),
        "{}",
        answer.body
    );
    let ids: std::collections::BTreeSet<String> =
        events.iter().map(|e| e["id"].to_string()).collect();
    assert_eq!(ids.len(), 1, "one answer, one id: {ids:?}");
    let finishes = events
        .iter()
        .filter(|e| !e["choices"][0]["finish_reason"].is_null())
        .count();
    assert_eq!(finishes, 1, "{}", answer.body);
    let text = text(&events);
    assert!(text.starts_with("Hello from first/gpt-4o"), "{text}");
    assert!(text.contains("continued by second/gpt-4o"), "{text}");
    assert_eq!(
        text.matches("Hello").count(),
        1,
        "the prefix was sent twice: {text}"
    );
    assert_eq!(h.endpoint("second").requests("gpt-4o"), 1);
}

/// `first` and `replica` are one upstream (the same endpoint and deployment), whose first stream
/// is cut after three words; `replica` takes no prefill. Usage goes to `db`.
fn replicated(db: &std::path::Path, replica_url: &str) -> String {
    format!(
        "usage: {{ store: \"sqlite://{}\" }}\nbackends:\n  - {{ name: first, provider: azure, region: swedencentral, url: \"{{url:first}}\" }}\n  - {{ name: replica, provider: azure, region: francecentral, url: \"{replica_url}\" }}\nmodels:\n  - name: chat\n    continue_cut_streams: true\n    targets:\n      - {{ backend: first, deployment: gpt-4o, priority: 1 }}\n      - {{ backend: replica, deployment: gpt-4o, priority: 2 }}\n",
        db.display()
    )
}

fn cut_once() -> Vec<EndpointSpec> {
    let cut = Behavior {
        cut_after: Some(3),
        cut_first: Some(1),
        ..Behavior::default()
    };
    vec![
        EndpointSpec::azure("first", "swedencentral")
            .deployment(DeploymentSpec::new("gpt-4o"))
            .behavior(cut),
        EndpointSpec::azure("second", "francecentral").deployment(DeploymentSpec::new("gpt-4o")),
    ]
}

fn temp_db(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("onedoor-streams-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("usage.db")
}

/// The stored record of request `id`: status, error, stream_cut, output tokens.
async fn stored(h: Harness, db: &std::path::Path, id: &str) -> (i64, Option<String>, bool, i64) {
    let Harness { gateway, fleet, .. } = h;
    gateway.shutdown().await;
    fleet.shutdown().await;
    let connection = rusqlite::Connection::open(db).unwrap();
    connection
        .query_row(
            "SELECT status, error, stream_cut, output_tokens FROM usage_records WHERE request_id = ?1",
            [id],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
        )
        .unwrap()
}

#[tokio::test]
async fn a_cut_stream_whose_fallback_takes_no_prefill_is_restarted_there_and_relayed_past_what_was_sent(
) {
    let db = temp_db("restart");
    let h = Harness::start(cut_once(), &replicated(&db, "{url:first}")).await;
    let answer = h
        .post("/v1/chat/completions", chat_body("chat", true))
        .await;
    assert_eq!(answer.status, 200);
    assert!(answer.body.ends_with("data: [DONE]\n\n"), "{}", answer.body);
    let events = events(&answer.body);
    assert!(
        events.iter().all(|e| e.get("error").is_none()),
        "{}",
        answer.body
    );
    let ids: std::collections::BTreeSet<String> =
        events.iter().map(|e| e["id"].to_string()).collect();
    assert_eq!(ids.len(), 1, "one answer, one id: {ids:?}");
    let finishes = events
        .iter()
        .filter(|e| !e["choices"][0]["finish_reason"].is_null())
        .count();
    assert_eq!(finishes, 1, "{}", answer.body);
    assert_eq!(
        text(&events),
        "Hello from first/gpt-4o this is a simulated reply",
        "{}",
        answer.body
    );
    assert_eq!(
        h.endpoint("first").requests("gpt-4o"),
        2,
        "cut, then restarted"
    );
    let id = answer.header("x-onedoor-request-id").to_owned();
    let (status, error, cut, output) = stored(h, &db, &id).await;
    assert_eq!((status, error, cut), (200, None, false));
    // The restart's eight words and the words of the attempt that was cut.
    assert!(output > 8, "output tokens {output}: both attempts count");
}

#[tokio::test]
async fn a_restarted_answer_that_differs_from_what_was_sent_ends_with_the_error_event() {
    let db = temp_db("diverged");
    let h = Harness::start(cut_once(), &replicated(&db, "{url:second}")).await;
    let answer = h
        .post("/v1/chat/completions", chat_body("chat", true))
        .await;
    let events = events(&answer.body);
    let message = events.last().unwrap()["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        message.contains("differs from the text already sent"),
        "{}",
        answer.body
    );
    assert!(!answer.body.contains("[DONE]"));
    assert_eq!(text(&events), "Hello from first/gpt-4o", "{}", answer.body);
    assert_eq!(h.endpoint("second").requests("gpt-4o"), 1);
    let id = answer.header("x-onedoor-request-id").to_owned();
    let (status, error, cut, _) = stored(h, &db, &id).await;
    assert_eq!(status, 200);
    assert!(cut);
    assert_eq!(
        error.as_deref(),
        Some("upstream_failed"),
        "a cut stream's record carries its error"
    );
}

#[tokio::test]
async fn a_fallback_that_rejects_the_prefill_yields_the_original_cut() {
    let h = Harness::start(fleet(2), &config(true)).await;
    h.endpoint("second").set_behavior(Behavior {
        status: Some(400),
        ..Behavior::default()
    });
    let answer = h
        .post("/v1/chat/completions", chat_body("chat", true))
        .await;
    let events = events(&answer.body);
    let last = events.last().unwrap();
    let message = last["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("upstream stream"), "{}", answer.body);
    assert!(!answer.body.contains("[DONE]"));
    assert_eq!(
        h.endpoint("second").requests("gpt-4o"),
        1,
        "the fallback was not asked"
    );
}

#[tokio::test]
async fn without_continuation_a_cut_ends_in_an_error_event_and_no_fallback_is_asked() {
    let h = Harness::start(fleet(3), &config(false)).await;
    let answer = h
        .post("/v1/chat/completions", chat_body("chat", true))
        .await;
    let events = events(&answer.body);
    assert!(
        events.last().unwrap().get("error").is_some(),
        "{}",
        answer.body
    );
    assert_eq!(h.endpoint("second").total_requests(), 0);
}

#[tokio::test]
async fn finished_streams_and_answers_hand_their_upstream_connection_to_the_next_request() {
    let fleet = vec![
        EndpointSpec::azure("first", "swedencentral").deployment(DeploymentSpec::new("gpt-4o"))
    ];
    let config = "backends:\n  - { name: first, provider: azure, region: swedencentral, url: \"{url:first}\" }\nmodels:\n  - name: chat\n    targets:\n      - { backend: first, deployment: gpt-4o }\n";
    let h = Harness::start(fleet, config).await;
    for stream in [
        true, false, true, true, false, true, true, false, true, true,
    ] {
        let answer = h
            .post("/v1/chat/completions", chat_body("chat", stream))
            .await;
        assert_eq!(answer.status, 200, "{}", answer.body);
    }
    let upstream = h.endpoint("first");
    assert_eq!(upstream.total_requests(), 10);
    // One pool per lane (and one off the lanes): each may open its own connection, no more.
    let pools = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64 + 1;
    assert!(
        upstream.connections() <= pools,
        "{} upstream connections for 10 requests one after another",
        upstream.connections()
    );
}

/// A stream whose tokens come `gap_ms` apart, on a route whose idle timeout is 300 ms.
async fn paced_stream(gap_ms: u64) -> String {
    let fleet = vec![EndpointSpec::azure("first", "swedencentral")
        .deployment(DeploymentSpec::new("gpt-4o"))
        .behavior(Behavior {
            inter_token_ms: gap_ms,
            reply_words: Some(5),
            ..Behavior::default()
        })];
    let config = "routing: { timeouts: { idle: 300ms } }\nbackends:\n  - { name: first, provider: azure, region: swedencentral, url: \"{url:first}\" }\nmodels:\n  - name: chat\n    targets:\n      - { backend: first, deployment: gpt-4o }\n";
    let h = Harness::start(fleet, config).await;
    let answer = h
        .post("/v1/chat/completions", chat_body("chat", true))
        .await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    answer.body
}

#[tokio::test]
async fn the_idle_timeout_counts_from_the_last_event_not_from_the_first() {
    // Five tokens 120 ms apart take longer than the idle timeout in all, never between two.
    let body = paced_stream(120).await;
    let events = events(&body);
    assert!(events.iter().all(|e| e.get("error").is_none()), "{body}");
    assert_eq!(text(&events).split_whitespace().count(), 5, "{body}");
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
}

#[tokio::test]
async fn a_stream_that_stalls_after_its_first_token_is_cut_by_the_idle_timeout() {
    let body = paced_stream(700).await;
    let events = events(&body);
    let error = &events.last().unwrap()["error"];
    assert!(
        error["message"].as_str().unwrap().contains("idle timeout"),
        "{body}"
    );
    assert_eq!(text(&events).split_whitespace().count(), 1, "{body}");
}
