//! The `routing` section: attempt budgets, retry waits, the not-served cache lifetime, and the
//! default `timeouts` that backends may override field by field.

use std::time::Duration;

use crate::model::{Routing, Timeouts};
use crate::problems::Problems;
use crate::read::{self, Fields};
use crate::tree::Node;

pub(crate) fn routing(node: Option<&Node>, p: &mut Problems) -> Routing {
    let known = [
        "default_max_tokens",
        "max_attempts",
        "same_target_retries",
        "max_retry_wait",
        "not_served_ttl",
        "timeouts",
    ];
    let f = Fields::open(node, &known, p);
    Routing {
        default_max_tokens: f.int("default_max_tokens", 1, p).unwrap_or(256),
        max_attempts: f.int32("max_attempts", 1, p).unwrap_or(4),
        same_target_retries: f.int32("same_target_retries", 0, p).unwrap_or(1),
        max_retry_wait: f
            .duration("max_retry_wait", p)
            .unwrap_or(Duration::from_secs(2)),
        not_served_ttl: f
            .duration("not_served_ttl", p)
            .unwrap_or(Duration::from_secs(3600)),
        timeouts: timeouts(f.get("timeouts"), Timeouts::default(), p),
    }
}

/// A `timeouts` block: each field given overrides the one in `base`.
pub(crate) fn timeouts(node: Option<&Node>, base: Timeouts, p: &mut Problems) -> Timeouts {
    let f = Fields::open(node, &["connect", "first_token", "idle", "total"], p);
    let field = |key: &str, default: Duration, p: &mut Problems| {
        f.get(key)
            .and_then(|n| read::positive_duration(n, p))
            .unwrap_or(default)
    };
    Timeouts {
        connect: field("connect", base.connect, p),
        first_token: field("first_token", base.first_token, p),
        idle: field("idle", base.idle, p),
        total: field("total", base.total, p),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::testing::{compile, problems};

    #[test]
    fn routing_values_override_defaults() {
        let s = compile(
            "routing: { max_attempts: 2, same_target_retries: 0, max_retry_wait: 500ms, timeouts: { idle: 5s } }",
        );
        assert_eq!(s.routing.max_attempts, 2);
        assert_eq!(s.routing.same_target_retries, 0);
        assert_eq!(s.routing.max_retry_wait, Duration::from_millis(500));
        assert_eq!(s.routing.timeouts.idle, Duration::from_secs(5));
        assert_eq!(s.routing.timeouts.connect, Duration::from_secs(2));
    }

    #[test]
    fn attempts_and_timeouts_must_be_useful() {
        assert_eq!(
            problems("routing:\n  max_attempts: 0\n  timeouts: { total: 0s, conect: 1s }\n"),
            [
                "2:17: must be at least 1",
                "3:22: must be longer than zero",
                "3:26: unknown key \"conect\" (expected one of: connect, first_token, idle, total)",
            ]
        );
    }
}
