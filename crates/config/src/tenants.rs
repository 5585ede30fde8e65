//! The `tenants` section: who may call, with which client keys (stored as sha256 digests) or JWT
//! principals, which aliases and regions they may use, and their limits.

use std::collections::{BTreeSet, HashMap};

use std::sync::Arc;

use crate::limits;
use crate::model::{ClaimValues, JwtIssuer, Key, KeyOrigin, Lookup, Principal, Tenant, TenantId};
use crate::models::{Models, WILDCARD};
use crate::problems::{Mark, Problems};
use crate::read::{self, Fields};
use crate::tree::Node;

/// What tenants refer to: aliases, region groups and the regions backends are in.
pub(crate) struct Known<'a> {
    pub models: &'a Models,
    pub groups: &'a HashMap<String, Vec<String>>,
    pub backend_regions: BTreeSet<&'a str>,
    /// The issuers of `client_auth.jwt`, which principals may name.
    pub issuers: &'a [JwtIssuer],
    /// Whether the file has a `client_auth` section (its issuers may all be wrong, and said so).
    pub client_auth_written: bool,
}

pub(crate) struct Tenants {
    pub list: Vec<Tenant>,
    pub keys_by_hash: Lookup<[u8; 32], (TenantId, usize)>,
    /// `ClientAuth::principals`: per claim, its value -> (tenant, principal index).
    pub principals: Vec<(Arc<str>, ClaimValues)>,
}

#[derive(Default)]
struct Seen {
    tenants: HashMap<String, Mark>,
    key_ids: HashMap<String, Mark>,
    /// Digest -> (key id, where it was written).
    hashes: HashMap<[u8; 32], (String, Mark)>,
    /// (claim, value, issuer) -> (principal id, where it was written).
    matches: HashMap<(String, String, Option<usize>), (String, Mark)>,
}

pub(crate) fn tenants(node: Option<&Node>, known: &Known, p: &mut Problems) -> Tenants {
    let mut tenants = Tenants {
        list: Vec::new(),
        keys_by_hash: Lookup::default(),
        principals: Vec::new(),
    };
    let Some(items) = node.and_then(|n| read::list(n, p)) else {
        return tenants;
    };
    let mut seen = Seen::default();
    for item in items {
        let f = Fields::new(
            item,
            &["name", "keys", "principals", "models", "regions", "limits"],
            p,
        );
        let name_node = f.required("name", p);
        let name = name_node.and_then(|n| read::name(n, p));
        if let (Some(name), Some(n)) = (name, name_node) {
            match seen.tenants.get(name) {
                Some(first) => p.at(
                    n.mark,
                    format!("duplicate tenant name {name:?} (first defined at {first})"),
                ),
                None => {
                    seen.tenants.insert(name.to_owned(), n.mark);
                }
            }
        }
        let id = tenants.list.len();
        let (keys, digests): (Vec<Key>, Vec<[u8; 32]>) =
            keys(f.get("keys"), &mut seen, p).into_iter().unzip();
        for (index, digest) in digests.into_iter().enumerate() {
            tenants.keys_by_hash.entry(digest).or_insert((id, index));
        }
        let principals = principals(f.get("principals"), known, &mut seen, p);
        for (index, principal) in principals.iter().enumerate() {
            index_principal(&mut tenants.principals, principal, (id, index));
        }
        tenants.list.push(Tenant {
            name: name.unwrap_or_default().into(),
            keys,
            principals,
            models: f.get("models").map(|n| models(n, known.models, p)),
            regions: f.get("regions").map(|n| regions(n, known, p)),
            limits: limits::limits(f.get("limits"), limits::TENANT, p),
        });
    }
    tenants
}

/// The tenant's keys, each with its digest.
fn keys(node: Option<&Node>, seen: &mut Seen, p: &mut Problems) -> Vec<(Key, [u8; 32])> {
    let Some(items) = node.and_then(|n| read::list(n, p)) else {
        return Vec::new();
    };
    let mut keys = Vec::with_capacity(items.len());
    for item in items {
        let f = Fields::new(item, &["id", "sha256", "trace_until", "limits"], p);
        let id = caller_id(&f, seen, p);
        let digest_node = f.required("sha256", p);
        let sha256 = digest_node.and_then(|n| digest(n, p));
        if let (Some(digest), Some(n)) = (sha256, digest_node) {
            match seen.hashes.get(&digest) {
                Some((other, first)) => p.at(
                    n.mark,
                    format!("this key hash is already used by key {other:?} (at {first})"),
                ),
                None => {
                    seen.hashes.insert(digest, (id.to_owned(), n.mark));
                }
            }
        }
        keys.push((caller(&f, id, p), sha256.unwrap_or_default()));
    }
    keys
}

/// A key's or principal's `id`, unique across both (it is the `key_id` of usage records).
fn caller_id<'a>(f: &Fields<'a>, seen: &mut Seen, p: &mut Problems) -> &'a str {
    let id_node = f.required("id", p);
    let id = id_node.and_then(|n| read::name(n, p)).unwrap_or_default();
    if let Some(n) = id_node.filter(|_| !id.is_empty()) {
        match seen.key_ids.get(id) {
            Some(first) => p.at(
                n.mark,
                format!("duplicate key id {id:?} (first defined at {first})"),
            ),
            None => {
                seen.key_ids.insert(id.to_owned(), n.mark);
            }
        }
    }
    id
}

/// What a key and a principal have alike: the id, traces and own limits.
fn caller(f: &Fields, id: &str, p: &mut Problems) -> Key {
    Key {
        id: id.into(),
        trace_until: f.get("trace_until").and_then(|n| read::timestamp(n, p)),
        limits: limits::limits(f.get("limits"), limits::TENANT, p),
        models: None,
        usd_budget: None,
        origin: KeyOrigin::Config,
    }
}

fn principals(
    node: Option<&Node>,
    known: &Known,
    seen: &mut Seen,
    p: &mut Problems,
) -> Vec<Principal> {
    let issuers = known.issuers;
    let Some(node) = node else {
        return Vec::new();
    };
    let Some(items) = read::list(node, p) else {
        return Vec::new();
    };
    if !known.client_auth_written && !items.is_empty() {
        p.at(
            node.mark,
            "principals need client_auth.jwt: no issuer is configured whose tokens they could carry",
        );
    }
    let mut principals = Vec::with_capacity(items.len());
    for item in items {
        let f = Fields::new(
            item,
            &["id", "claim", "equals", "issuer", "trace_until", "limits"],
            p,
        );
        let id = caller_id(&f, seen, p);
        let claim = f.required("claim", p).and_then(|n| claim(n, p));
        let equals = f.required("equals", p).and_then(|n| read::str(n, p));
        let issuer = f.get("issuer").and_then(|n| issuer(n, issuers, p));
        let key = caller(&f, id, p);
        let (Some(claim), Some(equals)) = (claim, equals) else {
            continue;
        };
        let same = (claim.to_owned(), equals.to_owned(), issuer);
        match seen.matches.get(&same) {
            Some((other, first)) => p.at(
                f.mark,
                format!(
                    "principal {id:?} matches the same tokens as principal {other:?} (at {first})"
                ),
            ),
            None => {
                seen.matches.insert(same, (id.to_owned(), f.mark));
            }
        }
        principals.push(Principal {
            key,
            claim: claim.into(),
            equals: equals.to_owned(),
            issuer,
        });
    }
    principals
}

/// A principal's claim: one top-level claim name (`azp`, `appid`, `oid`, `sub`, `roles`, ...).
fn claim<'a>(node: &'a Node, p: &mut Problems) -> Option<&'a str> {
    let text = read::str(node, p)?.trim();
    let plain = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
    if text.is_empty() || !text.chars().all(plain) {
        p.at(
            node.mark,
            format!("unknown claim form {text:?}: name one top-level claim such as azp, appid, oid, sub or roles (a list claim matches when it holds the value)"),
        );
        return None;
    }
    Some(text)
}

/// The index of the `client_auth.jwt` issuer a principal names.
fn issuer(node: &Node, issuers: &[JwtIssuer], p: &mut Problems) -> Option<usize> {
    let text = read::str(node, p)?.trim();
    let found = issuers.iter().position(|i| i.issuer == text);
    if found.is_none() {
        let known: Vec<&str> = issuers.iter().map(|i| i.issuer.as_str()).collect();
        p.at(
            node.mark,
            format!(
                "unknown issuer {text:?} (client_auth.jwt has: {})",
                list_or_none(&known)
            ),
        );
    }
    found
}

fn index_principal(
    index: &mut Vec<(Arc<str>, ClaimValues)>,
    principal: &Principal,
    at: (TenantId, usize),
) {
    let position = match index.iter().position(|(c, _)| *c == principal.claim) {
        Some(position) => position,
        None => {
            index.push((principal.claim.clone(), Lookup::default()));
            index.len() - 1
        }
    };
    if let Some((_, values)) = index.get_mut(position) {
        values.entry(principal.equals.clone()).or_default().push(at);
    }
}

/// A sha256 digest as 64 hex digits, optionally prefixed `sha256:`.
fn digest(node: &Node, p: &mut Problems) -> Option<[u8; 32]> {
    let text = read::str(node, p)?.trim();
    let hex_digits = text.strip_prefix("sha256:").unwrap_or(text);
    let mut digest = [0u8; 32];
    match hex::decode_to_slice(hex_digits, &mut digest) {
        Ok(()) => Some(digest),
        Err(_) => {
            p.at(
                node.mark,
                format!(
                    "expected a sha256 digest: 64 hex digits, optionally prefixed \"sha256:\" (found {} characters)",
                    hex_digits.chars().count()
                ),
            );
            None
        }
    }
}

/// The aliases a tenant may use: each an alias name or `"*"`.
fn models(node: &Node, known: &Models, p: &mut Problems) -> Vec<String> {
    let Some(items) = read::list(node, p) else {
        return Vec::new();
    };
    if items.is_empty() {
        p.at(
            node.mark,
            "models: [] would refuse every request; leave it out to allow every alias",
        );
    }
    let mut names = Vec::with_capacity(items.len());
    for item in items {
        let Some(name) = read::name(item, p) else {
            continue;
        };
        if name != WILDCARD && !known.by_name.contains_key(name) {
            let mut all: Vec<&str> = known.aliases.iter().map(|a| a.name.as_str()).collect();
            if known.wildcard.is_some() {
                all.push(WILDCARD);
            }
            let all = if all.is_empty() {
                "none are defined".to_owned()
            } else {
                all.join(", ")
            };
            p.at(item.mark, format!("unknown model {name:?} (known: {all})"));
            continue;
        }
        if !names.iter().any(|n| n == name) {
            names.push(name.to_owned());
        }
    }
    names
}

/// The region names a tenant may reach: groups expand to their regions.
fn regions(node: &Node, known: &Known, p: &mut Problems) -> Vec<String> {
    let Some(items) = read::list(node, p) else {
        return Vec::new();
    };
    if items.is_empty() {
        p.at(
            node.mark,
            "regions: [] would refuse every request; leave it out to allow any region",
        );
    }
    let mut regions: Vec<String> = Vec::new();
    for item in items {
        let Some(name) = read::name(item, p) else {
            continue;
        };
        let expanded: Vec<&str> = if let Some(group) = known.groups.get(name) {
            group.iter().map(String::as_str).collect()
        } else if known.backend_regions.contains(name) {
            vec![name]
        } else {
            let mut groups: Vec<&str> = known.groups.keys().map(String::as_str).collect();
            groups.sort_unstable();
            let regions: Vec<&str> = known.backend_regions.iter().copied().collect();
            p.at(
                item.mark,
                format!(
                    "unknown region {name:?}: neither a group in regions ({}) nor a backend's region ({})",
                    list_or_none(&groups),
                    list_or_none(&regions)
                ),
            );
            continue;
        };
        for region in expanded {
            if !regions.iter().any(|r| r == region) {
                regions.push(region.to_owned());
            }
        }
    }
    regions
}

fn list_or_none(names: &[&str]) -> String {
    if names.is_empty() {
        "none".to_owned()
    } else {
        names.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use crate::testing::{compile, problems, with_backends};

    const MODELS: &str = "models:
  - { name: chat, targets: [{ backend: a, deployment: gpt-4o }] }
  - { name: \"*\", targets: [{ backends: [a, b] }] }
";

    #[test]
    fn region_groups_expand_and_backend_regions_stand_alone() {
        let s = compile(&with_backends(&format!(
            "{MODELS}regions: {{ eu: [francecentral, westeurope], us: [eastus] }}
tenants:
  - name: t
    regions: [eu, eastus, us]
    models: [chat, \"*\"]
"
        )));
        let t = &s.tenants[0];
        assert_eq!(
            t.regions.as_deref().unwrap(),
            ["francecentral", "westeurope", "eastus"]
        );
        assert!(t.may_use("*") && t.may_use("chat") && !t.may_use("other"));
        assert!(compile("tenants: [{ name: open }]").tenants[0]
            .regions
            .is_none());
    }

    #[test]
    fn keys_are_indexed_by_digest_with_or_without_the_prefix() {
        let a = "5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8";
        let b = "A665A45920422F9D417E4867EFDC4FB8A04A1F3FFF1FA07E998E86F7F7A27AE3";
        let s = compile(&format!(
            "tenants:
  - name: one
    limits: {{ rpm: 10 }}
  - name: two
    keys:
      - {{ id: k1, sha256: {a}, limits: {{ tpm: 5, max_sessions: 2 }} }}
      - {{ id: k2, sha256: \"sha256:{b}\", trace_until: 2026-12-01T10:00:00Z }}
"
        ));
        let digest = |h: &str| -> [u8; 32] { hex::decode(h).unwrap().try_into().unwrap() };
        assert_eq!(s.keys_by_hash[&digest(a)], (1, 0));
        assert_eq!(s.keys_by_hash[&digest(b)], (1, 1));
        assert_eq!(s.tenants[0].limits.rpm, Some(10));
        assert_eq!(s.tenants[1].keys[0].limits.max_sessions, Some(2));
        assert_eq!(s.tenants[1].keys[1].trace_until, Some(1_796_119_200));
    }

    #[test]
    fn tenant_mistakes_are_located() {
        let a = "5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8";
        let found = problems(&with_backends(&format!(
            "{MODELS}regions: {{ eu: [westeurope] }}
tenants:
  - name: t
    models: [chat, chatt]
    regions: [eu, mars]
    keys:
      - {{ id: k1, sha256: {a}, trace_until: 2026-12-01T10:00+02:00 }}
      - {{ id: k2, sha256: \"sha256:{a}\" }}
      - {{ id: k3, sha256: secret-looking-value }}
  - name: t
    keys: [{{ id: k1, sha256: {a}0 }}]
    models: []
    regions: []
"
        )));
        assert_eq!(
            found,
            [
                "10:20: unknown model \"chatt\" (known: chat, *)",
                "11:19: unknown region \"mars\": neither a group in regions (eu) nor a backend's region (eastus, westeurope)",
                "13:106: only UTC times (ending in Z or +00:00) are accepted, found \"2026-12-01T10:00+02:00\"",
                "14:27: this key hash is already used by key \"k1\" (at 13:27)",
                "15:27: expected a sha256 digest: 64 hex digits, optionally prefixed \"sha256:\" (found 20 characters)",
                "16:11: duplicate tenant name \"t\" (first defined at 9:11)",
                "17:18: duplicate key id \"k1\" (first defined at 13:15)",
                "17:30: expected a sha256 digest: 64 hex digits, optionally prefixed \"sha256:\" (found 65 characters)",
                "18:13: models: [] would refuse every request; leave it out to allow every alias",
                "19:14: regions: [] would refuse every request; leave it out to allow any region",
            ]
        );
        assert!(found.iter().all(|p| !p.contains("secret-looking-value")));
    }

    const ISSUERS: &str = "client_auth:
  jwt:
    - { issuer: \"https://login.microsoftonline.com/t1/v2.0\", audience: api://onedoor }
    - { issuer: \"http://127.0.0.1:9/\", audience: api://onedoor }
";

    #[test]
    fn principals_are_indexed_by_claim_and_value() {
        let s = compile(&format!(
            "{ISSUERS}tenants:
  - name: legal
    principals:
      - {{ id: legal-app, claim: azp, equals: \"0000-1\", trace_until: 2026-12-01T10:00Z }}
      - {{ id: legal-ops, claim: roles, equals: Ops, issuer: \"http://127.0.0.1:9/\", limits: {{ rpm: 5 }} }}
  - name: hr
    principals: [{{ id: hr-app, claim: azp, equals: \"0000-2\" }}]
"
        ));
        let index = &s.client_auth.principals;
        assert_eq!(index.len(), 2);
        assert_eq!(&*index[0].0, "azp");
        assert_eq!(index[0].1["0000-1"], [(0, 0)]);
        assert_eq!(index[0].1["0000-2"], [(1, 0)]);
        assert_eq!(index[1].1["Ops"], [(0, 1)]);
        let legal = &s.tenants[0];
        assert_eq!(legal.principals[1].issuer, Some(1));
        assert_eq!(legal.principals[1].key.limits.rpm, Some(5));
        assert_eq!(legal.principals[0].key.trace_until, Some(1_796_119_200));
        let ids: Vec<&str> = legal.callers().map(|k| &*k.id).collect();
        assert_eq!(ids, ["legal-app", "legal-ops"]);
        let summary = crate::summary(&s);
        assert!(
            summary.contains("legal (0 keys, 2 principals)"),
            "{summary}"
        );
        assert!(
            summary.contains(
                "JWTs accepted from https://login.microsoftonline.com/t1/v2.0, http://127.0.0.1:9/"
            ),
            "{summary}"
        );
    }

    #[test]
    fn principal_mistakes_are_located() {
        let a = "5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8";
        let found = problems(&format!(
            "{ISSUERS}tenants:
  - name: t
    keys: [{{ id: app, sha256: {a} }}]
    principals:
      - {{ id: app, claim: azp, equals: x }}
      - {{ id: p2, claim: \"roles[0]\", equals: x }}
      - {{ id: p3, claim: azp, equals: x }}
      - {{ id: p4, claim: azp, equals: y, issuer: \"https://other.example.com\" }}
      - {{ id: p5, claim: oid }}
"
        ));
        assert_eq!(
            found,
            [
                "9:15: duplicate key id \"app\" (first defined at 7:18)",
                "10:26: unknown claim form \"roles[0]\": name one top-level claim such as azp, appid, oid, sub or roles (a list claim matches when it holds the value)",
                "11:9: principal \"p3\" matches the same tokens as principal \"app\" (at 9:9)",
                "12:50: unknown issuer \"https://other.example.com\" (client_auth.jwt has: https://login.microsoftonline.com/t1/v2.0, http://127.0.0.1:9/)",
                "13:9: missing required key \"equals\"",
            ]
        );
        assert_eq!(
            problems("tenants:\n  - name: t\n    principals: [{ id: a, claim: azp, equals: x }]\n"),
            ["3:17: principals need client_auth.jwt: no issuer is configured whose tokens they could carry"]
        );
    }
}
