//! The objects callers see: OpenAI's `file`, `batch` and `list` shapes, with the gateway's own
//! ids in place of a backend's and nothing that names a backend or a deployment.

use serde_json::{json, Value};

use super::ledger::{BatchRecord, FileRecord};
use crate::surface::{percent_decode, Encoded};

/// A list answers this many items unless `limit` says otherwise.
const DEFAULT_LIMIT: usize = 20;
const MAX_LIMIT: usize = 10_000;

pub fn file(file: &FileRecord) -> Value {
    json!({
        "id": file.id,
        "object": "file",
        "bytes": file.bytes,
        "created_at": file.created_at,
        "filename": file.filename,
        "purpose": file.purpose,
        "status": "processed",
        "status_details": null,
    })
}

/// The batch as its backend last described it, in the gateway's ids.
pub fn batch(record: &BatchRecord) -> Value {
    let mut object = match &record.upstream {
        Value::Object(fields) => fields.clone(),
        _ => serde_json::Map::new(),
    };
    object.remove("model");
    let mut put = |key: &str, value: Value| {
        object.insert(key.to_owned(), value);
    };
    put("id", json!(record.id));
    put("object", json!("batch"));
    put("endpoint", json!(record.endpoint));
    put("input_file_id", json!(record.input_file_id));
    put("output_file_id", json!(record.output_file_id));
    put("error_file_id", json!(record.error_file_id));
    put("created_at", json!(record.created_at));
    let status = record.upstream.get("status").cloned();
    put("status", status.unwrap_or_else(|| json!("validating")));
    if record.upstream.get("completion_window").is_none() {
        put("completion_window", json!("24h"));
    }
    Value::Object(object)
}

/// One page of a list, newest first: `after` (an id) and `limit` from the query.
pub fn page(data: Vec<Value>, query: Option<&str>) -> Value {
    let start = query_value(query, "after")
        .and_then(|after| data.iter().position(|item| item["id"] == after.as_str()))
        .map_or(0, |at| at + 1);
    let limit = query_value(query, "limit")
        .and_then(|l| l.parse().ok())
        .unwrap_or(DEFAULT_LIMIT)
        .clamp(1, MAX_LIMIT);
    let has_more = data.len() > start + limit;
    let page: Vec<Value> = data.into_iter().skip(start).take(limit).collect();
    json!({
        "object": "list",
        "data": page,
        "first_id": page.first().map(|item| item["id"].clone()),
        "last_id": page.last().map(|item| item["id"].clone()),
        "has_more": has_more,
    })
}

/// The value of `name` in a query string, decoded.
pub fn query_value(query: Option<&str>, name: &str) -> Option<String> {
    query?
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .find(|(key, _)| *key == name)
        .map(|(_, value)| percent_decode(value, Encoded::Query))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn a_page_starts_after_the_id_it_is_given() {
        let data: Vec<Value> = (0..5).map(|i| json!({"id": format!("b{i}")})).collect();
        let first = page(data.clone(), Some("limit=2"));
        assert_eq!(first["data"].as_array().unwrap().len(), 2);
        assert_eq!(
            (first["last_id"].clone(), first["has_more"].clone()),
            (json!("b1"), json!(true))
        );
        let rest = page(data, Some("after=b1&limit=10"));
        assert_eq!(rest["first_id"], "b2");
        assert_eq!(rest["has_more"], false);
    }
}
