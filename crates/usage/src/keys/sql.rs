//! The key tables, their own migrations (apart from `usage_records`' in `schema.rs`, recorded
//! in `key_schema_version`), and each change as statements both stores run: SQL in the common
//! dialect with `?N` placeholders (Postgres spells them `$N`).

use super::{Change, KeyWrite};

/// Every migration of the key tables, in order; a migration's version is its position, from 1.
pub const MIGRATIONS: &[&str] = &[
    // 1: keys, the digests of their secrets, and the audit of every change.
    "CREATE TABLE client_keys (
        id TEXT PRIMARY KEY,
        tenant TEXT NOT NULL,
        name TEXT,
        settings TEXT NOT NULL,
        created_at_ms BIGINT NOT NULL,
        updated_at_ms BIGINT NOT NULL,
        last_used_ms BIGINT
    );
    CREATE TABLE client_key_secrets (
        sha256 TEXT PRIMARY KEY,
        key_id TEXT NOT NULL,
        created_at_ms BIGINT NOT NULL,
        valid_until_ms BIGINT
    );
    CREATE INDEX client_key_secrets_key ON client_key_secrets (key_id);
    CREATE TABLE client_key_audit (
        seq BIGINT PRIMARY KEY,
        at_ms BIGINT NOT NULL,
        actor TEXT NOT NULL,
        action TEXT NOT NULL,
        key_id TEXT NOT NULL,
        detail TEXT NOT NULL
    );",
];

pub fn latest() -> i64 {
    MIGRATIONS.len() as i64
}

pub const CREATE_VERSION_TABLE: &str = "CREATE TABLE IF NOT EXISTS key_schema_version (
    version BIGINT PRIMARY KEY,
    applied_at_ms BIGINT NOT NULL
)";

pub const CURRENT_VERSION: &str = "SELECT COALESCE(MAX(version), 0) FROM key_schema_version";
pub const RECORD_VERSION: &str =
    "INSERT INTO key_schema_version (version, applied_at_ms) VALUES (?1, ?2)";

pub const VERSION: &str = "SELECT COALESCE(MAX(seq), 0) FROM client_key_audit";
pub const KEYS: &str = "SELECT id, tenant, name, settings, created_at_ms, updated_at_ms, last_used_ms FROM client_keys ORDER BY created_at_ms, id";
pub const SECRETS: &str = "SELECT sha256, key_id, valid_until_ms FROM client_key_secrets";
pub const AUDIT: &str = "SELECT seq, at_ms, actor, action, key_id, detail FROM client_key_audit ORDER BY seq DESC LIMIT ?1";
pub const TOUCH: &str = "UPDATE client_keys SET last_used_ms = ?1 WHERE id = ?2 AND (last_used_ms IS NULL OR last_used_ms < ?1)";
const AUDIT_INSERT: &str = "INSERT INTO client_key_audit (seq, at_ms, actor, action, key_id, detail)
    SELECT COALESCE(MAX(seq), 0) + 1, CAST(?1 AS BIGINT), CAST(?2 AS TEXT), CAST(?3 AS TEXT), CAST(?4 AS TEXT), CAST(?5 AS TEXT) FROM client_key_audit";

/// A value a statement binds.
#[derive(Debug, Clone)]
pub enum Value {
    Int(i64),
    Text(String),
    MaybeText(Option<String>),
}

/// One statement of a change; `one_row`: it must touch exactly one row, or the key does not
/// exist and the whole change is rolled back.
pub struct Statement {
    pub sql: &'static str,
    pub params: Vec<Value>,
    pub one_row: bool,
}

fn statement(sql: &'static str, params: Vec<Value>, one_row: bool) -> Statement {
    Statement {
        sql,
        params,
        one_row,
    }
}

/// The statements of `change`, its audit record last.
pub fn statements(change: &Change) -> Vec<Statement> {
    use Value::*;
    let at = change.at_ms;
    let mut list = match &change.write {
        KeyWrite::Create { key, sha256 } => vec![
            statement(
                "INSERT INTO client_keys (id, tenant, name, settings, created_at_ms, updated_at_ms) VALUES (?1, ?2, ?3, ?4, ?5, ?5)",
                vec![Text(key.id.clone()), Text(key.tenant.clone()), MaybeText(key.name.clone()), Text(key.settings.clone()), Int(at)],
                true,
            ),
            statement(
                "INSERT INTO client_key_secrets (sha256, key_id, created_at_ms) VALUES (?1, ?2, ?3)",
                vec![Text(sha256.clone()), Text(key.id.clone()), Int(at)],
                true,
            ),
        ],
        KeyWrite::Update { id, name, settings } => vec![statement(
            "UPDATE client_keys SET name = ?1, settings = ?2, updated_at_ms = ?3 WHERE id = ?4",
            vec![MaybeText(name.clone()), Text(settings.clone()), Int(at), Text(id.clone())],
            true,
        )],
        KeyWrite::Rotate { id, sha256, old_valid_until_ms } => vec![
            statement(
                "UPDATE client_keys SET updated_at_ms = ?1 WHERE id = ?2",
                vec![Int(at), Text(id.clone())],
                true,
            ),
            statement(
                "DELETE FROM client_key_secrets WHERE key_id = ?1 AND valid_until_ms <= ?2",
                vec![Text(id.clone()), Int(at)],
                false,
            ),
            statement(
                "UPDATE client_key_secrets SET valid_until_ms = ?1 WHERE key_id = ?2 AND (valid_until_ms IS NULL OR valid_until_ms > ?1)",
                vec![Int(*old_valid_until_ms), Text(id.clone())],
                false,
            ),
            statement(
                "INSERT INTO client_key_secrets (sha256, key_id, created_at_ms) VALUES (?1, ?2, ?3)",
                vec![Text(sha256.clone()), Text(id.clone()), Int(at)],
                true,
            ),
        ],
        KeyWrite::Delete { id } => vec![
            statement("DELETE FROM client_keys WHERE id = ?1", vec![Text(id.clone())], true),
            statement(
                "DELETE FROM client_key_secrets WHERE key_id = ?1",
                vec![Text(id.clone())],
                false,
            ),
        ],
    };
    list.push(statement(
        AUDIT_INSERT,
        vec![
            Int(at),
            Text(change.actor.clone()),
            Text(change.write.action().to_owned()),
            Text(change.write.key_id().to_owned()),
            Text(change.detail.clone()),
        ],
        true,
    ));
    list
}

/// `sql` with Postgres's placeholders.
pub fn postgres(sql: &str) -> String {
    sql.replace('?', "$")
}
