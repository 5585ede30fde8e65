//! The shared state store going away and coming back (contract section 2 `state.on_store_error`),
//! on a Redis of the test's own (`redis-server` on a free port, killed and restarted; the
//! machine's Redis is left alone): `fail_open` keeps serving with each instance's own limits and
//! says so on `/readyz`, `fail_closed` answers 503 `state_unavailable`, and once Redis is back the
//! shared limits hold again without a restart.

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
