use hyper::Method;
use onedoor_mock::{run_from_yaml, DeploymentSpec, EndpointSpec, Fleet};
use serde_json::json;

use crate::client::{call, get, post, user};

#[tokio::test]
async fn control_surface_reports_and_steers() {
    let spec = EndpointSpec::azure("sub1", "westeurope").deployment(DeploymentSpec::new("gpt-4o"));
    let fleet = Fleet::start(vec![spec]).await.unwrap();
    let base = fleet.endpoints()[0].url();
    let chat = format!("{base}/openai/deployments/gpt-4o/chat/completions?api-version=2024-10-21");
    let ask = json!({"messages": [user("hi")]});
    assert_eq!(post(&chat, &[], &ask).await.status, 200);
    let mut stats = get(&format!("{base}/_mock/stats")).await.json();
    // The client may have opened more than the one connection it used.
    let connections = stats["connections"].take();
    assert!(
        connections.as_u64().is_some_and(|n| n >= 1),
        "{connections}"
    );
    assert_eq!(
        stats,
        json!({"endpoint": "sub1", "total": 1, "cancelled": 0, "deployments": {"gpt-4o": 1},
               "realtime": {"sessions": 0, "open": 0}, "connections": null})
    );

    let put = |path: &str, body: serde_json::Value| {
        let url = format!("{base}/_mock/{path}");
        async move { call(Method::PUT, &url, &[], Some(&body)).await }
    };
    assert_eq!(put("behavior", json!({"status": 500})).await.status, 200);
    assert_eq!(post(&chat, &[], &ask).await.status, 500);
    assert_eq!(
        put("deployments/gpt-4o/behavior", json!({"status": 503}))
            .await
            .status,
        200
    );
    assert_eq!(post(&chat, &[], &ask).await.status, 503);
    assert_eq!(put("behavior", json!({"colour": "red"})).await.status, 400);

    let reset = call(Method::POST, &format!("{base}/_mock/reset"), &[], None).await;
    assert_eq!(reset.json()["total"], 0);
    assert_eq!(post(&chat, &[], &ask).await.status, 200);
}

#[tokio::test]
async fn yaml_fleet_runs_and_shuts_down() {
    let yaml = r#"
endpoints:
  - name: sub1-se
    dialect: azure
    region: swedencentral
    deployments:
      - { name: gpt-4o, model: gpt-4o-2024-11-20, rpm: 60 }
  - name: oai
    dialect: openai
    region: us
    deployments: [{ name: gpt-4o-mini }]
"#;
    let fleet = run_from_yaml(yaml).await.unwrap();
    let azure = fleet.endpoint("sub1-se").unwrap();
    let url = format!(
        "{}/openai/deployments/gpt-4o/chat/completions?api-version=2024-10-21",
        azure.url()
    );
    let answer = post(&url, &[], &json!({"messages": [user("hi")]})).await;
    assert_eq!(answer.header("x-ms-region"), Some("swedencentral"));
    assert_eq!(answer.json()["model"], "gpt-4o-2024-11-20");
    let addrs: Vec<_> = fleet.endpoints().iter().map(|e| e.addr()).collect();
    assert!(fleet.endpoint("oai").is_some());
    fleet.shutdown().await;
    for addr in addrs {
        assert!(
            tokio::net::TcpStream::connect(addr).await.is_err(),
            "{addr} still listening"
        );
    }
}
