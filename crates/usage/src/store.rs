//! Which store `usage.store` names, where its journal lives, and the errors of talking to it.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use onedoor_config::UsageConfig;

/// Where usage records are kept.
#[derive(Clone, PartialEq, Eq)]
pub enum StoreUrl {
    Sqlite(PathBuf),
    /// A `postgres://` or `postgresql://` URL; it may carry a password, so it is never shown.
    Postgres(String),
    Off,
}

impl StoreUrl {
    /// Reads `sqlite://PATH`, `postgres://...`, `postgresql://...` or `off`.
    pub fn parse(text: &str) -> Result<StoreUrl, UsageError> {
        if text == "off" {
            return Ok(StoreUrl::Off);
        }
        if let Some(path) = text.strip_prefix("sqlite://").filter(|p| !p.is_empty()) {
            return Ok(StoreUrl::Sqlite(PathBuf::from(path)));
        }
        let postgres = ["postgres://", "postgresql://"]
            .iter()
            .any(|scheme| text.len() > scheme.len() && text.starts_with(scheme));
        match postgres {
            true => Ok(StoreUrl::Postgres(text.to_owned())),
            false => Err(UsageError::BadStore),
        }
    }

    /// The journal file records spill to while this store cannot take them: next to an SQLite
    /// file, or `onedoor-usage.journal.jsonl` in `journal_dir` (default: the working directory).
    /// A configured `journal_dir` always wins.
    pub fn journal_path(&self, journal_dir: Option<&Path>) -> Option<PathBuf> {
        let (dir, name) = match self {
            StoreUrl::Off => return None,
            StoreUrl::Sqlite(path) => {
                let name = path.file_name()?.to_string_lossy().into_owned();
                let beside = path.parent().unwrap_or(Path::new("")).to_path_buf();
                (beside, format!("{name}.journal.jsonl"))
            }
            StoreUrl::Postgres(_) => (PathBuf::new(), "onedoor-usage.journal.jsonl".to_owned()),
        };
        let dir = journal_dir.map(Path::to_path_buf).unwrap_or(dir);
        Some(match dir.as_os_str().is_empty() {
            true => PathBuf::from(name),
            false => dir.join(name),
        })
    }
}

/// What logs and errors may say about a store: the SQLite path, or Postgres's host and
/// database without user or password.
impl fmt::Display for StoreUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreUrl::Off => f.write_str("off"),
            StoreUrl::Sqlite(path) => write!(f, "sqlite://{}", path.display()),
            StoreUrl::Postgres(url) => {
                let rest = url.split_once("://").map_or("", |(_, rest)| rest);
                let host_and_db = rest.rsplit_once('@').map_or(rest, |(_, after)| after);
                let host_and_db = host_and_db.split('?').next().unwrap_or("");
                write!(f, "postgres://{host_and_db}")
            }
        }
    }
}

impl fmt::Debug for StoreUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// The store and journal a [`crate::Recorder`] writes to, from the config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Destination {
    pub store: StoreUrl,
    pub journal: Option<PathBuf>,
}

impl Destination {
    pub fn of(config: &UsageConfig) -> Result<Destination, UsageError> {
        let store = StoreUrl::parse(&config.store)?;
        let journal = store.journal_path(config.journal_dir.as_deref());
        Ok(Destination { store, journal })
    }
}

/// Why the usage store could not be used.
#[derive(Debug, thiserror::Error)]
pub enum UsageError {
    #[error("usage.store must be sqlite://PATH, postgres://USER@HOST/DB or off")]
    BadStore,
    #[error("the usage store is off: there is nothing to report")]
    Off,
    #[error("there is no usage store at {0} (no request has been recorded there yet)")]
    Missing(PathBuf),
    #[error("SQLite: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("Postgres: {0}")]
    Postgres(#[from] tokio_postgres::Error),
    #[error("Postgres did not answer within {0:?}")]
    Timeout(Duration),
    #[error("the usage store has schema version {found}, newer than this onedoor knows ({known}); upgrade onedoor")]
    NewerSchema { found: i64, known: i64 },
    #[error("{0}: {1}")]
    Io(String, std::io::Error),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stores_are_read_from_their_urls() {
        assert_eq!(
            StoreUrl::parse("sqlite://data/u.db").unwrap(),
            StoreUrl::Sqlite("data/u.db".into())
        );
        assert_eq!(StoreUrl::parse("off").unwrap(), StoreUrl::Off);
        assert!(matches!(
            StoreUrl::parse("postgresql://u@h/db").unwrap(),
            StoreUrl::Postgres(_)
        ));
        assert!(StoreUrl::parse("sqlite://").is_err());
        assert!(StoreUrl::parse("mysql://h/db").is_err());
    }

    #[test]
    fn a_postgres_url_is_shown_without_its_credentials() {
        let store = StoreUrl::parse("postgres://app:hunter2@db.internal:5432/usage?x=1").unwrap();
        assert_eq!(store.to_string(), "postgres://db.internal:5432/usage");
        assert_eq!(format!("{store:?}"), "postgres://db.internal:5432/usage");
    }

    #[test]
    fn the_journal_sits_next_to_the_sqlite_file_unless_a_dir_is_configured() {
        let sqlite = StoreUrl::Sqlite("/var/lib/onedoor/usage.db".into());
        assert_eq!(
            sqlite.journal_path(None).unwrap(),
            PathBuf::from("/var/lib/onedoor/usage.db.journal.jsonl")
        );
        assert_eq!(
            StoreUrl::Sqlite("usage.db".into())
                .journal_path(None)
                .unwrap(),
            PathBuf::from("usage.db.journal.jsonl")
        );
        let postgres = StoreUrl::parse("postgres://u@h/db").unwrap();
        assert_eq!(
            postgres.journal_path(Some(Path::new("/spill"))).unwrap(),
            PathBuf::from("/spill/onedoor-usage.journal.jsonl")
        );
        assert_eq!(StoreUrl::Off.journal_path(None), None);
    }
}
