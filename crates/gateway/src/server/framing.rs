//! The framing rules of RFC 9110 and 9112 that hyper's parser leaves to its user, checked on an
//! HTTP/1.x request's head before anything reads it: one well-formed `Host` (required from
//! HTTP/1.1 clients), and no transfer coding the gateway would have to decode but `chunked`.
//! hyper refuses the rest itself (signed or doubled lengths, a coding that does not end in
//! `chunked`, codings from HTTP/1.0 clients, malformed chunks).

use http::header::{HOST, TRANSFER_ENCODING};
use http::{HeaderMap, Request, Version};

use crate::errors::GatewayError;

fn bad(why: &str) -> Option<GatewayError> {
    Some(GatewayError::InvalidRequest(why.to_owned()))
}

/// What is wrong with an HTTP/1.x `request`'s framing, if anything.
pub fn refusal<B>(request: &Request<B>) -> Option<GatewayError> {
    host(request.headers(), request.version()).or_else(|| codings(request.headers()))
}

fn host(headers: &HeaderMap, version: Version) -> Option<GatewayError> {
    let mut hosts = headers.get_all(HOST).iter();
    let first = hosts.next();
    if hosts.next().is_some() {
        return bad("the request has more than one Host header");
    }
    match first {
        None if version == Version::HTTP_11 => bad("an HTTP/1.1 request must have a Host header"),
        Some(host) if !is_authority(host.as_bytes()) => {
            bad("the Host header is not a host with an optional port")
        }
        _ => None,
    }
}

/// Whether `value` is `uri-host [ ":" port ]` (RFC 9110 7.2), or empty.
fn is_authority(value: &[u8]) -> bool {
    let (host, port) = match value.strip_prefix(b"[") {
        Some(literal) => match literal.iter().position(|&b| b == b']') {
            Some(end) => {
                let address = &literal[..end];
                let ok = address
                    .iter()
                    .all(|&b| b.is_ascii_hexdigit() || b == b':' || b == b'.');
                match ok {
                    true => (&b""[..], &literal[end + 1..]),
                    false => return false,
                }
            }
            None => return false,
        },
        None => match value.iter().rposition(|&b| b == b':') {
            Some(colon) => (&value[..colon], &value[colon..]),
            None => (value, &b""[..]),
        },
    };
    let port_ok = match port.split_first() {
        None => true,
        Some((b':', digits)) => digits.iter().all(u8::is_ascii_digit),
        Some(_) => false,
    };
    port_ok && host.iter().all(|&b| is_host_byte(b))
}

/// A byte of a reg-name or IPv4 address: unreserved, sub-delims or a percent-encoding's.
fn is_host_byte(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || b"-._~%!$&'()*+,;=".contains(&byte)
}

/// `chunked` once, and no other coding: a body coded otherwise would reach the handler undecoded.
fn codings(headers: &HeaderMap) -> Option<GatewayError> {
    let mut chunked = 0;
    for value in headers.get_all(TRANSFER_ENCODING) {
        for coding in value.as_bytes().split(|&b| b == b',') {
            let coding = coding.trim_ascii();
            if coding.eq_ignore_ascii_case(b"chunked") {
                chunked += 1;
            } else if !coding.is_empty() {
                return Some(GatewayError::NotImplemented(
                    "the gateway decodes no transfer coding but chunked".to_owned(),
                ));
            }
        }
    }
    match chunked > 1 {
        true => bad("the body is chunked more than once"),
        false => None,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn request(version: Version, headers: &[(&str, &str)]) -> Request<()> {
        let mut request = Request::builder().version(version).uri("/");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        request.body(()).unwrap()
    }

    fn refused(version: Version, headers: &[(&str, &str)]) -> Option<u16> {
        refusal(&request(version, headers)).map(|r| r.status().as_u16())
    }

    #[test]
    fn an_http11_request_needs_exactly_one_well_formed_host() {
        let v11 = Version::HTTP_11;
        assert_eq!(refused(v11, &[("host", "api.example.com")]), None);
        assert_eq!(refused(v11, &[("host", "127.0.0.1:8080")]), None);
        assert_eq!(refused(v11, &[("host", "[::1]:8080")]), None);
        assert_eq!(refused(v11, &[("host", "")]), None);
        assert_eq!(refused(v11, &[]), Some(400));
        assert_eq!(refused(v11, &[("host", "a"), ("host", "b")]), Some(400));
        assert_eq!(refused(v11, &[("host", "a b@c")]), Some(400));
        assert_eq!(refused(v11, &[("host", "user@host")]), Some(400));
        assert_eq!(refused(v11, &[("host", "host:80x")]), Some(400));
        assert_eq!(refused(v11, &[("host", "[::1")]), Some(400));
        assert_eq!(refused(v11, &[("host", "a/b")]), Some(400));
    }

    #[test]
    fn any_bytes_in_host_and_coding_are_judged_without_a_panic() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(48);
        let alphabet = b"aZ09.-_~%!$&'()*+,;=:[]@/ \t,chunkedgzip";
        for _ in 0..20_000 {
            let mut field = || -> Vec<u8> {
                (0..rng.random_range(0..24))
                    .map(|_| alphabet[rng.random_range(0..alphabet.len())])
                    .collect()
            };
            let (host, coding) = (field(), field());
            let (Ok(host), Ok(coding)) = (
                http::HeaderValue::from_bytes(&host),
                http::HeaderValue::from_bytes(&coding),
            ) else {
                continue;
            };
            let request = Request::builder()
                .header("host", host)
                .header("transfer-encoding", coding)
                .body(())
                .unwrap();
            let _ = refusal(&request);
        }
    }

    #[test]
    fn an_http10_request_may_come_without_host() {
        assert_eq!(refused(Version::HTTP_10, &[]), None);
    }

    #[test]
    fn only_chunked_is_decoded_and_only_once() {
        let v11 = Version::HTTP_11;
        let host = ("host", "x");
        assert_eq!(
            refused(v11, &[host, ("transfer-encoding", "chunked")]),
            None
        );
        assert_eq!(
            refused(v11, &[host, ("transfer-encoding", "Chunked")]),
            None
        );
        assert_eq!(
            refused(v11, &[host, ("transfer-encoding", "gzip, chunked")]),
            Some(501)
        );
        assert_eq!(
            refused(
                v11,
                &[
                    host,
                    ("transfer-encoding", "deflate"),
                    ("transfer-encoding", "chunked")
                ]
            ),
            Some(501)
        );
        assert_eq!(
            refused(v11, &[host, ("transfer-encoding", "chunked, chunked")]),
            Some(400)
        );
    }
}
