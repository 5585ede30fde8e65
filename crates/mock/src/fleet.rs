//! Starting, observing, steering and stopping a set of simulated endpoints.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::net::{TcpListener, TcpSocket};
use tokio::task::JoinHandle;

use crate::state::{lock, Shared};
use crate::{server, Behavior, Dialect, EndpointSpec, RealtimeHandshake};

/// A loopback port for an endpoint that is down: it refuses every connection for as long as the
/// returned socket lives. The socket is bound to the port and never listens, so no other listener
/// (a gateway's, a fleet endpoint's) can be given the port meanwhile.
pub fn refusing_port() -> std::io::Result<(TcpSocket, u16)> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))?;
    let port = socket.local_addr()?.port();
    Ok((socket, port))
}

/// A running endpoint. Dropping it stops it.
pub struct Endpoint {
    shared: Arc<Shared>,
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Endpoint {
    async fn start(spec: EndpointSpec) -> std::io::Result<Self> {
        let bind = spec
            .listen
            .unwrap_or_else(|| SocketAddr::from((Ipv4Addr::LOCALHOST, 0)));
        let listener = TcpListener::bind(bind).await.map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("mock endpoint {}: bind {bind}: {e}", spec.name),
            )
        })?;
        let mut addr = listener.local_addr()?;
        // A wildcard bind is still reached through loopback; url() must be dialable.
        if addr.ip().is_unspecified() {
            addr.set_ip(Ipv4Addr::LOCALHOST.into());
        }
        let shared = Arc::new(Shared::new(spec));
        let task = tokio::spawn(server::accept_loop(listener, shared.clone()));
        Ok(Self { shared, addr, task })
    }

    pub fn name(&self) -> &str {
        &self.shared.spec.name
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The base URL a client of this dialect is configured with.
    pub fn url(&self) -> String {
        match self.shared.spec.dialect {
            Dialect::OpenAi => format!("http://{}/v1", self.addr),
            Dialect::Azure | Dialect::Anthropic => format!("http://{}", self.addr),
        }
    }

    pub fn set_behavior(&self, b: Behavior) {
        self.shared.set_behavior(b);
    }

    /// Overrides the endpoint behaviour for one deployment.
    pub fn set_deployment_behavior(&self, deployment: &str, b: Behavior) {
        self.shared.set_deployment_behavior(deployment, b);
    }

    /// Requests routed to this deployment name (known or not), whatever their answer.
    pub fn requests(&self, deployment: &str) -> u64 {
        self.shared.requests(deployment)
    }

    /// The last model request this endpoint received: `{"headers": {..}, "body": "<as sent>"}`
    /// (as `GET /_mock/last_request` answers), `null` before any.
    pub fn last_request(&self) -> serde_json::Value {
        self.shared.last_request()
    }

    pub fn total_requests(&self) -> u64 {
        self.shared.total()
    }

    /// Connections accepted (since the start or the last counter reset).
    pub fn connections(&self) -> u64 {
        self.shared
            .counters
            .connections
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Requests whose client went away before the answer was complete.
    pub fn cancelled(&self) -> u64 {
        self.shared.cancelled()
    }

    pub fn reset_counters(&self) {
        self.shared.reset_counters();
    }

    /// Realtime sessions accepted (since the start or the last counter reset).
    pub fn realtime_sessions(&self) -> u64 {
        self.shared.realtime.sessions.load(Ordering::Relaxed)
    }

    /// Realtime sessions open now.
    pub fn realtime_open(&self) -> u64 {
        self.shared.realtime.open.load(Ordering::Relaxed)
    }

    /// The last close frame a realtime client sent: `Some(None)` for one without a status code.
    pub fn last_realtime_close(&self) -> Option<Option<(u16, String)>> {
        lock(&self.shared.realtime.last_close).clone()
    }

    /// What the last realtime handshake carried (path, subprotocols, beta header, credential).
    pub fn last_realtime_handshake(&self) -> Option<RealtimeHandshake> {
        lock(&self.shared.realtime.last_handshake).clone()
    }

    async fn stop(mut self) {
        self.task.abort();
        // The accept loop owns the connection tasks, so once it is gone nothing is listening or serving.
        let _ = (&mut self.task).await;
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A set of running endpoints.
pub struct Fleet {
    endpoints: Vec<Endpoint>,
}

impl Fleet {
    /// Starts every endpoint, each on 127.0.0.1 with an ephemeral port unless its spec says where.
    pub async fn start(specs: Vec<EndpointSpec>) -> std::io::Result<Fleet> {
        let mut endpoints = Vec::with_capacity(specs.len());
        for spec in specs {
            endpoints.push(Endpoint::start(spec).await?);
        }
        Ok(Fleet { endpoints })
    }

    pub fn endpoint(&self, name: &str) -> Option<&Endpoint> {
        self.endpoints.iter().find(|e| e.name() == name)
    }

    pub fn endpoints(&self) -> &[Endpoint] {
        &self.endpoints
    }

    /// Stops every endpoint and waits until their ports are closed.
    pub async fn shutdown(self) {
        for endpoint in self.endpoints {
            endpoint.stop().await;
        }
    }
}
