//! The usage tables and their migrations, one SQL text for SQLite and Postgres alike (types both
//! understand: `BIGINT`, `DOUBLE PRECISION`, `BOOLEAN`, `TEXT`). A store records each migration
//! it applied in `schema_version`; a new migration is a new entry at the end of [`MIGRATIONS`],
//! never an edit of an old one.

use crate::record::UsageRecord;

/// Every migration, in order; the version of a migration is its position, from 1.
pub const MIGRATIONS: &[&str] = &[
    // 1: one row per request.
    "CREATE TABLE usage_records (
        request_id TEXT PRIMARY KEY,
        at_ms BIGINT NOT NULL,
        day TEXT NOT NULL,
        tenant TEXT NOT NULL,
        key_id TEXT NOT NULL,
        alias TEXT NOT NULL,
        backend TEXT,
        model TEXT,
        region TEXT,
        status INTEGER NOT NULL,
        input_tokens BIGINT NOT NULL,
        output_tokens BIGINT NOT NULL,
        cached_tokens BIGINT NOT NULL,
        source TEXT NOT NULL,
        estimated_tokens BIGINT NOT NULL,
        cost_usd DOUBLE PRECISION NOT NULL,
        duration_ms BIGINT NOT NULL,
        ttft_ms BIGINT,
        attempts INTEGER NOT NULL,
        attempt_trail TEXT NOT NULL,
        stream BOOLEAN NOT NULL,
        stream_cut BOOLEAN NOT NULL
    );
    CREATE INDEX usage_records_at ON usage_records (at_ms);",
    // 2: the input tokens written to a prompt cache (part of input_tokens, like cached_tokens).
    "ALTER TABLE usage_records ADD COLUMN cache_write_tokens BIGINT NOT NULL DEFAULT 0;",
    // 3: the error code a request ended with.
    "ALTER TABLE usage_records ADD COLUMN error TEXT;",
    // 4: the requests a batch's record stands for; NULL for one request.
    "ALTER TABLE usage_records ADD COLUMN lines BIGINT;",
];

/// The version a store is at once every migration is applied.
pub fn latest() -> i64 {
    MIGRATIONS.len() as i64
}

pub const CREATE_VERSION_TABLE: &str = "CREATE TABLE IF NOT EXISTS schema_version (
    version BIGINT PRIMARY KEY,
    applied_at_ms BIGINT NOT NULL
)";

/// The columns of `usage_records` an insert fills, in the order stores bind them.
pub const COLUMNS: &[&str] = &[
    "request_id",
    "at_ms",
    "day",
    "tenant",
    "key_id",
    "alias",
    "backend",
    "model",
    "region",
    "status",
    "input_tokens",
    "output_tokens",
    "cached_tokens",
    "source",
    "estimated_tokens",
    "cost_usd",
    "duration_ms",
    "ttft_ms",
    "attempts",
    "attempt_trail",
    "stream",
    "stream_cut",
    "cache_write_tokens",
    "error",
    "lines",
];

/// An insert of `rows` records that keeps the row already there for a request id;
/// `placeholder(n)` spells the n-th parameter (from 1) in the store's dialect.
pub fn insert(rows: usize, placeholder: impl Fn(usize) -> String) -> String {
    let mut sql = format!("INSERT INTO usage_records ({}) VALUES ", COLUMNS.join(", "));
    for row in 0..rows {
        if row > 0 {
            sql.push_str(", ");
        }
        sql.push('(');
        for column in 0..COLUMNS.len() {
            if column > 0 {
                sql.push_str(", ");
            }
            sql.push_str(&placeholder(row * COLUMNS.len() + column + 1));
        }
        sql.push(')');
    }
    sql.push_str(" ON CONFLICT (request_id) DO NOTHING");
    sql
}

/// A number as the stores keep it (`BIGINT` is signed).
pub fn int(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// One record as the stores bind it, field for field in [`COLUMNS`] order.
pub struct Row<'a> {
    pub request_id: &'a str,
    pub at_ms: i64,
    pub day: String,
    pub tenant: &'a str,
    pub key_id: &'a str,
    pub alias: &'a str,
    pub backend: Option<&'a str>,
    pub model: Option<&'a str>,
    pub region: Option<&'a str>,
    pub status: i32,
    pub input_tokens: i64,
    pub output_tokens: i64,
    pub cached_tokens: i64,
    pub source: &'static str,
    pub estimated_tokens: i64,
    pub cost_usd: f64,
    pub duration_ms: i64,
    pub ttft_ms: Option<i64>,
    pub attempts: i32,
    pub attempt_trail: &'a str,
    pub stream: bool,
    pub stream_cut: bool,
    pub cache_write_tokens: i64,
    pub error: Option<&'a str>,
    pub lines: Option<i64>,
}

impl<'a> Row<'a> {
    pub fn of(record: &'a UsageRecord) -> Row<'a> {
        Row {
            request_id: &record.request_id,
            at_ms: int(record.at_ms),
            day: record.day(),
            tenant: &record.tenant,
            key_id: &record.key_id,
            alias: &record.alias,
            backend: record.backend.as_deref(),
            model: record.model.as_deref(),
            region: record.region.as_deref(),
            status: i32::from(record.status),
            input_tokens: int(record.tokens.input),
            output_tokens: int(record.tokens.output),
            cached_tokens: int(record.tokens.cached),
            source: record.tokens.source.as_str(),
            estimated_tokens: int(record.estimated_tokens),
            cost_usd: record.cost_usd,
            duration_ms: int(record.duration_ms),
            ttft_ms: record.ttft_ms.map(int),
            attempts: i32::try_from(record.attempt_count()).unwrap_or(i32::MAX),
            attempt_trail: &record.attempts,
            stream: record.stream,
            stream_cut: record.stream_cut,
            cache_write_tokens: int(record.tokens.cache_write),
            error: record.error.as_deref(),
            lines: record.lines.map(int),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_insert_numbers_every_parameter_and_keeps_existing_rows() {
        let sql = insert(2, |n| format!("${n}"));
        assert!(sql.contains("($1, $2,"), "{sql}");
        assert!(sql.contains("$25), ($26,"), "{sql}");
        assert!(
            sql.ends_with("$50) ON CONFLICT (request_id) DO NOTHING"),
            "{sql}"
        );
    }
}
