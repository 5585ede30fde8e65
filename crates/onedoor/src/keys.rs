//! Client keys: `keys new` makes one for the config (random, printed once; the config keeps only
//! its sha256); the other `keys` commands drive the admin API's runtime keys (`/admin/keys`) and
//! print its JSON answers, so a pipeline can create and rotate keys without curl.

use clap::{Args, Subcommand};
use http::Method;
use rand::Rng;
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

use crate::admin_client::AdminClient;
use crate::Failure;

const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";

/// A fresh key: `od-` and 40 base62 characters (about 238 bits).
pub fn new_key() -> String {
    let mut rng = rand::rng();
    let body: String = (0..40)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
        .collect();
    format!("od-{body}")
}

pub fn sha256_hex(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

pub fn new_key_text() -> String {
    let key = new_key();
    format!(
        "key:    {key}\nsha256: {hash}\n\nGive the key to the application; put only the hash in the config:\n  keys:\n    - id: my-app\n      sha256: {hash}\n",
        hash = sha256_hex(&key)
    )
}

/// Where the admin API is.
#[derive(Args)]
pub struct Admin {
    /// The gateway's admin port (its token comes from ONEDOOR_ADMIN_TOKEN).
    #[arg(
        long,
        env = "ONEDOOR_ADMIN_URL",
        default_value = "http://127.0.0.1:9090"
    )]
    admin_url: String,
}

#[derive(Subcommand)]
pub enum Runtime {
    /// List the runtime keys (never their secrets).
    List {
        #[command(flatten)]
        admin: Admin,
    },
    /// Create a runtime key; prints it with its secret, which is shown this once.
    Create {
        #[command(flatten)]
        admin: Admin,
        /// The tenant of the config the key belongs to.
        #[arg(long)]
        tenant: String,
        #[command(flatten)]
        settings: Settings,
    },
    /// One runtime key.
    Show {
        #[command(flatten)]
        admin: Admin,
        id: String,
    },
    /// Change a key's name, models, limits (the ones given; the others stay), budget, expiry, or
    /// disable it.
    Update {
        #[command(flatten)]
        admin: Admin,
        id: String,
        #[command(flatten)]
        settings: Settings,
        /// Refuse the key from now on (401) until --enable.
        #[arg(long, conflicts_with = "enable")]
        disable: bool,
        #[arg(long)]
        enable: bool,
    },
    /// A new secret for a key; the one in use stays valid for --grace.
    Rotate {
        #[command(flatten)]
        admin: Admin,
        id: String,
        /// How long the secret in use so far keeps working (e.g. 10m, 24h; default 0s).
        #[arg(long)]
        grace: Option<String>,
    },
    /// Delete a key: its secrets stop working.
    Delete {
        #[command(flatten)]
        admin: Admin,
        id: String,
    },
    /// Every change to runtime keys, newest first.
    Audit {
        #[command(flatten)]
        admin: Admin,
        #[arg(long, default_value_t = 100)]
        limit: u32,
    },
}

/// A key's settings as flags; only those given are sent.
#[derive(Args)]
pub struct Settings {
    #[arg(long)]
    name: Option<String>,
    /// The aliases the key may use, comma-separated (within its tenant's).
    #[arg(long, value_delimiter = ',')]
    models: Option<Vec<String>>,
    #[arg(long)]
    rpm: Option<u64>,
    #[arg(long)]
    tpm: Option<u64>,
    #[arg(long)]
    max_in_flight: Option<u64>,
    #[arg(long)]
    max_sessions: Option<u64>,
    #[arg(long)]
    tokens_per_day: Option<u64>,
    #[arg(long)]
    usd_per_month: Option<f64>,
    /// Dollars the key may spend per --budget-period.
    #[arg(long)]
    usd_budget: Option<f64>,
    /// The budget's period: month (UTC).
    #[arg(long)]
    budget_period: Option<String>,
    /// When the key stops working, UTC (2026-12-31T23:59:59Z).
    #[arg(long)]
    expires_at: Option<String>,
    /// Until when the key may ask for decision traces, UTC.
    #[arg(long)]
    trace_until: Option<String>,
}

impl Settings {
    /// The fields given, with `limits` merged into `current` (a key's limits so far).
    fn body(&self, current: &Value) -> Map<String, Value> {
        let mut body = Map::new();
        let mut put = |name: &str, value: Option<Value>| {
            if let Some(value) = value {
                body.insert(name.to_owned(), value);
            }
        };
        put("name", self.name.clone().map(Value::from));
        put("models", self.models.clone().map(Value::from));
        put("usd_budget", self.usd_budget.map(Value::from));
        put("budget_period", self.budget_period.clone().map(Value::from));
        put("expires_at", self.expires_at.clone().map(Value::from));
        put("trace_until", self.trace_until.clone().map(Value::from));
        let limits = [
            ("rpm", self.rpm.map(Value::from)),
            ("tpm", self.tpm.map(Value::from)),
            ("max_in_flight", self.max_in_flight.map(Value::from)),
            ("max_sessions", self.max_sessions.map(Value::from)),
            ("tokens_per_day", self.tokens_per_day.map(Value::from)),
            ("usd_per_month", self.usd_per_month.map(Value::from)),
        ];
        if limits.iter().any(|(_, v)| v.is_some()) {
            let mut merged = current.as_object().cloned().unwrap_or_default();
            for (name, value) in limits {
                if let Some(value) = value {
                    merged.insert(name.to_owned(), value);
                }
            }
            body.insert("limits".to_owned(), Value::Object(merged));
        }
        body
    }
}

/// Runs a runtime-key command and prints the admin API's answer.
pub async fn run(command: Runtime) -> Result<(), Failure> {
    let answer = answer(command).await?;
    let text = serde_json::to_string_pretty(&answer).unwrap_or_else(|_| answer.to_string());
    println!("{text}");
    Ok(())
}

async fn answer(command: Runtime) -> Result<Value, Failure> {
    match command {
        Runtime::List { admin } => client(&admin)?.call(Method::GET, "/admin/keys", None).await,
        Runtime::Create {
            admin,
            tenant,
            settings,
        } => {
            let mut body = settings.body(&Value::Null);
            body.insert("tenant".to_owned(), tenant.into());
            client(&admin)?
                .call(Method::POST, "/admin/keys", Some(Value::Object(body)))
                .await
        }
        Runtime::Show { admin, id } => {
            client(&admin)?
                .call(Method::GET, &key_path(&id)?, None)
                .await
        }
        Runtime::Update {
            admin,
            id,
            settings,
            disable,
            enable,
        } => {
            let client = client(&admin)?;
            let path = key_path(&id)?;
            let current = client.call(Method::GET, &path, None).await?;
            let mut body = settings.body(&current["limits"]);
            if disable || enable {
                body.insert("disabled".to_owned(), disable.into());
            }
            if body.is_empty() {
                return Err(Failure::BadInput(
                    "nothing to change: give a setting, --disable or --enable".into(),
                ));
            }
            client
                .call(Method::PATCH, &path, Some(Value::Object(body)))
                .await
        }
        Runtime::Rotate { admin, id, grace } => {
            let body = grace.map(|grace| json!({ "grace": grace }));
            let path = format!("{}/rotate", key_path(&id)?);
            client(&admin)?.call(Method::POST, &path, body).await
        }
        Runtime::Delete { admin, id } => {
            client(&admin)?
                .call(Method::DELETE, &key_path(&id)?, None)
                .await
        }
        Runtime::Audit { admin, limit } => {
            let path = format!("/admin/audit?limit={limit}");
            client(&admin)?.call(Method::GET, &path, None).await
        }
    }
}

fn client(admin: &Admin) -> Result<AdminClient, Failure> {
    AdminClient::new(&admin.admin_url)
}

/// A key's path; ids are made by the gateway (`key-` and hex digits), so anything else is a typo.
fn key_path(id: &str) -> Result<String, Failure> {
    let plain = !id.is_empty()
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    match plain {
        true => Ok(format!("/admin/keys/{id}")),
        false => Err(Failure::BadInput(format!(
            "{id:?} is not a key id (GET onedoor keys list)"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_update_sends_only_the_settings_given_and_keeps_the_other_limits() {
        let settings = Settings {
            name: None,
            models: Some(vec!["chat".into(), "mini".into()]),
            rpm: Some(5),
            tpm: None,
            max_in_flight: None,
            max_sessions: None,
            tokens_per_day: None,
            usd_per_month: None,
            usd_budget: None,
            budget_period: None,
            expires_at: None,
            trace_until: None,
        };
        let body = settings.body(&json!({"rpm": 10, "tpm": 1000}));
        assert_eq!(
            Value::Object(body),
            json!({"models": ["chat", "mini"], "limits": {"rpm": 5, "tpm": 1000}})
        );
        assert!(key_path("key-00ab").is_ok() && key_path("../reload").is_err());
    }

    #[test]
    fn keys_are_fresh_and_their_hash_is_sha256_hex() {
        let (a, b) = (new_key(), new_key());
        assert_ne!(a, b);
        assert_eq!(a.len(), 43);
        assert_eq!(
            sha256_hex("password"),
            "5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8"
        );
    }
}
