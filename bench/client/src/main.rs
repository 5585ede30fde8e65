//! `onedoor-bench-client`: the load bench/run needs beyond wrk and oha. Each mode prints one
//! machine-readable line (`STREAMS ...` or `IDLE ...`, `key=value` fields) that bench/run reads,
//! and the first error, if any, on stderr.
//!
//!   streams --url U --body JSON [--header 'name: value']... --streams N --ramp S --duration S [--pid P]
//!   idle    --url U --body JSON [--header 'name: value']... --connections N --hold S [--parallel N] [--pid P]
//!
//! `--pid` names the process whose resident memory is reported (the gateway under test).

mod idle;
mod memory;
mod streams;
mod target;

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use memory::{status_kb, PeakSampler};
use target::Target;

struct Args {
    mode: String,
    values: HashMap<String, String>,
    headers: Vec<String>,
}

impl Args {
    fn parse() -> Result<Self, String> {
        let mut args = std::env::args().skip(1);
        let mode = args
            .next()
            .ok_or("usage: onedoor-bench-client streams|idle --url ...")?;
        let (mut values, mut headers) = (HashMap::new(), Vec::new());
        while let Some(flag) = args.next() {
            let name = flag
                .strip_prefix("--")
                .ok_or_else(|| format!("unexpected argument {flag:?}"))?;
            let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
            if name == "header" {
                headers.push(value);
            } else {
                values.insert(name.to_owned(), value);
            }
        }
        Ok(Self {
            mode,
            values,
            headers,
        })
    }

    fn text(&self, name: &str) -> Result<&str, String> {
        self.values
            .get(name)
            .map(String::as_str)
            .ok_or_else(|| format!("--{name} is required"))
    }

    fn number(&self, name: &str, default: Option<f64>) -> Result<f64, String> {
        match self.values.get(name) {
            Some(v) => v.parse().map_err(|e| format!("--{name} {v}: {e}")),
            None => default.ok_or_else(|| format!("--{name} is required")),
        }
    }

    fn seconds(&self, name: &str) -> Result<Duration, String> {
        Duration::try_from_secs_f64(self.number(name, None)?).map_err(|e| format!("--{name}: {e}"))
    }

    fn pid(&self) -> Result<Option<u32>, String> {
        self.values
            .get("pid")
            .map(|p| p.parse().map_err(|e| format!("--pid {p}: {e}")))
            .transpose()
    }

    fn target(&self) -> Result<Arc<Target>, String> {
        let body = self.text("body")?.to_owned();
        Ok(Arc::new(Target::new(
            self.text("url")?,
            &self.headers,
            body,
        )?))
    }
}

fn main() {
    let result = Args::parse().and_then(|args| {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("runtime: {e}"))?
            .block_on(run(args))
    });
    if let Err(e) = result {
        eprintln!("onedoor-bench-client: {e}");
        std::process::exit(2);
    }
}

async fn run(args: Args) -> Result<(), String> {
    match args.mode.as_str() {
        "streams" => run_streams(&args).await,
        "idle" => run_idle(&args).await,
        other => Err(format!("unknown mode {other:?} (streams, idle)")),
    }
}

async fn run_streams(args: &Args) -> Result<(), String> {
    let plan = streams::Plan {
        streams: args.number("streams", None)? as usize,
        ramp: args.seconds("ramp")?,
        duration: args.seconds("duration")?,
    };
    let pid = args.pid()?;
    let sampler = pid.map(PeakSampler::start);
    let open = Arc::new(streams::Open::default());
    let mut o = streams::run(args.target()?, &plan, open.clone()).await;
    let recorded = o.ttft_us.len();
    let events_per_stream = o.events as f64 / recorded.max(1) as f64;
    o.ttft_us.sort_unstable();
    o.total_us.sort_unstable();
    let (ttft, total) = (&o.ttft_us, &o.total_us);
    println!(
        "STREAMS streams={} started={} recorded={recorded} errors={} peak_open={} \
         ttft_p50_us={} ttft_p90_us={} ttft_p99_us={} ttft_max_us={} total_p50_us={} total_p99_us={} \
         events_per_stream={events_per_stream:.1} rss_peak_kb={} rss_hwm_kb={}",
        plan.streams,
        o.started,
        o.errors,
        open.peak.load(Ordering::Relaxed),
        percentile(ttft, 50.0),
        percentile(ttft, 90.0),
        percentile(ttft, 99.0),
        percentile(ttft, 100.0),
        percentile(total, 50.0),
        percentile(total, 99.0),
        sampler.as_ref().map_or(0, PeakSampler::peak_kb),
        pid.and_then(|p| status_kb(p, "VmHWM")).unwrap_or(0),
    );
    if let Some(e) = o.first_error {
        eprintln!("first error: {e}");
    }
    Ok(())
}

async fn run_idle(args: &Args) -> Result<(), String> {
    let plan = idle::Plan {
        connections: args.number("connections", None)? as usize,
        parallel: args.number("parallel", Some(256.0))? as usize,
    };
    let hold = args.seconds("hold")?;
    let pid = args.pid()?;
    let rss = || pid.and_then(|p| status_kb(p, "VmRSS")).unwrap_or(0);
    let before = rss();
    let opened = idle::open(args.target()?, &plan).await;
    tokio::time::sleep(hold).await;
    let held = rss();
    let still_open = opened.still_open();
    let (count, errors, first_error) = (opened.senders.len(), opened.errors, opened.first_error);
    drop(opened.senders);
    // Give the server time to notice the closes and free what the connections held.
    tokio::time::sleep(Duration::from_secs(2)).await;
    println!(
        "IDLE connections={} opened={count} errors={errors} still_open={still_open} \
         rss_before_kb={before} rss_held_kb={held} rss_after_kb={} rss_hwm_kb={}",
        plan.connections,
        rss(),
        pid.and_then(|p| status_kb(p, "VmHWM")).unwrap_or(0),
    );
    if let Some(e) = first_error {
        eprintln!("first error: {e}");
    }
    Ok(())
}

/// The nearest-rank percentile of sorted samples (0 when there are none).
fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = (p / 100.0 * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}
