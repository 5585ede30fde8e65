//! Chargeback (`onedoor usage report`): requests, tokens and cost per group over a time range,
//! with how far the gateway's token estimates drifted from what upstreams measured. One SQL text
//! serves both stores; this module also prints the result as a table, CSV or JSON.

use std::fmt::Write as _;
use std::time::UNIX_EPOCH;

use serde_json::{json, Value};

use crate::postgres::PostgresStore;
use crate::sqlite::SqliteStore;
use crate::store::{StoreUrl, UsageError};

/// What a report's rows are grouped by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupBy {
    Tenant,
    Alias,
    Backend,
    /// The deployment or model name sent upstream.
    Model,
    /// The UTC day.
    Day,
    /// The UTC month.
    Month,
    /// `batch` for a batch's record (its request id is the batch's `batch_…` id), `request` for
    /// a synchronous request's: batch spend beside synchronous spend.
    Kind,
}

impl GroupBy {
    pub const ALL: [GroupBy; 7] = [
        GroupBy::Tenant,
        GroupBy::Alias,
        GroupBy::Backend,
        GroupBy::Model,
        GroupBy::Day,
        GroupBy::Month,
        GroupBy::Kind,
    ];

    pub fn name(self) -> &'static str {
        match self {
            GroupBy::Tenant => "tenant",
            GroupBy::Alias => "alias",
            GroupBy::Backend => "backend",
            GroupBy::Model => "model",
            GroupBy::Day => "day",
            GroupBy::Month => "month",
            GroupBy::Kind => "kind",
        }
    }

    /// The SQL expression of the group; records without a backend (nothing answered) are `-`.
    fn expression(self) -> &'static str {
        match self {
            GroupBy::Tenant => "tenant",
            GroupBy::Alias => "alias",
            GroupBy::Backend => "COALESCE(backend, '-')",
            GroupBy::Model => "COALESCE(model, '-')",
            GroupBy::Day => "day",
            GroupBy::Month => "substr(day, 1, 7)",
            GroupBy::Kind => {
                "CASE WHEN substr(request_id, 1, 6) = 'batch_' THEN 'batch' ELSE 'request' END"
            }
        }
    }

    /// A comma-separated list such as `tenant,model,day`; empty means one total.
    pub fn parse_list(text: &str) -> Result<Vec<GroupBy>, String> {
        let mut list = Vec::new();
        for word in text.split(',').map(str::trim).filter(|w| !w.is_empty()) {
            let Some(group) = GroupBy::ALL.into_iter().find(|g| g.name() == word) else {
                let names: Vec<&str> = GroupBy::ALL.iter().map(|g| g.name()).collect();
                return Err(format!(
                    "--by: unknown group `{word}`; expected some of {}",
                    names.join(",")
                ));
            };
            if list.contains(&group) {
                return Err(format!("--by: `{word}` is listed twice"));
            }
            list.push(group);
        }
        Ok(list)
    }
}

/// Which records a report covers and how it groups them. Times are Unix milliseconds; `since`
/// is inclusive, `until` exclusive.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReportQuery {
    pub since_ms: Option<u64>,
    pub until_ms: Option<u64>,
    pub by: Vec<GroupBy>,
}

impl ReportQuery {
    /// The query in a store's dialect (`placeholder(n)` spells parameter n) and its two
    /// parameters, the time bounds.
    pub(crate) fn sql(&self, placeholder: impl Fn(usize) -> String) -> (String, [i64; 2]) {
        let groups: Vec<&str> = self.by.iter().map(|g| g.expression()).collect();
        let sum = |expression: &str| format!("CAST(COALESCE(SUM({expression}), 0) AS BIGINT)");
        let mut columns: Vec<String> = groups.iter().map(|g| (*g).to_owned()).collect();
        columns.extend([
            "COUNT(*)".to_owned(),
            sum("input_tokens"),
            sum("output_tokens"),
            sum("cached_tokens"),
            sum("CASE WHEN source = 'estimated' THEN 1 ELSE 0 END"),
            sum("CASE WHEN source = 'measured' THEN estimated_tokens ELSE 0 END"),
            sum("CASE WHEN source = 'measured' THEN input_tokens + output_tokens ELSE 0 END"),
            "CAST(COALESCE(SUM(cost_usd), 0) AS DOUBLE PRECISION)".to_owned(),
        ]);
        let mut sql = format!(
            "SELECT {} FROM usage_records WHERE at_ms >= {} AND at_ms < {}",
            columns.join(", "),
            placeholder(1),
            placeholder(2)
        );
        if !groups.is_empty() {
            let list = groups.join(", ");
            let _ = write!(sql, " GROUP BY {list} ORDER BY {list}");
        }
        let bound = |ms: Option<u64>, default: i64| ms.map_or(default, crate::schema::int);
        (
            sql,
            [bound(self.since_ms, 0), bound(self.until_ms, i64::MAX)],
        )
    }
}

/// The totals of one group.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReportRow {
    /// One value per [`ReportQuery::by`] entry, in its order.
    pub group: Vec<String>,
    pub requests: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cached_tokens: u64,
    /// Requests whose tokens the gateway estimated (the upstream sent no usage).
    pub estimated_requests: u64,
    /// On the measured requests: what the gateway had estimated, and what was measured.
    pub estimate_on_measured: u64,
    pub measured_tokens: u64,
    pub cost_usd: f64,
}

impl ReportRow {
    /// How far the estimate was off the measured tokens, as a fraction of the measured
    /// (`0.25`: estimated 25 % too high); `None` without measured tokens.
    pub fn drift(&self) -> Option<f64> {
        (self.measured_tokens > 0).then(|| {
            (self.estimate_on_measured as f64 - self.measured_tokens as f64)
                / self.measured_tokens as f64
        })
    }

    pub fn total_tokens(&self) -> u64 {
        self.input_tokens + self.output_tokens
    }

    /// The measures of a result row whose group values came first: the eight numbers in the
    /// order [`ReportQuery::sql`] selects them.
    pub(crate) fn from_measures(group: Vec<String>, numbers: [i64; 7], cost_usd: f64) -> Self {
        let n = |i: usize| u64::try_from(numbers[i]).unwrap_or(0);
        ReportRow {
            group,
            requests: n(0),
            input_tokens: n(1),
            output_tokens: n(2),
            cached_tokens: n(3),
            estimated_requests: n(4),
            estimate_on_measured: n(5),
            measured_tokens: n(6),
            cost_usd,
        }
    }

    fn add(&mut self, other: &ReportRow) {
        self.requests += other.requests;
        self.input_tokens += other.input_tokens;
        self.output_tokens += other.output_tokens;
        self.cached_tokens += other.cached_tokens;
        self.estimated_requests += other.estimated_requests;
        self.estimate_on_measured += other.estimate_on_measured;
        self.measured_tokens += other.measured_tokens;
        self.cost_usd += other.cost_usd;
    }
}

/// A finished report: its rows in group order, and their sum.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    pub by: Vec<GroupBy>,
    pub rows: Vec<ReportRow>,
    pub total: ReportRow,
}

/// The measure columns every format prints after the group columns.
const MEASURES: [&str; 9] = [
    "requests",
    "input_tokens",
    "output_tokens",
    "cached_tokens",
    "total_tokens",
    "cost_usd",
    "estimated_requests",
    "estimate_drift",
    "measured_tokens",
];

impl Report {
    pub fn new(by: Vec<GroupBy>, rows: Vec<ReportRow>) -> Report {
        let mut total = ReportRow::default();
        for row in &rows {
            total.add(row);
        }
        // Without groups the store answers one row, which is the total itself.
        let rows = match by.is_empty() {
            true => Vec::new(),
            false => rows,
        };
        Report { by, rows, total }
    }

    fn header(&self) -> Vec<&'static str> {
        let mut header: Vec<&str> = self.by.iter().map(|g| g.name()).collect();
        header.extend(MEASURES);
        header
    }

    fn cells(row: &ReportRow, group: &[String]) -> Vec<String> {
        let mut cells = group.to_vec();
        cells.extend([
            row.requests.to_string(),
            row.input_tokens.to_string(),
            row.output_tokens.to_string(),
            row.cached_tokens.to_string(),
            row.total_tokens().to_string(),
            format!("{:.6}", row.cost_usd),
            row.estimated_requests.to_string(),
            row.drift()
                .map_or_else(|| "-".to_owned(), |d| format!("{:+.1}%", d * 100.0)),
            row.measured_tokens.to_string(),
        ]);
        cells
    }

    /// Aligned columns, the groups first, then a `total` line.
    pub fn table(&self) -> String {
        let mut lines = vec![self.header().iter().map(|h| h.to_string()).collect()];
        for row in &self.rows {
            lines.push(Self::cells(row, &row.group));
        }
        let mut total_label = vec![String::new(); self.by.len()];
        if let Some(first) = total_label.first_mut() {
            *first = "total".to_owned();
        }
        lines.push(Self::cells(&self.total, &total_label));
        let widths: Vec<usize> = (0..lines[0].len())
            .map(|c| lines.iter().map(|l| l[c].len()).max().unwrap_or(0))
            .collect();
        let groups = self.by.len();
        let mut out = String::new();
        for (i, line) in lines.iter().enumerate() {
            if i == lines.len() - 1 && !self.rows.is_empty() {
                let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
                let _ = writeln!(out, "{}", rule.join("  "));
            }
            let cells: Vec<String> = line
                .iter()
                .enumerate()
                .map(|(c, cell)| match c < groups {
                    true => format!("{cell:<width$}", width = widths[c]),
                    false => format!("{cell:>width$}", width = widths[c]),
                })
                .collect();
            let _ = writeln!(out, "{}", cells.join("  ").trim_end());
        }
        out
    }

    /// One header line and one line per group (no total line: a sum is one formula away).
    pub fn csv(&self) -> String {
        let mut out = self.header().join(",");
        out.push('\n');
        let rows: Vec<&ReportRow> = match self.by.is_empty() {
            true => vec![&self.total],
            false => self.rows.iter().collect(),
        };
        for row in rows {
            let cells: Vec<String> = Self::cells(row, &row.group)
                .into_iter()
                .map(|cell| csv_cell(&cell))
                .collect();
            out.push_str(&cells.join(","));
            out.push('\n');
        }
        out
    }

    /// `{"by": [...], "rows": [...], "total": {...}}`, numbers as numbers (drift a fraction).
    pub fn json(&self) -> Value {
        let object = |row: &ReportRow| {
            let mut value = json!({
                "requests": row.requests,
                "input_tokens": row.input_tokens,
                "output_tokens": row.output_tokens,
                "cached_tokens": row.cached_tokens,
                "total_tokens": row.total_tokens(),
                "cost_usd": (row.cost_usd * 1e9).round() / 1e9,
                "estimated_requests": row.estimated_requests,
                "estimate_drift": row.drift(),
                "measured_tokens": row.measured_tokens,
            });
            for (group, name) in self.by.iter().zip(&row.group) {
                value[group.name()] = json!(name);
            }
            value
        };
        json!({
            "by": self.by.iter().map(|g| g.name()).collect::<Vec<_>>(),
            "rows": self.rows.iter().map(object).collect::<Vec<_>>(),
            "total": object(&self.total),
        })
    }
}

fn csv_cell(cell: &str) -> String {
    match cell.contains([',', '"', '\n', '\r']) {
        true => format!("\"{}\"", cell.replace('"', "\"\"")),
        false => cell.to_owned(),
    }
}

/// The report of `query` over the records in `store`. An SQLite file that does not exist is an
/// error rather than an empty report: the path is more likely wrong than the fleet idle.
pub async fn report(store: &StoreUrl, query: &ReportQuery) -> Result<Report, UsageError> {
    let rows = match store {
        StoreUrl::Off => return Err(UsageError::Off),
        StoreUrl::Sqlite(path) => SqliteStore::open_existing(path)?.report(query)?,
        StoreUrl::Postgres(url) => PostgresStore::connect(url).await?.report(query).await?,
    };
    Ok(Report::new(query.by.clone(), rows))
}

/// The start of a `--since` bound: `YYYY-MM-DD` (that day's midnight, UTC) or an RFC 3339 time.
pub fn parse_since(text: &str) -> Result<u64, String> {
    parse_time(text, false)
}

/// The end of an `--until` bound: `YYYY-MM-DD` includes that whole day (UTC); an RFC 3339 time
/// is the exact, excluded end.
pub fn parse_until(text: &str) -> Result<u64, String> {
    parse_time(text, true)
}

fn parse_time(text: &str, end_of_day: bool) -> Result<u64, String> {
    let text = text.trim();
    let is_date = text.len() == 10 && text.as_bytes().get(4) == Some(&b'-');
    let parsed = match is_date {
        true => humantime::parse_rfc3339(&format!("{text}T00:00:00Z")),
        false => humantime::parse_rfc3339_weak(text),
    };
    let time = parsed.map_err(|_| {
        format!("`{text}` is not a date: expected YYYY-MM-DD or an RFC 3339 time like 2026-01-31T12:00:00Z")
    })?;
    let ms = time
        .duration_since(UNIX_EPOCH)
        .map_err(|_| format!("`{text}` is before 1970"))?
        .as_millis();
    let ms = u64::try_from(ms).unwrap_or(u64::MAX);
    Ok(match is_date && end_of_day {
        true => ms + 86_400_000,
        false => ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_are_read_from_a_list() {
        assert_eq!(
            GroupBy::parse_list("tenant, model,day").unwrap(),
            [GroupBy::Tenant, GroupBy::Model, GroupBy::Day]
        );
        assert_eq!(GroupBy::parse_list("").unwrap(), []);
        assert!(GroupBy::parse_list("tenant,week")
            .unwrap_err()
            .contains("unknown group `week`"));
        assert!(GroupBy::parse_list("day,day").is_err());
    }

    #[test]
    fn dates_bound_whole_utc_days() {
        let since = parse_since("2026-12-01").unwrap();
        assert_eq!(since, 1_796_083_200_000);
        assert_eq!(parse_until("2026-12-01").unwrap(), since + 86_400_000);
        assert_eq!(
            parse_until("2026-12-01T12:00:00Z").unwrap(),
            since + 43_200_000
        );
        assert!(parse_since("yesterday").is_err());
    }

    #[test]
    fn drift_is_the_estimate_over_the_measured() {
        let row = ReportRow {
            estimate_on_measured: 1_250,
            measured_tokens: 1_000,
            ..ReportRow::default()
        };
        assert_eq!(row.drift(), Some(0.25));
        assert_eq!(ReportRow::default().drift(), None);
    }

    fn sample() -> Report {
        let row = |tenant: &str, requests, cost| ReportRow {
            group: vec![tenant.to_owned()],
            requests,
            input_tokens: requests * 10,
            output_tokens: requests * 5,
            estimate_on_measured: requests * 20,
            measured_tokens: requests * 15,
            cost_usd: cost,
            ..ReportRow::default()
        };
        Report::new(
            vec![GroupBy::Tenant],
            vec![row("legal", 2, 0.5), row("ops, eu", 1, 0.25)],
        )
    }

    #[test]
    fn a_table_aligns_groups_and_ends_with_the_total() {
        let table = sample().table();
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 5, "{table}");
        assert!(lines[0].starts_with("tenant   requests"), "{table}");
        assert!(lines[1].starts_with("legal           2"), "{table}");
        assert!(lines[4].starts_with("total           3"), "{table}");
        assert!(lines[4].contains("0.750000"), "{table}");
        assert!(lines[4].contains("+33.3%"), "{table}");
    }

    #[test]
    fn csv_quotes_what_needs_quoting_and_json_keeps_numbers() {
        let report = sample();
        let csv = report.csv();
        assert!(csv.starts_with("tenant,requests,input_tokens"), "{csv}");
        assert!(csv.contains("\n\"ops, eu\",1,10,5,"), "{csv}");
        let json = report.json();
        assert_eq!(json["total"]["requests"], 3);
        assert_eq!(json["rows"][1]["tenant"], "ops, eu");
        assert_eq!(json["total"]["cost_usd"], 0.75);
    }
}
