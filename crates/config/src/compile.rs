//! The top level of the file: which sections exist, and the order they are compiled in (each
//! section may refer only to what was compiled before it).

use std::path::Path;

use crate::model::{ClientAuth, Snapshot};
use crate::problems::Problems;
use crate::read::Fields;
use crate::tenants::Known;
use crate::tree::Node;
use crate::{
    backends, batch, breakers, client_auth, connections, identities, models, realtime, regions,
    routing, service, shutdown, telemetry, tenants,
};

const SECTIONS: &[&str] = &[
    "listen",
    "max_request_body",
    "max_connections",
    "client_timeouts",
    "admin",
    "state",
    "usage",
    "routing",
    "realtime",
    "regions",
    "identities",
    "backends",
    "circuit_breakers",
    "models",
    "client_auth",
    "tenants",
    "telemetry",
    "shutdown",
    "batch",
];

/// Compile the whole tree. Problems go to `p`; when there are any the snapshot is incomplete and
/// must be thrown away.
pub(crate) fn snapshot(
    root: &Node,
    source: &Path,
    env: &dyn Fn(&str) -> Option<String>,
    p: &mut Problems,
) -> Snapshot {
    let f = Fields::new(root, SECTIONS, p);
    let listen = service::listen(f.get("listen"), p);
    let routing = routing::routing(f.get("routing"), p);
    let regions = regions::regions(f.get("regions"), p);
    let circuit_breakers = breakers::breakers(f.get("circuit_breakers"), p);
    let identities = identities::identities(f.get("identities"), env, p);
    let backends = backends::backends(
        f.get("backends"),
        &identities,
        &circuit_breakers,
        routing.timeouts,
        p,
    );
    let models = models::models(f.get("models"), &backends, p);
    let issuers = client_auth::jwt_issuers(f.get("client_auth"), p);
    let known = Known {
        models: &models,
        groups: &regions,
        backend_regions: backends.list.iter().map(|b| &*b.region).collect(),
        issuers: &issuers,
        client_auth_written: f.get("client_auth").is_some(),
    };
    let tenants = tenants::tenants(f.get("tenants"), &known, p);
    Snapshot {
        source: source.to_path_buf(),
        listen,
        max_request_body: service::max_request_body(f.get("max_request_body"), p),
        max_connections: connections::max_connections(f.get("max_connections"), p),
        client_timeouts: connections::client_timeouts(f.get("client_timeouts"), p),
        admin: service::admin(f.get("admin"), listen, !issuers.is_empty(), p),
        state: service::state(f.get("state"), p),
        usage: service::usage(f.get("usage"), p),
        routing,
        realtime: realtime::realtime(f.get("realtime"), p),
        regions,
        backends: backends.list,
        backend_by_name: backends.by_name,
        circuit_breakers,
        identities: identities.list,
        aliases: models.aliases,
        alias_by_name: models.by_name,
        wildcard: models.wildcard,
        tenants: tenants.list,
        keys_by_hash: tenants.keys_by_hash,
        client_auth: ClientAuth {
            jwt: issuers,
            principals: tenants.principals,
        },
        telemetry: telemetry::telemetry(f.get("telemetry"), p),
        shutdown: shutdown::shutdown(f.get("shutdown"), p),
        batch: batch::batch(f.get("batch"), p),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::model::{OnStoreError, StoreKind, Timeouts};
    use crate::testing::{compile, problems};

    #[test]
    fn an_empty_file_is_every_default() {
        let s = compile("");
        assert_eq!(s.listen, "0.0.0.0:8080".parse().unwrap());
        assert_eq!(s.max_request_body, 32 << 20);
        assert_eq!(s.admin.listen, "127.0.0.1:9090".parse().unwrap());
        assert!(s.admin.token.is_none());
        assert!(!s.admin.metrics_public);
        assert_eq!(s.state.store, StoreKind::Memory);
        assert_eq!(s.state.on_store_error, OnStoreError::FailOpen);
        assert_eq!(s.usage.store, "sqlite://onedoor-usage.db");
        assert_eq!(s.routing.max_attempts, 4);
        assert_eq!(s.routing.same_target_retries, 1);
        assert_eq!(s.routing.max_retry_wait, Duration::from_secs(2));
        assert_eq!(s.routing.not_served_ttl, Duration::from_secs(3600));
        assert_eq!(s.routing.timeouts, Timeouts::default());
        assert!(s.backends.is_empty() && s.aliases.is_empty() && s.wildcard.is_none());
        assert!(s.tenants.is_empty() && s.keys_by_hash.is_empty());
    }

    #[test]
    fn the_summary_of_an_empty_config_says_nothing_can_be_served() {
        let text = crate::summary(&compile("# nothing yet\n"));
        assert!(text.contains("no backends"), "{text}");
        assert!(text.contains("no aliases"), "{text}");
        assert!(text.contains("no tenants"), "{text}");
    }

    #[test]
    fn the_top_level_must_be_a_map() {
        assert_eq!(
            problems("- a\n- b\n"),
            ["1:1: expected a map, found a list"]
        );
    }

    #[test]
    fn a_yaml_syntax_error_is_one_located_problem() {
        let found = problems("listen: 0.0.0.0:8080\nadmin: { listen: x\nstate: {}\n");
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].starts_with("3:") && found[0].contains("invalid YAML"),
            "{found:?}"
        );
    }

    #[test]
    fn duplicate_keys_are_problems() {
        assert_eq!(
            problems("listen: 0.0.0.0:1\nlisten: 0.0.0.0:2\n"),
            ["2:1: duplicate key \"listen\" (first defined at 1:1)"]
        );
    }

    #[test]
    fn problems_display_as_file_line_col_message() {
        let problem = crate::Problem {
            file: "onedoor.yaml".to_owned(),
            line: 3,
            col: 7,
            message: "oops".to_owned(),
        };
        assert_eq!(problem.to_string(), "onedoor.yaml:3:7: oops");
    }
}
