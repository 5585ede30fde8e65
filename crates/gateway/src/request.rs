//! The client's JSON body, parsed only as deep as routing needs: top-level fields stay raw, so a
//! request that needs no translation is forwarded without re-serialising its messages.

use std::fmt;

use bytes::Bytes;
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::errors::GatewayError;

/// What the client asked for, as far as the gateway needs to know it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    ChatCompletions,
    Embeddings,
}

impl Operation {
    /// The path suffix shared by every OpenAI-shaped dialect.
    pub fn path(self) -> &'static str {
        match self {
            Operation::ChatCompletions => "chat/completions",
            Operation::Embeddings => "embeddings",
        }
    }
}

pub struct ClientRequest {
    /// The body as it came.
    pub raw: Bytes,
    fields: Vec<(String, Box<RawValue>)>,
    pub model: Option<String>,
    pub stream: bool,
}

struct Fields(Vec<(String, Box<RawValue>)>);

impl<'de> Deserialize<'de> for Fields {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct FieldsVisitor;
        impl<'de> Visitor<'de> for FieldsVisitor {
            type Value = Fields;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Fields, A::Error> {
                let mut fields = Vec::with_capacity(map.size_hint().unwrap_or(8));
                while let Some((key, value)) = map.next_entry::<String, Box<RawValue>>()? {
                    if fields.iter().any(|(k, _): &(String, _)| *k == key) {
                        return Err(de::Error::custom(format_args!("duplicate field `{key}`")));
                    }
                    fields.push((key, value));
                }
                Ok(Fields(fields))
            }
        }
        deserializer.deserialize_map(FieldsVisitor)
    }
}

impl ClientRequest {
    pub fn parse(raw: Bytes, operation: Operation) -> Result<Self, GatewayError> {
        let Fields(fields) = serde_json::from_slice(&raw).map_err(|e| {
            GatewayError::InvalidRequest(format!("the request body is not valid JSON: {e}"))
        })?;
        let mut request = ClientRequest {
            raw,
            fields,
            model: None,
            stream: false,
        };
        request.model = request.typed::<String>("model", "a string")?;
        request.stream = request
            .typed::<bool>("stream", "a boolean")?
            .unwrap_or(false);
        match operation {
            Operation::ChatCompletions => request.require_array("messages")?,
            Operation::Embeddings => request.require_present("input")?,
        }
        Ok(request)
    }

    fn field(&self, name: &str) -> Option<&RawValue> {
        self.fields
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_ref())
    }

    /// A field decoded as `T`, `None` when absent or null.
    fn typed<T: serde::de::DeserializeOwned>(
        &self,
        name: &str,
        expected: &str,
    ) -> Result<Option<T>, GatewayError> {
        match self.field(name) {
            None => Ok(None),
            Some(raw) if raw.get() == "null" => Ok(None),
            Some(raw) => serde_json::from_str(raw.get())
                .map(Some)
                .map_err(|_| GatewayError::InvalidRequest(format!("`{name}` must be {expected}"))),
        }
    }

    fn require_present(&self, name: &str) -> Result<(), GatewayError> {
        match self.field(name) {
            Some(raw) if raw.get() != "null" => Ok(()),
            _ => Err(GatewayError::InvalidRequest(format!(
                "missing required field `{name}`"
            ))),
        }
    }

    fn require_array(&self, name: &str) -> Result<(), GatewayError> {
        self.require_present(name)?;
        match self.field(name) {
            Some(raw) if raw.get().starts_with('[') => Ok(()),
            _ => Err(GatewayError::InvalidRequest(format!(
                "`{name}` must be an array"
            ))),
        }
    }

    /// The body to send upstream with `model` set to `model`; the other fields are copied as the
    /// client wrote them.
    pub fn with_model(&self, model: &str) -> Bytes {
        let mut out = Vec::with_capacity(self.raw.len() + model.len() + 16);
        out.push(b'{');
        let mut wrote_model = false;
        for (i, (key, value)) in self.fields.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            push_json_string(&mut out, key);
            out.push(b':');
            if key == "model" {
                push_json_string(&mut out, model);
                wrote_model = true;
            } else {
                out.extend_from_slice(value.get().as_bytes());
            }
        }
        if !wrote_model {
            if !self.fields.is_empty() {
                out.push(b',');
            }
            out.extend_from_slice(b"\"model\":");
            push_json_string(&mut out, model);
        }
        out.push(b'}');
        Bytes::from(out)
    }
}

fn push_json_string(out: &mut Vec<u8>, s: &str) {
    // Serialising a &str into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, s);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(body: &str) -> Result<ClientRequest, GatewayError> {
        ClientRequest::parse(Bytes::from(body.to_owned()), Operation::ChatCompletions)
    }

    #[test]
    fn the_model_is_replaced_and_everything_else_kept_verbatim() {
        let req = parse(r#"{"model":"chat-default","messages":[{"role":"user","content":"hi \u00e9"}],"stream":true}"#)
            .unwrap();
        assert_eq!(req.model.as_deref(), Some("chat-default"));
        assert!(req.stream);
        let out = req.with_model("gpt-4o");
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi \u00e9"}],"stream":true}"#
        );
    }

    #[test]
    fn malformed_bodies_say_what_is_wrong() {
        let err = parse("{not json").err().unwrap();
        assert!(err.to_string().contains("not valid JSON"), "{err}");
        let err = parse(r#"{"model":"m"}"#).err().unwrap();
        assert_eq!(err.to_string(), "missing required field `messages`");
        let err = parse(r#"{"model":"m","messages":{}}"#).err().unwrap();
        assert_eq!(err.to_string(), "`messages` must be an array");
        let err = parse(r#"{"model":3,"messages":[]}"#).err().unwrap();
        assert_eq!(err.to_string(), "`model` must be a string");
        let err = parse(r#"[1,2]"#).err().unwrap();
        assert!(err.to_string().contains("a JSON object"), "{err}");
    }
}
