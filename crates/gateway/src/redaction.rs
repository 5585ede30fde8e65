//! A backend's own credential, kept out of what the gateway passes on from that backend: the
//! error bodies it answers with (passed back as they came), the headers copied from its answers,
//! and the error event that ends one of its streams.
//!
//! A successful answer's content (a whole body, a stream's chunks) is passed on unscrubbed: the
//! key travels only in a request header the provider consumes, so the model never sees it and
//! cannot say it, while the rule below would alter real output (`sk-proj-` begins every OpenAI
//! project key, and code samples that show one). The search is not the reason: memmem scans
//! some 20 GB/s, about 50 ns for a 1 KB answer.

use bytes::{Bytes, BytesMut};
use http::HeaderValue;
use memchr::memmem::Finder;
use onedoor_config::Backend;

/// What stands where a credential was.
pub const MARKER: &str = "[redacted]";

/// How much of a key's start gives it away.
const SHOWN: usize = 8;

/// One backend's credential (its `api_key`, which is also the bearer token of an OpenAI
/// backend), as the gateway looks for it in what that backend sends.
///
/// The rule: wherever the key's first eight bytes appear (the whole key, when it is shorter),
/// they and as much of the rest of the key as follows them are replaced by [`MARKER`]. That takes
/// out the whole key and every echo that shows eight or more of its first characters, such as
/// `Incorrect API key provided: sk-abc123***wxyz`, whose stars and last few characters are left:
/// providers show those precisely because they say nothing. An echo of the key's end alone, or
/// of its start shorter than eight, is not found; nor is a key written escaped (JSON's `\/`).
pub struct Redaction {
    key: Box<[u8]>,
    start: Finder<'static>,
}

impl Redaction {
    /// The redaction of `backend`'s credential, if it has one.
    pub fn of(backend: &Backend) -> Option<Redaction> {
        let key = backend.api_key.as_ref()?.expose().as_bytes();
        let start = key.get(..key.len().min(SHOWN)).filter(|s| !s.is_empty())?;
        Some(Redaction {
            start: Finder::new(start).into_owned(),
            key: key.into(),
        })
    }

    /// `bytes` with every echo of the key replaced: the same buffer, not a copy, when it has none.
    pub fn bytes(&self, bytes: Bytes) -> Bytes {
        let Some(first) = self.start.find(&bytes) else {
            return bytes;
        };
        let mut out = BytesMut::with_capacity(bytes.len());
        let mut rest = &bytes[..];
        let mut found = Some(first);
        while let Some(at) = found {
            out.extend_from_slice(&rest[..at]);
            out.extend_from_slice(MARKER.as_bytes());
            rest = &rest[at + self.echoed(&rest[at..])..];
            found = self.start.find(rest);
        }
        out.extend_from_slice(rest);
        out.freeze()
    }

    /// A header value with every echo of the key replaced.
    pub fn header(&self, value: HeaderValue) -> HeaderValue {
        if self.start.find(value.as_bytes()).is_none() {
            return value;
        }
        let scrubbed = self.bytes(Bytes::copy_from_slice(value.as_bytes()));
        HeaderValue::from_maybe_shared(scrubbed).unwrap_or(HeaderValue::from_static(MARKER))
    }

    /// How many bytes at the start of `text` are the key's own, in order.
    fn echoed(&self, text: &[u8]) -> usize {
        text.iter()
            .zip(self.key.iter())
            .take_while(|(a, b)| a == b)
            .count()
    }
}

/// `bytes` scrubbed by `redaction`, when there is one.
pub fn scrub(redaction: Option<&Redaction>, bytes: Bytes) -> Bytes {
    match redaction {
        Some(redaction) => redaction.bytes(bytes),
        None => bytes,
    }
}

/// A header value scrubbed by `redaction`, when there is one.
pub fn scrub_header(redaction: Option<&Redaction>, value: HeaderValue) -> HeaderValue {
    match redaction {
        Some(redaction) => redaction.header(value),
        None => value,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn redaction(key: &str) -> Redaction {
        let yaml = format!(
            "backends:\n  - {{ name: b, provider: openai, url: 'http://127.0.0.1:1/v1', region: se, api_key: '{key}' }}\nmodels:\n  - {{ name: chat, targets: [{{ backend: b, model: m }}] }}\n"
        );
        let snapshot =
            onedoor_config::parse(&yaml, std::path::Path::new("t.yaml"), &|_| None).unwrap();
        Redaction::of(&snapshot.backends[0]).unwrap()
    }

    fn scrubbed(key: &str, text: &str) -> String {
        let out = redaction(key).bytes(Bytes::copy_from_slice(text.as_bytes()));
        String::from_utf8(out.to_vec()).unwrap()
    }

    #[test]
    fn the_whole_key_is_replaced_wherever_it_appears() {
        let key = "sk-abcdefgh12345678";
        let text = format!("key {key}, again {key}.");
        assert_eq!(scrubbed(key, &text), "key [redacted], again [redacted].");
    }

    #[test]
    fn a_key_shown_by_its_first_eight_characters_or_more_is_replaced() {
        let key = "sk-abcdefgh12345678";
        assert_eq!(
            scrubbed(key, "Incorrect API key provided: sk-abcde***5678."),
            "Incorrect API key provided: [redacted]***5678."
        );
        assert_eq!(
            scrubbed(key, "provided: sk-abcdefgh1***"),
            "provided: [redacted]***"
        );
    }

    #[test]
    fn fewer_than_eight_of_its_first_characters_are_left() {
        let key = "sk-abcdefgh12345678";
        let text = "provided: sk-abcd***5678";
        assert_eq!(scrubbed(key, text), text);
    }

    #[test]
    fn a_short_key_is_replaced_whole() {
        assert_eq!(scrubbed("k1x", "a k1x b k1"), "a [redacted] b k1");
    }

    #[test]
    fn bytes_without_the_key_are_the_same_buffer() {
        let bytes = Bytes::from_static(b"{\"error\":{\"message\":\"filtered\"}}");
        let out = redaction("sk-abcdefgh12345678").bytes(bytes.clone());
        assert_eq!(out.as_ptr(), bytes.as_ptr());
    }

    #[test]
    fn a_header_echoing_the_key_is_scrubbed() {
        let key = "sk-abcdefgh12345678";
        let value = HeaderValue::from_str(&format!("application/json; key={key}")).unwrap();
        let out = redaction(key).header(value);
        assert_eq!(out, "application/json; key=[redacted]");
    }
}
