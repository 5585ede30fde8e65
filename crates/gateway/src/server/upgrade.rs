//! A request's protocol upgrade (the realtime WebSocket handshake): its connection, handed over
//! by hyper once the 101 is out, with whatever the client sent after its handshake.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Request;
use hyper_util::rt::TokioIo;

/// An upgraded connection, as tokio's reader and writer.
pub type Upgraded = TokioIo<hyper::upgrade::Upgraded>;

/// The upgrade of a request whose answer is a 101: its connection, once that answer is out.
/// Handlers take it from the request with [`OnUpgrade::take`].
pub struct OnUpgrade(hyper::upgrade::OnUpgrade);

/// Why an upgrade did not happen.
#[derive(Debug)]
pub struct UpgradeFailed;

impl std::fmt::Display for UpgradeFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the connection was not upgraded")
    }
}

impl std::error::Error for UpgradeFailed {}

impl OnUpgrade {
    /// The request's upgrade; one that never happens when its connection cannot upgrade.
    pub fn take<B>(request: &mut Request<B>) -> OnUpgrade {
        OnUpgrade(hyper::upgrade::on(request))
    }
}

impl Future for OnUpgrade {
    type Output = Result<Upgraded, UpgradeFailed>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.0)
            .poll(cx)
            .map(|upgraded| upgraded.map(TokioIo::new).map_err(|_| UpgradeFailed))
    }
}
