//! The `batch` section: how the files and batches surface treats what it holds. Open batches are
//! polled on their backends every `poll_interval` (and on each client read); an uploaded input
//! file may be at most `max_file_bytes` and `max_lines` long.

use std::time::Duration;

use crate::model::BatchSettings;
use crate::problems::Problems;
use crate::read::{self, Fields};
use crate::tree::Node;

pub(crate) fn batch(node: Option<&Node>, p: &mut Problems) -> BatchSettings {
    let f = Fields::open(node, &["poll_interval", "max_file_bytes", "max_lines"], p);
    let defaults = BatchSettings::default();
    let poll_interval = f
        .get("poll_interval")
        .and_then(|n| read::positive_duration(n, p));
    let max_file_bytes = f.get("max_file_bytes").and_then(|n| read::size(n, p));
    let max_lines = f.get("max_lines").and_then(|n| read::int(n, 1, p));
    BatchSettings {
        poll_interval: poll_interval.unwrap_or(defaults.poll_interval),
        max_file_bytes: max_file_bytes.unwrap_or(defaults.max_file_bytes),
        max_lines: max_lines.unwrap_or(defaults.max_lines),
    }
}

impl Default for BatchSettings {
    fn default() -> Self {
        BatchSettings {
            poll_interval: Duration::from_secs(30),
            max_file_bytes: 32 << 20,
            max_lines: 50_000,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::testing::{compile, problems};

    #[test]
    fn open_batches_are_polled_every_thirty_seconds_by_default() {
        let s = compile("");
        assert_eq!(s.batch.poll_interval, Duration::from_secs(30));
        assert_eq!(s.batch.max_file_bytes, 32 << 20);
        let s = compile("batch: { poll_interval: 250ms, max_file_bytes: 1MiB, max_lines: 10 }");
        assert_eq!(s.batch.poll_interval, Duration::from_millis(250));
        assert_eq!((s.batch.max_file_bytes, s.batch.max_lines), (1 << 20, 10));
    }

    #[test]
    fn the_interval_must_be_positive() {
        assert_eq!(
            problems("batch: { poll_interval: 0s }\n"),
            ["1:25: must be longer than zero"]
        );
    }
}
