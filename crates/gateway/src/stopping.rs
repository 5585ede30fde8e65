//! Stopping in phases, as a load balancer or Kubernetes needs: first the gateway says it is
//! going (`/readyz` 503, `connection: close` on HTTP/1.1 answers, GOAWAY on h2) while it goes on
//! accepting for `shutdown.drain_delay`; then its client listener closes and what is under way
//! gets `shutdown.timeout`; then what is left is cut. The admin port answers (probes, metrics)
//! until the client port is done.

use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// Where a listener is in a stop; each phase follows the one before.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    Serving,
    /// Still accepting; answers say the connection closes, `/readyz` says 503.
    Draining,
    /// The listener is closed; idle connections close, requests under way go on.
    Closing,
    /// Whatever is still open ends now.
    Aborting,
}

/// How long the admin port's own requests (probes, scrapes) get once the client port is done.
const ADMIN_GRACE: Duration = Duration::from_secs(2);

/// The phase of the gateway's two listeners; shared by every runtime of the gateway.
pub struct Stopping {
    client: watch::Sender<Phase>,
    admin: watch::Sender<Phase>,
}

impl Default for Stopping {
    fn default() -> Self {
        Stopping {
            client: watch::Sender::new(Phase::Serving),
            admin: watch::Sender::new(Phase::Serving),
        }
    }
}

impl Stopping {
    /// Whether a stop has begun: `/readyz` answers 503 from then on.
    pub fn draining(&self) -> bool {
        *self.client.borrow() >= Phase::Draining
    }

    pub fn client(&self) -> watch::Receiver<Phase> {
        self.client.subscribe()
    }

    pub fn admin(&self) -> watch::Receiver<Phase> {
        self.admin.subscribe()
    }

    /// Says the gateway is going; the listeners keep accepting.
    pub fn drain(&self) {
        raise(&self.client, Phase::Draining);
    }

    /// Closes the client listener, then waits for its connections until `deadline`, and cuts
    /// those still open after it. `listener` is the client listener's task.
    pub async fn close_clients(&self, listener: JoinHandle<()>, deadline: Instant) {
        close(&self.client, listener, deadline).await;
    }

    /// Closes the admin listener, once the client port is done.
    pub async fn close_admin(&self, listener: JoinHandle<()>) {
        close(&self.admin, listener, Instant::now() + ADMIN_GRACE).await;
    }
}

/// Moves `phase` forward to `to` (never back).
fn raise(phase: &watch::Sender<Phase>, to: Phase) {
    phase.send_if_modified(|now| {
        let later = to > *now;
        if later {
            *now = to;
        }
        later
    });
}

async fn close(phase: &watch::Sender<Phase>, mut listener: JoinHandle<()>, deadline: Instant) {
    raise(phase, Phase::Closing);
    if tokio::time::timeout_at(deadline, &mut listener)
        .await
        .is_err()
    {
        tracing::warn!("shutdown: connections still open at shutdown.timeout, closing them");
        raise(phase, Phase::Aborting);
        let _ = listener.await;
    }
}

/// Resolves once `phase` has reached `at` (or its sender is gone).
pub async fn reached(phase: &mut watch::Receiver<Phase>, at: Phase) {
    let _ = phase.wait_for(|now| *now >= at).await;
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[tokio::test]
    async fn phases_only_move_forward_and_the_drain_shows_at_once() {
        let stopping = Stopping::default();
        let mut client = stopping.client();
        assert!(!stopping.draining());
        stopping.drain();
        assert!(stopping.draining());
        assert!(client.has_changed().unwrap());
        raise(&stopping.client, Phase::Aborting);
        raise(&stopping.client, Phase::Closing);
        assert_eq!(*client.borrow_and_update(), Phase::Aborting);
        assert_eq!(*stopping.admin().borrow(), Phase::Serving);
    }

    #[tokio::test]
    async fn a_listener_not_done_by_its_deadline_is_told_to_abort() {
        let stopping = Stopping::default();
        let mut phase = stopping.client();
        let listener = tokio::spawn(async move {
            reached(&mut phase, Phase::Aborting).await;
        });
        let started = Instant::now();
        let deadline = started + Duration::from_millis(100);
        stopping.close_clients(listener, deadline).await;
        assert!(started.elapsed() >= Duration::from_millis(100));
        assert_eq!(*stopping.client().borrow(), Phase::Aborting);
    }
}
