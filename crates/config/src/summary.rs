//! The one-paragraph description `onedoor validate` prints for a good config. It names things and
//! counts them; it never prints a secret or a network store URL (which may carry a password).

use std::fmt::Write;

use crate::model::{Otlp, Snapshot, StoreKind};

pub(crate) fn summary(s: &Snapshot) -> String {
    let mut out = format!("{}: ", s.source.display());
    let backends: Vec<String> = s
        .backends
        .iter()
        .map(|b| format!("{} ({}, {})", b.name, b.provider.as_str(), b.region))
        .collect();
    out.push_str(&counted(backends.len(), "backend", &backends));
    if s.backends.is_empty() {
        out.push_str(" (every request will fail until one is added)");
    }
    out.push_str("; ");
    let aliases: Vec<String> = s.aliases.iter().map(|a| a.name.clone()).collect();
    out.push_str(&counted(aliases.len(), "alias", &aliases));
    if let Some(w) = &s.wildcard {
        let _ = write!(
            out,
            ", plus \"*\" passing any other model name to {}",
            plural(w.targets.len(), "target")
        );
    }
    if s.aliases.is_empty() && s.wildcard.is_none() {
        out.push_str(" (no model can be called until one is added)");
    }
    out.push_str("; ");
    let tenants: Vec<String> = s
        .tenants
        .iter()
        .map(|t| match t.principals.len() {
            0 => format!("{} ({})", t.name, plural(t.keys.len(), "key")),
            n => format!(
                "{} ({}, {})",
                t.name,
                plural(t.keys.len(), "key"),
                plural(n, "principal")
            ),
        })
        .collect();
    out.push_str(&counted(tenants.len(), "tenant", &tenants));
    if s.tenants.is_empty() {
        out.push_str(" (no client key is accepted until one is added)");
    }
    if !s.client_auth.jwt.is_empty() {
        let issuers: Vec<&str> = s
            .client_auth
            .jwt
            .iter()
            .map(|i| i.issuer.as_str())
            .collect();
        let _ = write!(out, "; JWTs accepted from {}", issuers.join(", "));
    }
    let store = match s.state.store {
        StoreKind::Memory => "in memory",
        StoreKind::Redis => "in redis",
    };
    let usage = match s.usage.store.split_once("://") {
        Some(("sqlite", _)) => format!("usage recorded to {}", s.usage.store),
        Some((scheme, _)) => format!("usage recorded to {scheme}"),
        None => "usage recording off".to_owned(),
    };
    let admin = if s.admin.token.is_some() {
        ""
    } else {
        " (no token: /admin/* answers 401)"
    };
    let _ = write!(
        out,
        ". Clients on {}, admin on {}{admin}; state {store}; {usage}",
        s.listen, s.admin.listen
    );
    if let Some(otlp) = &s.telemetry.otlp {
        let _ = write!(out, "; traces over OTLP to {}", collector(otlp));
    }
    out.push('.');
    out
}

/// Where traces go, as scheme and host only: a path or query may carry a token.
fn collector(otlp: &Otlp) -> String {
    let Some(endpoint) = &otlp.endpoint else {
        return "the collector OTEL_EXPORTER_OTLP_ENDPOINT names".to_owned();
    };
    let (scheme, rest) = endpoint.split_once("://").unwrap_or(("http", endpoint));
    let authority = rest.split('/').next().unwrap_or(rest);
    let host = authority.rsplit('@').next().unwrap_or(authority);
    format!("{scheme}://{host}")
}

/// `3 backends: a, b, c` or `no backends`.
fn counted(n: usize, noun: &str, names: &[String]) -> String {
    if n == 0 {
        format!("no {}", plural_noun(noun))
    } else {
        format!("{}: {}", plural(n, noun), names.join(", "))
    }
}

fn plural(n: usize, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {}", plural_noun(noun))
    }
}

fn plural_noun(noun: &str) -> String {
    if noun.ends_with('s') {
        format!("{noun}es")
    } else {
        format!("{noun}s")
    }
}
