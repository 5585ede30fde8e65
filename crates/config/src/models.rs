//! The `models` section: the aliases applications call, each a list of targets (backend plus the
//! deployment or model sent upstream), and the optional `"*"` alias that passes any other name
//! through to a set of backends.

use std::collections::HashMap;
use std::sync::Arc;

use crate::backends::Backends;
use crate::model::{Alias, AliasId, BackendId, Lookup, Price, Target};
use crate::problems::{Mark, Problems};
use crate::read::{self, Fields};
use crate::tree::Node;

pub(crate) const WILDCARD: &str = "*";

const ALIAS_KEYS: &[&str] = &[
    "name",
    "targets",
    "continue_cut_streams",
    "session_affinity",
    "price",
];
const TARGET_KEYS: &[&str] = &[
    "backend",
    "backends",
    "deployment",
    "model",
    "priority",
    "weight",
    "price",
    "accepts_prefill",
    "batch",
];

pub(crate) struct Models {
    pub aliases: Vec<Alias>,
    pub by_name: Lookup<String, AliasId>,
    pub wildcard: Option<Alias>,
}

pub(crate) fn models(node: Option<&Node>, backends: &Backends, p: &mut Problems) -> Models {
    let mut models = Models {
        aliases: Vec::new(),
        by_name: Lookup::default(),
        wildcard: None,
    };
    let Some(items) = node.and_then(|n| read::list(n, p)) else {
        return models;
    };
    let mut first_seen: HashMap<String, Mark> = HashMap::new();
    for item in items {
        let f = Fields::new(item, ALIAS_KEYS, p);
        let name_node = f.required("name", p);
        let name = name_node.and_then(|n| read::name(n, p));
        let duplicate = match (name, name_node) {
            (Some(name), Some(n)) => match first_seen.get(name) {
                Some(first) => {
                    p.at(
                        n.mark,
                        format!("duplicate model name {name:?} (first defined at {first})"),
                    );
                    true
                }
                None => {
                    first_seen.insert(name.to_owned(), n.mark);
                    false
                }
            },
            _ => false,
        };
        let wildcard = name == Some(WILDCARD);
        let price = f.get("price").and_then(|n| self::price(n, p));
        let mut targets = targets(&f, wildcard, backends, p);
        for target in &mut targets {
            target.price = target.price.or(price);
        }
        let alias = Alias {
            name: name.unwrap_or_default().to_owned(),
            targets,
            continue_cut_streams: f.bool("continue_cut_streams", p).unwrap_or(false),
            session_affinity: f.bool("session_affinity", p).unwrap_or(false),
            price,
        };
        if duplicate {
            continue;
        }
        if wildcard {
            models.wildcard = Some(alias);
        } else {
            models
                .by_name
                .insert(alias.name.clone(), models.aliases.len());
            models.aliases.push(alias);
        }
    }
    models
}

fn targets(alias: &Fields, wildcard: bool, backends: &Backends, p: &mut Problems) -> Vec<Target> {
    let Some(node) = alias.required("targets", p) else {
        return Vec::new();
    };
    let Some(items) = read::list(node, p) else {
        return Vec::new();
    };
    if items.is_empty() {
        p.at(node.mark, "an alias needs at least one target");
    }
    let mut targets = Vec::new();
    let mut seen: Vec<(BackendId, Option<Arc<str>>, Mark)> = Vec::new();
    for item in items {
        for (target, mark) in target_entry(item, wildcard, backends, p) {
            let same = |(b, d, _): &&(BackendId, Option<Arc<str>>, Mark)| {
                *b == target.backend && *d == target.deployment
            };
            if let Some((_, _, first)) = seen.iter().find(same) {
                p.at(
                    mark,
                    format!("this alias already has this target (at {first})"),
                );
                continue;
            }
            seen.push((target.backend, target.deployment.clone(), mark));
            targets.push(target);
        }
    }
    targets
}

/// One entry of `targets`: a single target, or on `"*"` a `backends: [...]` list that expands to
/// one target per backend. Each comes with the mark of its backend name.
fn target_entry(
    item: &Node,
    wildcard: bool,
    backends: &Backends,
    p: &mut Problems,
) -> Vec<(Target, Mark)> {
    let f = Fields::new(item, TARGET_KEYS, p);
    let deployment = deployment(&f, wildcard, p);
    let priority = f.int32("priority", 1, p).unwrap_or(1);
    let weight = f.int32("weight", 1, p).unwrap_or(1);
    let price = f.get("price").and_then(|n| price(n, p));
    let accepts_prefill = f.bool("accepts_prefill", p).unwrap_or(false);
    let batch = f.bool("batch", p).unwrap_or(false);

    let names: Vec<&Node> = match (f.has("backend"), f.has("backends")) {
        (true, true) => {
            p.at(
                f.key_mark("backends"),
                "write backend or backends, not both",
            );
            Vec::new()
        }
        (false, true) if !wildcard => {
            let message =
                "backends: [...] is only for the \"*\" alias; write one target per backend";
            p.at(f.key_mark("backends"), message);
            Vec::new()
        }
        (false, true) => match f.list("backends", p) {
            Some([]) => {
                p.at(
                    f.key_mark("backends"),
                    "backends needs at least one backend",
                );
                Vec::new()
            }
            Some(items) => items.iter().collect(),
            None => Vec::new(),
        },
        (_, false) => f.required("backend", p).into_iter().collect(),
    };
    let resolved: Vec<(BackendId, Mark)> = names
        .into_iter()
        .filter_map(|name| Some((backends.resolve(name, p)?, name.mark)))
        .collect();
    // A target whose deployment was already reported would only cause follow-on problems.
    let Ok(deployment) = deployment else {
        return Vec::new();
    };
    let target = |backend| Target {
        backend,
        deployment: deployment.clone(),
        priority,
        weight,
        price,
        accepts_prefill,
        batch,
    };
    resolved
        .into_iter()
        .map(|(backend, mark)| (target(backend), mark))
        .collect()
}

/// `deployment` or `model` (the same thing in each provider's words); required except on `"*"`.
/// `Err` once a problem with it is reported.
fn deployment(f: &Fields, wildcard: bool, p: &mut Problems) -> Result<Option<Arc<str>>, ()> {
    let key = match (f.has("deployment"), f.has("model")) {
        (true, true) => {
            p.at(f.key_mark("model"), "write deployment or model, not both");
            return Err(());
        }
        (true, false) => "deployment",
        (false, true) => "model",
        (false, false) if wildcard => return Ok(None),
        (false, false) => {
            let message = "a target needs deployment (azure) or model (openai, anthropic)";
            p.at(f.mark, message);
            return Err(());
        }
    };
    match f.get(key).and_then(|n| read::name(n, p)) {
        Some(name) => Ok(Some(name.into())),
        None => Err(()),
    }
}

const PRICE_KEYS: &[&str] = &[
    "input_per_1m",
    "output_per_1m",
    "batch_input_per_1m",
    "batch_output_per_1m",
];

/// A price; the batch prices default to half the synchronous ones.
fn price(node: &Node, p: &mut Problems) -> Option<Price> {
    let f = Fields::new(node, PRICE_KEYS, p);
    let input = f
        .required("input_per_1m", p)
        .and_then(|n| read::non_negative(n, p));
    let output = f
        .required("output_per_1m", p)
        .and_then(|n| read::non_negative(n, p));
    let mut batch = |key: &str| f.get(key).map(|n| read::non_negative(n, p).ok_or(()));
    let batch_input = batch("batch_input_per_1m");
    let batch_output = batch("batch_output_per_1m");
    let mut price = Price::new(input?, output?);
    if let Some(value) = batch_input {
        price.batch_input_per_1m = value.ok()?;
    }
    if let Some(value) = batch_output {
        price.batch_output_per_1m = value.ok()?;
    }
    Some(price)
}

#[cfg(test)]
mod tests {
    use crate::testing::{compile, problems, with_backends};

    #[test]
    fn the_wildcard_expands_backends_into_one_target_each() {
        let s = compile(&with_backends(
            "models:
  - name: \"*\"
    targets:
      - { backends: [a, b], priority: 2, weight: 3 }
      - { backend: b, deployment: fallback, priority: 3 }
",
        ));
        assert!(s.aliases.is_empty() && s.alias_by_name.is_empty());
        let targets = &s.wildcard.as_ref().unwrap().targets;
        let got: Vec<_> = targets
            .iter()
            .map(|t| (t.backend, t.deployment.as_deref(), t.priority, t.weight))
            .collect();
        assert_eq!(
            got,
            [
                (0, None, 2, 3),
                (1, None, 2, 3),
                (1, Some("fallback"), 3, 1)
            ]
        );
    }

    #[test]
    fn deployment_and_model_are_the_same_field() {
        let s = compile(&with_backends(
            "models:
  - name: chat
    targets: [{ backend: a, deployment: gpt-4o }, { backend: b, model: gpt-4o-mini }]
",
        ));
        let chat = &s.aliases[s.alias_by_name["chat"]];
        assert_eq!(chat.targets[0].deployment.as_deref(), Some("gpt-4o"));
        assert_eq!(chat.targets[1].deployment.as_deref(), Some("gpt-4o-mini"));
        assert_eq!((chat.targets[1].priority, chat.targets[1].weight), (1, 1));
        assert!(!chat.targets[0].accepts_prefill && !chat.continue_cut_streams);
    }

    #[test]
    fn targets_without_a_price_take_the_alias_price() {
        let s = compile(&with_backends(
            "models:
  - name: chat
    price: { input_per_1m: 2.5, output_per_1m: 10 }
    targets:
      - { backend: a, deployment: ptu, price: { input_per_1m: 0, output_per_1m: 0 } }
      - { backend: b, model: gpt-4o }
  - name: free
    targets: [{ backend: b, model: llama }]
",
        ));
        let chat = &s.aliases[0];
        assert_eq!(chat.targets[0].price.unwrap().input_per_1m, 0.0);
        assert_eq!(chat.targets[1].price.unwrap().input_per_1m, 2.5);
        assert_eq!(chat.targets[1].price, chat.price);
        assert!(s.aliases[1].targets[0].price.is_none());
    }

    #[test]
    fn batch_prices_are_half_unless_written() {
        let s = compile(&with_backends(
            "models:
  - name: chat
    price: { input_per_1m: 2.5, output_per_1m: 10, batch_output_per_1m: 4 }
    targets:
      - { backend: a, deployment: gpt-4o-batch, batch: true }
",
        ));
        let target = &s.aliases[0].targets[0];
        let price = target.price.unwrap();
        assert_eq!(
            (price.batch_input_per_1m, price.batch_output_per_1m),
            (1.25, 4.0)
        );
        assert!(target.batch);
    }

    #[test]
    fn target_mistakes_are_located() {
        let found = problems(&with_backends(
            "models:
  - name: chat
    targets:
      - { backend: c, deployment: d }
      - { backend: a }
      - { backend: a, deployment: d, model: m }
      - { backends: [a, b], deployment: d }
      - { backend: a, deployment: e, weight: 0 }
      - { backend: b, model: x, price: { input_per_1m: -1, output_per_1m: 1 } }
      - { backend: b, model: x }
  - name: empty
    targets: []
  - name: chat
    targets: [{ backend: a, deployment: d }]
",
        ));
        assert_eq!(
            found,
            [
                "7:20: unknown backend \"c\" (known: a, b)",
                "8:9: a target needs deployment (azure) or model (openai, anthropic)",
                "9:38: write deployment or model, not both",
                "10:11: backends: [...] is only for the \"*\" alias; write one target per backend",
                "11:46: must be at least 1",
                "12:56: cannot be negative",
                "13:20: this alias already has this target (at 12:20)",
                "15:14: an alias needs at least one target",
                "16:11: duplicate model name \"chat\" (first defined at 5:11)",
            ]
        );
    }
}
