//! The shared state store on Redis as users run it, each a Redis of the test's own on free
//! loopback ports: TLS (`rediss://`) with an ACL user and the test's own CA, a three-master
//! Cluster, and a master found through Sentinel that survives a failover. Two gateway instances
//! share tenant limits, breakers and the not-served cache exactly on each.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
// The shared harness re-exports the mock's `Behavior`, which some of these tests have no use for.
#![allow(unused_imports)]

mod common;
mod instances;
mod own_redis;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use instances::*;
use own_redis::*;

fn backend(name: &str) -> String {
    format!(
        "  - {{ name: {name}, provider: azure, region: swedencentral, url: \"{{url:{name}}}\" }}\n"
    )
}

/// `count` requests with `key`, alternating between `gateways`; (200s, 429s, others).
async fn alternate(
    h: &Harness,
    gateways: &[Arc<onedoor_gateway::Running>],
    key: &str,
    count: usize,
) -> (usize, usize, usize) {
    for gateway in gateways {
        until_shared(h, gateway).await;
    }
    let mut answers = Vec::with_capacity(count);
    for i in 0..count {
        answers.push(
            chat_as(
                h,
                &gateways[i % gateways.len()],
                key,
                &chat_body("chat", false),
            )
            .await,
        );
    }
    tally(&answers)
}

async fn readiness(h: &Harness, gateway: &onedoor_gateway::Running) -> (u16, serde_json::Value) {
    let answer = get_on(h, gateway, "/readyz").await;
    (answer.status.as_u16(), answer.json())
}

/// Waits (up to 20 s) until `gateway` has reached its store: its first connections (TLS
/// handshakes with every node of a Cluster) can take longer than a call may on a busy machine.
async fn until_shared(h: &Harness, gateway: &onedoor_gateway::Running) {
    for _ in 0..200 {
        let (status, body) = readiness(h, gateway).await;
        if status == 200 && body["state"]["mode"] == "shared" {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the gateway did not reach its Redis within 20 s");
}

/// One backend `a` serving `chat`, tenants `first` and `second` (keys `KEY` and `OTHER_KEY`)
/// with their limits, and `state`.
fn two_tenants(state: &str, first: (&str, &str), second: (&str, &str)) -> String {
    format!(
        "{state}backends:\n{}models:\n  - {{ name: chat, targets: [{{ backend: a, deployment: gpt-4o }}] }}\ntenants:\n  - name: {}\n    keys: [{{ id: k1, sha256: {} }}]\n    limits: {}\n  - name: {}\n    keys: [{{ id: k2, sha256: {} }}]\n    limits: {}\n",
        backend("a"),
        first.0,
        key_hash(KEY),
        first.1,
        second.0,
        key_hash(OTHER_KEY),
        second.1,
    )
}

async fn fleet_of_a(config: &str) -> Harness {
    Harness::start(
        vec![EndpointSpec::azure("a", "swedencentral").deployment(DeploymentSpec::new("gpt-4o"))],
        config,
    )
    .await
}

#[tokio::test]
async fn a_tenant_limit_holds_over_rediss_with_an_acl_user_and_a_wrong_password_is_named_on_readyz()
{
    let dir = Scratch::new("tls");
    let ca = TestCa::new(&dir);
    let redis = tls_server(&dir, &ca, "gateway", "s3cret-pass");
    let state = |password: &str, prefix: &str| {
        format!(
            "state: {{ store: redis, redis_url: \"rediss://gateway:{password}@127.0.0.1:{}/0\", redis_ca_file: \"{}\", on_store_error: fail_closed, key_prefix: {prefix} }}\n",
            redis.port,
            ca.ca.display()
        )
    };
    let prefix = unique_prefix("tls");
    let config = two_tenants(
        &state("s3cret-pass", &prefix),
        ("team", "{ rpm: 3 }"),
        ("other", "{ rpm: 100 }"),
    );
    let h = fleet_of_a(&config).await;
    let gateways = vec![
        Arc::new(another(&h, &config).await),
        Arc::new(another(&h, &config).await),
    ];
    assert_eq!(alternate(&h, &gateways, KEY, 5).await, (3, 2, 0));
    let (status, ready) = readiness(&h, &gateways[0]).await;
    assert_eq!((status, &ready["state"]["mode"]), (200, &"shared".into()));

    let wrong = two_tenants(
        &state("not-the-password", &prefix),
        ("team", "{ rpm: 3 }"),
        ("other", "{ rpm: 100 }"),
    );
    let refused = another(&h, &wrong).await;
    let (status, ready) = readiness(&h, &refused).await;
    assert_eq!(status, 503, "{ready}");
    assert_eq!(ready["state"]["mode"], "fail_closed");
    let problem = ready["state"]["problem"].as_str().unwrap_or_default();
    assert!(
        problem.contains("refused the user name or password"),
        "{ready}"
    );
    assert!(!problem.contains("not-the-password"), "{problem}");
    assert_eq!(
        chat_as(&h, &refused, OTHER_KEY, &chat_body("chat", false))
            .await
            .status,
        503
    );
}

#[tokio::test]
async fn a_rediss_url_without_the_test_ca_is_refused_by_certificate() {
    let dir = Scratch::new("tls-roots");
    let ca = TestCa::new(&dir);
    let redis = tls_server(&dir, &ca, "gateway", "pw");
    let config = two_tenants(
        &format!(
            "state: {{ store: redis, redis_url: \"rediss://gateway:pw@127.0.0.1:{}/0\", on_store_error: fail_closed, key_prefix: {} }}\n",
            redis.port,
            unique_prefix("tls-roots")
        ),
        ("team", "{ rpm: 3 }"),
        ("other", "{ rpm: 3 }"),
    );
    let h = fleet_of_a(&config).await;
    let gateway = another(&h, &config).await;
    let (status, ready) = readiness(&h, &gateway).await;
    assert_eq!(status, 503, "{ready}");
    let problem = ready["state"]["problem"].as_str().unwrap_or_default();
    assert!(problem.to_lowercase().contains("certificate"), "{ready}");
}

/// Two tenant names whose meters land on different masters of `cluster` under `prefix`.
fn tenants_apart(cluster: &OwnCluster, prefix: &str) -> (String, String) {
    let owner = |name: &str| cluster.owner(&format!("{{{prefix}:t:{name}}}"));
    let first = "tenant-0".to_owned();
    let second = (1..64)
        .map(|i| format!("tenant-{i}"))
        .find(|name| owner(name) != owner(&first))
        .unwrap();
    (first, second)
}

#[tokio::test]
async fn two_instances_on_a_three_master_cluster_hold_exact_limits_for_tenants_on_different_masters(
) {
    let cluster = OwnCluster::start();
    let prefix = unique_prefix("cluster");
    let (first, second) = tenants_apart(&cluster, &prefix);
    let state = format!(
        "state: {{ store: redis, redis_url: \"{}\", on_store_error: fail_closed, key_prefix: {prefix} }}\n",
        cluster.url()
    );
    let config = two_tenants(&state, (&first, "{ rpm: 4 }"), (&second, "{ rpm: 6 }"));
    let h = fleet_of_a(&config).await;
    let gateways = vec![
        Arc::new(another(&h, &config).await),
        Arc::new(another(&h, &config).await),
    ];
    assert_eq!(alternate(&h, &gateways, KEY, 10).await, (4, 6, 0));
    assert_eq!(alternate(&h, &gateways, OTHER_KEY, 10).await, (6, 4, 0));

    let (a, b) = (
        cluster.owner(&format!("{{{prefix}:t:{first}}}")),
        cluster.owner(&format!("{{{prefix}:t:{second}}}")),
    );
    assert_ne!(a, b);
    assert!(cluster.keys_on(a, &format!("{{{prefix}:t:{first}}}*")) > 0);
    assert!(cluster.keys_on(b, &format!("{{{prefix}:t:{second}}}*")) > 0);
    assert_eq!(cluster.keys_on(a, &format!("{{{prefix}:t:{second}}}*")), 0);

    // The admin view reads both tenants' meters (one script call per hash tag).
    let admin = admin_get_on(&h, &gateways[0], "/admin/tenants").await;
    assert_eq!(admin.status, 200, "{}", admin.body);
    assert!(admin.body.contains("\"readable\":true"), "{}", admin.body);
}

#[tokio::test]
async fn a_tenant_limit_holds_on_a_tls_only_cluster_checked_against_the_test_ca() {
    let dir = Scratch::new("tls-cluster");
    let ca = TestCa::new(&dir);
    let cluster = OwnCluster::start_tls(dir, &ca);
    let state = format!(
        "state: {{ store: redis, redis_url: \"{}\", redis_ca_file: \"{}\", on_store_error: fail_closed, key_prefix: {} }}\n",
        cluster.url(),
        ca.ca.display(),
        unique_prefix("tls-cluster")
    );
    assert!(state.contains("rediss+cluster://"));
    let config = two_tenants(&state, ("team", "{ rpm: 5 }"), ("other", "{ rpm: 2 }"));
    let h = fleet_of_a(&config).await;
    let gateways = vec![
        Arc::new(another(&h, &config).await),
        Arc::new(another(&h, &config).await),
    ];
    assert_eq!(alternate(&h, &gateways, KEY, 8).await, (5, 3, 0));
    assert_eq!(alternate(&h, &gateways, OTHER_KEY, 4).await, (2, 2, 0));
}

#[tokio::test]
async fn a_not_served_deployment_and_a_tripped_breaker_are_shared_across_instances_on_a_cluster() {
    let cluster = OwnCluster::start();
    let config = format!(
        "state: {{ store: redis, redis_url: \"{}\", on_store_error: fail_closed, key_prefix: {} }}\ncircuit_breakers:\n  trip-once:\n    rules: [{{ name: server-errors, failures: {{ count: 1, within: 60s, status: [500-599] }}, trip: 30s }}]\nbackends:\n  - {{ name: bad, provider: azure, region: swedencentral, url: \"{{url:bad}}\", circuit_breaker: trip-once }}\n{}{}models:\n  - name: chat\n    targets:\n      - {{ backend: lacks, deployment: gpt-4o, priority: 1 }}\n      - {{ backend: bad, deployment: gpt-4o, priority: 2 }}\n      - {{ backend: good, deployment: gpt-4o, priority: 3 }}\n",
        cluster.url(),
        unique_prefix("cluster-routing"),
        backend("lacks"),
        backend("good"),
    );
    let h = Harness::start(
        vec![
            EndpointSpec::azure("lacks", "swedencentral").deployment(DeploymentSpec::new("other")),
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
    let b = another(&h, &config).await;
    let first = h.chat("chat").await;
    assert_eq!(first.status, 200);
    assert_eq!(first.attempts(), "lacks=404,bad=500,good=200");
    for _ in 0..3 {
        let on_b = chat_on(&h, &b, &chat_body("chat", false)).await;
        assert_eq!(on_b.attempts(), "good=200");
    }
    assert_eq!(h.endpoint("lacks").requests("gpt-4o"), 1);
    assert_eq!(h.endpoint("bad").requests("gpt-4o"), 1);
}

#[tokio::test]
async fn a_tenant_limit_found_through_sentinel_continues_after_a_failover() {
    let redis = OwnSentinel::start();
    let config = two_tenants(
        &format!(
            "state: {{ store: redis, redis_url: \"{}\", on_store_error: fail_closed, key_prefix: {} }}\n",
            redis.url(),
            unique_prefix("sentinel")
        ),
        ("team", "{ rpm: 6 }"),
        ("other", "{ rpm: 100 }"),
    );
    let h = fleet_of_a(&config).await;
    let gateways = vec![
        Arc::new(another(&h, &config).await),
        Arc::new(another(&h, &config).await),
    ];
    assert_eq!(alternate(&h, &gateways, KEY, 3).await, (3, 0, 0));
    // What the master counted is on the replica before it takes over.
    redis.master.cli(&["WAIT", "1", "2000"]);
    let old = redis.master.port;
    // A sentinel that found the replica moments ago may not rate it promotable yet.
    wait_for(
        Duration::from_secs(10),
        "the sentinel starts a failover",
        || redis.sentinel.cli(&["SENTINEL", "FAILOVER", "cache"]) == "OK",
    );
    wait_for(
        Duration::from_secs(15),
        "the sentinel names the replica",
        || {
            redis.master_port() == redis.replica.port
                && redis.replica.cli(&["ROLE"]).starts_with("master")
        },
    );
    assert_ne!(redis.master_port(), old);
    // Each instance finds the new master after its first call to the demoted one fails.
    for gateway in &gateways {
        let served = until(Duration::from_secs(10), || async {
            chat_as(&h, gateway, OTHER_KEY, &chat_body("chat", false))
                .await
                .status
                == 200
        })
        .await;
        assert!(served, "an instance did not follow the failover");
    }
    assert_eq!(alternate(&h, &gateways, KEY, 5).await, (3, 2, 0));
}
