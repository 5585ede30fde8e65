//! The YAML document as a small tree whose every node knows where it was written, built from
//! yaml-rust2's event parser. Duplicate map keys and syntax errors become located problems here.

use std::collections::HashMap;

use yaml_rust2::parser::{Event, MarkedEventReceiver, Parser};
use yaml_rust2::scanner::{Marker, TScalarStyle};

use crate::problems::{Mark, Problems};

#[derive(Debug, Clone)]
pub(crate) struct Node {
    pub value: Value,
    pub mark: Mark,
}

#[derive(Debug, Clone)]
pub(crate) enum Value {
    Scalar(Scalar),
    Map(Vec<(Node, Node)>),
    Seq(Vec<Node>),
    /// `~`, `null` or nothing at all.
    Null,
    /// A value whose problem has already been reported (e.g. a missing `${NAME}`); readers skip it
    /// silently so one mistake yields one problem.
    Invalid,
}

#[derive(Debug, Clone)]
pub(crate) struct Scalar {
    pub text: String,
    /// The text as written in the file, kept when `${NAME}` or `file:` replaced it, so problems
    /// quote what the operator wrote instead of what a secret resolved to.
    pub written: Option<String>,
}

impl Node {
    /// What this node is, for "expected X, found Y" messages. Scalars are quoted as written.
    pub fn found(&self) -> String {
        match &self.value {
            Value::Scalar(Scalar {
                written: Some(written),
                ..
            }) => {
                format!("{written:?} (its value is not shown)")
            }
            Value::Scalar(s) => format!("{:?}", s.text),
            Value::Map(_) => "a map".to_owned(),
            Value::Seq(_) => "a list".to_owned(),
            Value::Null | Value::Invalid => "nothing".to_owned(),
        }
    }

    /// Like [`Node::found`], but never quotes the value: for secrets and URLs that may carry credentials.
    pub fn found_kind(&self) -> &'static str {
        match &self.value {
            Value::Scalar(_) => "a string",
            Value::Map(_) => "a map",
            Value::Seq(_) => "a list",
            Value::Null | Value::Invalid => "nothing",
        }
    }
}

/// Parse `text` into a tree. `None` after a syntax error (reported), which ends compilation.
pub(crate) fn parse(text: &str, problems: &mut Problems) -> Option<Node> {
    let mut builder = Builder::default();
    let mut parser = Parser::new_from_str(text);
    if let Err(e) = parser.load(&mut builder, false) {
        let m = e.marker();
        let line = text.lines().nth(m.line().saturating_sub(1)).unwrap_or("");
        // `{ api_key: ${KEY} }` is the easy mistake: in flow style, braces end a plain value.
        let hint = if e.info().contains("flow") && line.contains("${") {
            " (inside { } or [ ], quote a value that contains ${...}: \"${NAME}\")"
        } else {
            ""
        };
        problems.at(
            Mark {
                line: m.line(),
                col: m.col() + 1,
            },
            format!("invalid YAML: {}{hint}", e.info()),
        );
        return None;
    }
    // One file is one config: a second `---` document would otherwise be ignored without a word.
    if let Ok((event, at)) = parser.next_token() {
        if event != Event::StreamEnd {
            problems.at(
                mark(at),
                "a config file holds one YAML document; remove this second one",
            );
        }
    }
    problems.extend(builder.problems);
    Some(builder.root.unwrap_or(Node {
        value: Value::Null,
        mark: Mark { line: 1, col: 1 },
    }))
}

enum Frame {
    Seq {
        mark: Mark,
        anchor: usize,
        items: Vec<Node>,
    },
    Map {
        mark: Mark,
        anchor: usize,
        entries: Vec<(Node, Node)>,
        key: Option<Node>,
    },
}

#[derive(Default)]
struct Builder {
    stack: Vec<Frame>,
    anchors: HashMap<usize, Node>,
    root: Option<Node>,
    problems: Problems,
}

/// yaml-rust2 markers have 1-based lines and 0-based columns.
fn mark(m: Marker) -> Mark {
    Mark {
        line: m.line(),
        col: m.col() + 1,
    }
}

impl MarkedEventReceiver for Builder {
    fn on_event(&mut self, event: Event, marker: Marker) {
        let at = mark(marker);
        match event {
            Event::Scalar(text, style, anchor, _tag) => {
                let value = if style == TScalarStyle::Plain && is_null(&text) {
                    Value::Null
                } else {
                    Value::Scalar(Scalar {
                        text,
                        written: None,
                    })
                };
                self.complete(Node { value, mark: at }, anchor);
            }
            Event::SequenceStart(anchor, _) => self.stack.push(Frame::Seq {
                mark: at,
                anchor,
                items: Vec::new(),
            }),
            Event::MappingStart(anchor, _) => self.stack.push(Frame::Map {
                mark: at,
                anchor,
                entries: Vec::new(),
                key: None,
            }),
            // yaml-rust2 marks a block collection after its first key or dash; a collection
            // starts where its first entry does when that is earlier (a flow one at its bracket).
            Event::SequenceEnd | Event::MappingEnd => match self.stack.pop() {
                Some(Frame::Seq {
                    mark,
                    anchor,
                    items,
                }) => {
                    let mark = items.first().map_or(mark, |first| mark.min(first.mark));
                    self.complete(
                        Node {
                            value: Value::Seq(items),
                            mark,
                        },
                        anchor,
                    )
                }
                Some(Frame::Map {
                    mark,
                    anchor,
                    entries,
                    ..
                }) => {
                    let mark = entries.first().map_or(mark, |(key, _)| mark.min(key.mark));
                    self.complete(
                        Node {
                            value: Value::Map(entries),
                            mark,
                        },
                        anchor,
                    )
                }
                None => {}
            },
            Event::Alias(id) => {
                let node = match self.anchors.get(&id) {
                    Some(node) => Node {
                        mark: at,
                        ..node.clone()
                    },
                    None => {
                        self.problems.at(at, "alias to an unknown anchor");
                        Node {
                            value: Value::Invalid,
                            mark: at,
                        }
                    }
                };
                self.complete(node, 0);
            }
            Event::Nothing
            | Event::StreamStart
            | Event::StreamEnd
            | Event::DocumentStart
            | Event::DocumentEnd => {}
        }
    }
}

impl Builder {
    /// A node is finished: remember its anchor and hang it under its parent.
    fn complete(&mut self, node: Node, anchor: usize) {
        if anchor != 0 {
            self.anchors.insert(anchor, node.clone());
        }
        match self.stack.last_mut() {
            None => self.root = Some(node),
            Some(Frame::Seq { items, .. }) => items.push(node),
            Some(Frame::Map { entries, key, .. }) => match key.take() {
                None => *key = Some(node),
                Some(k) => {
                    if let Some(first) = entries.iter().find(|(e, _)| same_key(e, &k)) {
                        self.problems.at(
                            k.mark,
                            format!(
                                "duplicate key {} (first defined at {})",
                                k.found(),
                                first.0.mark
                            ),
                        );
                    } else {
                        entries.push((k, node));
                    }
                }
            },
        }
    }
}

fn same_key(a: &Node, b: &Node) -> bool {
    match (&a.value, &b.value) {
        (Value::Scalar(a), Value::Scalar(b)) => a.text == b.text,
        (Value::Null, Value::Null) => true,
        _ => false,
    }
}

fn is_null(text: &str) -> bool {
    matches!(text, "" | "~" | "null" | "Null" | "NULL")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(text: &str) -> (Option<Node>, Vec<String>) {
        let mut p = Problems::default();
        let node = parse(text, &mut p);
        (node, p.messages())
    }

    fn entries(node: &Node) -> &[(Node, Node)] {
        match &node.value {
            Value::Map(e) => e,
            other => panic!("not a map: {other:?}"),
        }
    }

    #[test]
    fn marks_are_one_based_lines_and_columns() {
        let (node, problems) = tree("a: 1\nb:\n  c: [x, 'y']\n");
        assert!(problems.is_empty());
        let node = node.unwrap();
        let e = entries(&node);
        assert_eq!(e[0].0.mark, Mark { line: 1, col: 1 });
        assert_eq!(e[0].1.mark, Mark { line: 1, col: 4 });
        let inner = entries(&e[1].1);
        assert_eq!(inner[0].0.mark, Mark { line: 3, col: 3 });
        let Value::Seq(items) = &inner[0].1.value else {
            panic!("not a list")
        };
        assert_eq!(items[1].mark, Mark { line: 3, col: 10 });
    }

    #[test]
    fn empty_and_tilde_values_are_null_but_quoted_null_is_a_string() {
        let (node, _) = tree("a:\nb: ~\nc: 'null'\n");
        let node = node.unwrap();
        let e = entries(&node);
        assert!(matches!(e[0].1.value, Value::Null));
        assert!(matches!(e[1].1.value, Value::Null));
        assert!(matches!(&e[2].1.value, Value::Scalar(s) if s.text == "null"));
    }

    #[test]
    fn duplicate_keys_are_reported_at_the_second_one() {
        let (_, problems) = tree("a: 1\nb: 2\na: 3\n");
        assert_eq!(
            problems,
            ["3:1: duplicate key \"a\" (first defined at 1:1)"]
        );
    }

    #[test]
    fn syntax_errors_are_located() {
        let (node, problems) = tree("a: [1, 2\nb: 3\n");
        assert!(node.is_none());
        assert_eq!(problems.len(), 1);
        assert!(problems[0].contains("invalid YAML"), "{problems:?}");
    }

    #[test]
    fn unquoted_references_in_flow_style_get_a_hint() {
        let (_, problems) = tree("a: { k: ${KEY} }\n");
        assert_eq!(
            problems,
            ["1:10: invalid YAML: while parsing a flow mapping, did not find expected ',' or '}' \
              (inside { } or [ ], quote a value that contains ${...}: \"${NAME}\")"]
        );
    }

    #[test]
    fn a_second_document_is_a_problem() {
        let (_, problems) = tree("a: 1\n---\nb: 2\n");
        assert_eq!(problems.len(), 1);
        assert!(
            problems[0].starts_with("2:1: a config file holds one YAML document"),
            "{problems:?}"
        );
        assert!(tree("---\na: 1\n...\n").1.is_empty());
    }

    #[test]
    fn aliases_copy_the_anchored_node() {
        let (node, problems) = tree("a: &t { x: 1 }\nb: *t\n");
        assert!(problems.is_empty());
        let node = node.unwrap();
        assert_eq!(entries(&entries(&node)[1].1).len(), 1);
    }
}
