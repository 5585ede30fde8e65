//! A batch input file, line by line: every line a JSON object with its own `custom_id`, `POST`
//! to chat completions or embeddings, all lines for one alias and one endpoint. A file that
//! breaks a rule is refused with the number of the first line that does. The same reading
//! rewrites the lines for a backend (its deployment as `model`, its dialect's `url`) and
//! estimates the tokens the batch may use.

use std::collections::HashSet;

use bytes::Bytes;
use onedoor_config::{BatchSettings, Provider};
use serde_json::Value;

use crate::admission;
use crate::errors::GatewayError;
use crate::request::{ClientRequest, Operation};
use crate::tokens::Estimator;

/// A checked input file.
#[derive(Debug)]
pub struct Input {
    /// The alias every line names as its `model`.
    pub alias: String,
    pub operation: Operation,
    /// Each line as it came, parsed.
    pub lines: Vec<Value>,
}

/// The operation a batch line's `url` (or a batch's `endpoint`) names, in OpenAI's words
/// (`/v1/chat/completions`) or Azure's (`/chat/completions`).
pub fn operation_of(url: &str) -> Option<Operation> {
    match url.strip_prefix("/v1").unwrap_or(url) {
        "/chat/completions" => Some(Operation::ChatCompletions),
        "/embeddings" => Some(Operation::Embeddings),
        _ => None,
    }
}

fn at(number: usize, problem: &str) -> GatewayError {
    GatewayError::InvalidRequest(format!("line {number} of the batch input file: {problem}"))
}

/// Checks `text` against the rules above and `settings`' limits.
pub fn read(text: &str, settings: &BatchSettings) -> Result<Input, GatewayError> {
    let mut first: Option<(String, Operation)> = None;
    let mut ids: HashSet<String> = HashSet::new();
    let mut lines = Vec::new();
    for (index, line) in text.lines().enumerate() {
        let number = index + 1;
        if line.trim().is_empty() {
            continue;
        }
        if lines.len() as u64 >= settings.max_lines {
            let most = settings.max_lines;
            return Err(at(
                number,
                &format!("a batch has at most {most} lines (batch.max_lines)"),
            ));
        }
        let value: Value = serde_json::from_str(line).map_err(|e| {
            at(
                number,
                &format!("not a JSON object ({e}); the file must be JSONL"),
            )
        })?;
        let (custom_id, alias, operation) = line_fields(&value).map_err(|p| at(number, p))?;
        if !ids.insert(custom_id.to_owned()) {
            return Err(at(
                number,
                &format!("the custom_id {custom_id:?} is used by an earlier line"),
            ));
        }
        match &first {
            None => first = Some((alias.to_owned(), operation)),
            Some((first_alias, _)) if first_alias != alias => {
                return Err(at(number, &format!("its model {alias:?} is not the file's model {first_alias:?}; one batch is for one model")));
            }
            Some((_, first_op)) if *first_op != operation => {
                return Err(at(
                    number,
                    "its url is not the file's url; one batch is for one endpoint",
                ));
            }
            Some(_) => {}
        }
        lines.push(value);
    }
    let (alias, operation) = first
        .ok_or_else(|| GatewayError::InvalidRequest("the batch input file has no lines".into()))?;
    Ok(Input {
        alias,
        operation,
        lines,
    })
}

/// A line's custom_id, model and operation, or what is wrong with it.
fn line_fields(value: &Value) -> Result<(&str, &str, Operation), &'static str> {
    let object = value.as_object().ok_or("not a JSON object")?;
    let custom_id = object
        .get("custom_id")
        .and_then(Value::as_str)
        .filter(|id| !id.is_empty())
        .ok_or("missing custom_id (a non-empty string)")?;
    if object.get("method").and_then(Value::as_str) != Some("POST") {
        return Err("method must be \"POST\"");
    }
    let operation = object
        .get("url")
        .and_then(Value::as_str)
        .and_then(operation_of)
        .ok_or("url must be /v1/chat/completions or /v1/embeddings")?;
    let model = object
        .get("body")
        .and_then(|body| body.get("model"))
        .and_then(Value::as_str)
        .ok_or("body.model (the model alias) is missing")?;
    Ok((custom_id, model, operation))
}

/// The lines as `provider` takes them on `deployment`: `model` replaced, `url` in its dialect.
pub fn rewrite(input: &Input, deployment: &str, provider: Provider) -> Bytes {
    let url = match (provider, input.operation) {
        (Provider::Azure, operation) => format!("/{}", operation.path()),
        (_, operation) => format!("/v1/{}", operation.path()),
    };
    let mut out = Vec::new();
    for line in &input.lines {
        let mut line = line.clone();
        line["url"] = Value::String(url.clone());
        line["body"]["model"] = Value::String(deployment.to_owned());
        if serde_json::to_writer(&mut out, &line).is_ok() {
            out.push(b'\n');
        }
    }
    Bytes::from(out)
}

/// Prompt tokens, and completion budgets (`max_tokens`, else `default_max_tokens`; none for
/// embeddings), over every line. Prompts are counted by the tokenizer when an `estimator` is
/// given (a quota needs the count), else estimated at four bytes a token.
pub async fn estimate(
    input: &Input,
    estimator: Option<Estimator>,
    default_max_tokens: u64,
) -> (u64, u64) {
    let (mut prompt, mut completion) = (0, 0);
    for line in &input.lines {
        let body = Bytes::from(line["body"].to_string());
        let Ok(request) = ClientRequest::parse(body, input.operation) else {
            continue;
        };
        prompt += match estimator {
            Some(estimator) => admission::count_prompt(estimator, &request, input.operation).await,
            None => (request.raw().len() as u64).div_ceil(4),
        };
        completion += match input.operation {
            Operation::Embeddings => 0,
            _ => request.max_tokens.unwrap_or(default_max_tokens),
        };
    }
    (prompt, completion)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn line(id: &str, model: &str) -> String {
        format!(
            r#"{{"custom_id":"{id}","method":"POST","url":"/v1/chat/completions","body":{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}]}}}}"#
        )
    }

    fn refusal(text: &str) -> String {
        read(text, &BatchSettings::default())
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn a_good_file_names_its_alias_and_endpoint() {
        let text = [line("a", "chat"), line("b", "chat")].join("\n");
        let input = read(&text, &BatchSettings::default()).unwrap();
        assert_eq!((input.alias.as_str(), input.lines.len()), ("chat", 2));
        assert_eq!(input.operation, Operation::ChatCompletions);
        let azure = rewrite(&input, "gpt-4o-batch", Provider::Azure);
        let first: Value =
            serde_json::from_slice(azure.split(|b| *b == b'\n').next().unwrap()).unwrap();
        assert_eq!(
            (first["url"].as_str(), first["body"]["model"].as_str()),
            (Some("/chat/completions"), Some("gpt-4o-batch"))
        );
    }

    #[test]
    fn each_broken_rule_names_its_line() {
        assert!(refusal(&format!("{}\nnot json", line("a", "chat")))
            .starts_with("line 2 of the batch input file: not a JSON object"));
        assert!(
            refusal(&format!("{}\n{}", line("a", "chat"), line("a", "chat")))
                .contains("line 2 of the batch input file: the custom_id \"a\"")
        );
        assert!(
            refusal(&format!("{}\n\n{}", line("a", "chat"), line("b", "embed")))
                .starts_with("line 3")
        );
        let no_id = r#"{"method":"POST","url":"/v1/chat/completions","body":{"model":"chat"}}"#;
        assert!(refusal(no_id).contains("line 1 of the batch input file: missing custom_id"));
        let other = line("a", "chat").replace("/v1/chat/completions", "/v1/responses");
        assert!(refusal(&other).contains("url must be"));
        assert_eq!(refusal(""), "the batch input file has no lines");
        let few = BatchSettings {
            max_lines: 1,
            ..BatchSettings::default()
        };
        let two = [line("a", "chat"), line("b", "chat")].join("\n");
        assert!(read(&two, &few)
            .unwrap_err()
            .to_string()
            .starts_with("line 2"));
    }
}
