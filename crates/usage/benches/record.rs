//! What recording a request costs the thread that served it, in CPU time (not a timed test:
//! `cargo bench -p onedoor-usage --bench record` prints a table for BENCHMARKS.md). Three ways:
//! the recorder as it runs (the record pushed into the thread's slot and copied into the
//! memory-mapped ledger), the recorder without its ledger (a directory stands where the ledger
//! file would be, so it cannot be opened: what recording cost before the ledger), and the
//! design the ledger avoids, one `write(2)` of the record's JSON line to a file per request.
//! Each burst of a thousand records is timed on its own and the median burst reported: the loop
//! is CPU-bound and a burst lasts well under a scheduler slice, so the median burst is one that
//! nothing interrupted, and its time is the recording thread's CPU time, whatever else loads the
//! machine (the writer thread included).

use std::hint::black_box;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use onedoor_usage::{Destination, Recorder, Source, StoreUrl, Tokens, UsageRecord};

const RECORDS: u64 = 100_000;
/// Records between pauses: fewer than a slot holds, so the writer keeps up and none spills.
const BURST: u64 = 1_000;

fn record(n: u64) -> UsageRecord {
    UsageRecord {
        request_id: format!("01JF3Q5M8Y2K7B4N6P9R{n:010}"),
        at_ms: 1_796_083_200_000 + n,
        tenant: Arc::from("legal-chatbot"),
        key_id: Arc::from("legal-prod"),
        alias: Arc::from("chat-default"),
        backend: Some(Arc::from("sub1-swedencentral-ptu")),
        model: Some(Arc::from("gpt-4o-2024-11-20")),
        region: Some(Arc::from("swedencentral")),
        status: 200,
        tokens: Tokens {
            input: 1_200,
            output: 350,
            cached: 0,
            cache_write: 0,
            source: Source::Measured,
        },
        estimated_tokens: 1_600,
        cost_usd: 0.0065,
        duration_ms: 840,
        ttft_ms: Some(210),
        attempts: "sub1-fr=429,sub1-swedencentral-ptu=200".into(),
        stream: true,
        stream_cut: false,
        error: None,
        lines: None,
    }
}

/// The median of the bursts' times, in ns a record.
fn median_per_record(mut bursts: Vec<Duration>) -> f64 {
    bursts.sort();
    bursts
        .get(bursts.len() / 2)
        .map_or(f64::NAN, |d| d.as_nanos() as f64 / BURST as f64)
}

fn fresh_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "onedoor-bench-record-{}-{name}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::create_dir_all(&dir);
    dir
}

/// ns a record of `RECORDS` records made and recorded in bursts, and how many spilled.
async fn through_recorder(dir: &Path) -> (f64, u64) {
    let destination = Destination {
        store: StoreUrl::Sqlite(dir.join("usage.db")),
        journal: Some(dir.join("usage.journal.jsonl")),
    };
    let Ok(recorder) = Recorder::start(destination) else {
        return (f64::NAN, 0);
    };
    let mut bursts = Vec::new();
    for burst in 0..RECORDS / BURST {
        let records: Vec<UsageRecord> = (0..BURST).map(|i| record(burst * BURST + i)).collect();
        let start = Instant::now();
        for r in records {
            recorder.record(black_box(r));
        }
        bursts.push(start.elapsed());
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    recorder.close().await;
    let spilled = recorder.stats().spilled;
    (median_per_record(bursts), spilled)
}

/// ns a record of serializing each record and appending it with its own `write(2)`.
fn a_write_per_record(dir: &Path) -> f64 {
    let Ok(mut file) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("per-record.jsonl"))
    else {
        return f64::NAN;
    };
    let mut line = Vec::with_capacity(1024);
    let mut bursts = Vec::new();
    for burst in 0..RECORDS / BURST {
        let records: Vec<UsageRecord> = (0..BURST).map(|i| record(burst * BURST + i)).collect();
        let start = Instant::now();
        for r in &records {
            line.clear();
            let _ = serde_json::to_writer(&mut line, black_box(r));
            line.push(b'\n');
            let _ = file.write_all(&line);
        }
        bursts.push(start.elapsed());
    }
    median_per_record(bursts)
}

fn main() {
    let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    else {
        return;
    };
    let ledger = fresh_dir("ledger");
    let without = fresh_dir("without");
    // A directory where the ledger file would be: the recorder runs without one.
    let _ = std::fs::create_dir_all(without.join("usage.journal.ledger"));
    let per_write = fresh_dir("write");
    println!("| recording a request | ns a record, median burst | records spilled |");
    println!("| --- | --- | --- |");
    for round in 1..=3 {
        let (with, spilled_with) = runtime.block_on(through_recorder(&ledger));
        let (bare, spilled_bare) = runtime.block_on(through_recorder(&without));
        let write = a_write_per_record(&per_write);
        println!("| round {round}: slot + memory-mapped ledger | {with:.0} | {spilled_with} |");
        println!("| round {round}: slot only (no ledger) | {bare:.0} | {spilled_bare} |");
        println!("| round {round}: JSON line + write(2) per record | {write:.0} | - |");
    }
    for dir in [ledger, without, per_write] {
        let _ = std::fs::remove_dir_all(dir);
    }
}
