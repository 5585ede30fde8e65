//! Accepting connections and serving HTTP/1.1 on them, with the ability to drop one without an answer.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::task::JoinSet;

use crate::dispatch;
use crate::realtime::{self, Upgrade};
use crate::state::Shared;

/// Serves until aborted; aborting it also aborts every connection, since it owns their tasks.
pub async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    shared.counters.connections.fetch_add(1, Ordering::Relaxed);
                    connections.spawn(serve(stream, shared.clone()));
                }
                Err(e) => {
                    // Typically out of file descriptors: back off instead of spinning.
                    tracing::warn!(endpoint = %shared.spec.name, "mock accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

async fn serve(stream: TcpStream, shared: Arc<Shared>) {
    // Stream chunks must leave when written, not when Nagle decides.
    let _ = stream.set_nodelay(true);
    let kill = Arc::new(Notify::new());
    let upgrade = Arc::new(Upgrade::default());
    let service = {
        let (kill, upgrade, shared) = (kill.clone(), upgrade.clone(), shared.clone());
        service_fn(move |request| {
            dispatch::handle(shared.clone(), kill.clone(), upgrade.clone(), request)
        })
    };
    // Without `with_upgrades`, hyper ends the connection future after a 101 and gives the socket
    // back through `into_parts`, so a reset can still reach the raw stream below.
    let mut connection = http1::Builder::new().serve_connection(TokioIo::new(stream), service);
    tokio::select! {
        _ = &mut connection => {
            if let Some(accepted) = upgrade.take() {
                let parts = connection.into_parts();
                realtime::run(parts.io.into_inner(), parts.read_buf, accepted, shared).await;
            }
        }
        () = kill.notified() => {
            // A zero linger makes the close a TCP reset, so the client sees the connection die
            // rather than a clean end of stream.
            let stream = connection.into_parts().io.into_inner();
            let _ = stream.set_zero_linger();
        }
    }
}
