//! The Redis store against a real Redis at 127.0.0.1:6379, each test under its own key prefix:
//! its scripts make the same decisions as the memory store.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use onedoor_state::{
    Ask, BackendQuery, Backoff, BreakerPhase, Charge, Claim, Exclusion, Limit, MeterKey,
    MeterLimits, MeterUsage, OnError, RedisConfig, RedisState, RoutingQuery, Settlement, State,
    Store, TargetKey, Verdict,
};

const REDIS: &str = "127.0.0.1:6379";

/// A store on the machine's Redis under a prefix no other run uses, or a failure that says how
/// to start Redis.
async fn redis(test: &str) -> RedisState {
    let store = RedisState::new(&config(test));
    assert!(store.ping().await, "Redis at {REDIS} does not answer PING");
    store
}

/// A config for the machine's Redis under a prefix no other run uses.
fn config(test: &str) -> RedisConfig {
    if std::net::TcpStream::connect(REDIS).is_err() {
        panic!(
            "this test needs Redis at {REDIS}; start it with: redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save \"\" --appendonly no"
        );
    }
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    RedisConfig {
        url: format!("redis://{REDIS}/0"),
        ca_file: None,
        key_prefix: format!("test-{test}-{}-{nanos}", std::process::id()),
        on_error: OnError::FailClosed,
    }
}

fn ask(rpm: Option<u64>, tpm: Option<u64>, tokens: u64) -> Ask {
    Ask {
        meters: vec![
            (
                MeterKey::tenant("t"),
                MeterLimits {
                    rpm,
                    ..MeterLimits::default()
                },
            ),
            (
                MeterKey::key("t", "k"),
                MeterLimits {
                    tpm,
                    ..MeterLimits::default()
                },
            ),
        ],
        charge: Charge {
            tokens,
            micro_usd: 3,
            lease_ms: 60_000,
        },
        enforce: true,
    }
}

#[tokio::test]
async fn meters_admit_refuse_and_settle_as_in_memory() {
    let store = redis("meters").await;
    let Verdict::Admitted(first) = store.admit(&ask(Some(2), Some(100), 60)).await.unwrap() else {
        panic!("the first ask fits");
    };
    assert!(first.shared);
    assert_eq!(
        (
            first.usage[0].requests,
            first.usage[1].tokens,
            first.usage[1].in_flight
        ),
        (1, 60, 1)
    );
    let Verdict::Refused(refusal) = store.admit(&ask(Some(2), Some(100), 50)).await.unwrap() else {
        panic!("the key's tpm is full");
    };
    assert_eq!((refusal.meter, refusal.limit), (1, Limit::Tpm));
    assert!(
        refusal.retry_after_ms > 58_000 && refusal.retry_after_ms <= 60_000,
        "{refusal:?}"
    );
    assert_eq!((refusal.used, refusal.cap, refusal.asked), (60, 100, 50));
    store
        .settle(
            &first,
            Settlement {
                tokens: 30,
                micro_usd: 1,
                release: true,
            },
        )
        .await;
    let usage = store
        .usage(&[MeterKey::tenant("t"), MeterKey::key("t", "k")])
        .await
        .unwrap();
    assert_eq!(
        (usage[1].tokens, usage[1].in_flight, usage[1].day_tokens),
        (30, 0, 30)
    );
    assert_eq!(usage[0].month_micro_usd, 1);
    assert!(matches!(
        store.admit(&ask(Some(2), Some(100), 50)).await.unwrap(),
        Verdict::Admitted(_)
    ));
    let Verdict::Refused(refusal) = store.admit(&ask(Some(2), None, 1)).await.unwrap() else {
        panic!("rpm is full");
    };
    assert_eq!((refusal.meter, refusal.limit), (0, Limit::Rpm));
}

#[tokio::test]
async fn a_period_quota_is_refused_until_the_period_ends() {
    let store = redis("period").await;
    let limits = MeterLimits {
        rpm: Some(1),
        tokens_per_day: Some(10),
        micro_usd_per_month: Some(5),
        ..MeterLimits::default()
    };
    let ask = |tokens, micro_usd| Ask {
        meters: vec![(MeterKey::tenant("t"), limits)],
        charge: Charge {
            tokens,
            micro_usd,
            lease_ms: 1000,
        },
        enforce: true,
    };
    assert!(matches!(
        store.admit(&ask(8, 4)).await.unwrap(),
        Verdict::Admitted(_)
    ));
    let Verdict::Refused(refusal) = store.admit(&ask(8, 0)).await.unwrap() else {
        panic!("the day's tokens are used");
    };
    assert_eq!(refusal.limit, Limit::TokensPerDay);
    assert!(refusal.retry_after_ms <= 86_400_000);
    let Verdict::Refused(refusal) = store.admit(&ask(1, 4)).await.unwrap() else {
        panic!("the month's spend is used");
    };
    assert_eq!(refusal.limit, Limit::UsdPerMonth);
    assert!(refusal.retry_after_ms <= 31 * 86_400_000);
}

#[tokio::test]
async fn in_flight_counts_until_released() {
    let store = redis("flight").await;
    let limits = MeterLimits {
        max_in_flight: Some(1),
        ..MeterLimits::default()
    };
    let ask = Ask {
        meters: vec![(MeterKey::tenant("t"), limits)],
        charge: Charge {
            tokens: 0,
            micro_usd: 0,
            lease_ms: 60_000,
        },
        enforce: true,
    };
    let Verdict::Admitted(held) = store.admit(&ask).await.unwrap() else {
        panic!("first")
    };
    let Verdict::Refused(refusal) = store.admit(&ask).await.unwrap() else {
        panic!("second")
    };
    assert_eq!(refusal.limit, Limit::MaxInFlight);
    store
        .settle(
            &held,
            Settlement {
                tokens: 0,
                micro_usd: 0,
                release: true,
            },
        )
        .await;
    assert!(matches!(
        store.admit(&ask).await.unwrap(),
        Verdict::Admitted(_)
    ));
}

#[tokio::test]
async fn the_routing_view_reads_what_was_taught_and_breakers() {
    let store = redis("routing").await;
    store
        .mark_not_served(&TargetKey::new("a", "gpt-4o"), 60_000)
        .await;
    store.cool_down(&TargetKey::new("b", "gpt-4o"), 5_000).await;
    store.cool_down(&TargetKey::new("b", "gpt-4o"), 1_000).await;
    store.mark_served(&TargetKey::new("c", "x"), 60_000).await;
    assert_eq!(
        store.trip("a#p", 10_000).await.phase,
        BreakerPhase::Open {
            remaining_ms: 10_000
        }
    );
    store
        .admit(&Ask {
            meters: vec![(MeterKey::backend("b"), MeterLimits::default())],
            charge: Charge {
                tokens: 9,
                micro_usd: 0,
                lease_ms: 60_000,
            },
            enforce: false,
        })
        .await
        .unwrap();
    let backends = [
        BackendQuery {
            name: "a",
            breaker: Some("a#p"),
            metered: false,
        },
        BackendQuery {
            name: "b",
            breaker: None,
            metered: true,
        },
    ];
    store.trip("b#p@gpt-4o", 4_000).await;
    let target_breakers: [Option<Arc<str>>; 2] = [None, Some("b#p@gpt-4o".into())];
    let view = store
        .routing(RoutingQuery {
            targets: &[("a", "gpt-4o"), ("b", "gpt-4o"), ("c", "x")],
            target_breakers: &target_breakers,
            backends: &backends,
        })
        .await
        .unwrap();
    assert!(
        matches!(view.targets[0].exclusion, Some(Exclusion::NotServed { remaining_ms }) if remaining_ms > 59_000)
    );
    assert!(
        matches!(view.targets[1].exclusion, Some(Exclusion::CoolingDown { remaining_ms }) if remaining_ms > 4_000)
    );
    assert!(view.targets[2].served && view.targets[2].exclusion.is_none());
    let target_phases: Vec<_> = view.targets.iter().map(|t| t.breaker).collect();
    assert!(
        matches!(
            target_phases[..],
            [BreakerPhase::Closed, BreakerPhase::Open { remaining_ms }, BreakerPhase::Closed] if remaining_ms > 3_000
        ),
        "{target_phases:?}"
    );
    assert!(matches!(
        view.backends[0].breaker,
        BreakerPhase::Open { .. }
    ));
    assert_eq!(view.backends[0].usage, None);
    let usage = view.backends[1].usage.unwrap();
    assert_eq!((usage.requests, usage.tokens, usage.in_flight), (1, 9, 1));
    let listed = store.not_served().await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].key, TargetKey::new("a", "gpt-4o"));
    store
        .mark_served(&TargetKey::new("a", "gpt-4o"), 1000)
        .await;
    assert!(store.not_served().await.unwrap().is_empty());
}

#[tokio::test]
async fn a_half_open_breaker_gives_out_one_probe_and_backs_off_on_failure() {
    let store = redis("breaker").await;
    assert_eq!(store.claim_probe("b#p", 1000).await, Claim::Closed);
    store.trip("b#p", 1).await;
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    assert_eq!(store.claim_probe("b#p", 60_000).await, Claim::Probe);
    assert_eq!(store.claim_probe("b#p", 60_000).await, Claim::Busy);
    let backoff = Backoff {
        factor: 2.5,
        max_ms: 4000,
    };
    let reopened = store.reopen("b#p", 1000, backoff).await;
    assert_eq!(reopened.phase, BreakerPhase::Open { remaining_ms: 2500 });
    assert_eq!((reopened.reopens, reopened.trips), (1, 2));
    assert!(matches!(
        store.claim_probe("b#p", 1000).await,
        Claim::Open { .. }
    ));
    // Consecutive failed probes wait 2 ms x 1.5, then x 1.5 again capped at 4 ms.
    let capped = redis("breaker-capped").await;
    let short = Backoff {
        factor: 1.5,
        max_ms: 4,
    };
    capped.trip("c", 1).await;
    for expected in [3, 4, 4] {
        tokio::time::sleep(std::time::Duration::from_millis(6)).await;
        assert_eq!(capped.claim_probe("c", 1000).await, Claim::Probe);
        let reopened = capped.reopen("c", 2, short).await;
        assert_eq!(
            reopened.phase,
            BreakerPhase::Open {
                remaining_ms: expected
            }
        );
    }
    let exact = redis("breaker-exact").await;
    exact.trip("x", 1).await;
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    assert_eq!(exact.claim_probe("x", 1000).await, Claim::Probe);
    exact.release_probe("x").await;
    assert_eq!(exact.claim_probe("x", 1000).await, Claim::Probe);
    exact.close("x").await;
    assert_eq!(
        exact.breaker("x").await.unwrap().phase,
        BreakerPhase::Closed
    );
}

#[tokio::test]
async fn a_pin_is_shared_through_redis_and_expires() {
    let store = redis("pin").await;
    assert_eq!(store.pinned("responses/resp_1").await, Ok(None));
    store.pin("responses/resp_1", "sub1-se", 60_000).await;
    assert_eq!(
        store.pinned("responses/resp_1").await,
        Ok(Some("sub1-se".to_owned()))
    );
    store.pin("responses/resp_2", "sub2-fr", 1).await;
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    assert_eq!(store.pinned("responses/resp_2").await, Ok(None));
}

#[tokio::test]
async fn admission_and_routing_view_in_one_round_trip_decide_as_two_calls_would() {
    let store = redis("admit-and-route").await;
    let local = onedoor_state::MemoryState::new();
    store.cool_down(&TargetKey::new("b", "gpt-4o"), 5_000).await;
    local.cool_down(&TargetKey::new("b", "gpt-4o"), 5_000).await;
    let backends = [BackendQuery {
        name: "b",
        breaker: None,
        metered: false,
    }];
    let query = RoutingQuery {
        targets: &[("b", "gpt-4o")],
        target_breakers: &[],
        backends: &backends,
    };
    for round in 0..3 {
        let asked = ask(Some(2), Some(100), 30);
        let (verdict, view) = store.admit_and_route(&asked, query).await;
        let (expected, expected_view) = local.admit_and_route(&asked, query).await;
        let (verdict, view, expected_view) =
            (verdict.unwrap(), view.unwrap(), expected_view.unwrap());
        match (verdict, expected.unwrap()) {
            (Verdict::Admitted(got), Verdict::Admitted(want)) => {
                assert!(round < 2, "the third request is over rpm 2");
                assert_eq!(got.usage, want.usage);
            }
            (Verdict::Refused(got), Verdict::Refused(want)) => {
                assert_eq!(round, 2);
                assert_eq!(
                    (got.meter, got.limit, got.used),
                    (want.meter, want.limit, want.used)
                );
            }
            (got, want) => panic!("redis said {got:?}, memory {want:?}"),
        }
        assert!(matches!(
            view.targets[0].exclusion,
            Some(Exclusion::CoolingDown { .. })
        ));
        assert_eq!(view.targets[0].served, expected_view.targets[0].served);
        assert_eq!(view.backends, expected_view.backends);
    }
}

#[tokio::test]
async fn a_flushed_script_is_loaded_again_without_charging_twice() {
    let store = redis("admit-and-route-noscript").await;
    let client = redis::Client::open(format!("redis://{REDIS}/0")).unwrap();
    let mut connection = client.get_multiplexed_async_connection().await.unwrap();
    let query = RoutingQuery {
        targets: &[("b", "gpt-4o")],
        target_breakers: &[],
        backends: &[],
    };
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut connection)
        .await
        .unwrap();
    let (verdict, view) = store.admit_and_route(&ask(Some(10), None, 5), query).await;
    assert!(matches!(verdict.unwrap(), Verdict::Admitted(_)));
    assert!(view.unwrap().targets[0].exclusion.is_none());
    let usage = store.usage(&[MeterKey::tenant("t")]).await.unwrap();
    assert_eq!(usage[0].requests, 1, "the admission ran once");
}

/// Spends 20 tokens and 4 µ$, then 10 and 3, on a tenant and its key.
async fn spend<S: State>(store: &S) -> Vec<onedoor_state::MeterUsage> {
    let meters = [MeterKey::tenant("t"), MeterKey::key("t", "k")];
    store.charge(&meters, 20, 4).await.unwrap();
    store.charge(&meters, 10, 3).await.unwrap()
}

#[tokio::test]
async fn spent_tokens_count_in_the_minute_day_and_month_without_a_request_as_in_memory() {
    let redis = redis("charge").await;
    let memory = onedoor_state::MemoryState::new();
    let (shared, local) = (spend(&redis).await, spend(&memory).await);
    assert_eq!(shared, local);
    for used in &shared {
        let counted = (
            used.requests,
            used.tokens,
            used.in_flight,
            used.day_tokens,
            used.month_micro_usd,
        );
        assert_eq!(counted, (0, 30, 0, 30, 7));
    }
    let read = redis.usage(&[MeterKey::key("t", "k")]).await.unwrap();
    assert_eq!(read[0], shared[1]);
    // The day's tokens are spent: the next ask that needs one is refused.
    let quota = Ask {
        meters: vec![(
            MeterKey::tenant("t"),
            MeterLimits {
                tokens_per_day: Some(30),
                ..MeterLimits::default()
            },
        )],
        charge: Charge {
            tokens: 1,
            micro_usd: 0,
            lease_ms: 1000,
        },
        enforce: true,
    };
    for verdict in [redis.admit(&quota).await, memory.admit(&quota).await] {
        let Verdict::Refused(refusal) = verdict.unwrap() else {
            panic!("the day's tokens are spent");
        };
        assert_eq!((refusal.limit, refusal.used), (Limit::TokensPerDay, 30));
    }
}

/// Charges a backend three requests of 10 tokens and settles one at 25; returns its usage as the
/// routing view and as an operator's read see it.
async fn burst<S: State>(store: &S) -> (onedoor_state::MeterUsage, onedoor_state::MeterUsage) {
    let ask = Ask {
        meters: vec![(MeterKey::backend("ptu"), MeterLimits::default())],
        charge: Charge {
            tokens: 10,
            micro_usd: 0,
            lease_ms: 60_000,
        },
        enforce: false,
    };
    let mut made = Vec::new();
    for _ in 0..3 {
        let Verdict::Admitted(reservation) = store.admit(&ask).await.unwrap() else {
            panic!("a backend's count refuses nothing");
        };
        made.push(reservation);
    }
    let settlement = Settlement {
        tokens: 25,
        micro_usd: 0,
        release: true,
    };
    store.settle(&made[0], settlement).await;
    let backends = [BackendQuery {
        name: "ptu",
        breaker: None,
        metered: true,
    }];
    let query = RoutingQuery {
        targets: &[],
        target_breakers: &[],
        backends: &backends,
    };
    let view = store.routing(query).await.unwrap();
    let read = store.usage(&[MeterKey::backend("ptu")]).await.unwrap();
    (view.backends[0].usage.unwrap(), read[0])
}

#[tokio::test]
async fn the_last_ten_seconds_are_counted_as_in_memory() {
    let redis = redis("short-window").await;
    let memory = onedoor_state::MemoryState::new();
    let ((shared_view, shared_read), (local_view, local_read)) =
        (burst(&redis).await, burst(&memory).await);
    assert_eq!(shared_read, local_read);
    let short = |u: onedoor_state::MeterUsage| (u.requests_10s, u.tokens_10s, u.in_flight);
    assert_eq!(short(shared_read), (3, 45, 2));
    assert_eq!(short(shared_view), short(local_view));
    assert_eq!(short(shared_view), (3, 45, 2));
}

/// Polls `check` every 5 ms for up to a second.
async fn soon<F, Fut>(mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..200 {
        if check().await {
            return true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    false
}

fn one_in_flight() -> Ask {
    Ask {
        meters: vec![(
            MeterKey::tenant("t"),
            MeterLimits {
                max_in_flight: Some(1),
                ..MeterLimits::default()
            },
        )],
        charge: Charge {
            tokens: 50,
            micro_usd: 0,
            lease_ms: 60_000,
        },
        enforce: true,
    }
}

const ENDED_AT_20: Settlement = Settlement {
    tokens: 20,
    micro_usd: 0,
    release: true,
};

#[tokio::test]
async fn a_queued_settlement_is_paid_by_the_next_admission_of_its_tenant() {
    let store = Arc::new(Store::redis(&config("ride-along")));
    let Verdict::Admitted(held) = store.admit(&one_in_flight()).await.unwrap() else {
        panic!("the first request fits");
    };
    store.settle_detached(&held, ENDED_AT_20);
    let Verdict::Admitted(next) = store.admit(&one_in_flight()).await.unwrap() else {
        panic!("the admission right after the end saw it");
    };
    assert_eq!((next.usage[0].in_flight, next.usage[0].tokens), (1, 70));
}

#[tokio::test]
async fn a_settlement_no_admission_takes_along_is_paid_within_milliseconds() {
    let config = config("paid-alone");
    let (store, other) = (Arc::new(Store::redis(&config)), RedisState::new(&config));
    let Verdict::Admitted(held) = store.admit(&one_in_flight()).await.unwrap() else {
        panic!("the first request fits");
    };
    store.settle_detached(&held, ENDED_AT_20);
    let tenant = [MeterKey::tenant("t")];
    let paid = soon(|| async {
        let usage = other.usage(&tenant).await.unwrap()[0];
        (usage.in_flight, usage.tokens, usage.day_tokens) == (0, 20, 20)
    })
    .await;
    assert!(paid, "another instance sees the end and the real tokens");
}

fn backend_count(tokens: u64) -> Ask {
    Ask {
        meters: vec![(MeterKey::backend("ptu"), MeterLimits::default())],
        charge: Charge {
            tokens,
            micro_usd: 0,
            lease_ms: 60_000,
        },
        enforce: false,
    }
}

#[tokio::test]
async fn a_backends_count_is_made_and_settled_without_waiting() {
    let config = config("backend-count");
    let (store, other) = (Arc::new(Store::redis(&config)), RedisState::new(&config));
    let meter = [MeterKey::backend("ptu")];
    let read = |usage: MeterUsage| (usage.requests, usage.tokens, usage.in_flight);
    // Settled before it was sent: counted once, with its final tokens, never in flight.
    let quick = store.admit_detached(backend_count(30));
    store.settle_after(quick, ENDED_AT_20);
    assert!(soon(|| async { read(other.usage(&meter).await.unwrap()[0]) == (1, 20, 0) }).await);
    // Sent, then settled above its estimate: in flight until it ends, then its extra tokens.
    let slow = store.admit_detached(backend_count(10));
    assert!(soon(|| async { read(other.usage(&meter).await.unwrap()[0]) == (2, 30, 1) }).await);
    store.settle_after(slow, ENDED_AT_20);
    assert!(soon(|| async { read(other.usage(&meter).await.unwrap()[0]) == (2, 40, 0) }).await);
}

fn tpm_100(tokens: u64) -> Ask {
    Ask {
        meters: vec![(
            MeterKey::tenant("t"),
            MeterLimits {
                tpm: Some(100),
                ..MeterLimits::default()
            },
        )],
        charge: Charge {
            tokens,
            micro_usd: 0,
            lease_ms: 60_000,
        },
        enforce: true,
    }
}

#[tokio::test]
async fn a_refused_admission_still_pays_the_debts_it_took_along() {
    let config = config("refused-pays");
    let (store, other) = (Arc::new(Store::redis(&config)), RedisState::new(&config));
    let Verdict::Admitted(held) = store.admit(&tpm_100(50)).await.unwrap() else {
        panic!("50 of 100 fits");
    };
    store.settle_detached(&held, ENDED_AT_20);
    let Verdict::Refused(refusal) = store.admit(&tpm_100(90)).await.unwrap() else {
        panic!("20 + 90 is over 100");
    };
    assert_eq!((refusal.limit, refusal.used), (Limit::Tpm, 20));
    let seen = other.usage(&[MeterKey::tenant("t")]).await.unwrap()[0];
    assert_eq!((seen.tokens, seen.in_flight, seen.day_tokens), (20, 0, 20));
}

#[tokio::test]
async fn a_debt_from_an_earlier_second_corrects_its_own_bucket() {
    let config = config("earlier-second");
    let (store, other) = (Arc::new(Store::redis(&config)), RedisState::new(&config));
    let Verdict::Admitted(held) = store.admit(&tpm_100(50)).await.unwrap() else {
        panic!("50 of 100 fits");
    };
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    let next_second = 1_000 - u64::from(now.subsec_millis()) + 20;
    tokio::time::sleep(std::time::Duration::from_millis(next_second)).await;
    store.settle_detached(&held, ENDED_AT_20);
    let Verdict::Admitted(next) = store.admit(&tpm_100(80)).await.unwrap() else {
        panic!("20 + 80 fits in 100");
    };
    assert_eq!(next.usage[0].tokens, 100);
    let seen = other.usage(&[MeterKey::tenant("t")]).await.unwrap()[0];
    assert_eq!(
        (seen.tokens, seen.tokens_10s, seen.in_flight),
        (100, 100, 1)
    );
}

#[tokio::test]
async fn a_notice_reaches_the_listeners_of_its_prefix_and_no_other() {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let prefix = format!("test-notices-{}-{nanos}", std::process::id());
    let url = format!("redis://{REDIS}/0");
    redis("notices").await;
    let notices = |prefix: &str| onedoor_state::Notices::new(&url, prefix, "client-keys").unwrap();
    let (one, other, stranger) = (notices(&prefix), notices(&prefix), notices("elsewhere"));
    let mut heard = other.listen();
    let mut unheard = stranger.listen();
    // Each listener first says it has subscribed (with an empty notice).
    let wait = std::time::Duration::from_secs(5);
    assert_eq!(
        tokio::time::timeout(wait, heard.recv())
            .await
            .unwrap()
            .unwrap(),
        ""
    );
    assert_eq!(
        tokio::time::timeout(wait, unheard.recv())
            .await
            .unwrap()
            .unwrap(),
        ""
    );
    one.announce("42").await;
    assert_eq!(
        tokio::time::timeout(wait, heard.recv())
            .await
            .unwrap()
            .unwrap(),
        "42"
    );
    let quiet = std::time::Duration::from_millis(200);
    assert!(tokio::time::timeout(quiet, unheard.recv()).await.is_err());
    // Only one server's URL forms carry notices.
    assert!(onedoor_state::Notices::new("redis+cluster://127.0.0.1:7000", &prefix, "t").is_none());
}

const VIEWED: [(&str, &str); 2] = [("a", "gpt-4o"), ("b", "gpt-4o")];
const VIEWED_BACKENDS: [BackendQuery<'static>; 1] = [BackendQuery {
    name: "a",
    breaker: Some("a#p"),
    metered: false,
}];

fn viewed() -> RoutingQuery<'static> {
    RoutingQuery {
        targets: &VIEWED,
        target_breakers: &[],
        backends: &VIEWED_BACKENDS,
    }
}

/// One instance reads a view; another marks target b not served; this one marks a not served
/// and trips a's breaker, then reads again. `None` when that took longer than the view is kept
/// (a loaded machine), so nothing can be said.
async fn reread_after_marks(
    this: &RedisState,
    other: &RedisState,
) -> Option<onedoor_state::RoutingView> {
    this.routing(viewed()).await.unwrap();
    let read_at = std::time::Instant::now();
    other
        .mark_not_served(&TargetKey::new("b", "gpt-4o"), 60_000)
        .await;
    this.mark_not_served(&TargetKey::new("a", "gpt-4o"), 60_000)
        .await;
    this.trip("a#p", 10_000).await;
    let view = this.routing(viewed()).await.unwrap();
    (read_at.elapsed() < onedoor_state::VIEW_FRESH_FOR).then_some(view)
}

#[tokio::test]
async fn a_routing_view_kept_for_reuse_has_this_instances_own_marks_and_is_read_again_after() {
    let mut reused = None;
    for _ in 0..20 {
        let shared = config("views");
        let (this, other) = (RedisState::new(&shared), RedisState::new(&shared));
        assert!(this.ping().await && other.ping().await);
        if let Some(view) = reread_after_marks(&this, &other).await {
            reused = Some((this, view));
            break;
        }
    }
    let (this, view) = reused.expect("one round within the bound in twenty");
    assert!(
        matches!(view.targets[0].exclusion, Some(Exclusion::NotServed { .. })),
        "its own not-served mark"
    );
    assert!(matches!(
        view.backends[0].breaker,
        BreakerPhase::Open { .. }
    ));
    assert_eq!(
        view.targets[1].exclusion, None,
        "another instance's mark is not seen within the bound"
    );
    tokio::time::sleep(onedoor_state::VIEW_FRESH_FOR).await;
    let view = this.routing(viewed()).await.unwrap();
    assert!(
        matches!(view.targets[1].exclusion, Some(Exclusion::NotServed { .. })),
        "past its bound the view is read again"
    );
    assert!(matches!(
        view.targets[0].exclusion,
        Some(Exclusion::NotServed { .. })
    ));
}

fn rpm_20() -> Ask {
    Ask {
        meters: vec![(
            MeterKey::tenant("t"),
            MeterLimits {
                rpm: Some(20),
                ..MeterLimits::default()
            },
        )],
        charge: Charge {
            tokens: 5,
            micro_usd: 0,
            lease_ms: 60_000,
        },
        enforce: true,
    }
}

#[tokio::test]
async fn fifty_asks_at_once_across_two_instances_with_rpm_20_admit_exactly_20_in_order() {
    let shared = config("coalesced");
    let (one, two) = (RedisState::new(&shared), RedisState::new(&shared));
    assert!(one.ping().await && two.ping().await);
    let asked = rpm_20();
    let asks = (0..50).map(|i| {
        let store = if i % 2 == 0 { &one } else { &two };
        store.admit(&asked)
    });
    let verdicts = futures_util::future::join_all(asks).await;
    let mut counted: Vec<u64> = verdicts
        .iter()
        .filter_map(|verdict| match verdict.as_ref().unwrap() {
            Verdict::Admitted(reservation) => Some(reservation.usage[0].requests),
            Verdict::Refused(refusal) => {
                assert_eq!(
                    (refusal.limit, refusal.used, refusal.cap),
                    (Limit::Rpm, 20, 20)
                );
                None
            }
        })
        .collect();
    counted.sort_unstable();
    assert_eq!(
        counted,
        (1..=20).collect::<Vec<u64>>(),
        "each admitted ask saw the ones before it, as calls one after another would"
    );
}
