//! `POST /v1/files`: a multipart form with `purpose` (`batch`) and `file`. The file is checked
//! as a batch input before it is kept (its lines, its size, and that the caller may use the
//! alias it names), then kept by the gateway; it goes to a backend only when a batch is made
//! of it, rewritten for the backend chosen then.

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode};

use super::ledger::{self, FileRecord};
use super::{input, json, new_id, now_s, objects, tenant_of};
use crate::auth::Caller;
use crate::body::Body;
use crate::errors::GatewayError;
use crate::pipeline::resolve;
use crate::runtime::Runtime;

/// The form's two fields.
struct Form {
    purpose: Option<String>,
    filename: String,
    content: Bytes,
}

pub async fn upload(
    runtime: &Runtime,
    caller: &Caller<'_>,
    content_type: Option<&HeaderValue>,
    body: Bytes,
) -> Result<Response<Body>, GatewayError> {
    let form = form(content_type, body).await?;
    if form.purpose.as_deref() != Some("batch") {
        return Err(GatewayError::InvalidRequest(
            "onedoor keeps files for batches only: purpose must be \"batch\"".into(),
        ));
    }
    let settings = &runtime.snapshot.batch;
    if form.content.len() as u64 > settings.max_file_bytes {
        return Err(GatewayError::InvalidRequest(format!(
            "the file has {} bytes; a batch input file may have at most {} (batch.max_file_bytes)",
            form.content.len(),
            settings.max_file_bytes
        )));
    }
    let text = std::str::from_utf8(&form.content).map_err(|e| {
        GatewayError::InvalidRequest(format!("the batch input file is not UTF-8 text: {e}"))
    })?;
    let input = input::read(text, settings)?;
    resolve(&runtime.snapshot, &input.alias, caller.tenant, &caller.key)?;
    let record = FileRecord {
        id: new_id("file-"),
        filename: form.filename,
        purpose: "batch".into(),
        bytes: form.content.len() as u64,
        created_at: now_s(),
        held: None,
    };
    let tenant = tenant_of(caller);
    ledger::keep_content(runtime, tenant, &record.id, text).await?;
    ledger::keep_file(runtime, tenant, &record).await?;
    Ok(json(StatusCode::OK, &objects::file(&record)))
}

async fn form(content_type: Option<&HeaderValue>, body: Bytes) -> Result<Form, GatewayError> {
    let invalid = |why: String| GatewayError::InvalidRequest(why);
    let boundary = content_type
        .and_then(|v| v.to_str().ok())
        .and_then(|v| multer::parse_boundary(v).ok())
        .ok_or_else(|| invalid("a file upload is a multipart/form-data body".into()))?;
    let stream = futures_util::stream::once(async move { Ok::<Bytes, std::io::Error>(body) });
    let mut multipart = multer::Multipart::new(stream, boundary);
    let mut form = Form {
        purpose: None,
        filename: String::new(),
        content: Bytes::new(),
    };
    let mut has_file = false;
    while let Some(field) = multipart
        .next_field()
        .await
        .map_err(|e| invalid(format!("the multipart form cannot be read: {e}")))?
    {
        let name = field.name().unwrap_or_default().to_owned();
        let filename = field.file_name().map(str::to_owned);
        let value = field
            .bytes()
            .await
            .map_err(|e| invalid(format!("the multipart form cannot be read: {e}")))?;
        match name.as_str() {
            "purpose" => form.purpose = Some(String::from_utf8_lossy(&value).trim().to_owned()),
            "file" => {
                form.filename = filename.unwrap_or_else(|| "input.jsonl".into());
                form.content = value;
                has_file = true;
            }
            _ => {}
        }
    }
    match has_file {
        true => Ok(form),
        false => Err(invalid("the form has no `file` field".into())),
    }
}
