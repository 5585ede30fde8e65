//! The client-facing paths: which dialect a request speaks and where its alias comes from.

use http::Method;

use crate::errors::GatewayError;
use crate::request::Operation;

/// The API dialect a caller speaks; errors and stream details follow it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// `/v1/...`: plain OpenAI. Azure's filter-only stream chunks are dropped.
    OpenAi,
    /// `/openai/...`: Azure-style. Azure's stream chunks are kept as they came.
    Azure,
}

/// Where the alias of a model call is named.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AliasSource {
    /// The body's `model` field.
    Body,
    /// The path, as in `/openai/deployments/{alias}/...`.
    Path(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    Call {
        operation: Operation,
        dialect: Dialect,
        alias: AliasSource,
    },
    Models,
    Healthz,
    Readyz,
}

pub fn route(method: &Method, path: &str) -> Result<Route, GatewayError> {
    let segments: Vec<&str> = path.trim_end_matches('/').split('/').skip(1).collect();
    let (route, allowed) = match segments.as_slice() {
        ["healthz"] => (Route::Healthz, Method::GET),
        ["readyz"] => (Route::Readyz, Method::GET),
        ["v1", "models"] | ["openai", "v1", "models"] => (Route::Models, Method::GET),
        ["v1", rest @ ..] => (
            call(rest, Dialect::OpenAi, AliasSource::Body, path)?,
            Method::POST,
        ),
        ["openai", "v1", rest @ ..] => (
            call(rest, Dialect::Azure, AliasSource::Body, path)?,
            Method::POST,
        ),
        ["openai", "deployments", alias, rest @ ..] if !alias.is_empty() => {
            let alias = AliasSource::Path(percent_decode(alias));
            (call(rest, Dialect::Azure, alias, path)?, Method::POST)
        }
        _ => return Err(no_route(path)),
    };
    if *method != allowed {
        return Err(GatewayError::MethodNotAllowed(format!(
            "{path} accepts {allowed} only, not {method}"
        )));
    }
    Ok(route)
}

fn call(
    rest: &[&str],
    dialect: Dialect,
    alias: AliasSource,
    path: &str,
) -> Result<Route, GatewayError> {
    let operation = match rest {
        ["chat", "completions"] => Operation::ChatCompletions,
        ["embeddings"] => Operation::Embeddings,
        _ => return Err(no_route(path)),
    };
    Ok(Route::Call {
        operation,
        dialect,
        alias,
    })
}

fn no_route(path: &str) -> GatewayError {
    GatewayError::NotFound(format!("onedoor has no endpoint at {path}"))
}

/// Decodes `%XX` escapes in a path segment; invalid escapes are kept as written.
fn percent_decode(segment: &str) -> String {
    let bytes = segment.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok());
        match (bytes[i], hex.and_then(|h| u8::from_str_radix(h, 16).ok())) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_documented_path_has_its_route() {
        let chat = route(&Method::POST, "/v1/chat/completions").unwrap();
        assert_eq!(
            chat,
            Route::Call {
                operation: Operation::ChatCompletions,
                dialect: Dialect::OpenAi,
                alias: AliasSource::Body
            }
        );
        let azure = route(
            &Method::POST,
            "/openai/deployments/chat%2Ddefault/embeddings",
        )
        .unwrap();
        assert_eq!(
            azure,
            Route::Call {
                operation: Operation::Embeddings,
                dialect: Dialect::Azure,
                alias: AliasSource::Path("chat-default".into())
            }
        );
        assert_eq!(route(&Method::GET, "/v1/models").unwrap(), Route::Models);
        assert_eq!(route(&Method::GET, "/readyz").unwrap(), Route::Readyz);
    }

    #[test]
    fn unknown_paths_and_wrong_methods_are_refused() {
        assert!(matches!(
            route(&Method::POST, "/v2/x"),
            Err(GatewayError::NotFound(_))
        ));
        assert!(matches!(
            route(&Method::GET, "/v1/chat/completions"),
            Err(GatewayError::MethodNotAllowed(_))
        ));
    }
}
