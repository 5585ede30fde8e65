//! Rolling-minute request and token quotas, charged at admission the way Azure does, and
//! optionally Azure's short periods: a sixth of each limit in any ten seconds.

use std::collections::VecDeque;
use std::time::Duration;

use std::time::Instant;

const MINUTE: Duration = Duration::from_secs(60);
const TEN_SECONDS: Duration = Duration::from_secs(10);

/// A deployment's configured limits; `None` is unlimited.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub rpm: Option<u64>,
    pub tpm: Option<u64>,
    /// Also refuse what would make more than a sixth of `rpm` (or of `tpm`) in any ten seconds.
    /// A request alone in its ten seconds is held to the minute's token limit only.
    pub ten_second_windows: bool,
}

impl Limits {
    /// The (span, rpm, tpm) pairs to enforce: the minute, and the ten seconds when asked.
    fn spans(self) -> impl Iterator<Item = (Duration, Option<u64>, Option<u64>)> {
        let sixth = |limit: Option<u64>| limit.map(|l| (l / 6).max(1));
        let short = (TEN_SECONDS, sixth(self.rpm), sixth(self.tpm));
        std::iter::once((MINUTE, self.rpm, self.tpm))
            .chain(self.ten_second_windows.then_some(short))
    }
}

/// Which limit refused a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Requests,
    Tokens,
}

/// Why and for how long a request is refused.
#[derive(Clone, Debug)]
pub struct Throttle {
    pub kind: Kind,
    pub limit: u64,
    pub used: u64,
    pub requested: u64,
    /// Whole seconds until the window frees enough, at least 1.
    pub retry_after_s: u64,
}

/// What the rate-limit headers report after a request was handled.
#[derive(Clone, Debug)]
pub struct Snapshot {
    pub limits: Limits,
    pub remaining_requests: Option<u64>,
    pub remaining_tokens: Option<u64>,
    /// Time until the window is empty again (OpenAI's "resets to its initial state").
    pub reset: Duration,
}

/// The admitted requests of the last minute, oldest first, with the tokens each was charged.
#[derive(Default)]
pub struct Window {
    entries: VecDeque<(Instant, u64)>,
    tokens: u64,
}

impl Window {
    fn prune(&mut self, now: Instant) {
        while let Some(&(at, tokens)) = self.entries.front() {
            if now.duration_since(at) < MINUTE {
                break;
            }
            self.entries.pop_front();
            self.tokens -= tokens;
        }
    }

    /// Admits a request costing `cost` tokens, or says why not (boxed: refusals are rare and
    /// large); a refused request is not charged.
    pub fn admit(
        &mut self,
        limits: Limits,
        cost: u64,
        now: Instant,
    ) -> Result<Snapshot, Box<(Throttle, Snapshot)>> {
        self.prune(now);
        let refusals: Vec<Throttle> = limits
            .spans()
            .flat_map(|(span, rpm, tpm)| {
                [
                    rpm.and_then(|rpm| self.refuse_requests(rpm, span, now)),
                    tpm.and_then(|tpm| self.refuse_tokens(tpm, cost, span, now)),
                ]
            })
            .flatten()
            .collect();
        // When several limits refuse, report the one that lasts longest: that is when a retry
        // succeeds.
        match refusals.into_iter().max_by_key(|t| t.retry_after_s) {
            Some(throttle) => Err(Box::new((throttle, self.snapshot(limits, now)))),
            None => {
                self.entries.push_back((now, cost));
                self.tokens += cost;
                Ok(self.snapshot(limits, now))
            }
        }
    }

    /// The admitted requests of the last `span`, oldest first.
    fn within(&self, span: Duration, now: Instant) -> impl Iterator<Item = &(Instant, u64)> {
        let first = self
            .entries
            .partition_point(|&(at, _)| now.duration_since(at) >= span);
        self.entries.range(first..)
    }

    fn refuse_requests(&self, limit: u64, span: Duration, now: Instant) -> Option<Throttle> {
        let used = self.within(span, now).count() as u64;
        if used < limit {
            return None;
        }
        // One slot frees when the entry that brings the count below the limit expires.
        let freeing = self
            .within(span, now)
            .nth((used - limit) as usize)
            .map(|e| e.0);
        Some(Throttle {
            kind: Kind::Requests,
            limit,
            used,
            requested: 1,
            retry_after_s: seconds_until(freeing, span, now),
        })
    }

    fn refuse_tokens(
        &self,
        limit: u64,
        cost: u64,
        span: Duration,
        now: Instant,
    ) -> Option<Throttle> {
        let used: u64 = self.within(span, now).map(|e| e.1).sum();
        // An idle short window takes what the minute takes.
        if used + cost <= limit || (used == 0 && span < MINUTE) {
            return None;
        }
        // Walk the window oldest first until enough tokens have expired; a request larger than
        // the whole limit never fits, and is told to wait the full span like an empty window would.
        let mut left = used;
        let freeing = (cost <= limit)
            .then(|| {
                self.within(span, now).find_map(|&(at, tokens)| {
                    left -= tokens;
                    (left + cost <= limit).then_some(at)
                })
            })
            .flatten();
        Some(Throttle {
            kind: Kind::Tokens,
            limit,
            used,
            requested: cost,
            retry_after_s: seconds_until(freeing, span, now),
        })
    }

    fn snapshot(&self, limits: Limits, now: Instant) -> Snapshot {
        let used = self.entries.len() as u64;
        let reset = self.entries.back().map_or(Duration::ZERO, |&(at, _)| {
            (at + MINUTE).saturating_duration_since(now)
        });
        Snapshot {
            limits,
            remaining_requests: limits.rpm.map(|rpm| rpm.saturating_sub(used)),
            remaining_tokens: limits.tpm.map(|tpm| tpm.saturating_sub(self.tokens)),
            reset,
        }
    }
}

/// Whole seconds (rounded up, at least 1) until the entry admitted at `at` leaves the window of
/// `span`.
fn seconds_until(at: Option<Instant>, span: Duration, now: Instant) -> u64 {
    let wait = at.map_or(span, |at| (at + span).saturating_duration_since(now));
    wait.as_millis().div_ceil(1000).max(1) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        rpm: Some(2),
        tpm: Some(100),
        ten_second_windows: false,
    };

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    #[test]
    fn requests_free_up_as_the_minute_rolls() {
        let t0 = Instant::now();
        let mut w = Window::default();
        assert!(w.admit(LIMITS, 10, t0).is_ok());
        assert!(w.admit(LIMITS, 10, t0 + secs(20)).is_ok());
        let (t, snap) = *w.admit(LIMITS, 10, t0 + secs(20)).unwrap_err();
        assert_eq!(t.kind, Kind::Requests);
        assert_eq!(t.retry_after_s, 40);
        assert_eq!(snap.remaining_requests, Some(0));
        assert!(w.admit(LIMITS, 10, t0 + secs(60)).is_ok());
    }

    #[test]
    fn tokens_wait_for_enough_to_expire() {
        let t0 = Instant::now();
        let mut w = Window::default();
        let limits = Limits {
            rpm: None,
            tpm: Some(100),
            ten_second_windows: false,
        };
        assert!(w.admit(limits, 30, t0).is_ok());
        assert!(w.admit(limits, 60, t0 + secs(10)).is_ok());
        // 90 used; 50 more needs the 60 charged at t=10 to expire, at t=70.
        let (t, _) = *w.admit(limits, 50, t0 + secs(10)).unwrap_err();
        assert_eq!(
            (t.kind, t.retry_after_s, t.used, t.requested),
            (Kind::Tokens, 60, 90, 50)
        );
        let (t, _) = *w.admit(limits, 101, t0 + secs(10)).unwrap_err();
        assert_eq!(t.retry_after_s, 60);
        assert!(w.admit(limits, 40, t0 + secs(61)).is_ok());
    }

    #[test]
    fn ten_second_windows_refuse_more_than_a_sixth_of_the_minute() {
        let t0 = Instant::now();
        let mut w = Window::default();
        let limits = Limits {
            rpm: Some(60),
            tpm: Some(600),
            ten_second_windows: true,
        };
        for i in 0..10 {
            assert!(w
                .admit(limits, 1, t0 + Duration::from_millis(i * 100))
                .is_ok());
        }
        // The eleventh in ten seconds is refused until the first leaves them, at t=10 s.
        let (t, _) = *w.admit(limits, 1, t0 + secs(2)).unwrap_err();
        assert_eq!(
            (t.kind, t.limit, t.used, t.retry_after_s),
            (Kind::Requests, 10, 10, 8)
        );
        assert!(w.admit(limits, 1, t0 + secs(10)).is_ok());
        // Tokens: 100 a ten seconds, though an idle ten seconds takes a larger request.
        let mut w = Window::default();
        assert!(w.admit(limits, 150, t0).is_ok());
        let (t, _) = *w.admit(limits, 1, t0 + secs(9)).unwrap_err();
        assert_eq!((t.kind, t.retry_after_s), (Kind::Tokens, 1));
        assert!(w.admit(limits, 100, t0 + secs(10)).is_ok());
    }
}
