//! The client port's guard against slow and hostile clients: `max_connections` and the
//! `client_timeouts` each connection is held to.

use std::time::Duration;

use crate::model::ClientTimeouts;
use crate::problems::Problems;
use crate::read::{self, Fields};
use crate::tree::Node;

/// Open client connections at most, unless the config says otherwise; the descriptor limit may
/// lower it at start.
pub(crate) const DEFAULT_MAX_CONNECTIONS: usize = 10_000;

pub(crate) fn max_connections(node: Option<&Node>, p: &mut Problems) -> usize {
    node.and_then(|n| read::int(n, 1, p))
        .map_or(DEFAULT_MAX_CONNECTIONS, |n| {
            usize::try_from(n).unwrap_or(usize::MAX)
        })
}

pub(crate) fn client_timeouts(node: Option<&Node>, p: &mut Problems) -> ClientTimeouts {
    let f = Fields::open(node, &["head", "idle", "body", "write"], p);
    let field = |key: &str, default: Duration, p: &mut Problems| {
        f.get(key)
            .and_then(|n| read::positive_duration(n, p))
            .unwrap_or(default)
    };
    let base = ClientTimeouts::DEFAULT;
    ClientTimeouts {
        head: field("head", base.head, p),
        idle: field("idle", base.idle, p),
        body: field("body", base.body, p),
        write: field("write", base.write, p),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::testing::{compile, problems};

    #[test]
    fn connection_limits_default_to_what_an_operator_expects() {
        let s = compile("");
        assert_eq!(s.max_connections, 10_000);
        assert_eq!(s.client_timeouts.head, Duration::from_secs(20));
        assert_eq!(s.client_timeouts.idle, Duration::from_secs(75));
        assert_eq!(s.client_timeouts.body, Duration::from_secs(60));
        assert_eq!(s.client_timeouts.write, Duration::from_secs(60));
    }

    #[test]
    fn connection_limits_are_read_and_checked() {
        let s = compile("max_connections: 64\nclient_timeouts: { head: 2s, write: 500ms }\n");
        assert_eq!(s.max_connections, 64);
        assert_eq!(s.client_timeouts.head, Duration::from_secs(2));
        assert_eq!(s.client_timeouts.write, Duration::from_millis(500));
        assert_eq!(s.client_timeouts.idle, Duration::from_secs(75));
        assert_eq!(
            problems("max_connections: 0\nclient_timeouts: { head: 0s, linger: 1s }\n"),
            [
                "1:18: must be at least 1",
                "2:26: must be longer than zero",
                "2:30: unknown key \"linger\" (expected one of: head, idle, body, write)",
            ]
        );
    }
}
