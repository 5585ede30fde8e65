//! The shared state store going away and coming back (contract section 2 `state.on_store_error`),
//! on a Redis of the test's own (`redis-server` on a free port, killed and restarted; the
//! machine's Redis is left alone): `fail_open` keeps serving with each instance's own limits and
//! says so on `/readyz`, `fail_closed` answers 503 `state_unavailable`, and once Redis is back the
//! shared limits hold again without a restart. A Redis that keeps an append-only file and is
//! killed during traffic comes back with its counters and breakers, and the scripts it no longer
//! holds are loaded again.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
// The shared harness re-exports the mock's `Behavior`, which these tests have no use for.
#![allow(unused_imports)]

mod common;
mod instances;
mod own_redis;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use instances::*;
use own_redis::*;

fn config(redis: &OwnRedis, on_error: &str, limits: &str) -> String {
    format!(
        "state: {{ store: redis, redis_url: \"{}\", on_store_error: {on_error}, key_prefix: {} }}\nbackends:\n  - {{ name: a, provider: azure, region: swedencentral, url: \"{{url:a}}\" }}\nmodels:\n  - {{ name: chat, targets: [{{ backend: a, deployment: gpt-4o }}] }}\ntenants:\n  - name: team\n    keys: [{{ id: team-key, sha256: {} }}]\n    limits: {limits}\n",
        redis.url(),
        unique_prefix(on_error),
        key_hash(KEY)
    )
}

async fn readiness(h: &Harness, gateway: &onedoor_gateway::Running) -> (u16, serde_json::Value) {
    let answer = get_on(h, gateway, "/readyz").await;
    (answer.status.as_u16(), answer.json())
}

#[tokio::test]
async fn fail_open_serves_with_local_limits_while_redis_is_down_and_shares_again_when_it_is_back() {
    let mut redis = OwnRedis::start(free_port());
    let config = config(&redis, "fail_open", "{ rpm: 10 }");
    let h = Harness::start(
        vec![EndpointSpec::azure("a", "swedencentral").deployment(DeploymentSpec::new("gpt-4o"))],
        &config,
    )
    .await;
    let gateways = vec![
        Arc::new(another(&h, &config).await),
        Arc::new(another(&h, &config).await),
    ];
    let h = Arc::new(h);
    let body = chat_body("chat", false);
    assert_eq!(
        tally(&spread(&h, &gateways, body.clone(), 15, 4).await),
        (10, 5, 0)
    );

    redis.stop();
    // Each instance now holds the limit on its own: 10 each.
    assert_eq!(
        tally(&spread(&h, &gateways, body.clone(), 30, 4).await),
        (20, 10, 0)
    );
    for gateway in &gateways {
        let (status, ready) = readiness(&h, gateway).await;
        assert_eq!(status, 200, "fail_open stays ready: {ready}");
        assert_eq!(ready["state"]["mode"], "fail_open");
        assert_eq!(ready["state"]["reachable"], false);
        assert!(ready["state"]["outages"].as_u64().unwrap() >= 1);
    }

    redis.start_again();
    for gateway in &gateways {
        let back = until(Duration::from_secs(10), || async {
            readiness(&h, gateway).await.1["state"]["mode"] == "shared"
        })
        .await;
        assert!(back, "the instance did not reconnect to Redis");
    }
    // The restarted Redis starts empty: the shared limit holds across both again.
    assert_eq!(tally(&spread(&h, &gateways, body, 15, 4).await), (10, 5, 0));
}

#[tokio::test]
async fn fail_closed_answers_503_state_unavailable_while_redis_is_down_and_serves_when_it_is_back()
{
    let mut redis = OwnRedis::start(free_port());
    let h = Harness::start(
        vec![EndpointSpec::azure("a", "swedencentral").deployment(DeploymentSpec::new("gpt-4o"))],
        &config(&redis, "fail_closed", "{ rpm: 1000 }"),
    )
    .await;
    assert_eq!(h.chat("chat").await.status, 200);
    redis.stop();
    for _ in 0..3 {
        let refused = h.chat("chat").await;
        assert_eq!(refused.status, 503, "{}", refused.body);
        assert_eq!(refused.code(), "state_unavailable");
        assert_eq!(refused.header("retry-after"), "1");
    }
    let (status, ready) = readiness(&h, &h.gateway).await;
    assert_eq!((status, ready["status"].as_str()), (503, Some("not_ready")));
    assert_eq!(ready["state"]["mode"], "fail_closed");
    assert_eq!(
        h.endpoint("a").requests("gpt-4o"),
        1,
        "nothing reached the upstream"
    );

    redis.start_again();
    let back = until(Duration::from_secs(10), || async {
        readiness(&h, &h.gateway).await.0 == 200
    })
    .await;
    assert!(back, "the gateway did not reconnect to Redis");
    assert_eq!(h.chat("chat").await.status, 200);
}

/// A server that writes every change to its append-only file before answering, so a kill loses
/// nothing: what it counted is there when it is started again.
fn persisted_redis(dir: &Scratch) -> OwnRedis {
    let port = free_port();
    let args = ["--port", &port.to_string(), "--bind", "127.0.0.1"]
        .into_iter()
        .chain(["--appendonly", "yes", "--appendfsync", "always"])
        .map(str::to_owned)
        .collect();
    OwnRedis::spawn(&dir.0, args, port, answers_ping)
}

#[tokio::test]
async fn a_redis_killed_and_restarted_during_traffic_is_survived_and_its_counters_and_breakers_continue(
) {
    let dir = Scratch::new("restart");
    let mut redis = persisted_redis(&dir);
    let config = format!(
        "state: {{ store: redis, redis_url: \"{}\", on_store_error: fail_open, key_prefix: {} }}\ncircuit_breakers:\n  trip-once:\n    rules: [{{ name: server-errors, failures: {{ count: 1, within: 60s, status: [500-599] }}, trip: 60s }}]\nbackends:\n  - {{ name: bad, provider: azure, region: swedencentral, url: \"{{url:bad}}\", circuit_breaker: trip-once }}\n  - {{ name: good, provider: azure, region: swedencentral, url: \"{{url:good}}\" }}\nmodels:\n  - name: chat\n    targets:\n      - {{ backend: bad, deployment: gpt-4o, priority: 1 }}\n      - {{ backend: good, deployment: gpt-4o, priority: 2 }}\n  - {{ name: steady, targets: [{{ backend: good, deployment: gpt-4o }}] }}\ntenants:\n  - name: team\n    keys: [{{ id: team-key, sha256: {} }}]\n    limits: {{ rpm: 10 }}\n  - name: other\n    keys: [{{ id: other-key, sha256: {} }}]\n",
        redis.url(),
        unique_prefix("restart"),
        key_hash(KEY),
        key_hash(OTHER_KEY),
    );
    let h = Harness::start(
        vec![
            EndpointSpec::azure("bad", "swedencentral").deployment(DeploymentSpec::new("gpt-4o")),
            EndpointSpec::azure("good", "swedencentral").deployment(DeploymentSpec::new("gpt-4o")),
        ],
        &config,
    )
    .await;
    h.endpoint("bad").set_deployment_behavior(
        "gpt-4o",
        Behavior {
            status: Some(500),
            ..Behavior::default()
        },
    );
    let gateways = [
        Arc::new(another(&h, &config).await),
        Arc::new(another(&h, &config).await),
    ];
    let body = chat_body("chat", false);
    let tripped = chat_on(&h, &gateways[0], &body).await;
    assert_eq!(tripped.attempts(), "bad=500,good=200");
    for _ in 0..2 {
        assert_eq!(
            chat_on(&h, &gateways[1], &body).await.attempts(),
            "good=200"
        );
    }

    // Traffic of an unlimited tenant, to a model the breaker does not guard, keeps flowing
    // through both while Redis is killed and started again on the same port.
    let h = Arc::new(h);
    let steady = chat_body("steady", false);
    let running = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let traffic = {
        let (h, gateways, running, body) = (h.clone(), gateways.clone(), running.clone(), steady);
        tokio::spawn(async move {
            let mut statuses = Vec::new();
            while running.load(std::sync::atomic::Ordering::Relaxed) {
                for gateway in &gateways {
                    statuses.push(chat_as(&h, gateway, OTHER_KEY, &body).await.status.as_u16());
                }
            }
            statuses
        })
    };
    let served_before = h.endpoint("good").requests("gpt-4o");
    let flowing = until(Duration::from_secs(5), || async {
        h.endpoint("good").requests("gpt-4o") >= served_before + 2
    })
    .await;
    assert!(flowing, "no traffic before the kill");
    redis.stop();
    let outage_seen = until(Duration::from_secs(5), || async {
        readiness(&h, &gateways[0]).await.1["state"]["mode"] == "fail_open"
    })
    .await;
    assert!(outage_seen, "the instance did not notice Redis was gone");
    redis.start_again();
    for gateway in &gateways {
        let back = until(Duration::from_secs(10), || async {
            readiness(&h, gateway).await.1["state"]["mode"] == "shared"
        })
        .await;
        assert!(back, "an instance did not reconnect to Redis");
    }
    running.store(false, std::sync::atomic::Ordering::Relaxed);
    let statuses = traffic.await.unwrap();
    assert!(
        statuses.len() >= 4 && statuses.iter().all(|s| *s == 200),
        "fail_open served all traffic through the restart: {statuses:?}"
    );

    // The restarted Redis holds no scripts: each is loaded again on its first NOSCRIPT. The
    // breaker tripped before the kill is open on both instances and on one started only now
    // (it has nothing but Redis to go by), and the tenant's three requests before the kill
    // still count: after three more, 4 of its 10 are left.
    let late = another(&h, &config).await;
    for gateway in [&*gateways[0], &*gateways[1], &late] {
        assert_eq!(chat_on(&h, gateway, &body).await.attempts(), "good=200");
    }
    assert_eq!(tally(&spread(&h, &gateways, body, 8, 2).await), (4, 4, 0));
}
