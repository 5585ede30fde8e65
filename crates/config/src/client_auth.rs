//! The `client_auth` section: the OIDC issuers (Entra ID or any other) whose JWTs the gateway
//! accepts from callers, besides client keys. Which caller a token is comes from the tenants'
//! `principals` (tenants.rs); this file reads the issuers and checks their URLs.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::Duration;

use crate::model::JwtIssuer;
use crate::problems::{Mark, Problems};
use crate::read::{self, Fields};
use crate::tree::{Node, Value};

const DEFAULT_REFETCH_INTERVAL: Duration = Duration::from_secs(60);

/// The issuers of `client_auth.jwt`, in file order.
pub(crate) fn jwt_issuers(node: Option<&Node>, p: &mut Problems) -> Vec<JwtIssuer> {
    let f = Fields::open(node, &["jwt"], p);
    let Some(items) = f.list("jwt", p) else {
        return Vec::new();
    };
    let mut seen: HashMap<String, Mark> = HashMap::new();
    let mut issuers = Vec::with_capacity(items.len());
    for item in items {
        let f = Fields::new(
            item,
            &["issuer", "audience", "jwks_url", "refetch_interval"],
            p,
        );
        let issuer = f.required("issuer", p).and_then(|n| {
            let url = url(n, "issuer", p)?;
            match seen.get(&url) {
                Some(first) => {
                    p.at(
                        n.mark,
                        format!("duplicate issuer {url:?} (first defined at {first})"),
                    );
                    None
                }
                None => {
                    seen.insert(url.clone(), n.mark);
                    Some(url)
                }
            }
        });
        let audiences = f
            .required("audience", p)
            .map(|n| audiences(n, p))
            .unwrap_or_default();
        let jwks_url = f.get("jwks_url").and_then(|n| url(n, "jwks_url", p));
        let refetch_interval = f
            .get("refetch_interval")
            .and_then(|n| read::positive_duration(n, p))
            .unwrap_or(DEFAULT_REFETCH_INTERVAL);
        if let Some(issuer) = issuer {
            issuers.push(JwtIssuer {
                issuer,
                audiences,
                jwks_url,
                refetch_interval,
            });
        }
    }
    issuers
}

/// One audience or a list of them; a token passes when its `aud` names any.
fn audiences(node: &Node, p: &mut Problems) -> Vec<String> {
    let texts: Vec<&Node> = match &node.value {
        Value::Seq(items) => items.iter().collect(),
        _ => vec![node],
    };
    if texts.is_empty() {
        p.at(
            node.mark,
            "audience: [] would refuse every token; name the audience tokens are issued for",
        );
    }
    let mut out = Vec::with_capacity(texts.len());
    for n in texts {
        match read::str(n, p).map(str::trim) {
            Some("") => p.at(n.mark, "an audience cannot be empty"),
            Some(audience) => out.push(audience.to_owned()),
            None => {}
        }
    }
    out
}

/// An `https` URL, or an `http` one on a loopback address (tests, the demo): tokens and keys
/// fetched over plain HTTP from anywhere else could be swapped on the way.
fn url(node: &Node, key: &str, p: &mut Problems) -> Option<String> {
    let text = read::str(node, p)?.trim();
    let (scheme, rest) = match text.split_once("://") {
        Some((scheme, rest)) if scheme == "https" || scheme == "http" => (scheme, rest),
        _ => {
            p.at(
                node.mark,
                format!("{key} must be a URL starting with https:// (found {text:?})"),
            );
            return None;
        }
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let host = host_of(authority);
    if host.is_empty() || text.contains(char::is_whitespace) || text.contains('#') {
        p.at(
            node.mark,
            format!("{key} must be a URL with a host, like https://login.microsoftonline.com/TENANT/v2.0 (found {text:?})"),
        );
        return None;
    }
    if scheme == "http" && !is_loopback(host) {
        p.at(
            node.mark,
            format!("{key} {text:?} is plain http on a host that is not loopback; use https (http is accepted only on 127.0.0.1, ::1 or localhost)"),
        );
        return None;
    }
    Some(text.to_owned())
}

/// The host of `user@host:port`, without brackets around an IPv6 address.
fn host_of(authority: &str) -> &str {
    let host_port = authority.rsplit('@').next().unwrap_or(authority);
    if let Some(v6) = host_port.strip_prefix('[') {
        return v6.split(']').next().unwrap_or("");
    }
    host_port.split(':').next().unwrap_or("")
}

fn is_loopback(host: &str) -> bool {
    host.eq_ignore_ascii_case("localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use crate::testing::{compile, problems};

    #[test]
    fn issuers_are_read_with_one_audience_or_several() {
        let s = compile(
            "client_auth:
  jwt:
    - { issuer: \"https://login.microsoftonline.com/t1/v2.0\", audience: \"api://onedoor\" }
    - issuer: http://127.0.0.1:8443/
      audience: [a, b]
      jwks_url: \"http://[::1]:9/keys\"
      refetch_interval: 250ms
",
        );
        let jwt = &s.client_auth.jwt;
        assert_eq!(jwt[0].issuer, "https://login.microsoftonline.com/t1/v2.0");
        assert_eq!(jwt[0].audiences, ["api://onedoor"]);
        assert_eq!(jwt[0].jwks_url, None);
        assert_eq!(jwt[1].audiences, ["a", "b"]);
        assert_eq!(jwt[1].jwks_url.as_deref(), Some("http://[::1]:9/keys"));
        assert_eq!(jwt[0].refetch_interval, std::time::Duration::from_secs(60));
        assert_eq!(
            jwt[1].refetch_interval,
            std::time::Duration::from_millis(250)
        );
        assert!(compile("").client_auth.jwt.is_empty());
    }

    #[test]
    fn issuer_mistakes_are_located() {
        let found = problems(
            "client_auth:
  jwt:
    - { issuer: login.microsoftonline.com, audience: x }
    - { issuer: \"http://idp.example.com\", audience: x }
    - { issuer: \"https://idp.example.com\", audience: [] }
    - { issuer: \"https://idp.example.com\", audience: x, jwks_url: \"ftp://k\" }
    - { audience: x, issuer: \"https:///v2.0\" }
    - { issuer: \"https://b.example.com\" }
",
        );
        assert_eq!(
            found,
            [
                "3:17: issuer must be a URL starting with https:// (found \"login.microsoftonline.com\")",
                "4:17: issuer \"http://idp.example.com\" is plain http on a host that is not loopback; use https (http is accepted only on 127.0.0.1, ::1 or localhost)",
                "5:54: audience: [] would refuse every token; name the audience tokens are issued for",
                "6:17: duplicate issuer \"https://idp.example.com\" (first defined at 5:17)",
                "6:67: jwks_url must be a URL starting with https:// (found \"ftp://k\")",
                "7:30: issuer must be a URL with a host, like https://login.microsoftonline.com/TENANT/v2.0 (found \"https:///v2.0\")",
                "8:7: missing required key \"audience\"",
            ]
        );
    }
}
