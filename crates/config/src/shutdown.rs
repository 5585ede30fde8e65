//! The `shutdown` section: how a stopping gateway lets its traffic go. `drain_delay` is how long
//! it goes on accepting after SIGTERM while `/readyz` already says 503 (load balancers and
//! Kubernetes endpoints take a few seconds to stop sending); `timeout` is how long requests,
//! streams and realtime sessions under way then get before they are cut.

use std::time::Duration;

use crate::model::Shutdown;
use crate::problems::Problems;
use crate::read::{self, Fields};
use crate::tree::Node;

/// Longer than this is a mistake: no load balancer takes an hour to stop sending.
const MAX_DRAIN_DELAY: Duration = Duration::from_secs(10 * 60);

pub(crate) fn shutdown(node: Option<&Node>, p: &mut Problems) -> Shutdown {
    let f = Fields::open(node, &["drain_delay", "timeout"], p);
    let defaults = Shutdown::default();
    let drain_delay = f.get("drain_delay").and_then(|n| {
        let delay = read::duration(n, p)?;
        if delay > MAX_DRAIN_DELAY {
            p.at(n.mark, "must be at most 10m");
            return None;
        }
        Some(delay)
    });
    let timeout = f.get("timeout").and_then(|n| read::positive_duration(n, p));
    Shutdown {
        drain_delay: drain_delay.unwrap_or(defaults.drain_delay),
        timeout: timeout.unwrap_or(defaults.timeout),
    }
}

impl Default for Shutdown {
    fn default() -> Self {
        Shutdown {
            drain_delay: Duration::from_secs(5),
            timeout: Duration::from_secs(30),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::testing::{compile, problems};

    #[test]
    fn a_stop_drains_for_five_seconds_and_waits_thirty_by_default() {
        let s = compile("");
        assert_eq!(s.shutdown.drain_delay, Duration::from_secs(5));
        assert_eq!(s.shutdown.timeout, Duration::from_secs(30));
        let s = compile("shutdown: { drain_delay: 0s, timeout: 2m }");
        assert_eq!(s.shutdown.drain_delay, Duration::ZERO);
        assert_eq!(s.shutdown.timeout, Duration::from_secs(120));
    }

    #[test]
    fn the_delay_is_bounded_and_the_timeout_positive() {
        assert_eq!(
            problems("shutdown: { drain_delay: 2h, timeout: 0s, grace: 1s }\n"),
            [
                "1:26: must be at most 10m",
                "1:39: must be longer than zero",
                "1:43: unknown key \"grace\" (expected one of: drain_delay, timeout)",
            ]
        );
        assert_eq!(
            problems("shutdown: { drain_delay: soon }\n"),
            ["1:26: expected a duration like \"30s\", found \"soon\""]
        );
    }
}
