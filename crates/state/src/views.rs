//! The Redis store's recent routing views: requests that ask for the same view while a read of
//! it is in flight share that read, and a view younger than [`VIEW_FRESH_FOR`] is reused without
//! a call. What this instance itself decides (a not-served mark, a cooldown, a served mark, a
//! breaker's new phase) is written into the views it holds at once, so it never routes to what
//! it has just excluded; other instances' marks reach it within [`VIEW_FRESH_FOR`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::{BreakerPhase, Exclusion, RoutingQuery, RoutingView};

/// How long a routing view read from Redis is reused: the longest another instance's
/// not-served mark, cooldown, breaker trip or backend count can take to reach this one's routing.
pub const VIEW_FRESH_FOR: Duration = Duration::from_millis(3);

/// A read's outcome as its waiters see it: `None` when Redis could not be reached.
type Landing = Option<Option<RoutingView>>;

/// Where a read in flight lands, for a request that waits on it.
pub(crate) type Waiting = watch::Receiver<Landing>;

/// One decision of this instance, as it changes the views that hold its target or breaker.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Mark<'a> {
    NotServed { target: &'a str, ms: u64 },
    CoolingDown { target: &'a str, ms: u64 },
    Served { target: &'a str },
    Breaker { id: &'a str, phase: BreakerPhase },
}

/// What one query names, to find where a [`Mark`] lands in its view.
struct Names {
    /// Each target's field (redis.rs `field`), in the query's order.
    targets: Vec<String>,
    target_breakers: Vec<Option<String>>,
    backend_breakers: Vec<Option<String>>,
}

impl Names {
    fn of(query: &RoutingQuery<'_>, field: impl Fn(&str, &str) -> String) -> Self {
        Names {
            targets: query.targets.iter().map(|(b, d)| field(b, d)).collect(),
            target_breakers: (0..query.targets.len())
                .map(|i| query.target_breaker(i).map(str::to_owned))
                .collect(),
            backend_breakers: query
                .backends
                .iter()
                .map(|b| b.breaker.map(str::to_owned))
                .collect(),
        }
    }

    fn apply(&self, view: &mut RoutingView, mark: Mark<'_>) {
        let targets = self.targets.iter().zip(view.targets.iter_mut());
        match mark {
            Mark::NotServed { target, ms } => targets
                .filter(|(name, _)| *name == target)
                .for_each(|(_, t)| t.exclusion = Some(Exclusion::NotServed { remaining_ms: ms })),
            Mark::CoolingDown { target, ms } => targets
                .filter(|(name, _)| *name == target)
                .for_each(|(_, t)| t.exclusion = cooled(t.exclusion, ms)),
            Mark::Served { target } => {
                targets
                    .filter(|(name, _)| *name == target)
                    .for_each(|(_, t)| {
                        t.served = true;
                        if matches!(t.exclusion, Some(Exclusion::NotServed { .. })) {
                            t.exclusion = None;
                        }
                    })
            }
            Mark::Breaker { id, phase } => {
                let named = |held: &Option<String>| held.as_deref() == Some(id);
                for (held, t) in self.target_breakers.iter().zip(view.targets.iter_mut()) {
                    if named(held) {
                        t.breaker = phase;
                    }
                }
                for (held, b) in self.backend_breakers.iter().zip(view.backends.iter_mut()) {
                    if named(held) {
                        b.breaker = phase;
                    }
                }
            }
        }
    }
}

/// A cooldown of `ms` over what a target had: not-served stays, a longer cooldown stays.
fn cooled(held: Option<Exclusion>, ms: u64) -> Option<Exclusion> {
    match held {
        Some(Exclusion::NotServed { .. }) => held,
        Some(Exclusion::CoolingDown { remaining_ms }) if remaining_ms >= ms => held,
        _ => Some(Exclusion::CoolingDown { remaining_ms: ms }),
    }
}

struct Slot {
    names: Names,
    view: Option<(Instant, RoutingView)>,
    /// The read in flight (its number and where it lands), for others to wait on.
    flight: Option<(u64, Waiting)>,
}

#[derive(Default)]
pub(crate) struct Views {
    slots: Mutex<HashMap<String, Slot>>,
    /// Marks this instance made since start: a read that saw a mark made meanwhile is not kept.
    marks: AtomicU64,
    flights: AtomicU64,
}

/// What a request does for its view.
pub(crate) enum Lookup<'v> {
    /// A fresh view, with this instance's own marks in it.
    Fresh(RoutingView),
    /// Another request's read is in flight: wait for it.
    Wait(Waiting),
    /// Read it, then [`Flight::land`] what was read.
    Lead(Flight<'v>),
}

/// A read this request makes for everyone who asks meanwhile. Dropped without landing (its
/// request ended first), its waiters read on their own.
pub(crate) struct Flight<'v> {
    views: &'v Views,
    key: String,
    id: u64,
    marks_at_start: u64,
    landing: watch::Sender<Landing>,
}

impl Views {
    fn slots(&self) -> MutexGuard<'_, HashMap<String, Slot>> {
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The view of `query` (named by `key`): fresh, in flight, or to be read by this request.
    pub fn lookup(
        &self,
        key: String,
        query: &RoutingQuery<'_>,
        field: impl Fn(&str, &str) -> String,
    ) -> Lookup<'_> {
        let mut slots = self.slots();
        let slot = slots.entry(key.clone()).or_insert_with(|| Slot {
            names: Names::of(query, field),
            view: None,
            flight: None,
        });
        if let Some((read_at, view)) = &slot.view {
            if read_at.elapsed() < VIEW_FRESH_FOR {
                return Lookup::Fresh(view.clone());
            }
        }
        if let Some((_, landing)) = &slot.flight {
            return Lookup::Wait(landing.clone());
        }
        let id = self.flights.fetch_add(1, Ordering::Relaxed);
        let (landing, waiting) = watch::channel(None);
        slot.flight = Some((id, waiting));
        Lookup::Lead(Flight {
            views: self,
            key,
            id,
            marks_at_start: self.marks.load(Ordering::Acquire),
            landing,
        })
    }

    /// Writes this instance's `mark` into every view it holds. A read in flight may miss it:
    /// later requests start a read of their own, and that read is not kept.
    pub fn apply(&self, mark: Mark<'_>) {
        self.marks.fetch_add(1, Ordering::AcqRel);
        for slot in self.slots().values_mut() {
            slot.flight = None;
            if let Some((_, view)) = &mut slot.view {
                slot.names.apply(view, mark);
            }
        }
    }
}

impl Flight<'_> {
    /// Hands what was read (`None`: Redis could not be reached) to the waiters, and keeps a
    /// view that no mark of this instance may have missed.
    pub fn land(self, read: Option<&RoutingView>) {
        {
            let mut slots = self.views.slots();
            if let Some(slot) = slots.get_mut(&self.key) {
                let unmarked = self.views.marks.load(Ordering::Acquire) == self.marks_at_start;
                if let (Some(view), true) = (read, unmarked) {
                    slot.view = Some((Instant::now(), view.clone()));
                }
            }
        }
        self.landing.send_replace(Some(read.cloned()));
    }
}

impl Drop for Flight<'_> {
    fn drop(&mut self) {
        let mut slots = self.views.slots();
        if let Some(slot) = slots.get_mut(&self.key) {
            if slot.flight.as_ref().is_some_and(|(id, _)| *id == self.id) {
                slot.flight = None;
            }
        }
    }
}

/// Waits for another request's read: `None` when it ended without landing.
pub(crate) async fn landed(mut waiting: Waiting) -> Option<Option<RoutingView>> {
    let landed = waiting.wait_for(Option::is_some).await.ok()?;
    landed.clone()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BackendQuery, TargetView};

    const TARGETS: [(&str, &str); 2] = [("a", "m"), ("b", "m")];
    const BACKENDS: [BackendQuery<'static>; 1] = [BackendQuery {
        name: "a",
        breaker: Some("a#p"),
        metered: false,
    }];

    fn query() -> RoutingQuery<'static> {
        RoutingQuery {
            targets: &TARGETS,
            target_breakers: &[],
            backends: &BACKENDS,
        }
    }

    fn name(backend: &str, deployment: &str) -> String {
        [backend, "/", deployment].concat()
    }

    fn clean() -> RoutingView {
        RoutingView {
            targets: vec![TargetView::default(); 2],
            backends: vec![crate::BackendView::default()],
        }
    }

    fn lookup(views: &Views) -> Lookup<'_> {
        views.lookup("q".to_owned(), &query(), name)
    }

    #[tokio::test]
    async fn requests_that_ask_while_a_read_is_in_flight_get_what_it_read() {
        let views = Views::default();
        let Lookup::Lead(flight) = lookup(&views) else {
            panic!("the first request reads");
        };
        let Lookup::Wait(waiting) = lookup(&views) else {
            panic!("the second waits for the first's read");
        };
        flight.land(Some(&clean()));
        assert_eq!(landed(waiting).await, Some(Some(clean())));
    }

    #[tokio::test]
    async fn a_read_whose_request_ended_first_leaves_its_waiters_to_read_on_their_own() {
        let views = Views::default();
        let Lookup::Lead(flight) = lookup(&views) else {
            panic!("the first request reads");
        };
        let Lookup::Wait(waiting) = lookup(&views) else {
            panic!("the second waits");
        };
        drop(flight);
        assert_eq!(landed(waiting).await, None);
        assert!(
            matches!(lookup(&views), Lookup::Lead(_)),
            "no read in flight"
        );
    }

    #[test]
    fn a_read_that_may_have_missed_a_mark_of_this_instance_is_not_kept() {
        let views = Views::default();
        let Lookup::Lead(flight) = lookup(&views) else {
            panic!("the first request reads");
        };
        views.apply(Mark::NotServed {
            target: "a/m",
            ms: 1_000,
        });
        assert!(
            matches!(lookup(&views), Lookup::Lead(_)),
            "a request after the mark does not wait for a read that began before it"
        );
        flight.land(Some(&clean()));
        assert!(!matches!(lookup(&views), Lookup::Fresh(_)));
    }

    #[test]
    fn marks_land_on_their_target_and_breaker_only() {
        let names = Names::of(&query(), name);
        let mut view = clean();
        names.apply(
            &mut view,
            Mark::NotServed {
                target: "b/m",
                ms: 500,
            },
        );
        names.apply(
            &mut view,
            Mark::CoolingDown {
                target: "a/m",
                ms: 700,
            },
        );
        names.apply(
            &mut view,
            Mark::CoolingDown {
                target: "a/m",
                ms: 300,
            },
        );
        names.apply(
            &mut view,
            Mark::CoolingDown {
                target: "b/m",
                ms: 900,
            },
        );
        let open = BreakerPhase::Open { remaining_ms: 40 };
        names.apply(
            &mut view,
            Mark::Breaker {
                id: "a#p",
                phase: open,
            },
        );
        names.apply(
            &mut view,
            Mark::Breaker {
                id: "b#p",
                phase: BreakerPhase::Closed,
            },
        );
        assert_eq!(
            view.targets[0].exclusion,
            Some(Exclusion::CoolingDown { remaining_ms: 700 }),
            "the longer cooldown stays"
        );
        assert_eq!(
            view.targets[1].exclusion,
            Some(Exclusion::NotServed { remaining_ms: 500 }),
            "not-served wins over a cooldown"
        );
        assert_eq!(view.backends[0].breaker, open);
        names.apply(&mut view, Mark::Served { target: "b/m" });
        assert!(view.targets[1].served && view.targets[1].exclusion.is_none());
    }
}
