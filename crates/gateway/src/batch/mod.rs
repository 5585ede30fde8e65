//! The files and batches surface (OpenAI's `/v1/files` and `/v1/batches`, Azure's under
//! `/openai/`): a tenant's batch input files are kept by the gateway, checked line by line; a
//! batch is placed on one backend of its alias (the router's candidates, in priority order),
//! where its file is uploaded with each line's model rewritten, and moved to the next when that
//! backend refuses it. Ids given to callers are the gateway's own, and every lookup goes through
//! the caller's tenant, so a tenant never sees another's files or batches.

mod create;
mod holder;
mod input;
mod ledger;
mod objects;
mod settle;
mod upload;

use bytes::Bytes;
use http::{header, HeaderValue, Request, Response, StatusCode};
use serde_json::Value;

use crate::auth::{self, Caller};
use crate::body::{full, Body, RequestBody};
use crate::errors::GatewayError;
use crate::failover::Trail;
use crate::runtime::Runtime;
use crate::surface::Dialect;

pub use holder::Holder;
pub use ledger::{census, open_batches};
pub use settle::poll;

/// Whether a backend has a batch API the gateway speaks (Anthropic's is another shape).
pub fn takes_batches(backend: &onedoor_config::Backend) -> bool {
    Holder::takes_batches(backend)
}

/// One files or batches endpoint, with the id it names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resource {
    UploadFile,
    ListFiles,
    File(String),
    FileContent(String),
    DeleteFile(String),
    CreateBatch,
    ListBatches,
    Batch(String),
    CancelBatch(String),
}

/// What a files or batches answer learned: the backend it went to and the attempts it made.
#[derive(Default)]
pub struct Served {
    pub backend: Option<usize>,
    pub trail: Trail,
}

/// Serves one files or batches request for its caller.
pub async fn serve(
    runtime: &Runtime,
    request: Request<RequestBody>,
    resource: Resource,
    dialect: Dialect,
    served: &mut Served,
) -> Result<Response<Body>, GatewayError> {
    let caller = auth::identify(runtime, request.headers()).await?;
    let query = request.uri().query().map(str::to_owned);
    match resource {
        Resource::UploadFile => {
            let content_type = request.headers().get(header::CONTENT_TYPE).cloned();
            let body = whole(request, runtime.snapshot.max_request_body)?;
            upload::upload(runtime, &caller, content_type.as_ref(), body).await
        }
        Resource::ListFiles => ledger::list_files(runtime, &caller, query.as_deref()).await,
        Resource::File(id) => ledger::file(runtime, &caller, &id).await,
        Resource::FileContent(id) => settle::file_content(runtime, &caller, &id, served).await,
        Resource::DeleteFile(id) => ledger::delete_file(runtime, &caller, &id).await,
        Resource::CreateBatch => {
            let body = whole(request, runtime.snapshot.max_request_body)?;
            create::create(runtime, &caller, dialect, &body, served).await
        }
        Resource::ListBatches => ledger::list_batches(runtime, &caller, query.as_deref()).await,
        Resource::Batch(id) => settle::batch(runtime, &caller, &id, served).await,
        Resource::CancelBatch(id) => settle::cancel(runtime, &caller, &id, dialect, served).await,
    }
}

fn whole(request: Request<RequestBody>, limit: u64) -> Result<Bytes, GatewayError> {
    match request.into_body() {
        RequestBody::Whole(bytes) if bytes.len() as u64 <= limit => Ok(bytes),
        RequestBody::Whole(_) | RequestBody::TooLarge => {
            Err(GatewayError::RequestTooLarge { limit })
        }
    }
}

/// A JSON answer.
fn json(status: StatusCode, value: &Value) -> Response<Body> {
    let mut response = Response::new(full(value.to_string()));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// The caller's tenant, as the records name it.
fn tenant_of<'c>(caller: &'c Caller<'_>) -> &'c str {
    &caller.tenant.name
}

/// A fresh id in the gateway's own space: `prefix` and 24 random hex digits.
fn new_id(prefix: &str) -> String {
    format!("{prefix}{:024x}", rand::random::<u128>() >> 32)
}

/// Unix seconds now.
fn now_s() -> u64 {
    onedoor_state::now_ms() / 1000
}
