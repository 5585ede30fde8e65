//! Client keys: random, printed once; the config keeps only their sha256.

use rand::Rng;
use sha2::{Digest, Sha256};

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

#[cfg(test)]
mod tests {
    use super::*;

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
