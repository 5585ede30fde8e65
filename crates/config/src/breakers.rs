//! The `circuit_breakers` section: named policies, each a list of rules saying which failures count,
//! how many (or what share) within a window trip the breaker, for how long, against what (a
//! target or its whole backend) and how failed probes back off.

use std::collections::HashMap;

use crate::model::{
    BreakerBackoff, BreakerPolicy, BreakerRule, BreakerScope, FailureKind, FailureThreshold,
};
use crate::problems::{Mark, Problems};
use crate::read::{self, Fields};
use crate::tree::Node;

pub(crate) fn breakers(node: Option<&Node>, p: &mut Problems) -> HashMap<String, BreakerPolicy> {
    let mut policies = HashMap::new();
    let Some(node) = node else { return policies };
    for (name, _, value) in read::named_entries(node, p) {
        let f = Fields::new(value, &["rules"], p);
        let rules = match f.get("rules") {
            Some(list) => rules(list, p),
            None => {
                if !f.has("rules") {
                    p.at(f.mark, format!("circuit breaker {name:?} needs rules"));
                }
                Vec::new()
            }
        };
        policies.insert(
            name.to_owned(),
            BreakerPolicy {
                name: name.to_owned(),
                rules,
            },
        );
    }
    policies
}

fn rules(node: &Node, p: &mut Problems) -> Vec<BreakerRule> {
    let Some(items) = read::list(node, p) else {
        return Vec::new();
    };
    if items.is_empty() {
        p.at(node.mark, "a circuit breaker needs at least one rule");
    }
    let mut seen: Vec<(&str, Mark)> = Vec::new();
    let mut rules = Vec::with_capacity(items.len());
    for item in items {
        let f = Fields::new(
            item,
            &[
                "name",
                "failures",
                "trip",
                "accept_retry_after",
                "scope",
                "backoff",
            ],
            p,
        );
        let name_node = f.required("name", p);
        let name = name_node.and_then(|n| read::name(n, p));
        if let (Some(name), Some(n)) = (name, name_node) {
            match seen.iter().find(|(s, _)| *s == name) {
                Some((_, first)) => p.at(
                    n.mark,
                    format!("duplicate rule name {name:?} (first defined at {first})"),
                ),
                None => seen.push((name, n.mark)),
            }
        }
        let (threshold, within, status) = match f.required("failures", p) {
            Some(n) => failures(n, p),
            None => (FailureThreshold::Count(1), Default::default(), Vec::new()),
        };
        let trip = f
            .required("trip", p)
            .and_then(|n| read::positive_duration(n, p));
        rules.push(BreakerRule {
            name: name.unwrap_or_default().to_owned(),
            threshold,
            within,
            status,
            trip: trip.unwrap_or_default(),
            accept_retry_after: f.bool("accept_retry_after", p).unwrap_or(false),
            scope: f.get("scope").and_then(|n| read::choice(n, SCOPES, p)),
            backoff: f
                .get("backoff")
                .map_or(BreakerBackoff::DEFAULT, |n| backoff(n, trip, p)),
        });
    }
    rules
}

const SCOPES: &[(&str, BreakerScope)] = &[
    ("target", BreakerScope::Target),
    ("backend", BreakerScope::Backend),
];

/// `backoff: { factor, max }`, each defaulting to [`BreakerBackoff::DEFAULT`]'s.
fn backoff(node: &Node, trip: Option<std::time::Duration>, p: &mut Problems) -> BreakerBackoff {
    let f = Fields::new(node, &["factor", "max"], p);
    let mut backoff = BreakerBackoff::DEFAULT;
    if let Some(n) = f.get("factor") {
        match read::non_negative(n, p) {
            Some(x) if (1.0..=100.0).contains(&x) => backoff.factor = x,
            Some(_) => p.at(
                n.mark,
                "a backoff factor must be at least 1 (1: no backoff) and at most 100",
            ),
            None => {}
        }
    }
    if let Some(n) = f.get("max") {
        match (read::positive_duration(n, p), trip) {
            (Some(max), Some(trip)) if max < trip => p.at(
                n.mark,
                format!(
                    "the backoff max ({}) is shorter than the rule's trip ({})",
                    humantime::format_duration(max),
                    humantime::format_duration(trip)
                ),
            ),
            (Some(max), _) => backoff.max = max,
            (None, _) => {}
        }
    }
    backoff
}

/// `failures: { count | percent + min_requests, within, status }`.
fn failures(
    node: &Node,
    p: &mut Problems,
) -> (FailureThreshold, std::time::Duration, Vec<FailureKind>) {
    let f = Fields::new(
        node,
        &["count", "percent", "min_requests", "within", "status"],
        p,
    );
    let threshold = match (f.has("count"), f.has("percent")) {
        (true, true) => {
            p.at(f.key_mark("percent"), "write count or percent, not both");
            FailureThreshold::Count(1)
        }
        (false, false) => {
            p.at(
                f.mark,
                "failures needs count or percent (with min_requests)",
            );
            FailureThreshold::Count(1)
        }
        (true, false) => {
            if f.has("min_requests") {
                p.at(
                    f.key_mark("min_requests"),
                    "min_requests applies only with percent",
                );
            }
            FailureThreshold::Count(f.int32("count", 1, p).unwrap_or(1))
        }
        (false, true) => {
            let percent = f
                .get("percent")
                .and_then(|n| percent(n, p))
                .unwrap_or(100.0);
            let min_requests = f
                .required("min_requests", p)
                .and_then(|n| read::int32(n, 1, p));
            FailureThreshold::Percent {
                percent,
                min_requests: min_requests.unwrap_or(1),
            }
        }
    };
    let within = f
        .required("within", p)
        .and_then(|n| read::positive_duration(n, p));
    let status = match f.required("status", p) {
        Some(n) => statuses(n, p),
        None => Vec::new(),
    };
    (threshold, within.unwrap_or_default(), status)
}

fn percent(node: &Node, p: &mut Problems) -> Option<f64> {
    let x = read::non_negative(node, p)?;
    if x == 0.0 || x > 100.0 {
        p.at(node.mark, "a percentage must be above 0 and at most 100");
        return None;
    }
    Some(x)
}

fn statuses(node: &Node, p: &mut Problems) -> Vec<FailureKind> {
    let Some(items) = read::list(node, p) else {
        return Vec::new();
    };
    if items.is_empty() {
        p.at(node.mark, "status needs at least one entry");
    }
    items
        .iter()
        .filter_map(|item| {
            let text = read::str(item, p)?;
            let kind = failure_kind(text);
            if kind.is_none() {
                p.at(
                    item.mark,
                    format!(
                        "expected a status code (429), a range (500-599), connect_error or timeout, found {}",
                        item.found()
                    ),
                );
            }
            kind
        })
        .collect()
}

fn failure_kind(text: &str) -> Option<FailureKind> {
    let code = |s: &str| {
        s.trim()
            .parse::<u16>()
            .ok()
            .filter(|c| (100..=599).contains(c))
    };
    match text.trim() {
        "connect_error" => Some(FailureKind::ConnectError),
        "timeout" => Some(FailureKind::Timeout),
        "4xx" => Some(FailureKind::Status { from: 400, to: 499 }),
        "5xx" => Some(FailureKind::Status { from: 500, to: 599 }),
        other => match other.split_once('-') {
            Some((from, to)) => {
                let (from, to) = (code(from)?, code(to)?);
                (from <= to).then_some(FailureKind::Status { from, to })
            }
            None => code(other).map(|c| FailureKind::Status { from: c, to: c }),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_entries_are_codes_ranges_and_words() {
        assert_eq!(
            failure_kind("429"),
            Some(FailureKind::Status { from: 429, to: 429 })
        );
        assert_eq!(
            failure_kind("500-599"),
            Some(FailureKind::Status { from: 500, to: 599 })
        );
        assert_eq!(
            failure_kind("5xx"),
            Some(FailureKind::Status { from: 500, to: 599 })
        );
        assert_eq!(
            failure_kind("connect_error"),
            Some(FailureKind::ConnectError)
        );
        assert_eq!(failure_kind("timeout"), Some(FailureKind::Timeout));
        assert_eq!(failure_kind("599-500"), None);
        assert_eq!(failure_kind("700"), None);
        assert_eq!(failure_kind("oops"), None);
    }
}

#[cfg(test)]
mod breaker_tests {
    use crate::testing::problems;

    #[test]
    fn rule_mistakes_are_located() {
        let found = problems(
            "circuit_breakers:
  default:
    rules:
      - name: a
        failures: { percent: 50, within: 60s, status: [500-599] }
        trip: 30s
      - name: a
        failures: { count: 2, min_requests: 5, within: 1m, status: [teapot] }
      - name: b
        failures: { count: 1, within: 1m, status: [429] }
        trip: 30s
        scope: deployment
        backoff: { factor: 0.5, max: 10s, jitter: 1 }
  empty: { rules: [] }
  none: {}
",
        );
        assert_eq!(
            found,
            [
                "5:19: missing required key \"min_requests\"",
                "7:9: missing required key \"trip\"",
                "7:15: duplicate rule name \"a\" (first defined at 4:15)",
                "8:31: min_requests applies only with percent",
                "8:69: expected a status code (429), a range (500-599), connect_error or timeout, found \"teapot\"",
                "12:16: expected one of target, backend, found \"deployment\"",
                "13:28: a backoff factor must be at least 1 (1: no backoff) and at most 100",
                "13:38: the backoff max (10s) is shorter than the rule's trip (30s)",
                "13:43: unknown key \"jitter\" (expected one of: factor, max)",
                "14:19: a circuit breaker needs at least one rule",
                "15:9: circuit breaker \"none\" needs rules",
            ]
        );
    }
}
