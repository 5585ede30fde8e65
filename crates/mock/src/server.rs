//! Accepting connections and serving HTTP/1.1 on them, with the ability to drop one without an answer.

use std::sync::Arc;

use tokio::net::TcpListener;

use crate::state::Shared;

pub async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let _ = (listener, shared);
}
