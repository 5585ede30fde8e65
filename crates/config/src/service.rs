//! The gateway's own settings: the client `listen` address, `max_request_body`, the `admin`
//! surface, the shared `state` store and the `usage` store.

use std::net::SocketAddr;
use std::path::PathBuf;

use crate::model::{Admin, OnStoreError, StateConfig, StoreKind, UsageConfig};
use crate::problems::Problems;
use crate::read::{self, Fields};
use crate::redis_url::RedisAddress;
use crate::tree::Node;

pub(crate) const DEFAULT_LISTEN: ([u8; 4], u16) = ([0, 0, 0, 0], 8080);
pub(crate) const DEFAULT_ADMIN_LISTEN: ([u8; 4], u16) = ([127, 0, 0, 1], 9090);
pub(crate) const DEFAULT_MAX_REQUEST_BODY: u64 = 32 << 20;
pub(crate) const DEFAULT_USAGE_STORE: &str = "sqlite://onedoor-usage.db";
pub(crate) const DEFAULT_KEY_PREFIX: &str = "onedoor";

pub(crate) fn listen(node: Option<&Node>, p: &mut Problems) -> SocketAddr {
    node.and_then(|n| read::addr(n, p))
        .unwrap_or_else(|| DEFAULT_LISTEN.into())
}

pub(crate) fn max_request_body(node: Option<&Node>, p: &mut Problems) -> u64 {
    let Some(node) = node else {
        return DEFAULT_MAX_REQUEST_BODY;
    };
    match read::size(node, p) {
        Some(0) => {
            p.at(node.mark, "must be larger than zero");
            DEFAULT_MAX_REQUEST_BODY
        }
        Some(size) => size,
        None => DEFAULT_MAX_REQUEST_BODY,
    }
}

/// The admin section; its `listen` may not be the client address, and its `jwt_roles` need
/// issuers (`jwt_issuers`: whether `client_auth.jwt` has any).
pub(crate) fn admin(
    node: Option<&Node>,
    client: SocketAddr,
    jwt_issuers: bool,
    p: &mut Problems,
) -> Admin {
    let f = Fields::open(node, &["listen", "token", "metrics_public", "jwt_roles"], p);
    let listen = f.get("listen").and_then(|n| read::addr(n, p));
    if let (Some(listen), Some(node)) = (listen, f.get("listen")) {
        // Port 0 asks for any free port, so two of them never collide.
        if listen == client && listen.port() != 0 {
            p.at(
                node.mark,
                "the admin surface cannot share the client listen address",
            );
        }
    }
    Admin {
        listen: listen.unwrap_or_else(|| DEFAULT_ADMIN_LISTEN.into()),
        token: f.secret("token", p),
        metrics_public: f.bool("metrics_public", p).unwrap_or(false),
        jwt_roles: jwt_roles(f.get("jwt_roles"), jwt_issuers, p),
    }
}

fn jwt_roles(node: Option<&Node>, jwt_issuers: bool, p: &mut Problems) -> Vec<String> {
    let Some(node) = node else {
        return Vec::new();
    };
    let roles: Vec<String> = read::list(node, p)
        .unwrap_or_default()
        .iter()
        .filter_map(|item| read::str(item, p))
        .map(str::to_owned)
        .collect();
    if !roles.is_empty() && !jwt_issuers {
        p.at(
            node.mark,
            "admin.jwt_roles needs client_auth.jwt: no issuer is configured whose tokens could carry the roles",
        );
    }
    roles
}

pub(crate) fn state(node: Option<&Node>, p: &mut Problems) -> StateConfig {
    let f = Fields::open(
        node,
        &[
            "store",
            "redis_url",
            "redis_ca_file",
            "on_store_error",
            "key_prefix",
        ],
        p,
    );
    let store_node = f.get("store");
    let store = store_node.and_then(|n| {
        read::choice(
            n,
            &[("memory", StoreKind::Memory), ("redis", StoreKind::Redis)],
            p,
        )
    });
    let redis_address = f.get("redis_url").and_then(|n| {
        let url = read::str(n, p)?;
        match RedisAddress::parse(url) {
            Ok(address) => Some((url.to_owned(), address)),
            Err(why) => {
                p.at(n.mark, why.0);
                None
            }
        }
    });
    let redis_ca_file = f.get("redis_ca_file").and_then(|n| {
        let path = read::str(n, p)?;
        if redis_address.as_ref().is_some_and(|(_, a)| !a.tls) {
            p.at(n.mark, "redis_ca_file is for a rediss:// URL (TLS)");
        }
        Some(PathBuf::from(path))
    });
    if let (Some(StoreKind::Redis), Some(n)) = (store, store_node) {
        if !f.has("redis_url") {
            p.at(n.mark, "store: redis needs redis_url");
        }
    }
    let on_store_error = f.get("on_store_error").and_then(|n| {
        let options = [
            ("fail_open", OnStoreError::FailOpen),
            ("fail_closed", OnStoreError::FailClosed),
        ];
        read::choice(n, &options, p)
    });
    StateConfig {
        store: store.unwrap_or(StoreKind::Memory),
        redis_url: redis_address.map(|(url, _)| url),
        redis_ca_file,
        on_store_error: on_store_error.unwrap_or(OnStoreError::FailOpen),
        key_prefix: f
            .get("key_prefix")
            .and_then(|n| key_prefix(n, p))
            .unwrap_or_else(|| DEFAULT_KEY_PREFIX.to_owned()),
    }
}

/// A Redis key prefix: it sits inside the `{...}` hash tag, so braces and spaces are out.
fn key_prefix(node: &Node, p: &mut Problems) -> Option<String> {
    let text = read::str(node, p)?;
    let fits = !text.is_empty()
        && text.len() <= 64
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':'));
    if fits {
        Some(text.to_owned())
    } else {
        p.at(
            node.mark,
            format!("expected 1 to 64 letters, digits, '-', '_', '.' or ':', found {text:?}"),
        );
        None
    }
}

pub(crate) fn usage(node: Option<&Node>, p: &mut Problems) -> UsageConfig {
    let f = Fields::open(node, &["store", "journal_dir"], p);
    let store = f.get("store").and_then(|n| {
        let store = read::str(n, p)?;
        let path = ["sqlite://", "postgres://", "postgresql://"]
            .iter()
            .find_map(|scheme| store.strip_prefix(scheme));
        match path {
            Some(rest) if !rest.is_empty() => Some(store.to_owned()),
            _ if store == "off" => Some(store.to_owned()),
            // The URL may carry a password: say what is expected, never what was found.
            _ => {
                p.at(
                    n.mark,
                    "expected sqlite://PATH, postgres://USER@HOST/DB or off",
                );
                None
            }
        }
    });
    let journal_dir = f.get("journal_dir").and_then(|n| read::str(n, p));
    UsageConfig {
        store: store.unwrap_or_else(|| DEFAULT_USAGE_STORE.to_owned()),
        journal_dir: journal_dir.map(PathBuf::from),
    }
}

#[cfg(test)]
mod tests {
    use crate::model::{OnStoreError, StoreKind};
    use crate::testing::{compile, problems};

    #[test]
    fn sizes_and_addresses_are_read() {
        let s = compile(
            "listen: 127.0.0.1:8000\nmax_request_body: 512KiB\nadmin: { metrics_public: true }\n",
        );
        assert_eq!(s.listen, "127.0.0.1:8000".parse().unwrap());
        assert_eq!(s.max_request_body, 512 * 1024);
        assert!(s.admin.metrics_public);
        assert_eq!(
            compile("max_request_body: 10MB").max_request_body,
            10_000_000
        );
        assert_eq!(compile("max_request_body: 1024").max_request_body, 1024);
    }

    #[test]
    fn admin_jwt_roles_need_an_issuer() {
        let with_issuer = compile(
            "client_auth: { jwt: [{ issuer: \"https://login.example.com/t/v2.0\", audience: api://onedoor }] }\nadmin: { jwt_roles: [Onedoor.Admin] }\n",
        );
        assert_eq!(with_issuer.admin.jwt_roles, ["Onedoor.Admin"]);
        assert!(compile("admin: {}").admin.jwt_roles.is_empty());
        assert_eq!(
            problems("admin: { jwt_roles: [Onedoor.Admin] }\n"),
            ["1:21: admin.jwt_roles needs client_auth.jwt: no issuer is configured whose tokens could carry the roles"]
        );
    }

    #[test]
    fn wrong_values_say_what_was_expected() {
        assert_eq!(
            problems("listen: localhost\nmax_request_body: huge\nadmin: { metrics_public: yes }\n"),
            [
                "1:9: expected a socket address like \"0.0.0.0:8080\", found \"localhost\"",
                "2:19: expected a size like \"32MiB\", found \"huge\"",
                "3:26: expected true or false, found \"yes\"",
            ]
        );
    }

    #[test]
    fn the_admin_surface_cannot_share_the_client_port() {
        assert_eq!(
            problems("listen: 0.0.0.0:8080\nadmin: { listen: 0.0.0.0:8080 }\n"),
            ["2:18: the admin surface cannot share the client listen address"]
        );
        compile("listen: 127.0.0.1:0\nadmin: { listen: 127.0.0.1:0 }\n");
    }

    #[test]
    fn a_redis_store_needs_its_url() {
        assert_eq!(
            problems("state: { store: redis }\n"),
            ["1:17: store: redis needs redis_url"]
        );
        let s = compile(
            "state: { store: redis, redis_url: redis://r:6379/0, on_store_error: fail_closed }",
        );
        assert_eq!(s.state.store, StoreKind::Redis);
        assert_eq!(s.state.on_store_error, OnStoreError::FailClosed);
        assert_eq!(
            problems("state: { store: disk }\n"),
            ["1:17: expected one of memory, redis, found \"disk\""]
        );
    }

    #[test]
    fn a_malformed_redis_url_is_located_and_a_ca_file_needs_tls() {
        assert_eq!(
            problems("state:\n  store: redis\n  redis_url: \"redis+cluster://:pw@h:1/2\"\n"),
            ["3:14: a Redis Cluster has database 0 only"]
        );
        assert_eq!(
            problems("state: { redis_url: redis://h:6379/0, redis_ca_file: ca.pem }\n"),
            ["1:54: redis_ca_file is for a rediss:// URL (TLS)"]
        );
        let s = compile(
            "state: { redis_url: \"rediss+sentinel://s:26379/cache\", redis_ca_file: /etc/ca.pem }",
        );
        assert_eq!(
            s.state.redis_ca_file,
            Some(std::path::PathBuf::from("/etc/ca.pem"))
        );
    }

    #[test]
    fn the_redis_key_prefix_defaults_to_onedoor_and_keeps_out_of_the_hash_tag() {
        assert_eq!(compile("listen: 127.0.0.1:1").state.key_prefix, "onedoor");
        let s = compile("state: { key_prefix: \"test-41.a\" }");
        assert_eq!(s.state.key_prefix, "test-41.a");
        assert_eq!(
            problems("state: { key_prefix: \"a}b\" }\nrouting: { default_max_tokens: 0 }\n"),
            [
                "1:22: expected 1 to 64 letters, digits, '-', '_', '.' or ':', found \"a}b\"",
                "2:32: must be at least 1",
            ]
        );
    }

    #[test]
    fn usage_stores_are_sqlite_postgres_or_off_and_never_quoted() {
        assert_eq!(compile("usage: { store: off }").usage.store, "off");
        assert_eq!(
            compile("usage: { store: off, journal_dir: /var/spool/onedoor }")
                .usage
                .journal_dir,
            Some("/var/spool/onedoor".into())
        );
        assert_eq!(
            compile("usage: { store: \"postgresql://u@h/db\" }")
                .usage
                .store,
            "postgresql://u@h/db"
        );
        assert_eq!(
            problems("usage: { store: \"mysql://u:hunter2@h/db\" }\n"),
            ["1:17: expected sqlite://PATH, postgres://USER@HOST/DB or off"]
        );
    }
}
