//! Chaos: four backends with 429s, 500s, hangs and resets injected at random under steady load.
//! Every request ends in a success or one of the contract's error codes, none outlives the total
//! timeout, and every request gets exactly one answer. `ONEDOOR_CHAOS_SECONDS` sets the length
//! (CI runs a short form; 60 is the full run).

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use rand::Rng;

const CODES: [&str; 6] = [
    "upstream_rate_limited",
    "upstream_failed",
    "circuit_open",
    "no_backend_available",
    "upstream_timeout",
    "gateway_overloaded",
];

fn random_fault(rng: &mut impl Rng) -> Behavior {
    let mut behavior = Behavior {
        ttft_ms: rng.random_range(0..30),
        inter_token_ms: rng.random_range(0..5),
        ..Behavior::default()
    };
    match rng.random_range(0..6) {
        0 => behavior.status = Some(429),
        1 => behavior.error_rate = 0.5,
        2 => behavior.hang = true,
        3 => behavior.reset = true,
        4 => behavior.cut_after = Some(2),
        _ => {}
    }
    behavior.retry_after_s = Some(1);
    behavior
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_random_faults_every_request_ends_in_success_or_a_contract_error_in_time() {
    let seconds: u64 = std::env::var("ONEDOOR_CHAOS_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(8);
    let names = ["c1", "c2", "c3", "c4"];
    let specs = names
        .iter()
        .map(|n| EndpointSpec::azure(n, "swedencentral").deployment(DeploymentSpec::new("gpt-4o")))
        .collect();
    let mut config = String::from(
        "routing: { timeouts: { connect: 200ms, first_token: 300ms, idle: 300ms, total: 1500ms } }\ncircuit_breakers:\n  default:\n    rules:\n      - { name: errors, failures: { count: 5, within: 10s, status: [500-599, connect_error, timeout] }, trip: 1s }\nbackends:\n",
    );
    for n in names {
        config.push_str(&format!(
            "  - {{ name: {n}, provider: azure, region: swedencentral, url: \"{{url:{n}}}\", circuit_breaker: default }}\n"
        ));
    }
    config.push_str("models:\n  - name: chat\n    targets:\n");
    for n in names {
        config.push_str(&format!("      - {{ backend: {n}, deployment: gpt-4o }}\n"));
    }
    let h = Arc::new(Harness::start(specs, &config).await);
    let stop_at = Instant::now() + Duration::from_secs(seconds);

    let chaos = tokio::spawn({
        let h = h.clone();
        async move {
            while Instant::now() < stop_at {
                let (name, fault) = {
                    let mut rng = rand::rng();
                    (
                        names[rng.random_range(0..names.len())],
                        random_fault(&mut rng),
                    )
                };
                h.endpoint(name).set_behavior(fault);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    });

    let sent = Arc::new(AtomicU64::new(0));
    let answered = Arc::new(AtomicU64::new(0));
    let mut clients = Vec::new();
    for client in 0..8 {
        let (h, sent, answered) = (h.clone(), sent.clone(), answered.clone());
        clients.push(tokio::spawn(async move {
            let mut failures = Vec::new();
            while Instant::now() < stop_at {
                let stream = client % 2 == 0;
                sent.fetch_add(1, Ordering::Relaxed);
                let started = Instant::now();
                let answer = h
                    .post("/v1/chat/completions", chat_body("chat", stream))
                    .await;
                answered.fetch_add(1, Ordering::Relaxed);
                let took = started.elapsed();
                if took > Duration::from_millis(1500 + 1000) {
                    failures.push(format!("took {took:?}: {}", answer.attempts()));
                }
                match answer.status.as_u16() {
                    200 => {
                        if stream && !answer.body.ends_with("data: [DONE]\n\n") {
                            let last = answer
                                .body
                                .trim_end()
                                .lines()
                                .last()
                                .unwrap_or("")
                                .to_owned();
                            if !last.starts_with("data: {\"error\"") {
                                failures.push(format!("a stream ended silently: {last}"));
                            }
                        }
                    }
                    _ => {
                        let code = answer.header("x-onedoor-error").to_owned();
                        if !CODES.contains(&code.as_str()) {
                            failures.push(format!(
                                "status {} code {code:?}: {}",
                                answer.status, answer.body
                            ));
                        }
                    }
                }
            }
            failures
        }));
    }
    let mut failures = Vec::new();
    for client in clients {
        failures.extend(client.await.unwrap());
    }
    chaos.await.unwrap();
    let (sent, answered) = (
        sent.load(Ordering::Relaxed),
        answered.load(Ordering::Relaxed),
    );
    assert_eq!(sent, answered);
    assert!(sent > 20, "too little load: {sent}");
    assert!(
        failures.is_empty(),
        "{} of {sent} requests misbehaved: {:#?}",
        failures.len(),
        &failures[..failures.len().min(10)]
    );
}
