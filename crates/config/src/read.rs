//! Reading typed values out of the tree: [`Fields`] over a map node (unknown keys are reported as
//! soon as it is opened) and one reader per value type, each reporting a located "expected X, found
//! Y" problem and returning `None` when the value does not fit. Absent, `null` and already-reported
//! values read as `None` without a new problem.

use std::net::SocketAddr;
use std::time::Duration;

use crate::model::Secret;
use crate::problems::{Mark, Problems};
use crate::tree::{Node, Value};
use crate::values;

pub(crate) struct Fields<'a> {
    entries: &'a [(Node, Node)],
    /// Where the map starts, for "missing required key" problems.
    pub mark: Mark,
}

impl<'a> Fields<'a> {
    /// Open `node` as a map whose keys must be among `known`. `null` opens as an empty map.
    pub fn new(node: &'a Node, known: &[&str], p: &mut Problems) -> Fields<'a> {
        let entries: &[(Node, Node)] = match &node.value {
            Value::Map(entries) => entries,
            Value::Null | Value::Invalid => &[],
            _ => {
                p.at(node.mark, format!("expected a map, found {}", node.found()));
                &[]
            }
        };
        for (key, _) in entries {
            match &key.value {
                Value::Scalar(s) if known.contains(&s.text.as_str()) => {}
                Value::Scalar(s) => p.at(
                    key.mark,
                    format!(
                        "unknown key {:?} (expected one of: {})",
                        s.text,
                        known.join(", ")
                    ),
                ),
                _ => p.at(
                    key.mark,
                    format!("expected a key name, found {}", key.found()),
                ),
            }
        }
        Fields {
            entries,
            mark: node.mark,
        }
    }

    /// Like [`Fields::new`] for an optional section: `None` opens as an empty map.
    pub fn open(node: Option<&'a Node>, known: &[&str], p: &mut Problems) -> Fields<'a> {
        match node {
            Some(node) => Fields::new(node, known, p),
            None => Fields {
                entries: &[],
                mark: Mark { line: 1, col: 1 },
            },
        }
    }

    fn entry(&self, key: &str) -> Option<&'a (Node, Node)> {
        self.entries
            .iter()
            .find(|(k, _)| matches!(&k.value, Value::Scalar(s) if s.text == key))
    }

    /// The value under `key`; `None` when absent, `null` or already reported.
    pub fn get(&self, key: &str) -> Option<&'a Node> {
        self.entry(key)
            .map(|(_, v)| v)
            .filter(|v| !matches!(v.value, Value::Null | Value::Invalid))
    }

    /// Whether `key` is written with a value (even one already reported as wrong).
    pub fn has(&self, key: &str) -> bool {
        self.entry(key)
            .is_some_and(|(_, v)| !matches!(v.value, Value::Null))
    }

    /// Where `key` is written, or where the map starts.
    pub fn key_mark(&self, key: &str) -> Mark {
        self.entry(key).map_or(self.mark, |(k, _)| k.mark)
    }

    /// The value under `key`, reporting it missing when absent or `null`.
    pub fn required(&self, key: &str, p: &mut Problems) -> Option<&'a Node> {
        match self.entry(key) {
            None => {
                p.at(self.mark, format!("missing required key {key:?}"));
                None
            }
            Some((k, v)) => match v.value {
                Value::Null => {
                    p.at(k.mark, format!("{key:?} needs a value"));
                    None
                }
                Value::Invalid => None,
                _ => Some(v),
            },
        }
    }

    pub fn bool(&self, key: &str, p: &mut Problems) -> Option<bool> {
        self.get(key).and_then(|n| bool(n, p))
    }

    pub fn int(&self, key: &str, min: u64, p: &mut Problems) -> Option<u64> {
        self.get(key).and_then(|n| int(n, min, p))
    }

    pub fn int32(&self, key: &str, min: u32, p: &mut Problems) -> Option<u32> {
        self.get(key).and_then(|n| int32(n, min, p))
    }

    pub fn duration(&self, key: &str, p: &mut Problems) -> Option<Duration> {
        self.get(key).and_then(|n| duration(n, p))
    }

    pub fn list(&self, key: &str, p: &mut Problems) -> Option<&'a [Node]> {
        self.get(key).and_then(|n| list(n, p))
    }

    pub fn secret(&self, key: &str, p: &mut Problems) -> Option<Secret> {
        self.get(key).and_then(|n| secret(n, key, p))
    }
}

/// The entries of a map whose keys are names chosen by the operator (region groups, breaker
/// policies), each key as text; non-scalar keys are reported and skipped.
pub(crate) fn named_entries<'a>(
    node: &'a Node,
    p: &mut Problems,
) -> Vec<(&'a str, &'a Node, &'a Node)> {
    let entries: &[(Node, Node)] = match &node.value {
        Value::Map(entries) => entries,
        Value::Null | Value::Invalid => &[],
        _ => {
            p.at(node.mark, format!("expected a map, found {}", node.found()));
            &[]
        }
    };
    let mut named = Vec::with_capacity(entries.len());
    for (key, value) in entries {
        match &key.value {
            Value::Scalar(s) if !s.text.trim().is_empty() => {
                named.push((s.text.as_str(), key, value))
            }
            _ => p.at(key.mark, format!("expected a name, found {}", key.found())),
        }
    }
    named
}

/// The text of a scalar. Numbers and booleans are text too: the reader decides what it needs.
pub(crate) fn str<'a>(node: &'a Node, p: &mut Problems) -> Option<&'a str> {
    match &node.value {
        Value::Scalar(s) => Some(&s.text),
        Value::Invalid => None,
        _ => {
            p.at(
                node.mark,
                format!("expected a string, found {}", node.found()),
            );
            None
        }
    }
}

/// A non-empty name (of a backend, alias, tenant, key, rule ...).
pub(crate) fn name<'a>(node: &'a Node, p: &mut Problems) -> Option<&'a str> {
    let text = str(node, p)?;
    if text.trim().is_empty() {
        p.at(node.mark, "a name cannot be empty");
        return None;
    }
    Some(text)
}

/// A secret: any non-empty string, never quoted back in a problem.
pub(crate) fn secret(node: &Node, key: &str, p: &mut Problems) -> Option<Secret> {
    match &node.value {
        Value::Scalar(s) if s.text.trim().is_empty() => {
            p.at(node.mark, format!("{key} is empty"));
            None
        }
        Value::Scalar(s) => Some(Secret::new(s.text.clone())),
        Value::Invalid => None,
        _ => {
            p.at(
                node.mark,
                format!("expected a string, found {}", node.found_kind()),
            );
            None
        }
    }
}

pub(crate) fn bool(node: &Node, p: &mut Problems) -> Option<bool> {
    match str(node, p)? {
        "true" | "True" | "TRUE" => Some(true),
        "false" | "False" | "FALSE" => Some(false),
        _ => {
            p.at(
                node.mark,
                format!("expected true or false, found {}", node.found()),
            );
            None
        }
    }
}

/// A whole number of at least `min`.
pub(crate) fn int(node: &Node, min: u64, p: &mut Problems) -> Option<u64> {
    let found = match &node.value {
        Value::Scalar(s) => match s.text.trim().parse::<u64>() {
            Ok(n) if n >= min => return Some(n),
            Ok(_) => {
                p.at(node.mark, format!("must be at least {min}"));
                return None;
            }
            Err(_) if s.text.trim().parse::<i64>().is_ok() => {
                p.at(node.mark, format!("must be at least {min}"));
                return None;
            }
            Err(_) => node.found(),
        },
        Value::Invalid => return None,
        _ => node.found(),
    };
    p.at(node.mark, format!("expected an integer, found {found}"));
    None
}

pub(crate) fn int32(node: &Node, min: u32, p: &mut Problems) -> Option<u32> {
    let n = int(node, u64::from(min), p)?;
    match u32::try_from(n) {
        Ok(n) => Some(n),
        Err(_) => {
            p.at(node.mark, format!("must be at most {}", u32::MAX));
            None
        }
    }
}

/// A finite number that is not negative.
pub(crate) fn non_negative(node: &Node, p: &mut Problems) -> Option<f64> {
    let found = match &node.value {
        Value::Scalar(s) => match s.text.trim().parse::<f64>() {
            Ok(x) if x.is_finite() && x >= 0.0 => return Some(x),
            Ok(x) if x.is_finite() => {
                p.at(node.mark, "cannot be negative");
                return None;
            }
            _ => node.found(),
        },
        Value::Invalid => return None,
        _ => node.found(),
    };
    p.at(node.mark, format!("expected a number, found {found}"));
    None
}

pub(crate) fn duration(node: &Node, p: &mut Problems) -> Option<Duration> {
    scalar_as(node, p, "a duration like \"30s\"", |s| {
        crate::parse_duration(s).ok()
    })
}

/// A duration that must be longer than zero (timeouts, breaker windows).
pub(crate) fn positive_duration(node: &Node, p: &mut Problems) -> Option<Duration> {
    let d = duration(node, p)?;
    if d.is_zero() {
        p.at(node.mark, "must be longer than zero");
        return None;
    }
    Some(d)
}

pub(crate) fn size(node: &Node, p: &mut Problems) -> Option<u64> {
    scalar_as(node, p, "a size like \"32MiB\"", values::parse_size)
}

pub(crate) fn addr(node: &Node, p: &mut Problems) -> Option<SocketAddr> {
    scalar_as(node, p, "a socket address like \"0.0.0.0:8080\"", |s| {
        s.trim().parse().ok()
    })
}

pub(crate) fn timestamp(node: &Node, p: &mut Problems) -> Option<i64> {
    let text = str(node, p)?;
    match values::parse_timestamp(text) {
        Ok(t) => Some(t),
        Err(why) => {
            p.at(node.mark, format!("{why}, found {}", node.found()));
            None
        }
    }
}

pub(crate) fn list<'a>(node: &'a Node, p: &mut Problems) -> Option<&'a [Node]> {
    match &node.value {
        Value::Seq(items) => Some(items),
        Value::Invalid => None,
        _ => {
            p.at(
                node.mark,
                format!("expected a list, found {}", node.found()),
            );
            None
        }
    }
}

/// One of a fixed set of words.
pub(crate) fn choice<T: Copy>(node: &Node, options: &[(&str, T)], p: &mut Problems) -> Option<T> {
    let text = str(node, p)?;
    if let Some((_, value)) = options.iter().find(|(word, _)| *word == text) {
        return Some(*value);
    }
    let words: Vec<&str> = options.iter().map(|(w, _)| *w).collect();
    p.at(
        node.mark,
        format!(
            "expected one of {}, found {}",
            words.join(", "),
            node.found()
        ),
    );
    None
}

fn scalar_as<T>(
    node: &Node,
    p: &mut Problems,
    expected: &str,
    parse: impl Fn(&str) -> Option<T>,
) -> Option<T> {
    let found = match &node.value {
        Value::Scalar(s) => match parse(&s.text) {
            Some(value) => return Some(value),
            None => node.found(),
        },
        Value::Invalid => return None,
        _ => node.found(),
    };
    p.at(node.mark, format!("expected {expected}, found {found}"));
    None
}
