//! Random identifiers and timestamps in the shapes providers use.

use std::time::{SystemTime, UNIX_EPOCH};

use rand::distr::Alphanumeric;
use rand::Rng;

/// A random UUID-shaped id, as Azure's `apim-request-id`.
pub fn uuid() -> String {
    let h = format!("{:032x}", rand::random::<u128>());
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

/// `prefix` followed by `len` random letters and digits, as `chatcmpl-…` or `msg_…`.
pub fn token(prefix: &str, len: usize) -> String {
    let tail: String = rand::rng()
        .sample_iter(&Alphanumeric)
        .take(len)
        .map(char::from)
        .collect();
    format!("{prefix}{tail}")
}

pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
