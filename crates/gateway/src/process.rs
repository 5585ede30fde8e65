//! What the kernel says about the gateway's process, for `/metrics`: the standard `process_*`
//! metrics (CPU time, resident memory, open and allowed file descriptors, start time), read from
//! `/proc` at each scrape. A figure `/proc` does not give (another system, a restricted mount)
//! is left out rather than reported as zero.

use std::sync::{Mutex, PoisonError};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// Clock ticks a second in `/proc`'s CPU and start times: `USER_HZ`, which the kernel keeps at
/// 100 for user space on x86-64 and arm64 whatever its own tick rate.
const TICKS_PER_SECOND: f64 = 100.0;

/// The user and system CPU time in the text of a `/proc/<pid>/stat` or
/// `/proc/<pid>/task/<tid>/stat` file, in clock ticks.
pub fn cpu_ticks(stat: &str) -> Option<u64> {
    let mut fields = fields_after_name(stat)?;
    // utime and stime are fields 14 and 15 of the file, 11 and 12 counted from field 3.
    let user: u64 = fields.nth(11)?.parse().ok()?;
    let system: u64 = fields.next()?.parse().ok()?;
    Some(user + system)
}

/// When the process started, in clock ticks after the machine booted (field 22 of `stat`).
fn start_ticks(stat: &str) -> Option<u64> {
    fields_after_name(stat)?.nth(19)?.parse().ok()
}

/// The fields of a `stat` text from field 3 on: the command name before them, in parentheses,
/// may itself hold spaces and parentheses, so they begin after its last `)`.
fn fields_after_name(stat: &str) -> Option<std::str::SplitWhitespace<'_>> {
    Some(stat.rsplit_once(')')?.1.split_whitespace())
}

/// The resident set size in a `/proc/<pid>/status` text (`VmRSS:`, in kB), in bytes.
fn resident_bytes(status: &str) -> Option<u64> {
    let line = status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().next()?.parse().ok()?;
    Some(kb * 1024)
}

/// The soft limit on open files in a `/proc/<pid>/limits` text; `None` when unlimited.
fn max_open_files(limits: &str) -> Option<u64> {
    let line = limits
        .lines()
        .find_map(|l| l.strip_prefix("Max open files"))?;
    line.split_whitespace().next()?.parse().ok()
}

/// When the machine booted, in seconds since the Unix epoch (`btime` of `/proc/stat`).
fn boot_time(stat: &str) -> Option<u64> {
    let line = stat.lines().find_map(|l| l.strip_prefix("btime "))?;
    line.trim().parse().ok()
}

/// One reading of the process.
#[derive(Debug, Default, Clone)]
struct Reading {
    cpu_seconds: Option<f64>,
    start_time_seconds: Option<f64>,
    resident_bytes: Option<u64>,
    open_fds: Option<u64>,
    max_fds: Option<u64>,
}

impl Reading {
    fn of_this_process() -> Reading {
        let read = |path: &str| std::fs::read_to_string(path).ok();
        let stat = read("/proc/self/stat");
        let stat = stat.as_deref();
        let started = stat
            .and_then(start_ticks)
            .zip(read("/proc/stat").as_deref().and_then(boot_time));
        Reading {
            cpu_seconds: stat
                .and_then(cpu_ticks)
                .map(|t| t as f64 / TICKS_PER_SECOND),
            start_time_seconds: started
                .map(|(ticks, boot)| boot as f64 + ticks as f64 / TICKS_PER_SECOND),
            resident_bytes: read("/proc/self/status")
                .as_deref()
                .and_then(resident_bytes),
            open_fds: std::fs::read_dir("/proc/self/fd")
                .ok()
                .map(|entries| entries.count() as u64),
            max_fds: read("/proc/self/limits")
                .as_deref()
                .and_then(max_open_files),
        }
    }
}

/// Encodes the `process_*` metrics of the last reading [`ProcessCollector::refresh`] took.
#[derive(Debug, Default)]
pub struct ProcessCollector {
    last: Mutex<Reading>,
}

impl ProcessCollector {
    /// Reads the process anew, off the async threads: listing its descriptors takes
    /// milliseconds once thousands of connections are open.
    pub async fn refresh(&self) {
        let reading = tokio::task::spawn_blocking(Reading::of_this_process)
            .await
            .unwrap_or_default();
        *self.last.lock().unwrap_or_else(PoisonError::into_inner) = reading;
    }
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let reading = self
            .last
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if let Some(seconds) = reading.cpu_seconds {
            let cpu = ConstCounter::new(seconds);
            let help = "Total user and system CPU time spent in seconds";
            cpu.encode(encoder.encode_descriptor(
                "process_cpu_seconds",
                help,
                None,
                cpu.metric_type(),
            )?)?;
        }
        let gauges = [
            (
                "process_start_time_seconds",
                "Start time of the process since the Unix epoch in seconds",
                reading.start_time_seconds,
            ),
            (
                "process_resident_memory_bytes",
                "Resident memory size in bytes",
                reading.resident_bytes.map(|b| b as f64),
            ),
            (
                "process_open_fds",
                "Number of open file descriptors",
                reading.open_fds.map(|n| n as f64),
            ),
            (
                "process_max_fds",
                "Maximum number of open file descriptors",
                reading.max_fds.map(|n| n as f64),
            ),
        ];
        for (name, help, value) in gauges {
            if let Some(value) = value {
                let gauge = ConstGauge::new(value);
                gauge.encode(encoder.encode_descriptor(
                    name,
                    help,
                    None,
                    gauge.metric_type(),
                )?)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn figures_are_read_from_the_kernels_texts_whatever_the_command_is_called() {
        // A command name with spaces and a closing parenthesis, as `comm` allows.
        let stat = "4242 (lane (1) x) S 1 4242 4242 0 -1 4194560 1234 0 0 0 731 219 0 0 20 0 9 0 5120 1000000 2000 18446744073709551615";
        assert_eq!(cpu_ticks(stat), Some(731 + 219));
        assert_eq!(start_ticks(stat), Some(5120));
        assert_eq!(cpu_ticks("4242 (cut short) S 1 2 3"), None);
        assert_eq!(cpu_ticks("no name at all"), None);

        let status = "Name:\tonedoor\nVmPeak:\t  90000 kB\nVmRSS:\t   12345 kB\nThreads:\t9\n";
        assert_eq!(resident_bytes(status), Some(12345 * 1024));
        assert_eq!(resident_bytes("Name:\tonedoor\n"), None);

        let limits = "Limit                     Soft Limit           Hard Limit           Units     \nMax cpu time              unlimited            unlimited            seconds   \nMax open files            20000                20000                files     \n";
        assert_eq!(max_open_files(limits), Some(20000));
        let unlimited = limits.replace(
            "20000                20000",
            "unlimited            unlimited",
        );
        assert_eq!(max_open_files(&unlimited), None);

        assert_eq!(
            boot_time("cpu  1 2 3\nbtime 1764892800\nprocesses 9\n"),
            Some(1764892800)
        );
    }

    #[tokio::test]
    async fn the_collector_encodes_its_last_reading_and_nothing_before_one() {
        use prometheus_client::registry::Registry;
        let collector = std::sync::Arc::new(ProcessCollector::default());
        let mut registry = Registry::default();
        registry.register_collector(Box::new(collector.clone()));
        let encode = |registry: &Registry| {
            let mut out = String::new();
            prometheus_client::encoding::text::encode(&mut out, registry).unwrap();
            out
        };
        assert!(!encode(&registry).contains("process_"));
        collector.refresh().await;
        let text = encode(&registry);
        for name in ["process_cpu_seconds_total", "process_resident_memory_bytes"] {
            assert!(text.contains(&format!("\n{name} ")), "{name} in {text}");
        }
    }

    #[test]
    fn this_process_is_read_as_it_is() {
        let reading = Reading::of_this_process();
        let resident = reading.resident_bytes.expect("VmRSS");
        assert!(resident > 1 << 20, "{resident} bytes resident");
        let open = reading.open_fds.expect("/proc/self/fd");
        assert!(open >= 3, "{open} open descriptors");
        assert!(reading.max_fds.is_none_or(|max| max >= open));
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let started = reading.start_time_seconds.expect("start time");
        assert!(
            started <= now + 1.0 && started > now - 3600.0,
            "started {started}, now {now}"
        );
        let spent: u64 = (0..2_000_000u64).map(std::hint::black_box).sum();
        assert!(spent > 0);
        assert!(
            Reading::of_this_process().cpu_seconds.expect("CPU time")
                >= reading.cpu_seconds.unwrap()
        );
    }
}
