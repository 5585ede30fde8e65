//! Helpers for the section tests: compile a YAML snippet with a fixed environment.

use std::path::Path;

use crate::{parse, Snapshot};

pub(crate) fn env(name: &str) -> Option<String> {
    match name {
        "HOST" => Some("aoai.example.com".to_owned()),
        "KEY" => Some("secret-key-value".to_owned()),
        _ => None,
    }
}

pub(crate) fn compile(text: &str) -> Snapshot {
    match parse(text, Path::new("t.yaml"), &env) {
        Ok(snapshot) => snapshot,
        Err(problems) => panic!("unexpected problems: {problems:#?}"),
    }
}

/// The problems as `LINE:COL: message`.
pub(crate) fn problems(text: &str) -> Vec<String> {
    match parse(text, Path::new("t.yaml"), &env) {
        Ok(_) => panic!("expected problems"),
        Err(problems) => problems
            .iter()
            .map(|p| format!("{}:{}: {}", p.line, p.col, p.message))
            .collect(),
    }
}

/// Two backends, `a` (azure, westeurope) and `b` (openai, eastus), ahead of `rest`.
pub(crate) fn with_backends(rest: &str) -> String {
    format!(
        "backends:
  - {{ name: a, provider: azure, url: https://a.example.com, region: westeurope }}
  - {{ name: b, provider: openai, url: https://b.example.com, region: eastus }}
{rest}"
    )
}
