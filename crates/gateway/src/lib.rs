//! The onedoor gateway: listeners and surfaces, auth, routing and failover, provider adapters,
//! streaming, and the admin API. It runs on a compiled config [`Snapshot`] and keeps its learned
//! state behind the `onedoor_state::State` trait.

mod admin;
mod auth;
pub mod body;
mod errors;
mod failover;
mod outcome;
mod pipeline;
mod provider;
mod request;
mod router;
mod runtime;
mod server;
mod stream;
mod surface;
mod upstream;

use std::net::SocketAddr;
use std::sync::Arc;

use arc_swap::ArcSwap;
use onedoor_config::Snapshot;
use onedoor_state::MemoryState;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::runtime::Runtime;

/// A running gateway: its bound addresses and the handle that stops it.
pub struct Running {
    addr: SocketAddr,
    admin_addr: SocketAddr,
    shutdown: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl Running {
    /// The client-facing address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// Stops accepting, lets in-flight requests finish, and returns when both listeners are done.
    pub async fn shutdown(self) {
        let _ = self.shutdown.send(true);
        for task in self.tasks {
            let _ = task.await;
        }
    }
}

/// Binds the snapshot's `listen` and `admin.listen` addresses and starts serving.
pub async fn start(snapshot: Snapshot) -> std::io::Result<Running> {
    let client = TcpListener::bind(snapshot.listen).await?;
    let admin = TcpListener::bind(snapshot.admin.listen).await?;
    Ok(start_on(snapshot, client, admin))
}

/// Starts serving on listeners the caller bound (tests bind port 0).
pub fn start_on(snapshot: Snapshot, client: TcpListener, admin: TcpListener) -> Running {
    let state = Arc::new(MemoryState::new());
    let runtime = Arc::new(ArcSwap::from_pointee(Runtime::new(
        Arc::new(snapshot),
        state,
    )));
    let (shutdown, watcher) = watch::channel(false);
    let addr = client
        .local_addr()
        .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
    let admin_addr = admin
        .local_addr()
        .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
    let for_clients = runtime.clone();
    let clients = tokio::spawn(server::serve(
        client,
        move |request| pipeline::handle(for_clients.load_full(), request),
        watcher.clone(),
    ));
    let admins = tokio::spawn(server::serve(
        admin,
        move |request| admin::handle(runtime.clone(), request),
        watcher,
    ));
    Running {
        addr,
        admin_addr,
        shutdown,
        tasks: vec![clients, admins],
    }
}
