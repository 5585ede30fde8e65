//! The client-facing paths: which dialect a request speaks and where its alias comes from.

use http::Method;
use smallvec::SmallVec;

use crate::errors::GatewayError;
use crate::request::Operation;

/// The API dialect a caller speaks; errors and stream details follow it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// `/v1/...`: plain OpenAI. Azure's filter-only stream chunks are dropped.
    OpenAi,
    /// `/openai/...`: Azure-style. Azure's stream chunks are kept as they came.
    Azure,
    /// `/v1/messages`: Anthropic Messages, translated at the door and on the way out.
    Anthropic,
}

/// The dialect a path speaks, for answers given before (or without) a route: errors included.
pub fn dialect_of(path: &str) -> Dialect {
    let path = path.trim_end_matches('/');
    if path == "/v1/messages" || path.starts_with("/v1/messages/") {
        Dialect::Anthropic
    } else if path.starts_with("/openai/") {
        Dialect::Azure
    } else {
        Dialect::OpenAi
    }
}

/// Where the alias of a model call is named.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AliasSource {
    /// The body's `model` field.
    Body,
    /// The path, as in `/openai/deployments/{alias}/...`.
    Path(String),
}

/// Which realtime URL a WebSocket handshake came to; each names its alias in its own query field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RealtimePath {
    /// `/v1/realtime?model={alias}` (OpenAI clients).
    OpenAi,
    /// `/openai/realtime?deployment={alias}&api-version=...` (Azure clients, beta protocol).
    Azure,
    /// `/openai/v1/realtime?model={alias}` (Azure clients on the v1 surface).
    AzureV1,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    Call {
        operation: Operation,
        dialect: Dialect,
        alias: AliasSource,
    },
    Models,
    /// A realtime WebSocket handshake.
    Realtime(RealtimePath),
    /// The files and batches surface, in the caller's dialect.
    Batch(crate::batch::Resource, Dialect),
    Healthz,
    Readyz,
}

pub fn route(method: &Method, path: &str) -> Result<Route, GatewayError> {
    // Inline: every known path has at most five segments.
    let segments: SmallVec<[&str; 6]> = path.trim_end_matches('/').split('/').skip(1).collect();
    let (route, allowed) = match segments.as_slice() {
        ["healthz"] => (Route::Healthz, Method::GET),
        ["readyz"] => (Route::Readyz, Method::GET),
        ["v1", "models"] | ["openai", "v1", "models"] => (Route::Models, Method::GET),
        ["v1", "messages"] => (
            Route::Call {
                operation: Operation::ChatCompletions,
                dialect: Dialect::Anthropic,
                alias: AliasSource::Body,
            },
            Method::POST,
        ),
        ["v1", "realtime"] => (Route::Realtime(RealtimePath::OpenAi), Method::GET),
        ["openai", "realtime"] => (Route::Realtime(RealtimePath::Azure), Method::GET),
        ["openai", "v1", "realtime"] => (Route::Realtime(RealtimePath::AzureV1), Method::GET),
        ["v1", kind @ ("files" | "batches"), rest @ ..] => {
            return batch_route(method, Dialect::OpenAi, kind, rest, path)
        }
        ["openai", "v1", kind @ ("files" | "batches"), rest @ ..]
        | ["openai", kind @ ("files" | "batches"), rest @ ..] => {
            return batch_route(method, Dialect::Azure, kind, rest, path)
        }
        ["v1", rest @ ..] => (
            call(rest, Dialect::OpenAi, AliasSource::Body, path)?,
            Method::POST,
        ),
        ["openai", "v1", rest @ ..] => (
            call(rest, Dialect::Azure, AliasSource::Body, path)?,
            Method::POST,
        ),
        ["openai", "deployments", alias, rest @ ..] if !alias.is_empty() => {
            let alias = AliasSource::Path(percent_decode(alias, Encoded::Path));
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

/// A files or batches path: each resource takes its own methods.
fn batch_route(
    method: &Method,
    dialect: Dialect,
    kind: &str,
    rest: &[&str],
    path: &str,
) -> Result<Route, GatewayError> {
    use crate::batch::Resource;
    let id = |id: &str| percent_decode(id, Encoded::Path);
    let resource = match (kind, rest, method.as_str()) {
        ("files", [], "POST") => Resource::UploadFile,
        ("files", [], "GET") => Resource::ListFiles,
        ("files", [file], "GET") => Resource::File(id(file)),
        ("files", [file], "DELETE") => Resource::DeleteFile(id(file)),
        ("files", [file, "content"], "GET") => Resource::FileContent(id(file)),
        ("batches", [], "POST") => Resource::CreateBatch,
        ("batches", [], "GET") => Resource::ListBatches,
        ("batches", [batch], "GET") => Resource::Batch(id(batch)),
        ("batches", [batch, "cancel"], "POST") => Resource::CancelBatch(id(batch)),
        ("files", [] | [_] | [_, "content"], _) | ("batches", [] | [_] | [_, "cancel"], _) => {
            return Err(GatewayError::MethodNotAllowed(format!(
                "{path} does not accept {method}"
            )))
        }
        _ => return Err(no_route(path)),
    };
    Ok(Route::Batch(resource, dialect))
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
        ["responses"] if matches!(alias, AliasSource::Body) => Operation::Responses,
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

/// Where a percent-encoded text comes from: in a query, `+` means a space; in a path it is itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoded {
    Path,
    Query,
}

/// Decodes `%XX` escapes (and `+` in a query); invalid escapes are kept as written.
pub fn percent_decode(text: &str, encoded: Encoded) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let escaped = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], escaped) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (b'+', _) if encoded == Encoded::Query => {
                out.push(b' ');
                i += 1;
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
        let messages = route(&Method::POST, "/v1/messages").unwrap();
        assert_eq!(
            messages,
            Route::Call {
                operation: Operation::ChatCompletions,
                dialect: Dialect::Anthropic,
                alias: AliasSource::Body
            }
        );
        assert_eq!(dialect_of("/v1/messages"), Dialect::Anthropic);
        let responses = route(&Method::POST, "/v1/responses").unwrap();
        assert!(matches!(
            responses,
            Route::Call {
                operation: Operation::Responses,
                dialect: Dialect::OpenAi,
                ..
            }
        ));
        assert_eq!(route(&Method::GET, "/readyz").unwrap(), Route::Readyz);
        assert_eq!(
            route(&Method::GET, "/openai/realtime").unwrap(),
            Route::Realtime(RealtimePath::Azure)
        );
        assert!(matches!(
            route(&Method::POST, "/v1/realtime"),
            Err(GatewayError::MethodNotAllowed(_))
        ));
    }

    #[test]
    fn files_and_batches_have_their_routes_in_both_dialects() {
        use crate::batch::Resource;
        let upload = route(&Method::POST, "/v1/files").unwrap();
        assert_eq!(upload, Route::Batch(Resource::UploadFile, Dialect::OpenAi));
        let content = route(&Method::GET, "/openai/files/file-1/content").unwrap();
        assert_eq!(
            content,
            Route::Batch(Resource::FileContent("file-1".into()), Dialect::Azure)
        );
        let cancel = route(&Method::POST, "/openai/v1/batches/batch_1/cancel").unwrap();
        assert_eq!(
            cancel,
            Route::Batch(Resource::CancelBatch("batch_1".into()), Dialect::Azure)
        );
        assert!(matches!(
            route(&Method::PUT, "/v1/batches"),
            Err(GatewayError::MethodNotAllowed(_))
        ));
        assert!(matches!(
            route(&Method::GET, "/v1/batches/b/other"),
            Err(GatewayError::NotFound(_))
        ));
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
