//! Embeddings requests and their deterministic vectors (the same for Azure and OpenAI).

use serde_json::{json, Value};

use crate::dialect::Reject;
use crate::request::estimate;

/// The dimension of every mock vector: enough to compare, small enough to read.
const DIMENSIONS: usize = 8;

pub struct Input {
    /// What the vector is derived from.
    seed: String,
    tokens: u64,
}

/// `input` as a string, an array of strings, an array of token ids, or an array of those.
pub fn inputs(body: &Value) -> Result<Vec<Input>, Reject> {
    let input = body.get("input").ok_or(Reject::Missing("input"))?;
    let parsed = match input {
        Value::Array(items) if !items.is_empty() && !items.iter().all(Value::is_number) => {
            items.iter().map(one).collect()
        }
        single => one(single).map(|i| vec![i]),
    };
    parsed.ok_or_else(|| Reject::Invalid("'$.input' is invalid. Please check the API reference: https://platform.openai.com/docs/api-reference.".to_owned()))
}

fn one(input: &Value) -> Option<Input> {
    match input {
        Value::String(s) => Some(Input {
            seed: s.clone(),
            tokens: estimate(s.chars().count()),
        }),
        Value::Array(ids) if !ids.is_empty() && ids.iter().all(Value::is_number) => Some(Input {
            seed: input.to_string(),
            tokens: ids.len() as u64,
        }),
        _ => None,
    }
}

pub fn tokens(inputs: &[Input]) -> u64 {
    inputs.iter().map(|i| i.tokens).sum()
}

pub fn response(inputs: &[Input], model: &str) -> Value {
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(index, i)| json!({"object": "embedding", "index": index, "embedding": vector(&i.seed)}))
        .collect();
    let n = tokens(inputs);
    json!({"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": n, "total_tokens": n}})
}

/// Values in [-1, 1) from an FNV-1a hash of the text stretched by splitmix64: the same text
/// always embeds the same way, different texts differ.
fn vector(text: &str) -> Vec<f32> {
    let mut state = text.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    (0..DIMENSIONS)
        .map(|_| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vectors_are_deterministic_and_distinct() {
        assert_eq!(vector("a"), vector("a"));
        assert_ne!(vector("a"), vector("b"));
        assert!(vector("a").iter().all(|v| (-1.0..1.0).contains(v)));
    }

    #[test]
    fn accepts_the_input_shapes() {
        let count = |v: Value| inputs(&json!({ "input": v })).map(|i| (i.len(), tokens(&i)));
        assert_eq!(count(json!("abcdefgh")).ok(), Some((1, 2)));
        assert_eq!(count(json!(["abcd", "e"])).ok(), Some((2, 2)));
        assert_eq!(count(json!([1, 2, 3])).ok(), Some((1, 3)));
        assert_eq!(count(json!([[1, 2], [3]])).ok(), Some((2, 3)));
        assert!(count(json!([{"x": 1}])).is_err());
    }
}
