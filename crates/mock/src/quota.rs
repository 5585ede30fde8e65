//! Rolling-minute request and token quotas, charged at admission the way Azure does.

use std::collections::VecDeque;
use std::time::Duration;

use std::time::Instant;

const MINUTE: Duration = Duration::from_secs(60);

/// A deployment's configured limits; `None` is unlimited.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub rpm: Option<u64>,
    pub tpm: Option<u64>,
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

    /// Admits a request costing `cost` tokens, or says why not; a refused request is not charged.
    pub fn admit(
        &mut self,
        limits: Limits,
        cost: u64,
        now: Instant,
    ) -> Result<Snapshot, (Throttle, Snapshot)> {
        self.prune(now);
        let refusals = [
            limits.rpm.and_then(|rpm| self.refuse_requests(rpm, now)),
            limits
                .tpm
                .and_then(|tpm| self.refuse_tokens(tpm, cost, now)),
        ];
        // When both limits refuse, report the one that lasts longer: that is when a retry succeeds.
        match refusals
            .into_iter()
            .flatten()
            .max_by_key(|t| t.retry_after_s)
        {
            Some(throttle) => Err((throttle, self.snapshot(limits, now))),
            None => {
                self.entries.push_back((now, cost));
                self.tokens += cost;
                Ok(self.snapshot(limits, now))
            }
        }
    }

    fn refuse_requests(&self, rpm: u64, now: Instant) -> Option<Throttle> {
        let used = self.entries.len() as u64;
        if used < rpm {
            return None;
        }
        // One slot frees when the entry that brings the count below rpm expires.
        let freeing = self.entries.get((used - rpm) as usize).map(|e| e.0);
        Some(Throttle {
            kind: Kind::Requests,
            limit: rpm,
            used,
            requested: 1,
            retry_after_s: seconds_until(freeing, now),
        })
    }

    fn refuse_tokens(&self, tpm: u64, cost: u64, now: Instant) -> Option<Throttle> {
        if self.tokens + cost <= tpm {
            return None;
        }
        // Walk the window oldest first until enough tokens have expired; a request larger than
        // the whole limit never fits, and is told to wait a full minute like an empty window would.
        let mut left = self.tokens;
        let freeing = (cost <= tpm)
            .then(|| {
                self.entries.iter().find_map(|&(at, tokens)| {
                    left -= tokens;
                    (left + cost <= tpm).then_some(at)
                })
            })
            .flatten();
        Some(Throttle {
            kind: Kind::Tokens,
            limit: tpm,
            used: self.tokens,
            requested: cost,
            retry_after_s: seconds_until(freeing, now),
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

/// Whole seconds (rounded up, at least 1) until the entry admitted at `at` leaves the window.
fn seconds_until(at: Option<Instant>, now: Instant) -> u64 {
    let wait = at.map_or(MINUTE, |at| (at + MINUTE).saturating_duration_since(now));
    wait.as_millis().div_ceil(1000).max(1) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        rpm: Some(2),
        tpm: Some(100),
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
        let (t, snap) = w.admit(LIMITS, 10, t0 + secs(20)).unwrap_err();
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
        };
        assert!(w.admit(limits, 30, t0).is_ok());
        assert!(w.admit(limits, 60, t0 + secs(10)).is_ok());
        // 90 used; 50 more needs the 60 charged at t=10 to expire, at t=70.
        let (t, _) = w.admit(limits, 50, t0 + secs(10)).unwrap_err();
        assert_eq!(
            (t.kind, t.retry_after_s, t.used, t.requested),
            (Kind::Tokens, 60, 90, 50)
        );
        let (t, _) = w.admit(limits, 101, t0 + secs(10)).unwrap_err();
        assert_eq!(t.retry_after_s, 60);
        assert!(w.admit(limits, 40, t0 + secs(61)).is_ok());
    }
}
