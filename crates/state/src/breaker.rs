//! Circuit-breaker records: whether a breaker (of a backend, or of one target on it) is closed,
//! open (until when) or half-open (and whether its one probe is out), with its consecutive
//! re-opens and total trips. The rules that decide *when* to trip live in the gateway; the record
//! is shared, so a breaker tripped on one instance is open on all of them and only one probe goes
//! out at a time. The Redis script implements the same transitions.

/// How long a failed probe re-opens a breaker: its base wait times `factor` for each consecutive
/// re-open, at most `max_ms`, and never less than the base.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    pub factor: f64,
    pub max_ms: u64,
}

impl Backoff {
    /// Exactly the base wait every time (an upstream's Retry-After).
    pub const NONE: Backoff = Backoff {
        factor: 1.0,
        max_ms: 0,
    };

    /// The wait of the `reopens`-th consecutive re-open after a base of `base_ms`.
    pub fn wait(&self, base_ms: u64, reopens: u32) -> u64 {
        let exponent = i32::try_from(reopens).unwrap_or(i32::MAX);
        let grown = base_ms as f64 * self.factor.max(1.0).powi(exponent);
        // `as` saturates: an overflowing product is the cap.
        (grown.min(self.max_ms as f64) as u64).max(base_ms)
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum BreakerPhase {
    #[default]
    Closed,
    Open {
        remaining_ms: u64,
    },
    /// The trip is over; `probing` while the one probe allowed is out.
    HalfOpen {
        probing: bool,
    },
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BreakerRecord {
    pub phase: BreakerPhase,
    /// Failed probes since the breaker last closed.
    pub reopens: u32,
    /// How often it opened, re-opens included.
    pub trips: u64,
}

/// The answer to asking for a half-open breaker's probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    Closed,
    /// This request holds the one probe.
    Probe,
    Open {
        remaining_ms: u64,
    },
    /// Half-open, with another request's probe out.
    Busy,
}

/// The record in store time (absolute milliseconds).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Record {
    /// 0 when closed.
    pub open_until: u64,
    /// The probe's lease; 0 when no probe is out.
    pub probe_until: u64,
    pub reopens: u32,
    pub trips: u64,
}

impl Record {
    pub fn phase(&self, now: u64) -> BreakerPhase {
        if self.open_until == 0 {
            BreakerPhase::Closed
        } else if now < self.open_until {
            BreakerPhase::Open {
                remaining_ms: self.open_until - now,
            }
        } else {
            BreakerPhase::HalfOpen {
                probing: self.probe_until > now,
            }
        }
    }

    pub fn view(&self, now: u64) -> BreakerRecord {
        BreakerRecord {
            phase: self.phase(now),
            reopens: self.reopens,
            trips: self.trips,
        }
    }

    pub fn trip(&mut self, now: u64, wait_ms: u64) {
        if self.phase(now) == BreakerPhase::Closed {
            self.open(now, wait_ms.max(1));
            self.reopens = 0;
        }
    }

    pub fn reopen(&mut self, now: u64, base_ms: u64, backoff: Backoff) {
        if matches!(self.phase(now), BreakerPhase::HalfOpen { .. }) {
            self.reopens = self.reopens.saturating_add(1);
            let wait = backoff.wait(base_ms, self.reopens);
            self.open(now, wait.max(1));
        }
    }

    fn open(&mut self, now: u64, wait_ms: u64) {
        self.open_until = now.saturating_add(wait_ms);
        self.probe_until = 0;
        self.trips += 1;
    }

    pub fn claim(&mut self, now: u64, lease_ms: u64) -> Claim {
        match self.phase(now) {
            BreakerPhase::Closed => Claim::Closed,
            BreakerPhase::Open { remaining_ms } => Claim::Open { remaining_ms },
            BreakerPhase::HalfOpen { probing: true } => Claim::Busy,
            BreakerPhase::HalfOpen { probing: false } => {
                self.probe_until = now.saturating_add(lease_ms.max(1));
                Claim::Probe
            }
        }
    }

    pub fn close(&mut self, now: u64) {
        if matches!(self.phase(now), BreakerPhase::HalfOpen { .. }) {
            self.open_until = 0;
            self.probe_until = 0;
            self.reopens = 0;
        }
    }

    pub fn release(&mut self, now: u64) {
        if self.phase(now) == (BreakerPhase::HalfOpen { probing: true }) {
            self.probe_until = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trip_opens_then_half_opens_and_one_probe_closes_it() {
        let mut r = Record::default();
        r.trip(0, 1000);
        assert_eq!(r.phase(999), BreakerPhase::Open { remaining_ms: 1 });
        // A second trip while open changes nothing.
        r.trip(10, 5000);
        assert_eq!(r.phase(1000), BreakerPhase::HalfOpen { probing: false });
        assert_eq!(r.claim(1000, 500), Claim::Probe);
        assert_eq!(r.claim(1001, 500), Claim::Busy);
        r.close(1002);
        assert_eq!(r.view(1002).phase, BreakerPhase::Closed);
        assert_eq!(r.trips, 1);
    }

    #[test]
    fn failed_probes_re_open_with_the_backoff_up_to_its_cap() {
        let backoff = Backoff {
            factor: 2.0,
            max_ms: 1000,
        };
        let mut r = Record::default();
        r.trip(0, 100);
        let mut now = 100;
        for expected in [200, 400, 800, 1000, 1000] {
            assert_eq!(r.claim(now, 50), Claim::Probe);
            r.reopen(now, 100, backoff);
            assert_eq!(
                r.phase(now),
                BreakerPhase::Open {
                    remaining_ms: expected
                }
            );
            now += expected;
        }
        assert_eq!(r.trips, 6);
        r.close(now);
        r.trip(now, 100);
        assert_eq!(r.phase(now), BreakerPhase::Open { remaining_ms: 100 });
    }

    #[test]
    fn an_unsent_probe_or_an_expired_lease_frees_the_probe() {
        let mut r = Record::default();
        r.trip(0, 10);
        assert_eq!(r.claim(10, 100), Claim::Probe);
        r.release(11);
        assert_eq!(r.claim(12, 100), Claim::Probe);
        assert_eq!(r.claim(111, 100), Claim::Busy);
        assert_eq!(r.claim(112, 100), Claim::Probe);
        // An exact re-open (Retry-After) has no backoff.
        r.reopen(113, 1500, Backoff::NONE);
        assert_eq!(r.phase(113), BreakerPhase::Open { remaining_ms: 1500 });
    }

    #[test]
    fn a_backoff_never_waits_less_than_its_base_nor_more_than_its_cap_after_that() {
        let slow = Backoff {
            factor: 1.5,
            max_ms: 60_000,
        };
        assert_eq!(slow.wait(1000, 1), 1500);
        assert_eq!(slow.wait(1000, 2), 2250);
        assert_eq!(slow.wait(1000, u32::MAX), 60_000);
        // A cap below the base keeps the base.
        assert_eq!(slow.wait(90_000, 3), 90_000);
        assert_eq!(Backoff::NONE.wait(700, 9), 700);
    }
}
