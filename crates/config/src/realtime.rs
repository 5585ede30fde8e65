//! The `realtime` section: how long a realtime WebSocket session may sit idle (no text or binary
//! frame either way) and how long it may last at all.

use std::time::Duration;

use crate::model::Realtime;
use crate::problems::Problems;
use crate::read::{self, Fields};
use crate::tree::Node;

pub(crate) fn realtime(node: Option<&Node>, p: &mut Problems) -> Realtime {
    let f = Fields::open(node, &["idle", "max_session"], p);
    let defaults = Realtime::default();
    let idle = f.get("idle").and_then(|n| read::positive_duration(n, p));
    let max_session = f
        .get("max_session")
        .and_then(|n| read::positive_duration(n, p));
    if let (Some(idle), Some(max), Some(node)) = (idle, max_session, f.get("idle")) {
        if idle > max {
            p.at(
                node.mark,
                format!(
                    "idle ({}) is longer than max_session ({}), so no session could ever idle out",
                    humantime::format_duration(idle),
                    humantime::format_duration(max)
                ),
            );
        }
    }
    Realtime {
        idle: idle.unwrap_or(defaults.idle),
        max_session: max_session.unwrap_or(defaults.max_session),
    }
}

impl Default for Realtime {
    fn default() -> Self {
        Realtime {
            idle: Duration::from_secs(5 * 60),
            max_session: Duration::from_secs(30 * 60),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::testing::{compile, problems};

    #[test]
    fn sessions_idle_out_after_five_minutes_and_end_after_thirty_by_default() {
        let s = compile("");
        assert_eq!(s.realtime.idle, Duration::from_secs(300));
        assert_eq!(s.realtime.max_session, Duration::from_secs(1800));
        let s = compile("realtime: { idle: 45s, max_session: 2h }");
        assert_eq!(s.realtime.idle, Duration::from_secs(45));
        assert_eq!(s.realtime.max_session, Duration::from_secs(7200));
    }

    #[test]
    fn durations_must_be_positive_and_idle_within_the_session() {
        assert_eq!(
            problems("realtime: { idle: 0s, max_session: soon, ping: 1s }\n"),
            [
                "1:19: must be longer than zero",
                "1:36: expected a duration like \"30s\", found \"soon\"",
                "1:42: unknown key \"ping\" (expected one of: idle, max_session)",
            ]
        );
        assert_eq!(
            problems("realtime: { idle: 1h, max_session: 10m }\n"),
            ["1:19: idle (1h) is longer than max_session (10m), so no session could ever idle out"]
        );
    }
}
