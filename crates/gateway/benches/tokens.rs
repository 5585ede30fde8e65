//! What counting a prompt costs, by size (not a timed test: `cargo bench -p onedoor-gateway
//! --bench tokens` prints a table for BENCHMARKS.md). English prose, code, and a pathological run
//! without a space (where a regex-split tokenizer with quadratic pieces would blow up), for
//! o200k_base and cl100k_base; plus the one-time cost of loading each vocabulary.

use std::hint::black_box;
use std::time::{Duration, Instant};

use onedoor_gateway::tokens::Estimator;

const PROSE: &str = "The gateway estimates every prompt before it asks an upstream, reserves the \
estimate plus the completion budget against the tenant's limits, and replaces the reservation \
with the usage the upstream reports. Limits hold exactly across instances because every decision \
is one atomic script in the shared store. ";
const CODE: &str = "fn main() {\n    let xs: Vec<u32> = (0..10).map(|x| x * x).collect();\n    \
println!(\"{:?}\", xs);\n}\n";

fn text(kind: &str, bytes: usize) -> String {
    let unit = match kind {
        "prose" => PROSE.to_owned(),
        "code" => CODE.to_owned(),
        _ => "a".repeat(64),
    };
    let mut out = String::with_capacity(bytes + unit.len());
    while out.len() < bytes {
        out.push_str(&unit);
    }
    out.truncate(bytes);
    out
}

/// The median time of one count over enough runs to fill about 300 ms.
fn measure(estimator: &Estimator, text: &str) -> (Duration, u64) {
    let tokens = estimator.text(text);
    let once = {
        let start = Instant::now();
        black_box(estimator.text(black_box(text)));
        start.elapsed().max(Duration::from_nanos(50))
    };
    let runs = (Duration::from_millis(300).as_nanos() / once.as_nanos()).clamp(5, 100_000) as usize;
    let mut times: Vec<Duration> = (0..runs)
        .map(|_| {
            let start = Instant::now();
            black_box(estimator.text(black_box(text)));
            start.elapsed()
        })
        .collect();
    times.sort_unstable();
    (times[times.len() / 2], tokens)
}

fn main() {
    let models = [("gpt-4o", "o200k_base"), ("gpt-4", "cl100k_base")];
    println!("| encoding | first use (vocabulary load) |");
    println!("| --- | ---: |");
    for (model, encoding) in models {
        let estimator = Estimator::for_model(model);
        let start = Instant::now();
        black_box(estimator.text("warm up"));
        println!(
            "| {encoding} | {:.1} ms |",
            start.elapsed().as_secs_f64() * 1000.0
        );
    }
    println!();
    println!("| encoding | text | bytes | tokens | median µs | µs per KB | MB/s |");
    println!("| --- | --- | ---: | ---: | ---: | ---: | ---: |");
    for (model, encoding) in models {
        let estimator = Estimator::for_model(model);
        for kind in ["prose", "code", "no-spaces"] {
            for bytes in [100, 1_000, 10_000, 100_000, 1_000_000] {
                let text = text(kind, bytes);
                let (median, tokens) = measure(&estimator, &text);
                let us = median.as_secs_f64() * 1e6;
                println!(
                    "| {encoding} | {kind} | {bytes} | {tokens} | {us:.1} | {:.1} | {:.0} |",
                    us / (bytes as f64 / 1000.0),
                    bytes as f64 / median.as_secs_f64() / 1e6
                );
            }
        }
    }
}
