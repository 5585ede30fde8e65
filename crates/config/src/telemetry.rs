//! The `telemetry` section: OpenTelemetry traces over OTLP/HTTP, off unless `telemetry.otlp` is
//! written. Header values are secrets (collector tokens): problems name the header, never its value.

use std::time::Duration;

use crate::model::{Otlp, Secret, Telemetry};
use crate::problems::Problems;
use crate::read::{self, Fields};
use crate::tree::Node;

pub(crate) const DEFAULT_SERVICE_NAME: &str = "onedoor";
const DEFAULT_EXPORT_INTERVAL: Duration = Duration::from_secs(5);
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
const DEFAULT_MAX_QUEUE: u64 = 2048;
/// Where OTLP/HTTP collectors take spans, under their base URL.
const TRACES_PATH: &str = "/v1/traces";

pub(crate) fn telemetry(node: Option<&Node>, p: &mut Problems) -> Telemetry {
    let f = Fields::open(node, &["otlp"], p);
    Telemetry {
        otlp: f.get("otlp").map(|n| otlp(n, p)),
    }
}

fn otlp(node: &Node, p: &mut Problems) -> Otlp {
    let f = Fields::new(
        node,
        &[
            "endpoint",
            "service_name",
            "headers",
            "sample_ratio",
            "export_interval",
            "timeout",
            "max_queue",
        ],
        p,
    );
    let sample_ratio = f.get("sample_ratio").and_then(|n| {
        let ratio = read::non_negative(n, p)?;
        if ratio > 1.0 {
            p.at(n.mark, "must be between 0 and 1");
            return None;
        }
        Some(ratio)
    });
    Otlp {
        endpoint: f.get("endpoint").and_then(|n| endpoint(n, p)),
        service_name: f
            .get("service_name")
            .and_then(|n| read::name(n, p))
            .unwrap_or(DEFAULT_SERVICE_NAME)
            .to_owned(),
        headers: f.get("headers").map(|n| headers(n, p)).unwrap_or_default(),
        sample_ratio: sample_ratio.unwrap_or(1.0),
        export_interval: f
            .get("export_interval")
            .and_then(|n| read::positive_duration(n, p))
            .unwrap_or(DEFAULT_EXPORT_INTERVAL),
        timeout: f
            .get("timeout")
            .and_then(|n| read::positive_duration(n, p))
            .unwrap_or(DEFAULT_TIMEOUT),
        max_queue: f
            .int("max_queue", 1, p)
            .and_then(|n| usize::try_from(n).ok())
            .unwrap_or(DEFAULT_MAX_QUEUE as usize),
    }
}

/// The collector's base URL, as `OTEL_EXPORTER_OTLP_ENDPOINT` takes it; spans go to its
/// `/v1/traces` (a URL that already ends so is used as written).
fn endpoint(node: &Node, p: &mut Problems) -> Option<String> {
    let text = read::str(node, p)?.trim();
    let authority = ["http://", "https://"]
        .iter()
        .find_map(|scheme| text.strip_prefix(scheme))
        .map(|rest| rest.split(['/', '?', '#']).next().unwrap_or(""));
    if authority.is_none_or(str::is_empty) || text.contains(char::is_whitespace) {
        p.at(
            node.mark,
            "expected the collector's OTLP/HTTP URL, like http://collector:4318",
        );
        return None;
    }
    let base = text.trim_end_matches('/');
    if base.ends_with(TRACES_PATH) {
        return Some(base.to_owned());
    }
    Some(format!("{base}{TRACES_PATH}"))
}

/// Headers sent with every export (a collector's or vendor's token), each value a secret.
fn headers(node: &Node, p: &mut Problems) -> Vec<(String, Secret)> {
    let mut out = Vec::new();
    for (name, key, value) in read::named_entries(node, p) {
        if !name.bytes().all(is_token_byte) {
            p.at(key.mark, format!("{name:?} is not an HTTP header name"));
            continue;
        }
        let Some(secret) = read::secret(value, name, p) else {
            continue;
        };
        let fits = secret
            .expose()
            .bytes()
            .all(|b| b == b'\t' || (b' '..=b'~').contains(&b));
        if !fits {
            p.at(
                value.mark,
                format!("the value of header {name} has characters an HTTP header cannot carry"),
            );
            continue;
        }
        out.push((name.to_ascii_lowercase(), secret));
    }
    out
}

fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::testing::{compile, problems};

    #[test]
    fn telemetry_is_off_unless_otlp_is_written() {
        assert!(compile("").telemetry.otlp.is_none());
        assert!(compile("telemetry: {}").telemetry.otlp.is_none());
    }

    #[test]
    fn an_otlp_section_has_defaults_and_a_traces_url() {
        let otlp = compile("telemetry: { otlp: { endpoint: \"http://collector:4318/\" } }")
            .telemetry
            .otlp
            .unwrap();
        assert_eq!(
            otlp.endpoint.as_deref(),
            Some("http://collector:4318/v1/traces")
        );
        assert_eq!(otlp.service_name, "onedoor");
        assert_eq!(otlp.sample_ratio, 1.0);
        assert_eq!(otlp.export_interval, Duration::from_secs(5));
        assert_eq!(otlp.timeout, Duration::from_secs(10));
        assert_eq!(otlp.max_queue, 2048);
        assert!(otlp.headers.is_empty());
        let otlp = compile(
            "telemetry:\n  otlp:\n    endpoint: https://otel.example.com/v1/traces\n    service_name: edge-gw\n    sample_ratio: 0.25\n    export_interval: 50ms\n    max_queue: 10\n    headers: { Authorization: \"Bearer ${KEY}\" }\n",
        )
        .telemetry
        .otlp
        .unwrap();
        assert_eq!(
            otlp.endpoint.as_deref(),
            Some("https://otel.example.com/v1/traces")
        );
        assert_eq!(otlp.service_name, "edge-gw");
        assert_eq!(otlp.sample_ratio, 0.25);
        assert_eq!(otlp.export_interval, Duration::from_millis(50));
        assert_eq!(otlp.max_queue, 10);
        assert_eq!(otlp.headers[0].0, "authorization");
        assert_eq!(otlp.headers[0].1.expose(), "Bearer secret-key-value");
        let otlp = compile("telemetry: { otlp: {} }").telemetry.otlp.unwrap();
        assert_eq!(otlp.endpoint, None);
    }

    #[test]
    fn the_summary_names_the_collector_host_but_no_path_or_header() {
        let s = compile(
            "telemetry: { otlp: { endpoint: \"https://user@otel.example.com:4318/t/${KEY}\", headers: { x-token: \"${KEY}\" } } }",
        );
        let text = crate::summary(&s);
        assert!(
            text.contains("traces over OTLP to https://otel.example.com:4318."),
            "{text}"
        );
        assert!(
            !text.contains("secret-key-value") && !text.contains("user"),
            "{text}"
        );
        let text = crate::summary(&compile("telemetry: { otlp: {} }"));
        assert!(text.contains("OTEL_EXPORTER_OTLP_ENDPOINT"), "{text}");
    }

    #[test]
    fn wrong_otlp_settings_are_located_and_never_quote_a_header_value() {
        assert_eq!(
            problems(
                "telemetry:\n  otlp:\n    endpoint: collector:4318\n    sample_ratio: 2\n    headers: { \"bad name\": x, x-token: \"${KEY}\\n\" }\n    batch: 1\n"
            ),
            [
                "3:15: expected the collector's OTLP/HTTP URL, like http://collector:4318",
                "4:19: must be between 0 and 1",
                "5:16: \"bad name\" is not an HTTP header name",
                "5:40: the value of header x-token has characters an HTTP header cannot carry",
                "6:5: unknown key \"batch\" (expected one of: endpoint, service_name, headers, sample_ratio, export_interval, timeout, max_queue)",
            ]
        );
    }
}
