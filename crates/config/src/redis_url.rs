//! The forms `state.redis_url` may take: one server, the seed nodes of a Redis Cluster, or the
//! Sentinels that know a master, each over TLS when the scheme ends in `s` (`rediss`).
//!
//! ```text
//! redis://[USER:PASSWORD@]HOST[:PORT][/DB]
//! redis+cluster://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]
//! redis+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]/MASTER[/DB]
//! ```
//!
//! A message about a URL never repeats it: it may carry a password.

use std::fmt;

const SERVER_PORT: u16 = 6379;
const SENTINEL_PORT: u16 = 26379;

/// How the named nodes make up the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Topology {
    /// One server (or a managed endpoint that fronts several).
    Server,
    /// Seed nodes of a Redis Cluster; the rest of the cluster is discovered from them.
    Cluster,
    /// Sentinels to ask for the current master of `master`.
    Sentinel { master: String },
}

/// A parsed `redis_url`.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisAddress {
    pub topology: Topology,
    pub tls: bool,
    /// `HOST:PORT` of each node as written (for Sentinel: each sentinel), the default port added.
    pub nodes: Vec<String>,
    /// `USER:PASSWORD`, `:PASSWORD` or `USER`, still percent-encoded as written. Sentinel: the
    /// master's (and its replicas') credentials; the sentinels themselves are asked without.
    credentials: Option<String>,
    pub db: u32,
}

/// What was wrong with a `redis_url`, worded to stand after its location.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadRedisUrl(pub String);

impl fmt::Display for BadRedisUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for RedisAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisAddress")
            .field("topology", &self.topology)
            .field("tls", &self.tls)
            .field("nodes", &self.nodes)
            .field(
                "credentials",
                &self.credentials.as_ref().map(|_| "<redacted>"),
            )
            .field("db", &self.db)
            .finish()
    }
}

fn bad<T>(why: impl Into<String>) -> Result<T, BadRedisUrl> {
    Err(BadRedisUrl(why.into()))
}

impl RedisAddress {
    pub fn parse(url: &str) -> Result<RedisAddress, BadRedisUrl> {
        let (scheme, rest) = match url.split_once("://") {
            Some(parts) => parts,
            None => return bad(EXPECTED),
        };
        let (topology_name, tls) = match scheme {
            "redis" => ("", false),
            "rediss" => ("", true),
            "redis+cluster" => ("cluster", false),
            "rediss+cluster" => ("cluster", true),
            "redis+sentinel" => ("sentinel", false),
            "rediss+sentinel" => ("sentinel", true),
            _ => return bad(EXPECTED),
        };
        if rest.contains(['?', '#']) {
            return bad("a redis_url takes no ?query or #fragment (for a private CA set state.redis_ca_file)");
        }
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        let (credentials, hosts) = match authority.rsplit_once('@') {
            Some((credentials, hosts)) => (Some(credentials.to_owned()), hosts),
            None => (None, authority),
        };
        let default_port = match topology_name {
            "sentinel" => SENTINEL_PORT,
            _ => SERVER_PORT,
        };
        let nodes = hosts
            .split(',')
            .map(|node| node_with_port(node, default_port))
            .collect::<Result<Vec<_>, _>>()?;
        let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
        let (topology, db) = match (topology_name, segments.as_slice()) {
            ("", [] | [_]) if nodes.len() > 1 => {
                return bad("one server per redis:// URL; list Cluster nodes as redis+cluster://HOST:PORT,HOST:PORT")
            }
            ("", []) => (Topology::Server, 0),
            ("", [db]) => (Topology::Server, database(db)?),
            ("cluster", []) => (Topology::Cluster, 0),
            ("cluster", ["0"]) => (Topology::Cluster, 0),
            ("cluster", [_]) => return bad("a Redis Cluster has database 0 only"),
            ("sentinel", []) => {
                return bad("a redis+sentinel:// URL names the master after the sentinels: redis+sentinel://HOST:26379/MASTER")
            }
            ("sentinel", [master]) => (sentinel(master), 0),
            ("sentinel", [master, db]) => (sentinel(master), database(db)?),
            _ => return bad(EXPECTED),
        };
        Ok(RedisAddress {
            topology,
            tls,
            nodes,
            credentials: credentials.filter(|c| !c.is_empty()),
            db,
        })
    }

    /// A one-server URL for `node` (one of [`RedisAddress::nodes`], or a master a sentinel
    /// named), with the credentials and database: the form the Redis client reads.
    pub fn server_url(&self, node: &str) -> String {
        let scheme = if self.tls { "rediss" } else { "redis" };
        match &self.credentials {
            Some(credentials) => format!("{scheme}://{credentials}@{node}/{}", self.db),
            None => format!("{scheme}://{node}/{}", self.db),
        }
    }
}

const EXPECTED: &str = "expected redis://[USER:PASSWORD@]HOST[:PORT][/DB], redis+cluster://HOST:PORT,HOST:PORT,... or redis+sentinel://HOST:PORT,.../MASTER[/DB] (rediss, rediss+cluster, rediss+sentinel for TLS)";

fn sentinel(master: &str) -> Topology {
    Topology::Sentinel {
        master: master.to_owned(),
    }
}

fn database(text: &str) -> Result<u32, BadRedisUrl> {
    match text.parse() {
        Ok(db) => Ok(db),
        Err(_) => bad("the database after the address is a number, as in redis://HOST:6379/0"),
    }
}

/// `HOST[:PORT]` (an IPv6 host in brackets) with the port written out.
fn node_with_port(node: &str, default_port: u16) -> Result<String, BadRedisUrl> {
    let (host, port) = match node.strip_prefix('[') {
        Some(v6) => match v6.split_once(']') {
            Some((host, "")) => (&node[..host.len() + 2], None),
            Some((host, port)) => (&node[..host.len() + 2], port.strip_prefix(':')),
            None => return bad("an IPv6 host is written in brackets, as in [::1]:6379"),
        },
        None => match node.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (node, None),
        },
    };
    if host.is_empty() || host == "[]" {
        return bad("a node without a host name");
    }
    let port = match port {
        None => default_port,
        Some(port) => match port.parse::<u16>() {
            Ok(port) if port > 0 => port,
            _ => return bad("a port is a number from 1 to 65535"),
        },
    };
    Ok(format!("{host}:{port}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(url: &str) -> RedisAddress {
        match RedisAddress::parse(url) {
            Ok(address) => address,
            Err(why) => unreachable!("{url}: {why}"),
        }
    }

    fn why(url: &str) -> String {
        match RedisAddress::parse(url) {
            Ok(address) => unreachable!("{url} parsed as {address:?}"),
            Err(why) => why.0,
        }
    }

    #[test]
    fn one_server_with_an_acl_user_over_tls_keeps_its_credentials_and_database() {
        let a = parse("rediss://app:s%40cret@cache.internal:6380/2");
        assert_eq!(a.topology, Topology::Server);
        assert!(a.tls);
        assert_eq!(a.nodes, ["cache.internal:6380"]);
        assert_eq!(a.db, 2);
        assert_eq!(
            a.server_url("10.0.0.9:6380"),
            "rediss://app:s%40cret@10.0.0.9:6380/2"
        );
        assert!(!format!("{a:?}").contains("cret"));
        assert_eq!(
            parse("redis://localhost").server_url("localhost:6379"),
            "redis://localhost:6379/0"
        );
    }

    #[test]
    fn cluster_and_sentinel_urls_list_their_nodes() {
        let c = parse("redis+cluster://:pw@10.0.0.1:7000,10.0.0.2:7001,[::1]");
        assert_eq!(c.topology, Topology::Cluster);
        assert_eq!(c.nodes, ["10.0.0.1:7000", "10.0.0.2:7001", "[::1]:6379"]);
        let s = parse("rediss+sentinel://s1,s2:26380/cache/3");
        assert_eq!(
            s.topology,
            Topology::Sentinel {
                master: "cache".into()
            }
        );
        assert_eq!(s.nodes, ["s1:26379", "s2:26380"]);
        assert_eq!((s.tls, s.db), (true, 3));
    }

    #[test]
    fn malformed_urls_say_what_is_expected_without_repeating_the_password() {
        assert!(why("http://h:1").starts_with("expected redis://"));
        assert!(why("rediss://h:6379/0#insecure").contains("redis_ca_file"));
        assert!(why("redis://h:1,h:2").contains("redis+cluster://"));
        assert!(why("redis+cluster://h:1/3").contains("database 0 only"));
        assert!(why("redis+sentinel://h:26379").contains("MASTER"));
        assert!(why("redis://u:topsecret@h:99999").contains("1 to 65535"));
        assert!(!why("redis://u:topsecret@h:99999").contains("topsecret"));
        assert!(why("redis://h:6379/zero").contains("number"));
        assert!(why("redis://:pw@/0").contains("host"));
    }
}
