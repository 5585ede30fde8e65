//! `${NAME}` and `file:` in string values: every scalar value in the tree is resolved before the
//! schema is read, so secrets, URLs and names all work the same. A value that cannot be resolved is
//! reported (by variable name or path, never by content) and marked so no reader reports it again.

use std::path::Path;

use crate::problems::Problems;
use crate::tree::{Node, Value};

/// Resolve every scalar value under `node`; relative `file:` paths are relative to `base`.
pub(crate) fn resolve(
    node: &mut Node,
    base: &Path,
    env: &dyn Fn(&str) -> Option<String>,
    p: &mut Problems,
) {
    match &mut node.value {
        Value::Map(entries) => {
            for (_, value) in entries {
                resolve(value, base, env, p);
            }
        }
        Value::Seq(items) => {
            for item in items {
                resolve(item, base, env, p);
            }
        }
        Value::Scalar(scalar) => match resolve_text(&scalar.text, base, env) {
            Ok(None) => {}
            Ok(Some(text)) => {
                scalar.written = Some(std::mem::replace(&mut scalar.text, text));
            }
            Err(errors) => {
                for error in errors {
                    p.at(node.mark, error);
                }
                node.value = Value::Invalid;
            }
        },
        Value::Null | Value::Invalid => {}
    }
}

/// The resolved text, or `None` when `text` contains nothing to resolve.
fn resolve_text(
    text: &str,
    base: &Path,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<String>, Vec<String>> {
    let substituted = if text.contains('$') {
        Some(substitute(text, env)?)
    } else {
        None
    };
    let current = substituted.as_deref().unwrap_or(text);
    match current.strip_prefix("file:") {
        Some(path) => read_file(base, path).map(Some).map_err(|e| vec![e]),
        None => Ok(substituted.filter(|s| s != text)),
    }
}

/// Replace each `${NAME}` by the variable's value; `$${` is a literal `${`.
fn substitute(text: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<String, Vec<String>> {
    let mut out = String::with_capacity(text.len());
    let mut errors = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let from_dollar = &rest[i..];
        if let Some(after) = from_dollar.strip_prefix("$${") {
            out.push_str("${");
            rest = after;
        } else if let Some(body) = from_dollar.strip_prefix("${") {
            let Some(end) = body.find('}') else {
                errors.push("unterminated \"${\" (write $${ for a literal \"${\")".to_owned());
                rest = "";
                break;
            };
            let name = &body[..end];
            if !is_env_name(name) {
                errors.push(format!("invalid environment variable name {name:?}"));
            } else {
                match env(name) {
                    Some(value) => out.push_str(&value),
                    None => errors.push(format!("environment variable {name} is not set")),
                }
            }
            rest = &body[end + 1..];
        } else {
            out.push('$');
            rest = &from_dollar[1..];
        }
    }
    out.push_str(rest);
    if errors.is_empty() {
        Ok(out)
    } else {
        Err(errors)
    }
}

fn is_env_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn read_file(base: &Path, path: &str) -> Result<String, String> {
    let path = path.trim();
    if path.is_empty() {
        return Err("file: needs a path".to_owned());
    }
    let full = base.join(path);
    match std::fs::read_to_string(&full) {
        Ok(contents) if contents.trim().is_empty() => {
            Err(format!("file {} is empty", full.display()))
        }
        Ok(contents) => Ok(contents.trim().to_owned()),
        Err(e) => Err(format!("cannot read file {}: {e}", full.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(name: &str) -> Option<String> {
        match name {
            "HOST" => Some("db.internal".to_owned()),
            "PORT" => Some("5432".to_owned()),
            _ => None,
        }
    }

    #[test]
    fn variables_are_replaced_inside_longer_strings() {
        assert_eq!(
            substitute("postgres://app@${HOST}:${PORT}/usage", &env).unwrap(),
            "postgres://app@db.internal:5432/usage"
        );
    }

    #[test]
    fn a_doubled_dollar_is_a_literal_and_a_lone_dollar_stays() {
        assert_eq!(substitute("a$${HOST}b$c", &env).unwrap(), "a${HOST}b$c");
    }

    #[test]
    fn every_missing_variable_is_named() {
        assert_eq!(
            substitute("${NOPE}-${HOST}-${ALSO_NOPE}", &env).unwrap_err(),
            [
                "environment variable NOPE is not set",
                "environment variable ALSO_NOPE is not set"
            ]
        );
    }

    #[test]
    fn malformed_references_are_problems() {
        assert_eq!(substitute("${HOST", &env).unwrap_err().len(), 1);
        assert_eq!(substitute("${1X}", &env).unwrap_err().len(), 1);
    }

    #[test]
    fn unreadable_files_are_named_by_path() {
        let err = resolve_text("file:/no/such/secret", Path::new("."), &env).unwrap_err();
        assert_eq!(err.len(), 1);
        assert!(
            err[0].starts_with("cannot read file /no/such/secret:"),
            "{err:?}"
        );
    }

    #[test]
    fn text_without_references_is_left_alone() {
        assert_eq!(
            resolve_text("plain $ text", Path::new("."), &env).unwrap(),
            None
        );
    }
}
