//! The recorder against real stores: batches reach SQLite and Postgres, records survive a store
//! outage and a restart through the journal, and none is ever written twice.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use onedoor_usage::testing::{self, PrivatePostgres};
use onedoor_usage::{
    report, Destination, GroupBy, Recorder, ReportQuery, Source, StoreUrl, Tokens, UsageRecord,
};

fn temp_dir(name: &str) -> PathBuf {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "onedoor-usage-{}-{name}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Request `n` of a run: `n % 7 + 1` output tokens, so sums tell records apart.
fn record(run: &str, n: u64) -> UsageRecord {
    UsageRecord {
        request_id: format!("{run}-{n:05}"),
        at_ms: onedoor_usage::now_ms(),
        tenant: ["legal", "ops"][(n % 2) as usize].into(),
        key_id: "k".into(),
        alias: "chat".into(),
        backend: Some("sub1-fr".into()),
        model: Some("gpt-4o".into()),
        region: Some("francecentral".into()),
        status: 200,
        tokens: Tokens {
            input: 10,
            output: n % 7 + 1,
            cached: 0,
            cache_write: 0,
            source: Source::Measured,
        },
        estimated_tokens: 30,
        cost_usd: 0.0,
        duration_ms: 5,
        ttft_ms: None,
        attempts: "sub1-fr=200".into(),
        stream: false,
        stream_cut: false,
        error: None,
        lines: None,
    }
}

fn output_sum(range: std::ops::Range<u64>) -> u64 {
    range.map(|n| n % 7 + 1).sum()
}

fn sqlite(dir: &Path, journal_dir: Option<&Path>) -> Destination {
    let store = StoreUrl::Sqlite(dir.join("usage.db"));
    Destination {
        journal: store.journal_path(journal_dir),
        store,
    }
}

async fn totals(store: &StoreUrl) -> (u64, u64) {
    let report = report(store, &ReportQuery::default()).await.unwrap();
    (report.total.requests, report.total.output_tokens)
}

#[tokio::test]
async fn records_reach_sqlite_in_batches() {
    let dir = temp_dir("sqlite");
    let destination = sqlite(&dir, None);
    let recorder = Recorder::start(destination.clone()).unwrap();
    for n in 0..1_000 {
        recorder.record(record("batches", n));
    }
    assert!(recorder.flush().await, "the journal is not empty");
    assert_eq!(
        totals(&destination.store).await,
        (1_000, output_sum(0..1_000))
    );
    let by_tenant = report(
        &destination.store,
        &ReportQuery {
            by: vec![GroupBy::Tenant],
            ..ReportQuery::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(by_tenant.rows.len(), 2);
    assert_eq!(by_tenant.rows[0].requests, 500);
    assert!(recorder.close().await);
    assert_eq!(recorder.stats().written, 1_000);
}

#[tokio::test]
async fn a_full_buffer_spills_to_the_journal_and_nothing_is_lost() {
    let dir = temp_dir("full");
    let destination = sqlite(&dir, None);
    let recorder = Recorder::start(destination.clone()).unwrap();
    for n in 0..30_000 {
        recorder.record(record("full", n));
    }
    assert!(recorder.flush().await, "the journal is not empty");
    assert_eq!(
        totals(&destination.store).await,
        (30_000, output_sum(0..30_000))
    );
    let stats = recorder.stats();
    assert_eq!(stats.written + stats.replayed, 30_000, "{stats:?}");
    assert_eq!(stats.lost, 0);
}

#[tokio::test]
async fn records_from_many_threads_at_once_all_reach_the_store() {
    let dir = temp_dir("threads");
    let destination = sqlite(&dir, None);
    let recorder = Recorder::start(destination.clone()).unwrap();
    // More threads than the recorder has slots, so some share one.
    let threads: Vec<_> = (0..12u64)
        .map(|t| {
            let recorder = recorder.clone();
            std::thread::spawn(move || {
                for n in t * 500..(t + 1) * 500 {
                    recorder.record(record("threads", n));
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
    assert!(recorder.flush().await, "the journal is not empty");
    assert_eq!(
        totals(&destination.store).await,
        (6_000, output_sum(0..6_000))
    );
    assert_eq!(recorder.stats().buffered, 0);
    assert!(recorder.close().await);
    assert_eq!(recorder.stats().written, 6_000);
}

#[tokio::test]
async fn records_wait_in_the_journal_while_the_store_cannot_be_opened() {
    let dir = temp_dir("blocked");
    // The store's folder cannot be created while a file stands in its place.
    let blocker = dir.join("store");
    std::fs::write(&blocker, "not a folder").unwrap();
    let journal_dir = dir.join("journal");
    let destination = sqlite(&blocker, Some(&journal_dir));
    let recorder = Recorder::start(destination.clone()).unwrap();
    for n in 0..300 {
        recorder.record(record("blocked", n));
    }
    assert!(!recorder.flush().await, "the store cannot be open yet");
    assert!(recorder.stats().spilled >= 300);
    std::fs::remove_file(&blocker).unwrap();
    for n in 300..400 {
        recorder.record(record("blocked", n));
    }
    assert!(recorder.flush().await, "the journal was not replayed");
    assert_eq!(totals(&destination.store).await, (400, output_sum(0..400)));
}

#[tokio::test]
async fn a_journal_left_by_a_stop_is_replayed_by_the_next_start_once() {
    let dir = temp_dir("restart");
    let blocker = dir.join("store");
    std::fs::write(&blocker, "not a folder").unwrap();
    let journal_dir = dir.join("journal");
    let destination = sqlite(&blocker, Some(&journal_dir));
    let first = Recorder::start(destination.clone()).unwrap();
    for n in 0..250 {
        first.record(record("restart", n));
    }
    assert!(!first.close().await);
    // After the writer stopped, a late record goes straight to the journal.
    first.record(record("restart", 250));
    // A record the store already has is in the journal again: it must stay single.
    std::fs::remove_file(&blocker).unwrap();
    let second = Recorder::start(destination.clone()).unwrap();
    second.record(record("restart", 0));
    assert!(second.flush().await);
    assert_eq!(totals(&destination.store).await, (251, output_sum(0..251)));
    second.close().await;
    let third = Recorder::start(destination.clone()).unwrap();
    assert!(third.close().await);
    assert_eq!(totals(&destination.store).await, (251, output_sum(0..251)));
}

#[tokio::test]
async fn records_reach_the_machines_postgres_once() {
    let url = testing::fresh_database(testing::MACHINE_POSTGRES, "recorder")
        .await
        .unwrap_or_else(|message| panic!("{message}"));
    let store = StoreUrl::parse(&url).unwrap();
    let dir = temp_dir("postgres");
    let destination = Destination {
        journal: store.journal_path(Some(&dir)),
        store: store.clone(),
    };
    let recorder = Recorder::start(destination.clone()).unwrap();
    for n in 0..600 {
        recorder.record(record("pg", n));
    }
    recorder.record(record("pg", 7));
    assert!(recorder.flush().await);
    assert_eq!(totals(&store).await, (600, output_sum(0..600)));
    let by_month = report(
        &store,
        &ReportQuery {
            by: vec![GroupBy::Month, GroupBy::Tenant],
            ..ReportQuery::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(by_month.rows.len(), 2);
    assert_eq!(by_month.total.requests, 600);
    // Estimated 30 tokens each, measured 11 to 17: the estimates ran high.
    assert!(by_month.rows[0].drift().unwrap() > 0.5, "{by_month:?}");
    let mut batch = record("pg", 600);
    batch.request_id = "batch_0123456789abcdef01234567".into();
    recorder.record(batch);
    assert!(recorder.flush().await);
    let by_kind = report(
        &store,
        &ReportQuery {
            by: vec![GroupBy::Kind],
            ..ReportQuery::default()
        },
    )
    .await
    .unwrap();
    let kinds: Vec<(&str, u64)> = by_kind
        .rows
        .iter()
        .map(|row| (row.group[0].as_str(), row.requests))
        .collect();
    assert_eq!(kinds, [("batch", 1), ("request", 600)], "{by_kind:?}");
    recorder.close().await;
    testing::drop_database(testing::MACHINE_POSTGRES, &url).await;
}

#[tokio::test]
async fn a_postgres_outage_mid_run_loses_no_record() {
    let server = PrivatePostgres::start().unwrap_or_else(|message| panic!("{message}"));
    let store = StoreUrl::parse(&server.url()).unwrap();
    let dir = temp_dir("outage");
    let destination = Destination {
        journal: store.journal_path(Some(&dir)),
        store: store.clone(),
    };
    let recorder = Recorder::start(destination).unwrap();
    for n in 0..300 {
        recorder.record(record("outage", n));
    }
    assert!(recorder.flush().await);
    server.stop().unwrap();
    for n in 300..700 {
        recorder.record(record("outage", n));
    }
    assert!(
        !recorder.flush().await,
        "the store is down: records must wait"
    );
    server.resume().unwrap();
    for n in 700..1_000 {
        recorder.record(record("outage", n));
    }
    assert!(recorder.flush().await, "the journal was not replayed");
    assert_eq!(totals(&store).await, (1_000, output_sum(0..1_000)));
    assert!(recorder.stats().spilled >= 400);
}

#[tokio::test]
async fn a_replaced_recorder_keeps_writing_and_closes_with_its_successor() {
    let dir = temp_dir("replaced");
    let (first, second) = (dir.join("first"), dir.join("second"));
    let old = Recorder::start(sqlite(&first, None)).unwrap();
    let new = Recorder::start(sqlite(&second, None)).unwrap();
    new.replaces(&old);
    for n in 0..50 {
        old.record(record("replaced", n));
        new.record(record("replaced", n));
    }
    assert!(new.close().await);
    old.record(record("replaced", 50));
    assert_eq!(totals(&sqlite(&first, None).store).await.0, 50);
    assert_eq!(totals(&sqlite(&second, None).store).await.0, 50);
}

#[tokio::test]
async fn a_replay_cut_short_and_what_came_after_are_both_replayed_at_close() {
    let dir = temp_dir("two-files");
    let destination = sqlite(&dir, None);
    let journal = destination.journal.clone().unwrap();
    let lines = |range: std::ops::Range<u64>| {
        range
            .map(|n| serde_json::to_string(&record("two", n)).unwrap() + "\n")
            .collect::<String>()
    };
    // A replay that was cut short left its file; records spilled after it are in a new one.
    let mut replaying = journal.clone().into_os_string();
    replaying.push(".replaying");
    std::fs::write(&replaying, lines(0..300)).unwrap();
    std::fs::write(&journal, lines(300..500)).unwrap();
    let recorder = Recorder::start(destination.clone()).unwrap();
    assert!(recorder.close().await, "a journal file was left");
    assert_eq!(totals(&destination.store).await, (500, output_sum(0..500)));
}
