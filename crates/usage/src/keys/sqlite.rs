//! The key tables in the SQLite usage file, on a connection of their own (the recorder keeps its
//! own); every call runs on a blocking thread.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rusqlite::types::Value as SqlValue;
use rusqlite::{params, params_from_iter, Connection, TransactionBehavior};

use super::sql::{self, Value};
use super::{AuditEntry, Change, KeySet, KeyStoreError, StoredKey, StoredSecret};
use crate::record::now_ms;
use crate::store::UsageError;

const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

pub struct SqliteKeys {
    connection: Arc<Mutex<Connection>>,
}

impl SqliteKeys {
    pub async fn open(path: &Path) -> Result<SqliteKeys, UsageError> {
        let owned = path.to_path_buf();
        let connection = blocking(move || {
            if let Some(dir) = owned.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir)
                    .map_err(|e| UsageError::Io(format!("cannot create {}", dir.display()), e))?;
            }
            let mut connection = Connection::open(&owned)?;
            connection.busy_timeout(BUSY_TIMEOUT)?;
            let _: String =
                connection
                    .pragma_update_and_check(None, "journal_mode", "WAL", |row| row.get(0))?;
            migrate(&mut connection)?;
            Ok(connection)
        })
        .await?;
        Ok(SqliteKeys {
            connection: Arc::new(Mutex::new(connection)),
        })
    }

    /// Runs `work` on the connection, off the async threads.
    async fn with<T: Send + 'static, E: From<UsageError> + Send + 'static>(
        &self,
        work: impl FnOnce(&mut Connection) -> Result<T, E> + Send + 'static,
    ) -> Result<T, E> {
        let connection = self.connection.clone();
        let joined = tokio::task::spawn_blocking(move || match connection.lock() {
            Ok(mut guard) => work(&mut guard),
            Err(_) => Err(E::from(stopped())),
        })
        .await;
        joined.unwrap_or_else(|_| Err(E::from(stopped())))
    }

    pub async fn version(&self) -> Result<i64, UsageError> {
        self.with(|c| Ok(c.query_row(sql::VERSION, [], |row| row.get(0))?))
            .await
    }

    pub async fn load(&self) -> Result<KeySet, UsageError> {
        self.with(|c| {
            let tx = c.transaction()?;
            let version = tx.query_row(sql::VERSION, [], |row| row.get(0))?;
            let keys = {
                let mut statement = tx.prepare(sql::KEYS)?;
                let rows = statement.query_map([], |row| {
                    Ok(StoredKey {
                        id: row.get(0)?,
                        tenant: row.get(1)?,
                        name: row.get(2)?,
                        settings: row.get(3)?,
                        created_at_ms: row.get(4)?,
                        updated_at_ms: row.get(5)?,
                        last_used_ms: row.get(6)?,
                    })
                })?;
                rows.collect::<Result<Vec<_>, _>>()?
            };
            let secrets = {
                let mut statement = tx.prepare(sql::SECRETS)?;
                let rows = statement.query_map([], |row| {
                    Ok(StoredSecret {
                        sha256: row.get(0)?,
                        key_id: row.get(1)?,
                        valid_until_ms: row.get(2)?,
                    })
                })?;
                rows.collect::<Result<Vec<_>, _>>()?
            };
            Ok(KeySet {
                keys,
                secrets,
                version,
            })
        })
        .await
    }

    pub async fn apply(&self, change: Change) -> Result<i64, KeyStoreError> {
        self.with(move |c| {
            let tx = c.transaction_with_behavior(TransactionBehavior::Immediate)?;
            for statement in sql::statements(&change) {
                let values = statement.params.iter().map(value);
                let changed = tx.execute(statement.sql, params_from_iter(values))?;
                if statement.one_row && changed != 1 {
                    return Err(KeyStoreError::NoSuchKey(change.write.key_id().to_owned()));
                }
            }
            let seq = tx.query_row(sql::VERSION, [], |row| row.get(0))?;
            tx.commit()?;
            Ok(seq)
        })
        .await
    }

    pub async fn audit(&self, limit: i64) -> Result<Vec<AuditEntry>, UsageError> {
        self.with(move |c| {
            let mut statement = c.prepare(sql::AUDIT)?;
            let rows = statement.query_map(params![limit], |row| {
                Ok(AuditEntry {
                    seq: row.get(0)?,
                    at_ms: row.get(1)?,
                    actor: row.get(2)?,
                    action: row.get(3)?,
                    key_id: row.get(4)?,
                    detail: row.get(5)?,
                })
            })?;
            Ok(rows.collect::<Result<Vec<_>, _>>()?)
        })
        .await
    }

    pub async fn touch(&self, used: Vec<(String, i64)>) -> Result<(), UsageError> {
        self.with(move |c| {
            let tx = c.transaction()?;
            for (id, at) in &used {
                tx.execute(sql::TOUCH, params![at, id])?;
            }
            tx.commit()?;
            Ok(())
        })
        .await
    }
}

fn migrate(connection: &mut Connection) -> Result<(), UsageError> {
    let tx = connection.transaction_with_behavior(TransactionBehavior::Immediate)?;
    tx.execute_batch(sql::CREATE_VERSION_TABLE)?;
    let current: i64 = tx.query_row(sql::CURRENT_VERSION, [], |row| row.get(0))?;
    if current > sql::latest() {
        return Err(UsageError::NewerSchema {
            found: current,
            known: sql::latest(),
        });
    }
    for (version, text) in (1i64..).zip(sql::MIGRATIONS).skip(current as usize) {
        tx.execute_batch(text)?;
        tx.execute(sql::RECORD_VERSION, params![version, now_ms() as i64])?;
    }
    tx.commit()?;
    Ok(())
}

fn value(value: &Value) -> SqlValue {
    match value {
        Value::Int(n) => SqlValue::Integer(*n),
        Value::Text(t) => SqlValue::Text(t.clone()),
        Value::MaybeText(t) => t.clone().map_or(SqlValue::Null, SqlValue::Text),
    }
}

async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, UsageError> + Send + 'static,
) -> Result<T, UsageError> {
    tokio::task::spawn_blocking(work)
        .await
        .unwrap_or_else(|_| Err(stopped()))
}

fn stopped() -> UsageError {
    UsageError::Io(
        "the key store's connection".into(),
        std::io::Error::other("a thread that used it stopped"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::KeyWrite;

    fn change(write: KeyWrite, at_ms: i64) -> Change {
        Change {
            write,
            actor: "test".into(),
            at_ms,
            detail: "{}".into(),
        }
    }

    #[tokio::test]
    async fn each_change_is_one_audit_record_and_a_rotation_shortens_every_older_grace() {
        let dir = std::env::temp_dir().join(format!("onedoor-keys-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let store = SqliteKeys::open(&dir.join("usage.db")).await.unwrap();
        assert_eq!(store.version().await.unwrap(), 0);
        let key = StoredKey {
            id: "k1".into(),
            tenant: "t".into(),
            name: None,
            settings: "{}".into(),
            created_at_ms: 1,
            updated_at_ms: 1,
            last_used_ms: None,
        };
        let sha = |n: u8| format!("{n:02x}").repeat(32);
        store
            .apply(change(
                KeyWrite::Create {
                    key,
                    sha256: sha(1),
                },
                1,
            ))
            .await
            .unwrap();
        let rotate = |sha256: String, until: i64, at: i64| {
            let write = KeyWrite::Rotate {
                id: "k1".into(),
                sha256,
                old_valid_until_ms: until,
            };
            change(write, at)
        };
        store.apply(rotate(sha(2), 1_000, 10)).await.unwrap();
        // A shorter grace shortens the first secret's too; a longer one would not lengthen it.
        store.apply(rotate(sha(3), 500, 20)).await.unwrap();
        let set = store.load().await.unwrap();
        let mut secrets: Vec<(String, Option<i64>)> = set
            .secrets
            .iter()
            .map(|s| (s.sha256.clone(), s.valid_until_ms))
            .collect();
        secrets.sort();
        assert_eq!(
            secrets,
            [(sha(1), Some(500)), (sha(2), Some(500)), (sha(3), None)]
        );
        // Past their grace, the next rotation removes them.
        store.apply(rotate(sha(4), 2_000, 600)).await.unwrap();
        assert_eq!(store.load().await.unwrap().secrets.len(), 2);
        let missing = KeyWrite::Delete {
            id: "nobody".into(),
        };
        assert!(matches!(
            store.apply(change(missing, 700)).await,
            Err(KeyStoreError::NoSuchKey(_))
        ));
        assert_eq!(store.version().await.unwrap(), 4);
        let audit = store.audit(10).await.unwrap();
        let actions: Vec<&str> = audit.iter().map(|a| a.action.as_str()).collect();
        assert_eq!(actions, ["rotate", "rotate", "rotate", "create"]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
