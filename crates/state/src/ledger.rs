//! The Redis store's settlement queue: what requests of this instance still owe their meters
//! (token and spend corrections, ends of their time in flight) and the backend counts not made
//! yet, summed per meter and kept per hash tag. The next admission under a tag takes its debts
//! along in its own script call, so it decides on them; what no admission takes is paid a few
//! milliseconds after the first debt, all tags in one pipeline ([`FLUSH_AFTER`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use redis::Cmd;
use smallvec::SmallVec;
use tokio::sync::Notify;

use crate::meter::{MeterKey, Reservation, Settlement};

/// How long a debt waits for an admission under its tag before it is paid on its own: the
/// longest another instance may see a request in flight, or at its estimate, after it ended.
pub const FLUSH_AFTER: Duration = Duration::from_millis(2);

/// The debts of one hash tag, per meter.
#[derive(Debug, Default)]
pub(crate) struct Debts {
    meters: SmallVec<[(MeterKey, Debt); 2]>,
}

/// Corrections per bucket, day or month: (which, delta).
type Corrections = SmallVec<[(u64, i64); 2]>;

/// What one meter is owed, in the order debts.lua reads it.
#[derive(Debug, Default)]
struct Debt {
    /// Token corrections per window bucket (second).
    buckets: Corrections,
    days: Corrections,
    months: Corrections,
    /// In-flight members whose requests ended.
    ended: Vec<u64>,
    /// Counts to make now (a backend's quota meter).
    counts: Vec<Count>,
}

#[derive(Debug)]
struct Count {
    requests: u64,
    tokens: u64,
    /// Its in-flight entry; `None` when it ended before it was counted, or counts no request.
    member: Option<u64>,
    lease_ms: u64,
}

/// Adds `delta` to the entry for `at`, or a new one.
fn add(list: &mut Corrections, at: u64, delta: i64) {
    if delta == 0 {
        return;
    }
    match list.iter_mut().find(|(held, _)| *held == at) {
        Some((_, sum)) => *sum += delta,
        None => list.push((at, delta)),
    }
}

impl Debts {
    fn meter(&mut self, key: &MeterKey) -> &mut Debt {
        let at = match self.meters.iter().position(|(held, _)| held == key) {
            Some(at) => at,
            None => {
                self.meters.push((key.clone(), Debt::default()));
                self.meters.len() - 1
            }
        };
        &mut self.meters[at].1
    }

    /// The meters owed, in the order [`Debts::write`] numbers them after `first`.
    pub fn meters(&self) -> impl Iterator<Item = &MeterKey> {
        self.meters.iter().map(|(key, _)| key)
    }

    /// Writes the debts as debts.lua reads them; `index` gives each meter's number among the
    /// script's keys (three keys a meter, counted from 1).
    pub fn write(&self, cmd: &mut Cmd, index: impl Fn(&MeterKey) -> usize) {
        for (key, debt) in &self.meters {
            cmd.arg(index(key));
            for list in [&debt.buckets[..], &debt.days[..], &debt.months[..]] {
                cmd.arg(list.len());
                for (at, delta) in list {
                    cmd.arg(*at).arg(*delta);
                }
            }
            cmd.arg(debt.ended.len());
            for member in &debt.ended {
                cmd.arg(*member);
            }
            cmd.arg(debt.counts.len());
            for count in &debt.counts {
                cmd.arg(count.requests).arg(count.tokens);
                match count.member {
                    Some(member) => cmd.arg(member),
                    None => cmd.arg("-"),
                };
                cmd.arg(count.lease_ms);
            }
        }
    }
}

/// A reservation's settlement as debts (its meters share one tag): the corrections of its charge
/// and, when it is over, the end of its time in flight.
pub(crate) fn settlement_debts(reservation: &Reservation, settlement: Settlement) -> Debts {
    let mut debts = Debts::default();
    for key in &reservation.meters {
        owe_settlement(&mut debts, key, reservation, settlement);
    }
    debts
}

fn owe_settlement(
    debts: &mut Debts,
    key: &MeterKey,
    reservation: &Reservation,
    settlement: Settlement,
) {
    let tokens = settlement.tokens as i64 - reservation.tokens as i64;
    let usd = settlement.micro_usd as i64 - reservation.micro_usd as i64;
    let debt = debts.meter(key);
    add(&mut debt.buckets, reservation.second, tokens);
    add(&mut debt.days, reservation.day, tokens);
    add(&mut debt.months, reservation.month, usd);
    if settlement.release {
        debt.ended.push(reservation.member);
    }
}

#[derive(Debug, Default)]
pub(crate) struct Ledger {
    tags: Mutex<HashMap<String, Debts>>,
    /// Rung when the ledger stops being empty (and when the store goes).
    pub bell: Arc<Notify>,
    /// The task that pays what no admission took along is running.
    pub paying: AtomicBool,
}

impl Ledger {
    fn tags(&self) -> MutexGuard<'_, HashMap<String, Debts>> {
        self.tags.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn owe(&self, tag: &str, write: impl FnOnce(&mut Debts)) {
        let was_empty = {
            let mut tags = self.tags();
            let was_empty = tags.is_empty();
            match tags.get_mut(tag) {
                Some(debts) => write(debts),
                None => {
                    let mut debts = Debts::default();
                    write(&mut debts);
                    tags.insert(tag.to_owned(), debts);
                }
            }
            was_empty
        };
        if was_empty {
            self.bell.notify_one();
        }
    }

    /// Queues a shared reservation's settlement, each meter under its own tag.
    pub fn settle(&self, reservation: &Reservation, settlement: Settlement) {
        for key in &reservation.meters {
            self.owe(&key.tag, |debts| {
                owe_settlement(debts, key, reservation, settlement)
            });
        }
    }

    /// Queues a count of one request of `tokens` on `key`, in flight as `member` for at most
    /// `lease_ms`.
    pub fn count(&self, key: &MeterKey, tokens: u64, member: u64, lease_ms: u64) {
        self.owe(&key.tag, |debts| {
            debts.meter(key).counts.push(Count {
                requests: 1,
                tokens,
                member: Some(member),
                lease_ms,
            })
        });
    }

    /// Settles a [`Ledger::count`]: one still queued is changed in place (ended, it never
    /// enters the in-flight set); one already made gets the tokens beyond its estimate counted
    /// now, and its end.
    pub fn settle_count(&self, key: &MeterKey, counted: u64, member: u64, settlement: Settlement) {
        self.owe(&key.tag, |debts| {
            let debt = debts.meter(key);
            let queued = debt
                .counts
                .iter_mut()
                .find(|count| count.member == Some(member));
            match queued {
                Some(count) => {
                    count.tokens = settlement.tokens;
                    if settlement.release {
                        count.member = None;
                    }
                }
                None => {
                    if settlement.tokens > counted {
                        debt.counts.push(Count {
                            requests: 0,
                            tokens: settlement.tokens - counted,
                            member: None,
                            lease_ms: 0,
                        });
                    }
                    if settlement.release {
                        debt.ended.push(member);
                    }
                }
            }
        });
    }

    /// The debts of `tag`, for an admission under it to pay.
    pub fn take(&self, tag: &str) -> Option<Debts> {
        let mut tags = self.tags();
        if tags.is_empty() {
            return None;
        }
        tags.remove(tag)
    }

    /// Every debt, to be paid now.
    pub fn take_all(&self) -> HashMap<String, Debts> {
        std::mem::take(&mut *self.tags())
    }

    /// Marks the paying task started; true only for the first caller.
    pub fn start_paying(&self) -> bool {
        !self.paying.swap(true, Ordering::AcqRel)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reservation(member: u64, tokens: u64) -> Reservation {
        Reservation {
            meters: vec![MeterKey::tenant("t"), MeterKey::key("t", "k")],
            second: 100,
            day: 7,
            month: 9,
            tokens,
            micro_usd: 0,
            member,
            usage: Vec::new(),
            shared: true,
        }
    }

    const ENDED_AT_20: Settlement = Settlement {
        tokens: 20,
        micro_usd: 0,
        release: true,
    };

    #[test]
    fn settlements_of_one_second_sum_into_one_correction_a_meter() {
        let ledger = Ledger::default();
        ledger.settle(&reservation(1, 50), ENDED_AT_20);
        ledger.settle(&reservation(2, 40), ENDED_AT_20);
        let debts = ledger.take("t:t").expect("the tenant's tag owes");
        assert_eq!(debts.meters.len(), 2, "the tenant's meter and its key's");
        let (_, debt) = &debts.meters[0];
        assert_eq!(&debt.buckets[..], &[(100, -50)]);
        assert_eq!(&debt.days[..], &[(7, -50)]);
        assert!(debt.months.is_empty(), "no spend changed");
        assert_eq!(debt.ended, vec![1, 2]);
        assert!(ledger.take("t:t").is_none(), "taken once");
    }

    #[test]
    fn a_count_settled_before_it_is_sent_never_enters_the_in_flight_set() {
        let ledger = Ledger::default();
        let meter = MeterKey::backend("ptu");
        ledger.count(&meter, 30, 5, 60_000);
        ledger.settle_count(&meter, 30, 5, ENDED_AT_20);
        let debts = ledger.take("routing").expect("the routing tag owes");
        let (_, debt) = &debts.meters[0];
        assert_eq!(debt.counts.len(), 1);
        assert_eq!((debt.counts[0].tokens, debt.counts[0].member), (20, None));
        assert!(debt.ended.is_empty());
    }

    #[test]
    fn a_count_sent_already_is_ended_with_its_tokens_beyond_the_estimate_counted_now() {
        let ledger = Ledger::default();
        let meter = MeterKey::backend("ptu");
        ledger.count(&meter, 10, 5, 60_000);
        assert_eq!(ledger.take_all().len(), 1, "sent");
        ledger.settle_count(&meter, 10, 5, ENDED_AT_20);
        let debts = ledger.take("routing").expect("the routing tag owes");
        let (_, debt) = &debts.meters[0];
        assert_eq!(debt.ended, vec![5]);
        let extra = &debt.counts[0];
        assert_eq!((extra.requests, extra.tokens, extra.member), (0, 10, None));
    }
}
