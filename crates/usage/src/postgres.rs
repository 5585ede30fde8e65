//! The Postgres store, for many gateway instances sharing one usage table: one multi-row insert
//! per batch over one connection. Every call is bounded in time, so a store that hangs is treated
//! like one that is down and records go to the journal instead of waiting.

use std::future::Future;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Config, NoTls};

use crate::record::{now_ms, UsageRecord};
use crate::report::{ReportQuery, ReportRow};
use crate::schema::{self, Row};
use crate::store::UsageError;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const QUERY_TIMEOUT: Duration = Duration::from_secs(10);
/// Serialises migrations of gateways starting at the same time (an arbitrary, fixed key).
const MIGRATION_LOCK: i64 = 0x006f_6e65_646f_6f72;

pub struct PostgresStore {
    client: Client,
    /// Drives the connection; aborted when the store is dropped.
    connection: JoinHandle<()>,
}

impl Drop for PostgresStore {
    fn drop(&mut self) {
        self.connection.abort();
    }
}

async fn within<T, E: Into<UsageError>>(
    limit: Duration,
    call: impl Future<Output = Result<T, E>>,
) -> Result<T, UsageError> {
    match tokio::time::timeout(limit, call).await {
        Ok(result) => result.map_err(Into::into),
        Err(_) => Err(UsageError::Timeout(limit)),
    }
}

impl PostgresStore {
    /// Connects to `url` and brings its tables up to date. Must run inside a tokio runtime.
    pub async fn connect(url: &str) -> Result<PostgresStore, UsageError> {
        let mut config: Config = url.parse()?;
        config.connect_timeout(CONNECT_TIMEOUT);
        config.application_name("onedoor");
        let (client, connection) = within(
            CONNECT_TIMEOUT + Duration::from_secs(1),
            config.connect(NoTls),
        )
        .await?;
        let connection = tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(%error, "the usage store connection ended");
            }
        });
        let mut store = PostgresStore { client, connection };
        store.migrate().await?;
        Ok(store)
    }

    /// Whether the connection is gone (the server stopped or restarted).
    pub fn is_closed(&self) -> bool {
        self.client.is_closed()
    }

    async fn migrate(&mut self) -> Result<(), UsageError> {
        let tx = within(QUERY_TIMEOUT, self.client.transaction()).await?;
        within(
            QUERY_TIMEOUT,
            tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK]),
        )
        .await?;
        within(
            QUERY_TIMEOUT,
            tx.batch_execute(schema::CREATE_VERSION_TABLE),
        )
        .await?;
        let row = within(
            QUERY_TIMEOUT,
            tx.query_one(
                "SELECT COALESCE(MAX(version), 0)::BIGINT FROM schema_version",
                &[],
            ),
        )
        .await?;
        let current: i64 = row.try_get(0)?;
        if current > schema::latest() {
            return Err(UsageError::NewerSchema {
                found: current,
                known: schema::latest(),
            });
        }
        for (version, sql) in (1i64..).zip(schema::MIGRATIONS).skip(current as usize) {
            within(QUERY_TIMEOUT, tx.batch_execute(sql)).await?;
            within(
                QUERY_TIMEOUT,
                tx.execute(
                    "INSERT INTO schema_version (version, applied_at_ms) VALUES ($1, $2)",
                    &[&version, &schema::int(now_ms())],
                ),
            )
            .await?;
        }
        within(QUERY_TIMEOUT, tx.commit()).await
    }

    /// Writes `records` in one statement; a request id already stored keeps its row. Returns
    /// how many rows were new.
    pub async fn insert(&self, records: &[UsageRecord]) -> Result<u64, UsageError> {
        if records.is_empty() {
            return Ok(0);
        }
        let rows: Vec<Row> = records.iter().map(Row::of).collect();
        let mut params: Vec<&(dyn ToSql + Sync)> =
            Vec::with_capacity(rows.len() * schema::COLUMNS.len());
        for r in &rows {
            params.extend_from_slice(&[
                &r.request_id,
                &r.at_ms,
                &r.day,
                &r.tenant,
                &r.key_id,
                &r.alias,
                &r.backend,
                &r.model,
                &r.region,
                &r.status,
                &r.input_tokens,
                &r.output_tokens,
                &r.cached_tokens,
                &r.source,
                &r.estimated_tokens,
                &r.cost_usd,
                &r.duration_ms,
                &r.ttft_ms,
                &r.attempts,
                &r.attempt_trail,
                &r.stream,
                &r.stream_cut,
                &r.cache_write_tokens,
                &r.error,
                &r.lines,
            ]);
        }
        let sql = schema::insert(rows.len(), |n| format!("${n}"));
        within(QUERY_TIMEOUT, self.client.execute(&sql, &params)).await
    }

    pub async fn report(&self, query: &ReportQuery) -> Result<Vec<ReportRow>, UsageError> {
        let (sql, bounds) = query.sql(|n| format!("${n}"));
        let rows = within(
            QUERY_TIMEOUT,
            self.client.query(&sql, &[&bounds[0], &bounds[1]]),
        )
        .await?;
        let groups = query.by.len();
        let mut report = Vec::with_capacity(rows.len());
        for row in rows {
            let mut group = Vec::with_capacity(groups);
            for i in 0..groups {
                group.push(row.try_get::<_, String>(i)?);
            }
            let mut numbers = [0i64; 7];
            for (i, number) in numbers.iter_mut().enumerate() {
                *number = row.try_get(groups + i)?;
            }
            let cost: f64 = row.try_get(groups + 7)?;
            report.push(ReportRow::from_measures(group, numbers, cost));
        }
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing;

    /// Every column of the stored rows as text, `null` for NULL, in [`schema::COLUMNS`] order.
    async fn stored(store: &PostgresStore, ids: &[&str]) -> Vec<String> {
        let columns: Vec<String> = schema::COLUMNS
            .iter()
            .map(|c| format!("COALESCE({c}::TEXT, 'null')"))
            .collect();
        let sql = format!(
            "SELECT {} FROM usage_records WHERE request_id = ANY($1) ORDER BY request_id",
            columns.join(" || '|' || ")
        );
        let rows = store.client.query(&sql, &[&ids]).await.unwrap();
        rows.iter().map(|row| row.get(0)).collect()
    }

    #[tokio::test]
    async fn every_field_lands_in_its_column() {
        let url = testing::fresh_database(testing::MACHINE_POSTGRES, "columns")
            .await
            .unwrap_or_else(|message| panic!("{message}"));
        let store = PostgresStore::connect(&url).await.unwrap();
        let mut record = crate::testing_record("cols");
        record.backend = None;
        let many: Vec<UsageRecord> = (0..32)
            .map(|i| crate::testing_record(&format!("many-{i:02}")))
            .collect();
        assert_eq!(
            store.insert(std::slice::from_ref(&record)).await.unwrap(),
            1
        );
        assert_eq!(store.insert(&many).await.unwrap(), 32);
        let rows = stored(&store, &["cols", "many-31"]).await;
        drop(store);
        testing::drop_database(testing::MACHINE_POSTGRES, &url).await;
        let fields = "1796083200000|2026-12-01|legal|legal-prod|chat";
        let rest = "gpt-4o|francecentral|200|100|20|10|measured|150|0.00045|800|120|1|sub1-fr=200|true|false|5|null|null";
        assert_eq!(
            rows,
            [
                format!("cols|{fields}|null|{rest}"),
                format!("many-31|{fields}|sub1-fr|{rest}"),
            ]
        );
    }
}
