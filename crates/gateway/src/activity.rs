//! The gateway's recent activity, for the dashboard: running totals (requests, errors, tokens,
//! cost) that the request path bumps with atomic adds, an hour of them sampled every 10 s, every
//! error counted by code, and the last errors answered. One per gateway, kept over reloads.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use arc_swap::ArcSwap;
use serde::Serialize;
use tokio::sync::watch;

/// How often the totals are sampled into the history.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(10);
/// An hour of samples.
const POINTS: usize = 360;
/// The errors kept for the dashboard's list.
const RECENT_ERRORS: usize = 50;
/// Distinct (code, status) pairs counted apart; past this they count as `other`. The gateway's
/// codes and the HTTP statuses are few, so this is only a bound.
const MAX_KINDS: usize = 64;

/// Cumulative totals at one moment; the dashboard's rates are differences between two of them.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Point {
    pub at_ms: u64,
    pub requests: u64,
    /// Answers with a 4xx status.
    pub client_errors: u64,
    /// Answers with a 5xx status.
    pub server_errors: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cost_usd: f64,
    /// Errors by kind, in the order of [`Tally`]'s kinds.
    #[serde(skip)]
    kinds: Vec<u64>,
}

/// An error answer as the dashboard lists it: names and numbers only, never a prompt or a key.
#[derive(Debug, Clone, Serialize)]
pub struct ErrorEntry {
    pub at_ms: u64,
    pub status: u16,
    /// The `x-onedoor-error` code, `-` for an upstream's own error answer passed on.
    #[serde(serialize_with = "shared_str")]
    pub code: Arc<str>,
    pub tenant: Option<String>,
    pub alias: Option<String>,
    /// The backend whose answer it was, if one answered.
    pub backend: Option<String>,
    /// Every upstream attempt, as `x-onedoor-attempts` lists them.
    pub attempts: String,
}

/// An answered request, as the pipeline hands it over.
pub struct Answered<'a> {
    pub status: u16,
    pub code: Option<&'a str>,
    pub tenant: Option<&'a str>,
    pub alias: Option<&'a str>,
    pub backend: Option<&'a str>,
    /// (backend, outcome) of every upstream attempt.
    pub attempts: &'a [(std::sync::Arc<str>, crate::upstream::Outcome)],
}

/// How many errors of one kind so far.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KindCount {
    #[serde(serialize_with = "shared_str")]
    pub code: Arc<str>,
    pub status: u16,
    pub count: u64,
}

fn shared_str<S: serde::Serializer>(text: &Arc<str>, to: S) -> Result<S::Ok, S::Error> {
    to.serialize_str(text)
}

#[derive(Default)]
pub struct Activity {
    started_ms: AtomicU64,
    requests: AtomicU64,
    client_errors: AtomicU64,
    server_errors: AtomicU64,
    input_tokens: AtomicU64,
    output_tokens: AtomicU64,
    /// An `f64` as its bits: updated with a compare-and-swap.
    cost_usd_bits: AtomicU64,
    kinds: Tally,
    /// Newest last. Pushed with `try_lock`: an error answered while another is being pushed is
    /// counted but not listed.
    recent: Mutex<VecDeque<ErrorEntry>>,
    /// Oldest first; only the sampler and the dashboard touch it.
    history: Mutex<VecDeque<Point>>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Activity {
    /// When the first sample was taken (0 before).
    pub fn started_ms(&self) -> u64 {
        self.started_ms.load(Ordering::Relaxed)
    }

    /// Counts an answered request; an error one is also counted by kind and listed.
    pub fn answered(&self, answer: &Answered<'_>) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        let errors = match answer.status {
            400..=499 => &self.client_errors,
            500..=599 => &self.server_errors,
            _ => return,
        };
        errors.fetch_add(1, Ordering::Relaxed);
        let code = self.kinds.count(answer.code.unwrap_or("-"), answer.status);
        let Ok(mut recent) = self.recent.try_lock() else {
            return;
        };
        if recent.len() == RECENT_ERRORS {
            recent.pop_front();
        }
        recent.push_back(ErrorEntry {
            at_ms: onedoor_state::now_ms(),
            status: answer.status,
            code,
            tenant: answer.tenant.map(str::to_owned),
            alias: answer.alias.map(str::to_owned),
            backend: answer.backend.map(str::to_owned),
            attempts: answer
                .attempts
                .iter()
                .map(|(backend, outcome)| format!("{backend}={outcome}"))
                .collect::<Vec<_>>()
                .join(","),
        });
    }

    /// Counts a finished request's tokens and cost.
    pub fn finished(&self, input_tokens: u64, output_tokens: u64, cost_usd: f64) {
        self.input_tokens.fetch_add(input_tokens, Ordering::Relaxed);
        self.output_tokens
            .fetch_add(output_tokens, Ordering::Relaxed);
        if cost_usd > 0.0 {
            let _ = self
                .cost_usd_bits
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                    Some((f64::from_bits(bits) + cost_usd).to_bits())
                });
        }
    }

    /// The totals now.
    pub fn now(&self, at_ms: u64) -> Point {
        Point {
            at_ms,
            requests: self.requests.load(Ordering::Relaxed),
            client_errors: self.client_errors.load(Ordering::Relaxed),
            server_errors: self.server_errors.load(Ordering::Relaxed),
            input_tokens: self.input_tokens.load(Ordering::Relaxed),
            output_tokens: self.output_tokens.load(Ordering::Relaxed),
            cost_usd: f64::from_bits(self.cost_usd_bits.load(Ordering::Relaxed)),
            kinds: self.kinds.counts(),
        }
    }

    /// Takes a sample into the history, dropping the oldest past an hour of them.
    pub fn sample(&self, at_ms: u64) {
        let _ = self
            .started_ms
            .compare_exchange(0, at_ms, Ordering::Relaxed, Ordering::Relaxed);
        let point = self.now(at_ms);
        let mut history = lock(&self.history);
        if history.len() == POINTS {
            history.pop_front();
        }
        history.push_back(point);
    }

    /// The samples of the last hour, oldest first.
    pub fn history(&self) -> Vec<Point> {
        lock(&self.history).iter().cloned().collect()
    }

    /// The last errors, newest first.
    pub fn recent_errors(&self) -> Vec<ErrorEntry> {
        lock(&self.recent).iter().rev().cloned().collect()
    }

    /// Errors by kind between `since` and `until` (two points of the history), most first.
    pub fn errors_between(&self, since: Option<&Point>, until: &Point) -> Vec<KindCount> {
        // Kinds are only ever appended, so today's list names every point's counts.
        let kinds = self.kinds.kinds.load();
        let mut counts: Vec<KindCount> = until
            .kinds
            .iter()
            .enumerate()
            .filter_map(|(i, &total)| {
                let before = since.and_then(|p| p.kinds.get(i)).copied().unwrap_or(0);
                let kind = kinds.get(i)?;
                let count = total.saturating_sub(before);
                (count > 0).then(|| KindCount {
                    code: kind.code.clone(),
                    status: kind.status,
                    count,
                })
            })
            .collect();
        counts.sort_by(|a, b| b.count.cmp(&a.count).then(a.code.cmp(&b.code)));
        counts
    }
}

/// Error counts by (code, status). Counting a kind seen before reads a shared list and adds to
/// its atomic; only the first error of a new kind takes a lock, to append it.
#[derive(Default)]
struct Tally {
    kinds: ArcSwap<Vec<Arc<Kind>>>,
    grow: Mutex<()>,
}

struct Kind {
    code: Arc<str>,
    status: u16,
    count: AtomicU64,
}

impl Tally {
    /// Counts one error; returns the kind's code, shared, for the error's entry.
    fn count(&self, code: &str, status: u16) -> Arc<str> {
        if let Some(kind) = find(&self.kinds.load(), code, status) {
            kind.count.fetch_add(1, Ordering::Relaxed);
            return kind.code.clone();
        }
        let _grow = lock(&self.grow);
        let current = self.kinds.load_full();
        if let Some(kind) = find(&current, code, status) {
            kind.count.fetch_add(1, Ordering::Relaxed);
            return kind.code.clone();
        }
        let (code, status) = match current.len() < MAX_KINDS - 1 {
            true => (code, status),
            false => ("other", 0),
        };
        if let Some(kind) = find(&current, code, status) {
            kind.count.fetch_add(1, Ordering::Relaxed);
            return kind.code.clone();
        }
        let kind = Arc::new(Kind {
            code: Arc::from(code),
            status,
            count: AtomicU64::new(1),
        });
        let mut next = Vec::clone(&current);
        next.push(kind.clone());
        self.kinds.store(Arc::new(next));
        kind.code.clone()
    }

    fn counts(&self) -> Vec<u64> {
        self.kinds
            .load()
            .iter()
            .map(|k| k.count.load(Ordering::Relaxed))
            .collect()
    }
}

fn find<'k>(kinds: &'k [Arc<Kind>], code: &str, status: u16) -> Option<&'k Arc<Kind>> {
    kinds
        .iter()
        .find(|k| k.status == status && &*k.code == code)
}

/// Samples `activity` every [`SAMPLE_EVERY`], the first at once, until `shutdown` says stop.
pub async fn sample(activity: Arc<Activity>, mut shutdown: watch::Receiver<bool>) {
    let mut ticker = tokio::time::interval(SAMPLE_EVERY);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        if *shutdown.borrow() {
            return;
        }
        tokio::select! {
            _ = ticker.tick() => activity.sample(onedoor_state::now_ms()),
            changed = shutdown.changed() => if changed.is_err() { return },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error(status: u16, code: &str) -> Answered<'_> {
        Answered {
            status,
            code: Some(code),
            tenant: Some("team"),
            alias: Some("chat"),
            backend: None,
            attempts: &[],
        }
    }

    #[test]
    fn a_success_is_a_request_and_an_error_is_also_counted_by_code_and_listed() {
        let activity = Activity::default();
        let attempts = [
            ("a".into(), "500".into()),
            ("b".into(), "connect_error".into()),
        ];
        activity.answered(&Answered {
            attempts: &attempts,
            ..error(200, "-")
        });
        activity.answered(&Answered {
            attempts: &attempts,
            ..error(502, "upstream_failed")
        });
        activity.answered(&Answered {
            code: None,
            ..error(400, "-")
        });
        let now = activity.now(1);
        assert_eq!(
            (now.requests, now.client_errors, now.server_errors),
            (3, 1, 1)
        );
        let recent = activity.recent_errors();
        assert_eq!(recent.len(), 2);
        assert_eq!(
            &*recent[0].code, "-",
            "an upstream's own answer, newest first"
        );
        assert_eq!(recent[1].attempts, "a=500,b=connect_error");
        let counts = activity.errors_between(None, &now);
        let pairs: Vec<(&str, u16, u64)> = counts
            .iter()
            .map(|k| (&*k.code, k.status, k.count))
            .collect();
        assert_eq!(pairs, [("-", 400, 1), ("upstream_failed", 502, 1)]);
    }

    #[test]
    fn only_the_last_fifty_errors_are_listed_but_every_one_is_counted() {
        let activity = Activity::default();
        for i in 0..(RECENT_ERRORS + 10) {
            let code = if i % 2 == 0 {
                "rate_limited"
            } else {
                "quota_exceeded"
            };
            activity.answered(&error(429, code));
        }
        assert_eq!(activity.recent_errors().len(), RECENT_ERRORS);
        let counts = activity.errors_between(None, &activity.now(1));
        assert_eq!(counts.iter().map(|k| k.count).sum::<u64>(), 60);
        assert_eq!(counts.len(), 2);
    }

    #[test]
    fn errors_between_two_points_are_those_after_the_first() {
        let activity = Activity::default();
        activity.answered(&error(503, "circuit_open"));
        activity.sample(1_000);
        activity.answered(&error(503, "circuit_open"));
        activity.answered(&error(401, "invalid_api_key"));
        let history = activity.history();
        let counts = activity.errors_between(history.first(), &activity.now(2_000));
        let pairs: Vec<(&str, u64)> = counts.iter().map(|k| (&*k.code, k.count)).collect();
        assert_eq!(pairs, [("circuit_open", 1), ("invalid_api_key", 1)]);
    }

    #[test]
    fn tokens_and_cost_add_up() {
        let activity = Activity::default();
        activity.finished(10, 5, 0.25);
        activity.finished(1, 2, 0.5);
        activity.finished(0, 0, 0.0);
        let now = activity.now(0);
        assert_eq!((now.input_tokens, now.output_tokens), (11, 7));
        assert!((now.cost_usd - 0.75).abs() < 1e-12);
    }

    #[test]
    fn the_history_keeps_an_hour_of_samples() {
        let activity = Activity::default();
        for i in 0..(POINTS as u64 + 40) {
            activity.answered(&error(200, "-"));
            activity.sample(1 + i * 10_000);
        }
        let history = activity.history();
        assert_eq!(history.len(), POINTS);
        assert_eq!(history[0].at_ms, 1 + 40 * 10_000);
        assert_eq!(history[0].requests, 41);
        assert_eq!(
            activity.started_ms(),
            1,
            "the first sample, not the oldest kept"
        );
    }

    #[test]
    fn kinds_past_the_bound_count_as_other() {
        let activity = Activity::default();
        for status in 0..(MAX_KINDS as u16 + 10) {
            activity.answered(&error(400 + status % 100, &format!("code{status}")));
        }
        let counts = activity.errors_between(None, &activity.now(0));
        assert_eq!(counts.len(), MAX_KINDS);
        let other = counts.iter().find(|k| &*k.code == "other").unwrap();
        assert_eq!(other.count, 11);
    }

    #[tokio::test]
    async fn the_sampler_takes_a_first_sample_at_once_and_stops_on_shutdown() {
        let activity = Arc::new(Activity::default());
        let (stop, stopped) = watch::channel(false);
        let sampler = tokio::spawn(sample(activity.clone(), stopped));
        for _ in 0..200 {
            if !activity.history().is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(activity.history().len(), 1);
        stop.send(true).unwrap();
        tokio::time::timeout(Duration::from_secs(1), sampler)
            .await
            .expect("the sampler stops")
            .unwrap();
    }
}
