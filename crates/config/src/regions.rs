//! The `regions` section: named groups of region names, used by tenants' data-residency rules.

use std::collections::HashMap;

use crate::problems::Problems;
use crate::read;
use crate::tree::Node;

pub(crate) fn regions(node: Option<&Node>, p: &mut Problems) -> HashMap<String, Vec<String>> {
    let mut groups = HashMap::new();
    let Some(node) = node else { return groups };
    for (group, _, value) in read::named_entries(node, p) {
        let Some(items) = read::list(value, p) else {
            continue;
        };
        if items.is_empty() {
            p.at(
                value.mark,
                format!("region group {group:?} needs at least one region"),
            );
        }
        let names = items
            .iter()
            .filter_map(|n| read::name(n, p))
            .map(str::to_owned)
            .collect();
        groups.insert(group.to_owned(), names);
    }
    groups
}
