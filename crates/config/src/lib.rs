//! The onedoor config file: YAML schema, `${ENV}` and `file:` secrets, validation that reports every
//! problem as `FILE:LINE:COL: message`, and compilation into the read-only [`Snapshot`].

pub mod model;

mod backends;
mod batch;
mod breakers;
mod client_auth;
mod compile;
mod connections;
mod identities;
mod limits;
mod models;
mod problems;
mod read;
mod realtime;
mod redis_url;
mod regions;
mod routing;
mod secrets;
mod service;
mod shutdown;
mod summary;
mod telemetry;
mod tenants;
#[cfg(test)]
mod testing;
mod tree;
mod values;

pub use model::*;
pub use redis_url::{BadRedisUrl, RedisAddress, Topology};

use std::path::Path;
use std::time::Duration;

use problems::Problems;

/// One thing wrong with a config file, located at the value (or key) it is about.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}:{line}:{col}: {message}")]
pub struct Problem {
    pub file: String,
    /// 1-based.
    pub line: usize,
    /// 1-based.
    pub col: usize,
    pub message: String,
}

/// Read and compile a config file; env vars from the process environment.
pub fn load(path: &Path) -> Result<Snapshot, Vec<Problem>> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        vec![Problem {
            file: path.display().to_string(),
            line: 1,
            col: 1,
            message: format!("cannot read the config file: {e}"),
        }]
    })?;
    parse(&text, path, &|name| std::env::var(name).ok())
}

/// Compile config text. `source` is used as FILE in problems and as `Snapshot::source`. `env` looks up `${NAME}`.
pub fn parse(
    text: &str,
    source: &Path,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Snapshot, Vec<Problem>> {
    let file = source.display().to_string();
    let mut p = Problems::default();
    let Some(mut root) = tree::parse(text, &mut p) else {
        return Err(p.into_located(&file));
    };
    let base = source.parent().unwrap_or(Path::new(""));
    secrets::resolve(&mut root, base, env, &mut p);
    let snapshot = compile::snapshot(&root, source, env, &mut p);
    if p.is_empty() {
        Ok(snapshot)
    } else {
        Err(p.into_located(&file))
    }
}

/// One paragraph for `onedoor validate`: counts and names of backends (with providers and regions),
/// aliases, tenants. Never any secret.
pub fn summary(snapshot: &Snapshot) -> String {
    summary::summary(snapshot)
}

/// Parse a duration string like "250ms", "30s", "5m", "1h" (humantime).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| e.to_string())
}
