//! Client keys made at runtime through the admin API, kept in the usage store's database beside
//! the usage records: each key's tenant, name and settings (a JSON document the gateway reads),
//! the sha256 digests of its secrets (a rotated one with the end of its grace period; never a
//! secret itself), and an audit record of every change. The audit's sequence number is also the
//! store's version: gateways poll it to learn that something changed.

mod postgres;
mod sql;
mod sqlite;

use crate::store::{StoreUrl, UsageError};

/// A key as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredKey {
    pub id: String,
    pub tenant: String,
    pub name: Option<String>,
    /// The key's settings as JSON text; the gateway gives it its meaning.
    pub settings: String,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    /// When an instance last reported a request with it (flushed every few seconds).
    pub last_used_ms: Option<i64>,
}

/// The digest of one of a key's secrets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredSecret {
    /// 64 lowercase hex digits.
    pub sha256: String,
    pub key_id: String,
    /// `None` while it is the key's current secret; after a rotation, the end of its grace.
    pub valid_until_ms: Option<i64>,
}

/// Everything the store holds about keys, read in one go.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KeySet {
    pub keys: Vec<StoredKey>,
    pub secrets: Vec<StoredSecret>,
    /// The audit sequence number this set is current at.
    pub version: i64,
}

/// One change to the keys.
#[derive(Debug, Clone)]
pub enum KeyWrite {
    Create {
        key: StoredKey,
        sha256: String,
    },
    /// New settings (and name) for an existing key.
    Update {
        id: String,
        name: Option<String>,
        settings: String,
    },
    /// A new current secret; the ones in use so far stay valid until `old_valid_until_ms`.
    Rotate {
        id: String,
        sha256: String,
        old_valid_until_ms: i64,
    },
    Delete {
        id: String,
    },
}

impl KeyWrite {
    pub fn key_id(&self) -> &str {
        match self {
            KeyWrite::Create { key, .. } => &key.id,
            KeyWrite::Update { id, .. } | KeyWrite::Rotate { id, .. } | KeyWrite::Delete { id } => {
                id
            }
        }
    }

    pub fn action(&self) -> &'static str {
        match self {
            KeyWrite::Create { .. } => "create",
            KeyWrite::Update { .. } => "update",
            KeyWrite::Rotate { .. } => "rotate",
            KeyWrite::Delete { .. } => "delete",
        }
    }
}

/// A change with who made it and what it was, for the audit (`detail` is JSON, never a secret).
#[derive(Debug, Clone)]
pub struct Change {
    pub write: KeyWrite,
    pub actor: String,
    pub at_ms: i64,
    pub detail: String,
}

/// One audit record.
#[derive(Debug, Clone, PartialEq)]
pub struct AuditEntry {
    pub seq: i64,
    pub at_ms: i64,
    pub actor: String,
    pub action: String,
    pub key_id: String,
    /// JSON text.
    pub detail: String,
}

/// Why a change was not made.
#[derive(Debug, thiserror::Error)]
pub enum KeyStoreError {
    #[error("no key with id `{0}`")]
    NoSuchKey(String),
    #[error(transparent)]
    Store(#[from] UsageError),
}

impl From<rusqlite::Error> for KeyStoreError {
    fn from(error: rusqlite::Error) -> Self {
        KeyStoreError::Store(error.into())
    }
}

impl From<tokio_postgres::Error> for KeyStoreError {
    fn from(error: tokio_postgres::Error) -> Self {
        KeyStoreError::Store(error.into())
    }
}

/// The database that holds runtime keys: the usage store's.
pub enum KeyStore {
    Sqlite(sqlite::SqliteKeys),
    Postgres(Box<postgres::PostgresKeys>),
}

impl KeyStore {
    /// Opens (and migrates) the key tables of `store`; `None` when the usage store is off.
    pub async fn open(store: &StoreUrl) -> Result<Option<KeyStore>, UsageError> {
        Ok(match store {
            StoreUrl::Off => None,
            StoreUrl::Sqlite(path) => Some(KeyStore::Sqlite(sqlite::SqliteKeys::open(path).await?)),
            StoreUrl::Postgres(url) => Some(KeyStore::Postgres(Box::new(
                postgres::PostgresKeys::connect(url).await?,
            ))),
        })
    }

    /// The audit sequence number of the latest change (0 before any).
    pub async fn version(&self) -> Result<i64, UsageError> {
        match self {
            KeyStore::Sqlite(s) => s.version().await,
            KeyStore::Postgres(p) => p.version().await,
        }
    }

    /// Every key and secret digest.
    pub async fn load(&self) -> Result<KeySet, UsageError> {
        match self {
            KeyStore::Sqlite(s) => s.load().await,
            KeyStore::Postgres(p) => p.load().await,
        }
    }

    /// Makes `change` and its audit record in one transaction; returns the audit's number.
    pub async fn apply(&self, change: Change) -> Result<i64, KeyStoreError> {
        match self {
            KeyStore::Sqlite(s) => s.apply(change).await,
            KeyStore::Postgres(p) => p.apply(change).await,
        }
    }

    /// The latest `limit` audit records, newest first.
    pub async fn audit(&self, limit: i64) -> Result<Vec<AuditEntry>, UsageError> {
        match self {
            KeyStore::Sqlite(s) => s.audit(limit).await,
            KeyStore::Postgres(p) => p.audit(limit).await,
        }
    }

    /// Records when keys were last used (only ever later than what is stored).
    pub async fn touch(&self, used: Vec<(String, i64)>) -> Result<(), UsageError> {
        if used.is_empty() {
            return Ok(());
        }
        match self {
            KeyStore::Sqlite(s) => s.touch(used).await,
            KeyStore::Postgres(p) => p.touch(used).await,
        }
    }
}
