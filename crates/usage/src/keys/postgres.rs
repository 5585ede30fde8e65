//! The key tables in the Postgres usage database, over one connection of their own on the
//! gateway's runtime, made again when it drops. Every call is bounded in time.

use std::future::Future;
use std::time::Duration;

use tokio::sync::{MappedMutexGuard, Mutex, MutexGuard};
use tokio::task::JoinHandle;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Config, NoTls, Row};

use super::sql::{self, Value};
use super::{AuditEntry, Change, KeySet, KeyStoreError, StoredKey, StoredSecret};
use crate::record::now_ms;
use crate::store::UsageError;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const QUERY_TIMEOUT: Duration = Duration::from_secs(10);
/// Serialises key changes (and migrations) of every gateway on this database (a fixed key,
/// apart from the usage tables' migration lock).
const KEYS_LOCK: i64 = 0x006b_6579_735f_6f64;

pub struct PostgresKeys {
    url: String,
    connected: Mutex<Option<Connected>>,
}

struct Connected {
    client: Client,
    driver: JoinHandle<()>,
}

impl Drop for Connected {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

async fn within<T, E: Into<UsageError>>(
    call: impl Future<Output = Result<T, E>>,
) -> Result<T, UsageError> {
    match tokio::time::timeout(QUERY_TIMEOUT, call).await {
        Ok(result) => result.map_err(Into::into),
        Err(_) => Err(UsageError::Timeout(QUERY_TIMEOUT)),
    }
}

impl PostgresKeys {
    pub async fn connect(url: &str) -> Result<PostgresKeys, UsageError> {
        let keys = PostgresKeys {
            url: url.to_owned(),
            connected: Mutex::new(None),
        };
        let mut connected = keys.connected.lock().await;
        let mut fresh = open(url).await?;
        migrate(&mut fresh.client).await?;
        *connected = Some(fresh);
        drop(connected);
        Ok(keys)
    }

    /// The client, connected again first if the connection was lost.
    async fn client(&self) -> Result<MappedMutexGuard<'_, Client>, UsageError> {
        let mut connected = self.connected.lock().await;
        if connected.as_ref().is_none_or(|c| c.client.is_closed()) {
            *connected = None;
            *connected = Some(open(&self.url).await?);
        }
        MutexGuard::try_map(connected, |c| c.as_mut().map(|c| &mut c.client))
            .map_err(|_| UsageError::Timeout(CONNECT_TIMEOUT))
    }

    pub async fn version(&self) -> Result<i64, UsageError> {
        let client = self.client().await?;
        let row = within(client.query_one(sql::VERSION, &[])).await?;
        Ok(row.try_get(0)?)
    }

    pub async fn load(&self) -> Result<KeySet, UsageError> {
        let mut client = self.client().await?;
        let tx = within(
            client
                .build_transaction()
                .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
                .start(),
        )
        .await?;
        let version: i64 = within(tx.query_one(sql::VERSION, &[])).await?.try_get(0)?;
        let keys = within(tx.query(sql::KEYS, &[])).await?;
        let secrets = within(tx.query(sql::SECRETS, &[])).await?;
        within(tx.commit()).await?;
        Ok(KeySet {
            keys: keys.iter().map(key).collect::<Result<_, _>>()?,
            secrets: secrets.iter().map(secret).collect::<Result<_, _>>()?,
            version,
        })
    }

    pub async fn apply(&self, change: Change) -> Result<i64, KeyStoreError> {
        let mut client = self.client().await?;
        let tx = within(client.transaction()).await?;
        within(tx.execute("SELECT pg_advisory_xact_lock($1)", &[&KEYS_LOCK])).await?;
        for statement in sql::statements(&change) {
            let values: Vec<Box<dyn ToSql + Sync + Send>> =
                statement.params.iter().map(value).collect();
            let params: Vec<&(dyn ToSql + Sync)> = values
                .iter()
                .map(|v| v.as_ref() as &(dyn ToSql + Sync))
                .collect();
            let text = sql::postgres(statement.sql);
            let changed = within(tx.execute(text.as_str(), &params)).await?;
            if statement.one_row && changed != 1 {
                return Err(KeyStoreError::NoSuchKey(change.write.key_id().to_owned()));
            }
        }
        let seq: i64 = within(tx.query_one(sql::VERSION, &[])).await?.try_get(0)?;
        within(tx.commit()).await?;
        Ok(seq)
    }

    pub async fn audit(&self, limit: i64) -> Result<Vec<AuditEntry>, UsageError> {
        let client = self.client().await?;
        let rows = within(client.query(sql::postgres(sql::AUDIT).as_str(), &[&limit])).await?;
        rows.iter()
            .map(|row| {
                Ok(AuditEntry {
                    seq: row.try_get(0)?,
                    at_ms: row.try_get(1)?,
                    actor: row.try_get(2)?,
                    action: row.try_get(3)?,
                    key_id: row.try_get(4)?,
                    detail: row.try_get(5)?,
                })
            })
            .collect()
    }

    pub async fn touch(&self, used: Vec<(String, i64)>) -> Result<(), UsageError> {
        let client = self.client().await?;
        let text = sql::postgres(sql::TOUCH);
        for (id, at) in &used {
            within(client.execute(text.as_str(), &[at, id])).await?;
        }
        Ok(())
    }
}

async fn open(url: &str) -> Result<Connected, UsageError> {
    let mut config: Config = url.parse()?;
    config.connect_timeout(CONNECT_TIMEOUT);
    config.application_name("onedoor-keys");
    let (client, connection) = within(config.connect(NoTls)).await?;
    let driver = tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::debug!(%error, "the key store connection ended");
        }
    });
    Ok(Connected { client, driver })
}

async fn migrate(client: &mut Client) -> Result<(), UsageError> {
    let tx = within(client.transaction()).await?;
    within(tx.execute("SELECT pg_advisory_xact_lock($1)", &[&KEYS_LOCK])).await?;
    within(tx.batch_execute(sql::CREATE_VERSION_TABLE)).await?;
    let current: i64 = within(tx.query_one(sql::CURRENT_VERSION, &[]))
        .await?
        .try_get(0)?;
    if current > sql::latest() {
        return Err(UsageError::NewerSchema {
            found: current,
            known: sql::latest(),
        });
    }
    let record = sql::postgres(sql::RECORD_VERSION);
    for (version, text) in (1i64..).zip(sql::MIGRATIONS).skip(current as usize) {
        within(tx.batch_execute(text)).await?;
        let at = now_ms() as i64;
        within(tx.execute(record.as_str(), &[&version, &at])).await?;
    }
    within(tx.commit()).await
}

fn key(row: &Row) -> Result<StoredKey, tokio_postgres::Error> {
    Ok(StoredKey {
        id: row.try_get(0)?,
        tenant: row.try_get(1)?,
        name: row.try_get(2)?,
        settings: row.try_get(3)?,
        created_at_ms: row.try_get(4)?,
        updated_at_ms: row.try_get(5)?,
        last_used_ms: row.try_get(6)?,
    })
}

fn secret(row: &Row) -> Result<StoredSecret, tokio_postgres::Error> {
    Ok(StoredSecret {
        sha256: row.try_get(0)?,
        key_id: row.try_get(1)?,
        valid_until_ms: row.try_get(2)?,
    })
}

fn value(value: &Value) -> Box<dyn ToSql + Sync + Send> {
    match value {
        Value::Int(n) => Box::new(*n),
        Value::Text(t) => Box::new(t.clone()),
        Value::MaybeText(t) => Box::new(t.clone()),
    }
}
