//! The connection to Redis in each form users run it: one server (reconnecting by itself), a
//! Redis Cluster (slots discovered and followed), or the master a Sentinel names (asked again
//! after the master goes away or turns replica), each over TLS for a `rediss` URL. One
//! cloneable [`Link`] stands for all of them, and keeps the last error Redis gave so readiness
//! can say why the store is unreachable.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwapOption;

use onedoor_config::{RedisAddress, Topology};
use redis::aio::{
    ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection,
};
use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{
    AsyncConnectionConfig, Cmd, ErrorKind, IntoConnectionInfo, Pipeline, RedisError, RedisFuture,
    RedisResult, ServerErrorKind, TlsCertificates, TlsMode, Value,
};

/// How a [`Link`] connects: the URL, the CA for TLS, and how long one connect or answer may take.
pub struct LinkSettings<'a> {
    pub url: &'a str,
    /// PEM CA certificates for `rediss`; `None`: the system's roots.
    pub ca_file: Option<&'a Path>,
    pub timeout: Duration,
}

/// The store's connection, whichever form Redis takes; clones share it.
#[derive(Clone)]
pub struct Link {
    route: Route,
    problem: Arc<Problem>,
}

/// The last error, behind a flag so that a call that succeeds while all is well takes no lock.
struct Problem {
    set: AtomicBool,
    text: Mutex<Option<String>>,
}

impl Problem {
    fn new(text: Option<String>) -> Problem {
        Problem {
            set: AtomicBool::new(text.is_some()),
            text: Mutex::new(text),
        }
    }

    fn note(&self, error: Option<&RedisError>) {
        if error.is_none() && !self.set.load(Ordering::Relaxed) {
            return;
        }
        if let Ok(mut text) = self.text.lock() {
            *text = error.map(describe);
            self.set.store(text.is_some(), Ordering::Relaxed);
        }
    }
}

#[derive(Clone)]
enum Route {
    Server(ConnectionManager),
    Cluster(Arc<Cluster>),
    Sentinel(Arc<Sentinel>),
    /// The settings cannot make a connection; every call fails with this.
    Unusable(Arc<str>),
}

impl Link {
    /// A link for `settings`. Nothing connects yet: a Redis that is down now is an outage of
    /// the first calls, not an error here. Settings that can never connect (a malformed URL,
    /// an unreadable CA file) give a link whose every call fails saying so.
    pub fn open(settings: &LinkSettings<'_>) -> Link {
        let route = Route::open(settings).unwrap_or_else(|error| {
            Route::Unusable(format!("the state store cannot be set up: {error}").into())
        });
        let problem = match &route {
            Route::Unusable(why) => Some(why.to_string()),
            _ => None,
        };
        Link {
            route,
            problem: Arc::new(Problem::new(problem)),
        }
    }

    /// The last error a call met, until a call succeeds again.
    pub fn problem(&self) -> Option<String> {
        self.problem.text.lock().ok().and_then(|p| p.clone())
    }

    fn note<T>(&self, result: RedisResult<T>) -> RedisResult<T> {
        self.problem.note(result.as_ref().err());
        result
    }
}

/// An error as an operator reads it: what Redis said, with a hint for a refused login.
fn describe(error: &RedisError) -> String {
    match error.kind() {
        ErrorKind::AuthenticationFailed => {
            format!("Redis refused the user name or password in redis_url: {error}")
        }
        ErrorKind::Server(ServerErrorKind::NoPerm) => {
            format!("the Redis user lacks a permission onedoor needs (scripts, keys under the prefix): {error}")
        }
        _ => error.to_string(),
    }
}

impl Route {
    fn open(settings: &LinkSettings<'_>) -> RedisResult<Route> {
        let address = RedisAddress::parse(settings.url).map_err(|why| {
            RedisError::from((ErrorKind::InvalidClientConfig, "redis_url", why.0))
        })?;
        let ca = certificates(settings.ca_file)?;
        match &address.topology {
            Topology::Server => server(&address, ca, settings.timeout),
            Topology::Cluster => cluster(&address, ca, settings.timeout),
            Topology::Sentinel { master } => sentinel(&address, master, ca, settings.timeout),
        }
    }
}

fn certificates(ca_file: Option<&Path>) -> RedisResult<Option<TlsCertificates>> {
    let Some(path) = ca_file else {
        return Ok(None);
    };
    let pem = std::fs::read(path).map_err(|error| {
        RedisError::from((
            ErrorKind::InvalidClientConfig,
            "redis_ca_file cannot be read",
            format!("{}: {error}", path.display()),
        ))
    })?;
    Ok(Some(TlsCertificates {
        client_tls: None,
        root_cert: Some(pem),
    }))
}

fn client(url: &str, ca: Option<TlsCertificates>) -> RedisResult<redis::Client> {
    match ca {
        Some(ca) => redis::Client::build_with_tls(url, ca),
        None => redis::Client::open(url),
    }
}

fn server(
    address: &RedisAddress,
    ca: Option<TlsCertificates>,
    timeout: Duration,
) -> RedisResult<Route> {
    let node = address
        .nodes
        .first()
        .map(String::as_str)
        .unwrap_or_default();
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(timeout))
        .set_response_timeout(Some(timeout))
        .set_number_of_retries(1)
        .set_min_delay(Duration::from_millis(10))
        .set_max_delay(Duration::from_millis(100));
    let client = client(&address.server_url(node), ca)?;
    Ok(Route::Server(ConnectionManager::new_lazy_with_config(
        client, config,
    )?))
}

/// A Redis Cluster, connected on first use; the connection then follows the slots itself.
struct Cluster {
    client: ClusterClient,
    connection: tokio::sync::OnceCell<ClusterConnection>,
}

fn cluster(
    address: &RedisAddress,
    ca: Option<TlsCertificates>,
    timeout: Duration,
) -> RedisResult<Route> {
    let seeds: Vec<String> = address
        .nodes
        .iter()
        .map(|node| address.server_url(node))
        .collect();
    let mut builder = ClusterClientBuilder::new(seeds)
        .connection_timeout(timeout)
        .response_timeout(timeout)
        .retries(1);
    if let Some(ca) = ca {
        builder = builder.certs(ca);
    }
    Ok(Route::Cluster(Arc::new(Cluster {
        client: builder.build()?,
        connection: tokio::sync::OnceCell::new(),
    })))
}

impl Cluster {
    async fn connection(&self) -> RedisResult<ClusterConnection> {
        self.connection
            .get_or_try_init(|| self.client.get_async_connection())
            .await
            .cloned()
    }

    /// A Cluster takes a pipeline only when all its commands share a slot; onedoor's pipelines
    /// carry independent commands under different hash tags, so each goes on its own, all at
    /// once, and the replies come back in the pipeline's order.
    async fn pipeline(
        &self,
        pipeline: &Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        let connection = self.connection().await?;
        if pipeline.is_transaction() || pipeline.len() < 2 {
            let mut connection = connection;
            return connection
                .req_packed_commands(pipeline, offset, count)
                .await;
        }
        let sends = pipeline.cmd_iter().map(|cmd| {
            let mut connection = connection.clone();
            let mut one = redis::pipe();
            one.add_command(cmd.clone());
            async move { connection.req_packed_commands(&one, 0, 1).await }
        });
        let replies = futures_util::future::try_join_all(sends).await?;
        Ok(replies.into_iter().flatten().collect())
    }
}

/// The master a Sentinel names. The connection is kept until it fails in a way that says the
/// master is gone or no longer master; the next call asks the sentinels again.
struct Sentinel {
    sentinels: tokio::sync::Mutex<SentinelClient>,
    master: ArcSwapOption<MultiplexedConnection>,
    config: AsyncConnectionConfig,
}

fn sentinel(
    address: &RedisAddress,
    master: &str,
    ca: Option<TlsCertificates>,
    timeout: Duration,
) -> RedisResult<Route> {
    let sentinels = address
        .nodes
        .iter()
        .map(|node| {
            let scheme = if address.tls { "rediss" } else { "redis" };
            Ok(format!("{scheme}://{node}")
                .into_connection_info()?
                .addr()
                .clone())
        })
        .collect::<RedisResult<Vec<_>>>()?;
    let login = address
        .server_url("sentinel-named-master:1")
        .into_connection_info()?;
    let login = login.redis_settings();
    let mut builder = SentinelClientBuilder::new(sentinels, master, SentinelServerType::Master)?
        .set_client_to_redis_db(login.db());
    if let Some(username) = login.username() {
        builder = builder.set_client_to_redis_username(username);
    }
    if let Some(password) = login.password() {
        builder = builder.set_client_to_redis_password(password);
    }
    if address.tls {
        builder = builder
            .set_client_to_redis_tls_mode(TlsMode::Secure)
            .set_client_to_sentinel_tls_mode(TlsMode::Secure);
        if let Some(ca) = ca {
            builder = builder
                .set_client_to_redis_certificates(ca.clone())
                .set_client_to_sentinel_certificates(ca);
        }
    }
    Ok(Route::Sentinel(Arc::new(Sentinel {
        sentinels: tokio::sync::Mutex::new(builder.build()?),
        master: ArcSwapOption::empty(),
        config: AsyncConnectionConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout)),
    })))
}

impl Sentinel {
    fn current(&self) -> Option<MultiplexedConnection> {
        self.master
            .load_full()
            .map(|m| MultiplexedConnection::clone(&m))
    }

    async fn connection(&self) -> RedisResult<MultiplexedConnection> {
        if let Some(connection) = self.current() {
            return Ok(connection);
        }
        let mut sentinels = self.sentinels.lock().await;
        if let Some(connection) = self.current() {
            return Ok(connection);
        }
        let client = sentinels.async_get_client().await?;
        let connection = client
            .get_multiplexed_async_connection_with_config(&self.config)
            .await?;
        self.master.store(Some(Arc::new(connection.clone())));
        Ok(connection)
    }

    /// Drops the connection after an error that means the master moved.
    fn after<T>(&self, result: RedisResult<T>) -> RedisResult<T> {
        if let Err(error) = &result {
            let moved = error.is_io_error()
                || error.is_connection_dropped()
                || error.is_timeout()
                || error.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly);
            if moved {
                self.master.store(None);
            }
        }
        result
    }

    async fn command(&self, cmd: &Cmd) -> RedisResult<Value> {
        let mut connection = self.connection().await?;
        let result = connection.req_packed_command(cmd).await;
        self.after(result)
    }

    async fn pipeline(
        &self,
        pipeline: &Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        let mut connection = self.connection().await?;
        let result = connection
            .req_packed_commands(pipeline, offset, count)
            .await;
        let result = self.after(result);
        // A pipeline's replies carry server errors inside; a demoted master answers READONLY.
        if let Ok(replies) = &result {
            let readonly = replies.iter().any(|reply| {
                matches!(reply, Value::ServerError(e) if e.kind() == Some(ServerErrorKind::ReadOnly))
            });
            if readonly {
                let _ = self.after::<()>(Err(RedisError::from((
                    ErrorKind::Server(ServerErrorKind::ReadOnly),
                    "the master turned replica",
                ))));
            }
        }
        result
    }
}

fn unusable(why: &str) -> RedisError {
    RedisError::from((ErrorKind::InvalidClientConfig, "unusable", why.to_owned()))
}

impl ConnectionLike for Link {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let result = match &mut self.route {
                Route::Server(connection) => connection.req_packed_command(cmd).await,
                Route::Cluster(cluster) => match cluster.connection().await {
                    Ok(mut connection) => connection.req_packed_command(cmd).await,
                    Err(error) => Err(error),
                },
                Route::Sentinel(sentinel) => sentinel.command(cmd).await,
                Route::Unusable(why) => Err(unusable(why)),
            };
            self.note(result)
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let result = match &mut self.route {
                Route::Server(connection) => {
                    connection
                        .req_packed_commands(pipeline, offset, count)
                        .await
                }
                Route::Cluster(cluster) => cluster.pipeline(pipeline, offset, count).await,
                Route::Sentinel(sentinel) => sentinel.pipeline(pipeline, offset, count).await,
                Route::Unusable(why) => Err(unusable(why)),
            };
            self.note(result)
        })
    }

    fn get_db(&self) -> i64 {
        match &self.route {
            Route::Server(connection) => connection.get_db(),
            _ => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problem_of(url: &str, ca_file: Option<&Path>) -> String {
        let link = Link::open(&LinkSettings {
            url,
            ca_file,
            timeout: Duration::from_millis(100),
        });
        link.problem().unwrap_or_default()
    }

    #[test]
    fn settings_that_can_never_connect_say_why_before_any_call() {
        let unreadable = problem_of(
            "rediss://u:pw@127.0.0.1:6380/0",
            Some(Path::new("/no/such/ca.pem")),
        );
        assert!(
            unreadable.contains("redis_ca_file cannot be read"),
            "{unreadable}"
        );
        assert!(unreadable.contains("/no/such/ca.pem"), "{unreadable}");
        let malformed = problem_of("redis://u:pw@h:1,h:2/0", None);
        assert!(malformed.contains("redis+cluster://"), "{malformed}");
        assert!(!malformed.contains("pw"), "{malformed}");
    }

    #[tokio::test]
    async fn every_form_opens_without_connecting() {
        for url in [
            "redis://127.0.0.1:1/0",
            "redis+cluster://127.0.0.1:1,127.0.0.1:2",
            "redis+sentinel://127.0.0.1:1/cache/2",
        ] {
            assert_eq!(problem_of(url, None), "", "{url}");
        }
    }
}
