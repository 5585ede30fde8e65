//! The client's JSON body, parsed only as deep as routing needs: top-level fields stay raw, so a
//! request that needs no translation is forwarded without re-serialising its messages.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::errors::GatewayError;

/// What the client asked for, as far as the gateway needs to know it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    ChatCompletions,
    Embeddings,
    /// The OpenAI Responses API.
    Responses,
}

impl Operation {
    pub const ALL: [Operation; 3] = [
        Operation::ChatCompletions,
        Operation::Embeddings,
        Operation::Responses,
    ];

    /// The path suffix shared by every OpenAI-shaped dialect.
    pub fn path(self) -> &'static str {
        match self {
            Operation::ChatCompletions => "chat/completions",
            Operation::Embeddings => "embeddings",
            Operation::Responses => "responses",
        }
    }
}

#[derive(Clone)]
pub struct ClientRequest {
    /// The body as it came; `fields` point into it, so it never changes.
    raw: Bytes,
    /// Its top-level members in order, each a name and the place of its value in `raw`: read
    /// once, copied never.
    fields: Vec<Field>,
    pub model: Option<Arc<str>>,
    pub stream: bool,
    /// `max_completion_tokens`, else `max_tokens` (`max_output_tokens` on the Responses API).
    pub max_tokens: Option<u64>,
    /// `stream_options.include_usage`: the client wants the final usage chunk.
    pub include_usage: bool,
    /// Responses API: the earlier response this one continues.
    pub previous_response_id: Option<String>,
    /// An Anthropic client's Messages body, when this is its chat form: what an Anthropic
    /// backend is sent instead.
    pub native: Option<Arc<crate::messages::Native>>,
}

/// Completion tokens assumed for a request that sets no `max_tokens`.
const DEFAULT_COMPLETION_ESTIMATE: u64 = 256;

/// A top-level member of the body: its name, and where its value's JSON text stands in the body.
#[derive(Debug, Clone)]
struct Field {
    name: Name,
    value: Range<usize>,
}

/// A member's name: where it stands in the body (between its quotes), or decoded when the
/// client wrote it with escapes.
#[derive(Debug, Clone)]
enum Name {
    At(Range<usize>),
    Decoded(Box<str>),
}

impl Field {
    fn name<'a>(&'a self, raw: &'a [u8]) -> &'a [u8] {
        match &self.name {
            Name::At(at) => raw.get(at.clone()).unwrap_or_default(),
            Name::Decoded(name) => name.as_bytes(),
        }
    }

    fn value<'a>(&self, raw: &'a [u8]) -> &'a [u8] {
        raw.get(self.value.clone()).unwrap_or_default()
    }

    /// Writes the name as a JSON string, as the client wrote it when it had no escapes.
    fn write_name(&self, raw: &[u8], out: &mut Vec<u8>) {
        match &self.name {
            Name::At(_) => {
                out.push(b'"');
                out.extend_from_slice(self.name(raw));
                out.push(b'"');
            }
            Name::Decoded(name) => push_json_string(out, name),
        }
    }
}

/// Where `part`, borrowed from `raw` by the parser, stands in it.
fn place(raw: &[u8], part: &[u8]) -> Option<Range<usize>> {
    let start = (part.as_ptr() as usize).checked_sub(raw.as_ptr() as usize)?;
    let end = start.checked_add(part.len())?;
    (end <= raw.len()).then_some(start..end)
}

/// The top-level members of a JSON object body, read without copying a name or a value. The body
/// is checked as UTF-8 once and read as text: read from bytes, serde_json checks every string it
/// meets, and each member's raw value, again.
fn members(raw: &[u8]) -> serde_json::Result<Vec<Field>> {
    let text = std::str::from_utf8(raw).map_err(|error| {
        de::Error::custom(format_args!(
            "invalid UTF-8 at byte {}",
            error.valid_up_to()
        ))
    })?;
    let mut deserializer = serde_json::Deserializer::from_str(text);
    let fields = deserializer.deserialize_map(Members { raw })?;
    deserializer.end()?;
    Ok(fields)
}

struct Members<'r> {
    raw: &'r [u8],
}

impl<'de> Visitor<'de> for Members<'de> {
    type Value = Vec<Field>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Vec<Field>, A::Error> {
        let raw = self.raw;
        let mut fields: Vec<Field> = Vec::with_capacity(map.size_hint().unwrap_or(8));
        while let Some(name) = map.next_key_seed(NameIn { raw })? {
            let value: &'de RawValue = map.next_value()?;
            let value = place(raw, value.get().as_bytes())
                .ok_or_else(|| de::Error::custom("a value outside the body"))?;
            let field = Field { name, value };
            let name = field.name(raw);
            if fields.iter().any(|f| f.name(raw) == name) {
                let name = String::from_utf8_lossy(name);
                return Err(de::Error::custom(format_args!("duplicate field `{name}`")));
            }
            fields.push(field);
        }
        Ok(fields)
    }
}

/// Reads a member's name as its place in the body, or decoded when it has escapes.
struct NameIn<'r> {
    raw: &'r [u8],
}

impl<'de> de::DeserializeSeed<'de> for NameIn<'de> {
    type Value = Name;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Name, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for NameIn<'de> {
    type Value = Name;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a member name")
    }

    fn visit_borrowed_str<E: de::Error>(self, name: &'de str) -> Result<Name, E> {
        Ok(match place(self.raw, name.as_bytes()) {
            Some(at) => Name::At(at),
            None => Name::Decoded(name.into()),
        })
    }

    fn visit_str<E: de::Error>(self, name: &str) -> Result<Name, E> {
        Ok(Name::Decoded(name.into()))
    }
}

impl ClientRequest {
    pub fn parse(raw: Bytes, operation: Operation) -> Result<Self, GatewayError> {
        let fields = members(&raw).map_err(|e| {
            GatewayError::InvalidRequest(format!("the request body is not valid JSON: {e}"))
        })?;
        let mut request = ClientRequest {
            raw,
            fields,
            model: None,
            stream: false,
            max_tokens: None,
            include_usage: false,
            previous_response_id: None,
            native: None,
        };
        request.model = request.text("model")?;
        request.stream = request
            .typed::<bool>("stream", "a boolean")?
            .unwrap_or(false);
        let completion = request.typed::<u64>("max_completion_tokens", "a non-negative integer")?;
        let legacy = request.typed::<u64>("max_tokens", "a non-negative integer")?;
        let output = request.typed::<u64>("max_output_tokens", "a non-negative integer")?;
        request.max_tokens = completion.or(legacy).or(output);
        request.include_usage = request
            .typed::<StreamOptions>("stream_options", "an object")?
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
        match operation {
            Operation::ChatCompletions => request.require_array("messages")?,
            Operation::Embeddings => request.require_present("input")?,
            Operation::Responses => {
                request.previous_response_id =
                    request.typed::<String>("previous_response_id", "a string")?;
            }
        }
        Ok(request)
    }

    /// The body as it came.
    pub fn raw(&self) -> &Bytes {
        &self.raw
    }

    /// A rough token estimate (about four bytes a token, plus the completion budget) for headroom
    /// routing; exact counting comes with tenant limits.
    pub fn estimated_tokens(&self, operation: Operation) -> u64 {
        let prompt = (self.raw.len() as u64).div_ceil(4);
        match operation {
            Operation::ChatCompletions | Operation::Responses => {
                prompt + self.max_tokens.unwrap_or(DEFAULT_COMPLETION_ESTIMATE)
            }
            Operation::Embeddings => prompt,
        }
    }

    /// The gateway's count of the prompt, for usage an upstream did not report: the text of
    /// `messages`, `input`, `instructions` and `system`, about four characters a token, plus
    /// three tokens of framing per message.
    pub fn prompt_estimate(&self) -> u64 {
        let mut chars = 0;
        let mut messages = 0;
        for name in ["messages", "input", "instructions", "system"] {
            let Some(text) = self
                .field(name)
                .and_then(|raw| serde_json::from_slice::<TextChars>(raw).ok())
            else {
                continue;
            };
            messages += text.items;
            chars += text.chars;
        }
        crate::usage::estimate_tokens(chars) + 3 * messages as u64
    }

    /// The client's `stream_options` with `include_usage: true` added, as JSON.
    pub fn stream_options_with_usage(&self) -> String {
        let mut options = self
            .field("stream_options")
            .and_then(|raw| serde_json::from_slice::<serde_json::Value>(raw).ok())
            .filter(serde_json::Value::is_object)
            .unwrap_or_else(|| serde_json::json!({}));
        options["include_usage"] = serde_json::Value::Bool(true);
        options.to_string()
    }

    /// The body with each `(name, json)` field replaced (or added); the others as they came.
    /// A change that is not JSON is left out.
    pub fn with_fields(&self, changes: &[(&str, String)]) -> Bytes {
        let changes: Vec<(&str, &[u8])> = changes
            .iter()
            .filter(|(_, json)| serde_json::from_str::<&RawValue>(json).is_ok())
            .map(|(name, json)| (*name, json.as_bytes()))
            .collect();
        serialize(&self.raw, &self.fields, &changes)
    }

    /// The JSON text of the top-level member `name`, as the client wrote it.
    pub(crate) fn field(&self, name: &str) -> Option<&[u8]> {
        let raw = &self.raw[..];
        self.fields
            .iter()
            .find(|field| field.name(raw) == name.as_bytes())
            .map(|field| field.value(raw))
    }

    /// The string member `name`, read in place unless it has escapes (then as [`Self::typed`]
    /// reads it): the one copy of it that the call, its log line and its usage record share.
    fn text(&self, name: &str) -> Result<Option<Arc<str>>, GatewayError> {
        if let Some(Ok(text)) = self.field(name).map(serde_json::from_slice::<&str>) {
            return Ok(Some(Arc::from(text)));
        }
        Ok(self.typed::<String>(name, "a string")?.map(Arc::from))
    }

    /// A field decoded as `T`, `None` when absent or null.
    fn typed<T: serde::de::DeserializeOwned>(
        &self,
        name: &str,
        expected: &str,
    ) -> Result<Option<T>, GatewayError> {
        match self.field(name) {
            None => Ok(None),
            Some(b"null") => Ok(None),
            Some(raw) => serde_json::from_slice(raw)
                .map(Some)
                .map_err(|_| GatewayError::InvalidRequest(format!("`{name}` must be {expected}"))),
        }
    }

    fn require_present(&self, name: &str) -> Result<(), GatewayError> {
        match self.field(name) {
            Some(raw) if raw != b"null" => Ok(()),
            _ => Err(GatewayError::InvalidRequest(format!(
                "missing required field `{name}`"
            ))),
        }
    }

    fn require_array(&self, name: &str) -> Result<(), GatewayError> {
        self.require_present(name)?;
        match self.field(name) {
            Some(raw) if raw.starts_with(b"[") => Ok(()),
            _ => Err(GatewayError::InvalidRequest(format!(
                "`{name}` must be an array"
            ))),
        }
    }

    /// The body to send upstream with `model` set to `model`; the other fields are copied as the
    /// client wrote them.
    pub fn with_model(&self, model: &str) -> Bytes {
        let mut model_json = Vec::with_capacity(model.len() + 2);
        push_json_string(&mut model_json, model);
        serialize(&self.raw, &self.fields, &[("model", &model_json)])
    }

    /// The same request with `text` appended as a final assistant message, so a target that
    /// accepts prefill continues from it. `None` when the messages cannot be rebuilt.
    pub fn with_prefill(&self, text: &str) -> Option<ClientRequest> {
        let messages = self.field("messages")?;
        let mut list: Vec<&RawValue> = serde_json::from_slice(messages).ok()?;
        let prefill = serde_json::json!({"role": "assistant", "content": text}).to_string();
        list.push(serde_json::from_str(&prefill).ok()?);
        let messages = serde_json::to_vec(&list).ok()?;
        let raw = serialize(&self.raw, &self.fields, &[("messages", &messages)]);
        Some(ClientRequest {
            fields: members(&raw).ok()?,
            raw,
            model: self.model.clone(),
            stream: self.stream,
            max_tokens: self.max_tokens,
            include_usage: self.include_usage,
            previous_response_id: self.previous_response_id.clone(),
            // A continuation says the prefill in the chat form: every backend is sent that.
            native: None,
        })
    }
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

/// The characters of every string in a JSON value except the structural ones (roles, types, ids),
/// counted as the value is read, without building it (a key given twice counts twice); `items` is
/// an array's length, 1 for anything else.
struct TextChars {
    chars: usize,
    items: usize,
}

impl TextChars {
    fn of(chars: usize) -> TextChars {
        TextChars { chars, items: 1 }
    }
}

impl<'de> Deserialize<'de> for TextChars {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(CountText)
    }
}

struct CountText;

impl<'de> Visitor<'de> for CountText {
    type Value = TextChars;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<TextChars, E> {
        Ok(TextChars::of(text.chars().count()))
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<TextChars, E> {
        Ok(TextChars::of(0))
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<TextChars, E> {
        Ok(TextChars::of(0))
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<TextChars, E> {
        Ok(TextChars::of(0))
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<TextChars, E> {
        Ok(TextChars::of(0))
    }

    fn visit_unit<E: de::Error>(self) -> Result<TextChars, E> {
        Ok(TextChars::of(0))
    }

    fn visit_seq<S: SeqAccess<'de>>(self, mut seq: S) -> Result<TextChars, S::Error> {
        let (mut chars, mut items) = (0, 0);
        while let Some(item) = seq.next_element::<TextChars>()? {
            chars += item.chars;
            items += 1;
        }
        Ok(TextChars { chars, items })
    }

    fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<TextChars, M::Error> {
        let mut chars = 0;
        while let Some(Structural(structural)) = map.next_key()? {
            match structural {
                true => drop(map.next_value::<de::IgnoredAny>()?),
                false => chars += map.next_value::<TextChars>()?.chars,
            }
        }
        Ok(TextChars::of(chars))
    }
}

/// Whether an object's key names a structural member, whose text is not prompt.
struct Structural(bool);

impl<'de> Deserialize<'de> for Structural {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Key;
        impl Visitor<'_> for Key {
            type Value = Structural;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object key")
            }
            fn visit_str<E: de::Error>(self, key: &str) -> Result<Structural, E> {
                let structural = matches!(key, "role" | "type" | "id" | "tool_call_id" | "detail");
                Ok(Structural(structural))
            }
        }
        deserializer.deserialize_str(Key)
    }
}

/// The body's members with `changes` made: a member a change names gets its JSON (the last
/// change of that name counts), the others stay as the client wrote them, and changes naming no
/// member are added at the end.
fn serialize(raw: &[u8], fields: &[Field], changes: &[(&str, &[u8])]) -> Bytes {
    let change = |name: &[u8]| {
        changes
            .iter()
            .rev()
            .find(|(n, _)| n.as_bytes() == name)
            .map(|&(_, json)| json)
    };
    let extra: usize = changes.iter().map(|(n, v)| n.len() + v.len() + 4).sum();
    let mut out = Vec::with_capacity(raw.len() + extra + 2);
    out.push(b'{');
    for field in fields {
        if out.len() > 1 {
            out.push(b',');
        }
        field.write_name(raw, &mut out);
        out.push(b':');
        let name = field.name(raw);
        out.extend_from_slice(change(name).unwrap_or_else(|| field.value(raw)));
    }
    for (i, &(name, json)) in changes.iter().enumerate() {
        let present = fields.iter().any(|f| f.name(raw) == name.as_bytes());
        let later = changes[i + 1..].iter().any(|(n, _)| *n == name);
        if present || later {
            continue;
        }
        if out.len() > 1 {
            out.push(b',');
        }
        push_json_string(&mut out, name);
        out.push(b':');
        out.extend_from_slice(json);
    }
    out.push(b'}');
    Bytes::from(out)
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
    fn the_prompt_estimate_counts_prompt_text_but_not_structural_members() {
        let req = parse(
            r#"{"model":"m","messages":[
                {"role":"system","content":"Be brief."},
                {"role":"user","content":[{"type":"text","text":"h\u00e9llo \"x\""},
                    {"type":"image_url","image_url":{"url":"u","detail":"low"}}],"n":[1,2.5,true,null]},
                {"role":"tool","tool_call_id":"call_1","content":"42"}],
              "instructions":"Answer.","max_tokens":7}"#,
        )
        .unwrap();
        // Be brief. (9) + héllo "x" (9) + u (1) + 42 (2) in 3 messages, and Answer. (7) as one.
        let expected = crate::usage::estimate_tokens(9 + 9 + 1 + 2 + 7) + 3 * (3 + 1);
        assert_eq!(req.prompt_estimate(), expected);
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
    fn the_model_is_read_in_place_or_unescaped_and_must_be_a_string() {
        let plain = parse(r#"{"model":"chat-default","messages":[]}"#).unwrap();
        assert_eq!(plain.model.as_deref(), Some("chat-default"));
        let escaped = parse(r#"{"model":"chat\u002ddefault \"x\"","messages":[]}"#).unwrap();
        assert_eq!(escaped.model.as_deref(), Some(r#"chat-default "x""#));
        let none = parse(r#"{"model":null,"messages":[]}"#).unwrap();
        assert_eq!(none.model, None);
        let err = parse(r#"{"model":7,"messages":[]}"#).err().unwrap();
        assert_eq!(err.to_string(), "`model` must be a string");
    }

    #[test]
    fn a_prefill_is_appended_as_the_last_assistant_message() {
        let req =
            parse(r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}"#)
                .unwrap();
        let continued = req.with_prefill("Hello \"there\"").unwrap();
        let body: serde_json::Value = serde_json::from_slice(&continued.raw).unwrap();
        assert_eq!(body["messages"][1]["role"], "assistant");
        assert_eq!(body["messages"][1]["content"], "Hello \"there\"");
        assert_eq!(body["stream"], true);
        assert_eq!(continued.with_model("x").len(), continued.raw.len());
    }

    #[test]
    fn members_are_found_by_their_names_however_the_client_wrote_them() {
        let req = parse(
            "{ \"mod\\u0065l\" : \"m\" ,\n \"messages\":[ {\"role\":\"user\",\"content\":\"hi\"} ],\"n\":null }",
        )
        .unwrap();
        assert_eq!(req.model.as_deref(), Some("m"));
        assert_eq!(
            req.field("messages"),
            Some(&br#"[ {"role":"user","content":"hi"} ]"#[..])
        );
        assert_eq!(req.field("n"), Some(&b"null"[..]));
        assert_eq!(req.field("stream"), None);
        // Written back without the whitespace between members, the escaped name decoded.
        assert_eq!(
            std::str::from_utf8(&req.with_model("gpt-4o")).unwrap(),
            r#"{"model":"gpt-4o","messages":[ {"role":"user","content":"hi"} ],"n":null}"#
        );
        let err = parse(r#"{"model":"a","mod\u0065l":"b","messages":[]}"#)
            .err()
            .unwrap();
        assert!(err.to_string().contains("duplicate field `model`"), "{err}");
        let err = parse(r#"{"messages":[],"messages":[]}"#).err().unwrap();
        assert!(
            err.to_string().contains("duplicate field `messages`"),
            "{err}"
        );
    }

    #[test]
    fn changed_fields_replace_or_join_the_members_and_the_last_change_counts() {
        let req = parse(r#"{"model":"m","messages":[],"stream":true}"#).unwrap();
        let changes = [
            ("stream", "false".to_owned()),
            ("stream_options", r#"{"include_usage":true}"#.to_owned()),
            ("bad", "{not json".to_owned()),
            ("stream_options", "{}".to_owned()),
            ("a\"b", "1".to_owned()),
        ];
        assert_eq!(
            std::str::from_utf8(&req.with_fields(&changes)).unwrap(),
            r#"{"model":"m","messages":[],"stream":false,"stream_options":{},"a\"b":1}"#
        );
        let empty = ClientRequest::parse(Bytes::from_static(b"{}"), Operation::Responses).unwrap();
        assert_eq!(&empty.with_model("x")[..], br#"{"model":"x"}"#);
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
        let bytes = b"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"h\xffi\"}]}";
        let err = ClientRequest::parse(Bytes::from_static(bytes), Operation::ChatCompletions)
            .err()
            .unwrap();
        assert_eq!(
            err.to_string(),
            "the request body is not valid JSON: invalid UTF-8 at byte 52"
        );
    }

    /// The members as serde_json reads them into owned names and boxed values (how the body
    /// was read before it was read in place): the reference for the random test below.
    fn owned_members(raw: &[u8]) -> Option<Vec<(String, Box<RawValue>)>> {
        struct Owned;
        impl<'de> Visitor<'de> for Owned {
            type Value = Vec<(String, Box<RawValue>)>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut members: Vec<(String, Box<RawValue>)> = Vec::new();
                while let Some((name, value)) = map.next_entry::<String, Box<RawValue>>()? {
                    if members.iter().any(|(n, _)| *n == name) {
                        return Err(de::Error::custom("duplicate"));
                    }
                    members.push((name, value));
                }
                Ok(members)
            }
        }
        let mut deserializer = serde_json::Deserializer::from_slice(raw);
        let members = deserializer.deserialize_map(Owned).ok()?;
        deserializer.end().ok()?;
        Some(members)
    }

    /// A JSON object with random names (some written with escapes), values and whitespace.
    fn random_object(rng: &mut rand::rngs::StdRng) -> String {
        use rand::Rng;
        const NAMES: [&str; 8] = [
            "model",
            "messages",
            "stream",
            "max_tokens",
            "é",
            "a\"b",
            "x",
            "tools",
        ];
        const VALUES: [&str; 8] = [
            r#""gpt-4o""#,
            r#"[{"role":"user","content":"hi \"there\" \u00e9\n"}]"#,
            "true",
            "-12.5e3",
            "null",
            r#"{"a":[1,{"b":"}"}],"c":"\\"}"#,
            r#""""#,
            "[ ]",
        ];
        let space =
            |rng: &mut rand::rngs::StdRng| [" ", "", "\n", "\t", "  "][rng.random_range(0..5)];
        let mut out = String::from(space(rng));
        out.push('{');
        let count = rng.random_range(0..6);
        for i in 0..count {
            if i > 0 {
                out.push(',');
            }
            out.push_str(space(rng));
            let name = NAMES[rng.random_range(0..NAMES.len())];
            out.push('"');
            for c in name.chars() {
                match (c, rng.random_range(0..4)) {
                    ('"', _) => out.push_str("\\\""),
                    (c, 0) if c.is_ascii() => out.push_str(&format!("\\u{:04x}", c as u32)),
                    (c, _) => out.push(c),
                }
            }
            out.push('"');
            out.push_str(space(rng));
            out.push(':');
            out.push_str(space(rng));
            out.push_str(VALUES[rng.random_range(0..VALUES.len())]);
            out.push_str(space(rng));
        }
        out.push('}');
        out.push_str(space(rng));
        out
    }

    #[test]
    fn random_bodies_are_read_as_serde_json_reads_them_and_rewritten_as_json() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(12);
        let (mut whole, mut refused) = (0, 0);
        for _ in 0..4000 {
            let mut raw = random_object(&mut rng).into_bytes();
            if rng.random_bool(0.3) {
                crate::wire_damage::damage(&mut rng, &mut raw);
            }
            let expected = owned_members(&raw);
            let Ok(fields) = members(&raw) else {
                assert!(expected.is_none(), "{}", String::from_utf8_lossy(&raw));
                refused += 1;
                continue;
            };
            whole += 1;
            let expected = expected.expect("serde_json reads it too");
            let read: Vec<(&[u8], &[u8])> = fields
                .iter()
                .map(|f| (f.name(&raw), f.value(&raw)))
                .collect();
            let owned: Vec<(&[u8], &[u8])> = expected
                .iter()
                .map(|(n, v)| (n.as_bytes(), v.get().as_bytes()))
                .collect();
            assert_eq!(read, owned, "{}", String::from_utf8_lossy(&raw));
            // Rewritten with the model set: JSON, the other members as they were.
            let rewritten = serialize(&raw, &fields, &[("model", b"\"m\"")]);
            let again = owned_members(&rewritten).expect("the rewritten body is an object");
            let model = again
                .iter()
                .find(|(n, _)| n == "model")
                .map(|(_, v)| v.get());
            assert_eq!(model, Some("\"m\""));
            let others = |list: &[(String, Box<RawValue>)]| -> Vec<(String, String)> {
                list.iter()
                    .filter(|(n, _)| n != "model")
                    .map(|(n, v)| (n.clone(), v.get().to_owned()))
                    .collect()
            };
            assert_eq!(others(&again), others(&expected));
        }
        assert!(
            whole > 1500 && refused > 1000,
            "{whole} read, {refused} refused"
        );
    }
}
