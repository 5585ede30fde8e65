//! The common chunk of an OpenAI-shaped stream, told by searching its bytes instead of parsing
//! it: delta text and nothing else of note (no usage, error, tool call, refusal or finish). Most
//! of a stream's chunks are that, and Azure's carry some 400 bytes of content-filter results
//! each, which a parse has to walk; a few SIMD searches do not.
//!
//! A search can be fooled one way only: by a key it looks for appearing inside a string value
//! (a quote inside a string is escaped, so only a whole string equal to the key can). That makes
//! a chunk look less plain than it is, and the caller reads it in full. It never makes a chunk
//! with usage, an error or a tool call look plain: providers write those keys unescaped.

use std::sync::LazyLock;

use memchr::memmem::Finder;

/// Keys whose presence needs the chunk read in full (`usage` too unless it is `null`, as it is
/// in every chunk before the last when the stream was asked for its usage).
const FULL_READ_KEYS: [&str; 4] = [
    "\"error\"",
    "\"tool_calls\"",
    "\"function_call\"",
    "\"prompt_filter_results\"",
];

struct Finders {
    full_read: Vec<Finder<'static>>,
    content: Finder<'static>,
    refusal: Finder<'static>,
    finish_reason: Finder<'static>,
    usage: Finder<'static>,
}

static FINDERS: LazyLock<Finders> = LazyLock::new(|| Finders {
    full_read: FULL_READ_KEYS.iter().map(Finder::new).collect(),
    content: Finder::new("\"content\""),
    refusal: Finder::new("\"refusal\""),
    finish_reason: Finder::new("\"finish_reason\""),
    usage: Finder::new("\"usage\""),
});

/// The characters of delta text in a plain content chunk (`data` is its JSON); `None` for any
/// other chunk, or one this search cannot vouch for. Characters are counted as a parse would,
/// except that an escaped surrogate pair counts two (the count only feeds an estimate).
pub fn content_chars(data: &[u8]) -> Option<usize> {
    let finders = &*FINDERS;
    if finders.full_read.iter().any(|f| f.find(data).is_some()) {
        return None;
    }
    let null_or_absent = [&finders.finish_reason, &finders.refusal, &finders.usage];
    if !null_or_absent.iter().all(|key| all_null(data, key)) {
        return None;
    }
    let mut chars = 0;
    for value in values(data, &finders.content) {
        chars += match value.first() {
            Some(b'"') => string_chars(&value[1..])?,
            Some(b'n') if value.starts_with(b"null") => 0,
            _ => return None,
        };
    }
    (chars > 0).then_some(chars)
}

/// Whether every value of `key` in `data` is `null`.
fn all_null(data: &[u8], key: &Finder<'_>) -> bool {
    values(data, key).all(|value| value.starts_with(b"null"))
}

/// What follows each occurrence of `key` used as a key (followed by `:`), whitespace skipped.
fn values<'a>(data: &'a [u8], key: &'a Finder<'_>) -> impl Iterator<Item = &'a [u8]> + 'a {
    let length = key.needle().len();
    key.find_iter(data).filter_map(move |at| {
        let rest = data[at + length..].trim_ascii_start();
        Some(rest.strip_prefix(b":")?.trim_ascii_start())
    })
}

/// The characters of a JSON string from just after its opening quote; `None` if it never ends.
fn string_chars(bytes: &[u8]) -> Option<usize> {
    let mut chars = 0;
    let mut at = 0;
    while let Some(&byte) = bytes.get(at) {
        match byte {
            b'"' => return Some(chars),
            b'\\' if bytes.get(at + 1) == Some(&b'u') => at += 6,
            b'\\' => at += 2,
            _ => at += 1,
        }
        // A UTF-8 continuation byte belongs to the character before it.
        chars += usize::from(byte & 0xC0 != 0x80);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const AZURE: &str = r#"{"choices":[{"content_filter_results":{"hate":{"filtered":false,"severity":"safe"},"self_harm":{"filtered":false,"severity":"safe"}},"delta":{"content":"Hello"},"finish_reason":null,"index":0,"logprobs":null}],"created":1796149676,"id":"chatcmpl-1","model":"gpt-4o-2024-11-20","object":"chat.completion.chunk","system_fingerprint":"fp"}"#;

    #[test]
    fn plain_content_chunks_are_told_with_their_characters() {
        assert_eq!(content_chars(AZURE.as_bytes()), Some(5));
        let spaced =
            r#"{"choices": [{"delta": {"content" : "hé\"llo\n\u00e9"}, "finish_reason": null}]}"#;
        assert_eq!(content_chars(spaced.as_bytes()), Some(8));
        let two = r#"{"choices":[{"delta":{"content":"ab"}},{"delta":{"content":"cd"}}]}"#;
        assert_eq!(content_chars(two.as_bytes()), Some(4));
        let asked_for_usage = r#"{"choices":[{"delta":{"content":"abc"}}],"usage":null}"#;
        assert_eq!(content_chars(asked_for_usage.as_bytes()), Some(3));
        let value_named_like_a_key = r#"{"choices":[{"delta":{"content":"usage"}}]}"#;
        assert_eq!(content_chars(value_named_like_a_key.as_bytes()), Some(5));
    }

    #[test]
    fn every_other_chunk_is_left_to_a_full_read() {
        let others = [
            // the role chunk, no text
            r#"{"choices":[{"delta":{"content":"","refusal":null,"role":"assistant"},"finish_reason":null}],"id":"x"}"#,
            r#"{"choices":[{"delta":{},"finish_reason":"stop"}],"id":"x"}"#,
            r#"{"choices":[{"delta":{"content":"a"},"finish_reason" : "length"}]}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}"#,
            r#"{"choices":[{"delta":{"content":"a"}}],"usage":{"total_tokens":3}}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0}]}}]}"#,
            r#"{"choices":[{"delta":{"refusal":"no"}}]}"#,
            r#"{"error":{"message":"overloaded"}}"#,
            r#"{"choices":[],"prompt_filter_results":[]}"#,
            r#"{"choices":[{"delta":{"content":["a"]}}]}"#,
            r#"{"choices":[{"delta":{"content":"unterminated"#,
            // a false alarm: the text is exactly a key; read in full, which is only slower
            r#"{"choices":[{"delta":{"content":"error"}}]}"#,
        ];
        for chunk in others {
            assert_eq!(content_chars(chunk.as_bytes()), None, "{chunk}");
        }
    }
}
