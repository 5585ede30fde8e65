//! Answers of OpenAI-shaped backends (Azure, OpenAI-compatible servers): usage read, the usage
//! chunk the gateway asked for on the client's behalf dropped when the client did not ask, and
//! the quirks of lax OpenAI-compatible servers (reference section 2.6) repaired: every tool
//! call at index 0, arguments sent as an object, `finish_reason: stop` after tool calls. A
//! chunk or body that needs no repair is relayed byte for byte.

use std::borrow::Cow;
use std::sync::LazyLock;

use bytes::Bytes;
use memchr::memmem::Finder;
use serde::de::{self, Deserializer, IgnoredAny, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{json, Value};

use crate::provider::{EventTranslator, StreamAnswer};
use crate::stream::{classify, error_event, event_data, EventKind};
use crate::usage::{estimate_tokens, Usage};

/// Gives each tool call its position in the message: a new `id` on an index already taken is
/// a new call (servers that send every call at index 0).
#[derive(Default)]
struct ToolIndex {
    /// (upstream index, the call's id, its position)
    calls: Vec<(u64, Option<String>, u64)>,
}

impl ToolIndex {
    fn position(&mut self, upstream: u64, id: Option<&str>) -> u64 {
        let next = self.calls.len() as u64;
        if let Some(call) = self.calls.iter_mut().rev().find(|c| c.0 == upstream) {
            match (id, call.1.as_deref()) {
                (Some(id), Some(known)) if id != known => {}
                (Some(id), None) => {
                    call.1 = Some(id.to_owned());
                    return call.2;
                }
                _ => return call.2,
            }
        }
        self.calls.push((upstream, id.map(str::to_owned), next));
        next
    }
}

/// Tool call arguments as the JSON string clients expect; whether they had to be serialised.
fn string_arguments(call: &mut Value) -> bool {
    let Some(arguments) = call
        .get_mut("function")
        .and_then(|f| f.get_mut("arguments"))
    else {
        return false;
    };
    match arguments {
        Value::Object(_) | Value::Array(_) => {
            *arguments = json!(arguments.to_string());
            true
        }
        _ => false,
    }
}

/// The array under `key`, if there is one (never inserting the key, as indexing would).
fn array_mut<'a>(value: &'a mut Value, key: &str) -> impl Iterator<Item = &'a mut Value> {
    value
        .get_mut(key)
        .and_then(Value::as_array_mut)
        .into_iter()
        .flatten()
}

pub struct ChatEvents {
    /// The client asked for the usage chunk (`stream_options.include_usage`).
    include_usage: bool,
    prompt_estimate: u64,
    usage: Option<Usage>,
    identity: Identity,
    tools: ToolIndex,
    saw_tool: bool,
    completion_chars: usize,
    done: bool,
    /// The latest `finish_reason` a chunk carried.
    finish_reason: Option<String>,
    /// Azure chunks' start up to and with their first choice's content-filter results, as an
    /// earlier chunk had it (see [`Annotations`]).
    annotations: Annotations,
    /// The last chunk that went out with text, for telling the next one by its bytes.
    last_text: LastText,
}

impl ChatEvents {
    pub fn new(include_usage: bool, prompt_estimate: u64) -> Self {
        ChatEvents {
            include_usage,
            prompt_estimate,
            usage: None,
            identity: Identity::default(),
            tools: ToolIndex::default(),
            saw_tool: false,
            completion_chars: 0,
            done: false,
            finish_reason: None,
            annotations: Annotations::default(),
            last_text: LastText::default(),
        }
    }

    /// Keeps the chunk's finish reason, moved out of the chunk once it has been sent.
    fn keep_finish_reason(&mut self, mut chunk: Value) {
        for choice in array_mut(&mut chunk, "choices") {
            if let Some(Value::String(reason)) = choice.get_mut("finish_reason").map(Value::take) {
                self.finish_reason = Some(reason);
            }
        }
    }

    /// Repairs the quirks in one chunk; whether anything changed.
    fn repair(&mut self, chunk: &mut Value) -> bool {
        let mut changed = false;
        for choice in array_mut(chunk, "choices") {
            let Some(delta) = choice.get_mut("delta") else {
                if self.saw_tool && choice["finish_reason"] == "stop" {
                    choice["finish_reason"] = json!("tool_calls");
                    changed = true;
                }
                continue;
            };
            if let Some(text) = delta["content"].as_str() {
                self.completion_chars += text.chars().count();
            }
            for call in array_mut(delta, "tool_calls") {
                self.saw_tool = true;
                let upstream = call["index"].as_u64();
                let position = self
                    .tools
                    .position(upstream.unwrap_or(0), call["id"].as_str());
                if upstream != Some(position) {
                    call["index"] = json!(position);
                    changed = true;
                }
                changed |= string_arguments(call);
                if let Some(arguments) = call["function"]["arguments"].as_str() {
                    self.completion_chars += arguments.chars().count();
                }
            }
            if self.saw_tool && choice["finish_reason"] == "stop" {
                choice["finish_reason"] = json!("tool_calls");
                changed = true;
            }
        }
        changed
    }

    /// The usage chunk a client that asked for one gets when the upstream sent none: the
    /// gateway's estimate (the trailing usage comment says so).
    fn synthesized_usage(&self) -> Bytes {
        let mut chunk = json!({"object": "chat.completion.chunk", "choices": [], "usage": self.usage().to_openai()});
        self.identity.stamp(&mut chunk);
        Bytes::from(format!("data: {chunk}\n\n"))
    }

    /// A chunk that goes out as it came (or, a usage the client did not ask for, stays here),
    /// read without building its tree: no tool calls or error in it (the first to carry an id
    /// gives the stream its identity). `None` for any other chunk, which
    /// [`EventTranslator::translate`] reads whole.
    fn pass(&mut self, data: &[u8]) -> Option<Passed> {
        if self.saw_tool {
            return None;
        }
        let mut shortened = std::mem::take(&mut self.annotations.shortened);
        let kind = self.pass_read(data, &mut shortened);
        self.annotations.shortened = shortened;
        kind
    }

    /// [`ChatEvents::pass`] on the chunk, read without its content-filter results when an
    /// earlier chunk began with the same ones.
    fn pass_read(&mut self, data: &[u8], shortened: &mut Vec<u8>) -> Option<Passed> {
        let known = self.annotations.shorten(data, shortened);
        let read = match known {
            true => &shortened[..],
            false => data,
        };
        // Skipped strings are not checked for UTF-8 by the parser; the caller must get text.
        let text = std::str::from_utf8(read).ok()?;
        let chunk: Passing<'_> = serde_json::from_str(text).ok()?;
        if !known {
            self.annotations.learn(data, chunk.choices.first_filter);
        }
        if chunk.error.is_some() || chunk.choices.tool_calls {
            return None;
        }
        if let Some(id) = chunk.id.filter(|id| self.gives_identity(&id.0)) {
            self.identity = identity(id, chunk.created, chunk.model);
        }
        if let Some(usage) = chunk.usage {
            return self.take_usage(usage, chunk.choices.count);
        }
        let choices = chunk.choices;
        self.completion_chars += choices.content_chars;
        if let Some(reason) = choices.finish_reason {
            self.finish_reason = Some(reason.0.into_owned());
        }
        let kind = match (choices.count, choices.finished, choices.content) {
            (0, _, _) if chunk.prompt_filter_results.is_some() => EventKind::FilterOnly,
            (0, _, _) | (_, false, false) => EventKind::Meta,
            (_, finished, _) => EventKind::Content { finished },
        };
        if let (EventKind::Content { finished: false }, 1, Some(text)) =
            (kind, choices.count, choices.text)
        {
            let at = text.as_ptr() as usize - read.as_ptr() as usize;
            let at = match known {
                true => (at + self.annotations.known.len()).checked_sub(OPENED.len()),
                false => Some(at),
            };
            self.last_text.learn(data, at, text);
        }
        Some(Passed::As(kind))
    }

    /// A usage chunk without choices: its usage is the stream's, and it goes out only when the
    /// client asked for it. `None` for one with choices, or a usage this does not read.
    fn take_usage(&mut self, usage: &RawValue, choices: usize) -> Option<Passed> {
        if choices > 0 {
            return None;
        }
        // Read into its numbers alone, as a whole answer's usage is, without a tree.
        let usage = serde_json::from_str::<PlainUsage>(usage.get()).ok()?;
        Some(match self.keeps_usage(usage.usage()?, true) {
            true => Passed::Kept,
            false => Passed::As(EventKind::Meta),
        })
    }

    /// Takes a chunk's usage as the stream's; whether the chunk stays here: a usage without
    /// choices that the gateway asked for on the client's behalf.
    fn keeps_usage(&mut self, usage: Usage, no_choices: bool) -> bool {
        self.usage = Some(usage);
        no_choices && !self.include_usage
    }

    /// Whether a chunk with `id` gives the stream its identity: the first with an id does.
    fn gives_identity(&self, id: &str) -> bool {
        !id.is_empty() && self.identity.id.is_empty()
    }

    /// The kind of a chunk that is the last chunk with text, with other text in it (see
    /// [`LastText`]).
    fn same_but_text(&mut self, data: &[u8]) -> Option<EventKind> {
        if self.saw_tool {
            return None;
        }
        self.completion_chars += self.last_text.chars_instead(data)?;
        Some(EventKind::Content { finished: false })
    }

    fn end(&mut self, done: Bytes, out: &mut Vec<(EventKind, Bytes)>) {
        if self.done {
            return;
        }
        self.done = true;
        if self.include_usage && self.usage.is_none() {
            out.push((EventKind::Meta, self.synthesized_usage()));
        }
        out.push((EventKind::Done, done));
    }
}

impl EventTranslator for ChatEvents {
    fn translate(&mut self, event: Bytes, out: &mut Vec<(EventKind, Bytes)>) {
        let data = event_data(&event);
        let data = data.trim_ascii();
        if data.is_empty() {
            return;
        }
        if data == b"[DONE]" {
            return self.end(event, out);
        }
        if let Some(kind) = self.same_but_text(data) {
            out.push((kind, event));
            return;
        }
        self.last_text.forget();
        match self.pass(data) {
            Some(Passed::As(kind)) => return out.push((kind, event)),
            Some(Passed::Kept) => return,
            None => {}
        }
        let Ok(mut chunk) = serde_json::from_slice::<Value>(data) else {
            out.push((EventKind::Malformed, event));
            return;
        };
        if chunk.get("error").is_some_and(|e| !e.is_null()) {
            out.push((EventKind::Error, event));
            return;
        }
        if chunk["id"]
            .as_str()
            .is_some_and(|id| self.gives_identity(id))
        {
            self.identity = Identity {
                id: chunk["id"].as_str().unwrap_or_default().to_owned(),
                created: chunk["created"].clone(),
                model: chunk["model"].clone(),
            };
        }
        if let Some(usage) = chunk.get("usage").and_then(Usage::from_openai) {
            let no_choices = chunk["choices"].as_array().is_some_and(Vec::is_empty);
            if self.keeps_usage(usage, no_choices) {
                return;
            }
        }
        let event = match self.repair(&mut chunk) {
            true => Bytes::from(format!("data: {chunk}\n\n")),
            false => event,
        };
        self.keep_finish_reason(chunk);
        out.push((classify(&event), event));
    }

    fn finish(&mut self, out: &mut Vec<(EventKind, Bytes)>) {
        self.end(Bytes::from_static(b"data: [DONE]\n\n"), out);
    }

    fn failure_event(&self, message: &str) -> Bytes {
        error_event(message)
    }

    fn usage(&self) -> Usage {
        self.usage.unwrap_or_else(|| {
            Usage::estimated(self.prompt_estimate, estimate_tokens(self.completion_chars))
        })
    }

    fn answer_so_far(&self) -> StreamAnswer<'_> {
        StreamAnswer {
            id: Some(self.identity.id.as_str()).filter(|id| !id.is_empty()),
            finish_reason: self.finish_reason.as_deref(),
        }
    }
}

/// A chunk as far as [`ChatEvents::pass`] reads it, borrowed from the event; anything else in it
/// is skipped unparsed.
#[derive(Deserialize)]
struct Passing<'a> {
    #[serde(borrow, default)]
    id: Option<Text<'a>>,
    #[serde(borrow, default)]
    created: Option<&'a RawValue>,
    #[serde(borrow, default)]
    model: Option<&'a RawValue>,
    #[serde(default)]
    error: Option<IgnoredAny>,
    #[serde(borrow, default)]
    usage: Option<&'a RawValue>,
    #[serde(default)]
    prompt_filter_results: Option<IgnoredAny>,
    #[serde(borrow, default)]
    choices: PassingChoices<'a>,
}

/// What [`ChatEvents::pass`] made of a chunk.
enum Passed {
    /// It goes out as it came, as this kind.
    As(EventKind),
    /// A usage chunk the gateway asked for on the client's behalf: it stays here.
    Kept,
}

/// A string borrowed from the event when it has no escapes.
#[derive(Deserialize)]
struct Text<'a>(#[serde(borrow)] Cow<'a, str>);

/// A stream's `id`, `created` and `model`, as its first chunk with an id has them (`null` for
/// those it lacks); an empty id, `0` and `""` until then.
struct Identity {
    id: String,
    created: Value,
    model: Value,
}

impl Default for Identity {
    fn default() -> Self {
        Identity {
            id: String::new(),
            created: Value::from(0),
            model: Value::from(""),
        }
    }
}

impl Identity {
    fn stamp(&self, chunk: &mut Value) {
        chunk["id"] = Value::from(self.id.as_str());
        chunk["created"] = self.created.clone();
        chunk["model"] = self.model.clone();
    }
}

fn identity(id: Text<'_>, created: Option<&RawValue>, model: Option<&RawValue>) -> Identity {
    let value = |raw: Option<&RawValue>| {
        raw.and_then(|raw| serde_json::from_str(raw.get()).ok())
            .unwrap_or(Value::Null)
    };
    Identity {
        id: id.0.into_owned(),
        created: value(created),
        model: value(model),
    }
}

/// A string's characters, counted without keeping it, and the string itself when it stands in
/// the chunk as it reads (no escapes in it).
struct Content<'a> {
    chars: usize,
    unescaped: Option<&'a str>,
}

impl<'de: 'a, 'a> Deserialize<'de> for Content<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Read<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for Read<'a> {
            type Value = Content<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, text: &'de str) -> Result<Content<'a>, E> {
                Ok(Content {
                    chars: text.chars().count(),
                    unescaped: Some(text),
                })
            }
            fn visit_str<E: de::Error>(self, text: &str) -> Result<Content<'a>, E> {
                Ok(Content {
                    chars: text.chars().count(),
                    unescaped: None,
                })
            }
        }
        deserializer.deserialize_str(Read(std::marker::PhantomData))
    }
}

/// What a chunk's choices say, summed over them as they are read (no list is built).
#[derive(Default)]
struct PassingChoices<'a> {
    count: usize,
    content_chars: usize,
    /// The first choice's text, when it has no escapes.
    text: Option<&'a str>,
    /// Text or a refusal in a delta.
    content: bool,
    tool_calls: bool,
    finished: bool,
    /// The last finish reason among them.
    finish_reason: Option<Text<'a>>,
    /// The first choice's content-filter results, as they stand in the chunk.
    first_filter: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct PassingChoice<'a> {
    #[serde(borrow, default)]
    content_filter_results: Option<&'a RawValue>,
    #[serde(borrow, default)]
    delta: Option<PassingDelta<'a>>,
    #[serde(borrow, default)]
    finish_reason: Option<Text<'a>>,
}

#[derive(Deserialize)]
struct PassingDelta<'a> {
    #[serde(borrow, default)]
    content: Option<Content<'a>>,
    #[serde(default)]
    tool_calls: Option<IgnoredAny>,
    #[serde(borrow, default)]
    refusal: Option<Content<'a>>,
}

impl<'de: 'a, 'a> Deserialize<'de> for PassingChoices<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Sum<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for Sum<'a> {
            type Value = PassingChoices<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a list of choices")
            }
            fn visit_seq<S: SeqAccess<'de>>(self, mut seq: S) -> Result<Self::Value, S::Error> {
                let mut sum = PassingChoices::default();
                while let Some(choice) = seq.next_element::<PassingChoice<'a>>()? {
                    if sum.count == 0 {
                        sum.first_filter = choice.content_filter_results;
                    }
                    sum.count += 1;
                    if let Some(delta) = choice.delta {
                        if sum.count == 1 {
                            sum.text = delta.content.as_ref().and_then(|c| c.unescaped);
                        }
                        let text = delta.content.map_or(0, |c| c.chars);
                        sum.content_chars += text;
                        sum.content |= text > 0 || delta.refusal.is_some_and(|r| r.chars > 0);
                        sum.tool_calls |= delta.tool_calls.is_some();
                    }
                    if let Some(reason) = choice.finish_reason {
                        sum.finished = true;
                        sum.finish_reason = Some(reason);
                    }
                }
                Ok(sum)
            }
        }
        deserializer.deserialize_seq(Sum(std::marker::PhantomData))
    }
}

/// A whole `chat.completion` with the same repairs, its usage, and, when it carries none, the
/// characters of its answer (for an estimate; 0 beside a usage).
pub fn completion(body: Bytes) -> (Bytes, Option<Usage>, usize) {
    if let Some(usage) = trailing_usage(&body) {
        return (body, Some(usage), 0);
    }
    if let Some((usage, chars)) = plain_completion(&body) {
        return (body, usage, chars);
    }
    let Ok(mut value) = serde_json::from_slice::<Value>(&body) else {
        return (body, None, 0);
    };
    let usage = value.get("usage").and_then(Usage::from_openai);
    let mut changed = false;
    let mut chars = 0;
    for choice in array_mut(&mut value, "choices") {
        let mut calls = 0;
        if let Some(message) = choice.get_mut("message") {
            chars += message["content"].as_str().map_or(0, |t| t.chars().count());
            for call in array_mut(message, "tool_calls") {
                calls += 1;
                changed |= string_arguments(call);
                chars += call["function"]["arguments"]
                    .as_str()
                    .map_or(0, |t| t.chars().count());
            }
        }
        if calls > 0 && choice["finish_reason"] == "stop" {
            choice["finish_reason"] = json!("tool_calls");
            changed = true;
        }
    }
    match changed {
        true => (Bytes::from(value.to_string()), usage, chars),
        false => (body, usage, chars),
    }
}

/// Azure annotates every streamed choice with content-filter results, some 450 bytes that are
/// the same chunk after chunk and were most of what reading a chunk walked. A chunk that begins
/// byte for byte as an earlier one did, up to and with those results and the comma after them
/// (`{"choices":[{"content_filter_results":{...},`), is read as `{"choices":[{` and the rest:
/// the parser is in the same place after either beginning (inside the first choice, a member
/// to come), so the shortened chunk is JSON exactly when the whole one is, and the results were
/// checked when they were learnt. What follows must not close the object at once, which a
/// trailing comma would make invalid.
#[derive(Default)]
struct Annotations {
    /// The known beginning; empty until a chunk taught it.
    known: Vec<u8>,
    /// Reused for the shortened chunk.
    shortened: Vec<u8>,
}

/// How an annotated Azure chunk begins, before its first choice's results.
const ANNOTATED: &[u8] = b"{\"choices\":[{\"content_filter_results\":";
/// What the shortened chunk begins with instead.
const OPENED: &[u8] = b"{\"choices\":[{";

impl Annotations {
    /// Writes `data` without its known beginning into `into`; `false` when it has another.
    fn shorten(&self, data: &[u8], into: &mut Vec<u8>) -> bool {
        let Some(rest) = data
            .strip_prefix(&self.known[..])
            .filter(|_| !self.known.is_empty())
        else {
            return false;
        };
        if rest.trim_ascii_start().first() == Some(&b'}') {
            return false;
        }
        into.clear();
        into.extend_from_slice(OPENED);
        into.extend_from_slice(rest);
        true
    }

    /// Learns the beginning of a chunk that was read whole, if it is an annotated one.
    fn learn(&mut self, data: &[u8], filter: Option<&RawValue>) {
        let Some(filter) = filter.map(|f| f.get().as_bytes()) else {
            return;
        };
        let Some(at) = (filter.as_ptr() as usize).checked_sub(data.as_ptr() as usize) else {
            return;
        };
        let end = at + filter.len();
        if data.starts_with(ANNOTATED) && at == ANNOTATED.len() && data.get(end) == Some(&b',') {
            self.known.clear();
            self.known.extend_from_slice(&data[..=end]);
        }
    }
}

/// The last chunk that went out as it came with text in its only choice, and where that text
/// stands in it. A model streams chunks that differ in their text alone. A chunk with the same
/// bytes before and after the text, and between them a string with nothing to unescape, is the
/// same JSON with other text: its kind is known without reading it.
///
/// Why that holds: the bytes before the text end in its opening quote and the bytes after it
/// begin with its closing one. Text without a quote, a backslash or a control character is a
/// whole JSON string body on its own, so the parser reads the new chunk token for token as the
/// last one, that string's value aside.
///
/// The chunk's bytes are not kept: the length and a 64-bit hash of the bytes before its text and
/// of those after it are, some hundreds of bytes less a stream. With thousands of streams open a
/// kept chunk has left the cache by the stream's next event; the new chunk, just read, is hashed
/// instead. The hash is keyed at random for each process, so no upstream can aim for a
/// collision. Should one happen all the same, the chunk still goes out as it came; only its
/// kind and character count are taken as those of a chunk with other text.
#[derive(Default)]
struct LastText {
    /// `None` when no chunk is known.
    shape: Option<Shape>,
}

/// The bytes of a chunk around its text, by length and hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Shape {
    before: usize,
    after: usize,
    before_hash: u64,
    after_hash: u64,
}

/// The keyed hash [`LastText`] tells bytes apart by.
fn bytes_hash(bytes: &[u8]) -> u64 {
    use std::hash::BuildHasher;
    static KEY: LazyLock<foldhash::quality::RandomState> = LazyLock::new(Default::default);
    KEY.hash_one(bytes)
}

impl LastText {
    /// Keeps `data`'s shape, whose text is `text` at `at` (checked).
    fn learn(&mut self, data: &[u8], at: Option<usize>, text: &str) {
        let Some(at) = at.filter(|&at| at > 0 && !text.is_empty()) else {
            return self.forget();
        };
        let end = at + text.len();
        let quoted = data.get(at - 1) == Some(&b'"') && data.get(end) == Some(&b'"');
        if !quoted || data.get(at..end) != Some(text.as_bytes()) {
            return self.forget();
        }
        self.shape = Some(Shape {
            before: at,
            after: data.len() - end,
            before_hash: bytes_hash(&data[..at]),
            after_hash: bytes_hash(&data[end..]),
        });
    }

    fn forget(&mut self) {
        self.shape = None;
    }

    /// The characters of `data`'s text when `data` is the known chunk with other, non-empty
    /// text.
    fn chars_instead(&self, data: &[u8]) -> Option<usize> {
        let shape = self.shape?;
        let end = data.len().checked_sub(shape.after)?;
        if end <= shape.before {
            return None;
        }
        let text = &data[shape.before..end];
        if text.iter().any(|&b| b == b'"' || b == b'\\' || b < 0x20) {
            return None;
        }
        if bytes_hash(&data[..shape.before]) != shape.before_hash
            || bytes_hash(&data[end..]) != shape.after_hash
        {
            return None;
        }
        Some(std::str::from_utf8(text).ok()?.chars().count())
    }
}

/// The usage of a completion that needs no repair, read from its last member alone: OpenAI and
/// Azure end a completion with `"usage":{...}}`, and its content-filter annotations and text
/// need not be walked to find it. Without tool calls nothing is repaired, and with the usage
/// the answer's characters are not needed. `None` whenever that cannot be told for sure
/// (`"tool_calls"` anywhere, no `"usage"` key ending the top-level object), and the whole body
/// is read instead.
///
/// Why the match is the top-level member: inside a JSON string a quote is escaped, so the bytes
/// `"usage"` there would end in `\"`; a match whose first quote is escaped is refused; and a
/// `usage` object followed by a single `}` and the end is a member of the outermost object.
fn trailing_usage(body: &[u8]) -> Option<Usage> {
    static TOOL_CALLS: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"tool_calls\""));
    if TOOL_CALLS.find(body).is_some() {
        return None;
    }
    let key = last_usage_key(body)?;
    if key == 0 || body[key - 1] == b'\\' {
        return None;
    }
    let value = body[key + b"\"usage\"".len()..]
        .trim_ascii_start()
        .strip_prefix(b":")?;
    // Read as text, checked once: from bytes serde_json checks every string it meets again.
    let value = std::str::from_utf8(value).ok()?;
    let mut read = serde_json::Deserializer::from_str(value).into_iter::<PlainUsage>();
    let usage = read.next()?.ok()?;
    let after = value.get(read.byte_offset()..)?;
    (after.trim_ascii() == "}").then(|| usage.usage())?
}

/// Where the last `"usage"` in `body` begins. A backwards substring search has no vector
/// prefilter; the letter `u` has one (`memrchr`), and few others in an answer's tail are one.
fn last_usage_key(body: &[u8]) -> Option<usize> {
    memchr::memrchr_iter(b'u', body)
        .filter_map(|u| u.checked_sub(1))
        .find(|&quote| {
            body.get(quote..)
                .is_some_and(|tail| tail.starts_with(b"\"usage\""))
        })
}

/// A chat completion as far as [`completion`] reads it, borrowed from the body: anything else
/// in it is skipped unparsed.
#[derive(Deserialize)]
struct Plain<'a> {
    #[serde(default)]
    usage: Option<PlainUsage>,
    #[serde(borrow, default)]
    choices: Option<Vec<PlainChoice<'a>>>,
}

/// A usage block's numbers, as [`Usage::from_openai`] reads them.
#[derive(Deserialize)]
struct PlainUsage {
    prompt_tokens: Option<u64>,
    input_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    output_tokens: Option<u64>,
    prompt_tokens_details: Option<PlainDetails>,
    input_tokens_details: Option<PlainDetails>,
    cache_creation_input_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct PlainDetails {
    cached_tokens: Option<u64>,
}

impl PlainUsage {
    fn usage(&self) -> Option<Usage> {
        let cached = |d: &Option<PlainDetails>| d.as_ref().and_then(|d| d.cached_tokens);
        Some(Usage {
            prompt_tokens: self.prompt_tokens.or(self.input_tokens)?,
            completion_tokens: self.completion_tokens.or(self.output_tokens).unwrap_or(0),
            cached_tokens: cached(&self.prompt_tokens_details)
                .or_else(|| cached(&self.input_tokens_details))
                .unwrap_or(0),
            cache_write_tokens: self.cache_creation_input_tokens.unwrap_or(0),
            source: crate::usage::UsageSource::Measured,
        })
    }
}

#[derive(Deserialize)]
struct PlainChoice<'a> {
    #[serde(borrow, default)]
    message: Option<PlainMessage<'a>>,
}

#[derive(Deserialize)]
struct PlainMessage<'a> {
    #[serde(borrow, default)]
    content: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    tool_calls: Option<&'a RawValue>,
}

/// The usage and answer characters of a completion that needs no repair (no tool calls), read
/// without building the body's tree; `None` for anything else, which [`completion`] reads whole.
fn plain_completion(body: &[u8]) -> Option<(Option<Usage>, usize)> {
    let plain: Plain<'_> = serde_json::from_slice(body).ok()?;
    let mut chars = 0;
    for choice in plain.choices.iter().flatten() {
        let Some(message) = &choice.message else {
            continue;
        };
        if message
            .tool_calls
            .is_some_and(|calls| calls.get() != "null")
        {
            return None;
        }
        chars += message.content.as_deref().map_or(0, |t| t.chars().count());
    }
    Some((plain.usage.as_ref().and_then(PlainUsage::usage), chars))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_completion_without_tool_calls_is_read_without_its_tree_and_kept_byte_for_byte() {
        let body = Bytes::from_static(
            br#"{"id":"x","choices":[{"index":0,"message":{"role":"assistant","content":"h\u00e9llo"},"finish_reason":"stop","content_filter_results":{"hate":{"filtered":false}}}],"usage":{"prompt_tokens":5,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":1}}}"#,
        );
        assert!(plain_completion(&body).is_some());
        let (out, usage, chars) = completion(body.clone());
        assert_eq!(out, body);
        let usage = usage.unwrap();
        let read = (
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.cached_tokens,
        );
        assert_eq!(
            (read, chars),
            ((5, 2, 1), 0),
            "characters are not counted beside a usage"
        );
        let unmeasured = br#"{"choices":[{"message":{"content":"h\u00e9llo"}}]}"#;
        let (_, usage, chars) = completion(Bytes::from_static(unmeasured));
        assert_eq!((usage.is_none(), chars), (true, 5));
        let with_tools = br#"{"choices":[{"message":{"content":null,"tool_calls":[{"id":"a","function":{"name":"f","arguments":{"x":1}}}]},"finish_reason":"stop"}]}"#;
        assert!(plain_completion(with_tools).is_none());
        let (repaired, _, _) = completion(Bytes::from_static(with_tools));
        let repaired = std::str::from_utf8(&repaired).unwrap();
        assert!(
            repaired.contains(r#""finish_reason":"tool_calls""#),
            "{repaired}"
        );
    }

    fn tokens(usage: Option<Usage>) -> Option<(u64, u64, u64)> {
        usage.map(|u| (u.prompt_tokens, u.completion_tokens, u.cached_tokens))
    }

    #[test]
    fn the_usage_ending_a_completion_is_read_from_there_and_only_when_it_ends_it() {
        let body = br#"{"choices":[{"message":{"content":"say \"usage\":{\"prompt_tokens\":99}}"},"content_filter_results":{"hate":{"filtered":false}}}],"usage":{"prompt_tokens":5,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":1},"completion_tokens_details":{"reasoning_tokens":0}} }"#;
        assert_eq!(tokens(trailing_usage(body)), Some((5, 2, 1)));
        let elsewhere: [&[u8]; 5] = [
            br#"{"x":{"usage":{"prompt_tokens":9}}}"#,
            br#"{"usage":{"prompt_tokens":9},"id":"a"}"#,
            br#"{"a \"usage":{"prompt_tokens":9}}"#,
            br#"{"choices":[{"message":{"tool_calls":null}}],"usage":{"prompt_tokens":9}}"#,
            br#"{"usage":null}"#,
        ];
        for body in elsewhere {
            assert!(
                trailing_usage(body).is_none(),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        let (_, usage, _) = completion(Bytes::from_static(elsewhere[1]));
        assert_eq!(tokens(usage), Some((9, 0, 0)));
        let (_, usage, _) = completion(Bytes::from_static(elsewhere[2]));
        assert_eq!(tokens(usage), None);
    }

    #[test]
    fn the_last_usage_key_is_found_wherever_it_is() {
        let bodies: [&[u8]; 7] = [
            br#""usage""#,
            br#"{"usage":{"u":"usage"},"uu":"u\"usage"}"#,
            br#"{"usage":1,"usage_x":2}"#,
            br#"usage"usage"#,
            b"",
            b"u",
            br#"{"id":"x"}"#,
        ];
        for body in bodies {
            let naive = body.windows(7).rposition(|w| w == b"\"usage\"");
            assert_eq!(
                last_usage_key(body),
                naive,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn the_usage_read_from_the_end_is_the_one_the_whole_body_carries() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let texts = [
            "hi",
            r#"\"usage\":{\"prompt_tokens\":1}}"#,
            "usage",
            "}",
            r#"\\"#,
            "é",
        ];
        for _ in 0..500 {
            let text = texts[rng.random_range(0..texts.len())];
            let (prompt, completion_tokens) =
                (rng.random_range(0..1000), rng.random_range(0..1000));
            let usage =
                format!(r#"{{"prompt_tokens":{prompt},"completion_tokens":{completion_tokens}}}"#);
            let members = [
                format!(r#""choices":[{{"message":{{"content":"{text}"}}}}]"#),
                format!(r#""usage":{usage}"#),
                r#""id":"x""#.to_owned(),
                r#""nested":{"usage":{"prompt_tokens":7}}"#.to_owned(),
            ];
            let mut order: Vec<&String> = members.iter().collect();
            for i in (1..order.len()).rev() {
                order.swap(i, rng.random_range(0..=i));
            }
            let joined: Vec<&str> = order.iter().map(|m| m.as_str()).collect();
            let body = format!("{{{}}}", joined.join(","));
            let whole = serde_json::from_str::<Value>(&body).unwrap();
            let carried = Usage::from_openai(&whole["usage"]);
            if let Some(read) = trailing_usage(body.as_bytes()) {
                assert_eq!(tokens(Some(read)), tokens(carried), "{body}");
            }
            assert_eq!(
                tokens(completion(Bytes::from(body.clone())).1),
                tokens(carried),
                "{body}"
            );
        }
    }

    const AZURE_CHUNK: &str = r#"{"choices":[{"content_filter_results":{"hate":{"filtered":false,"severity":"safe"},"self_harm":{"filtered":false,"severity":"safe"}},"delta":{"content":"TEXT"},"finish_reason":null,"index":0,"logprobs":null}],"created":1,"id":"chatcmpl-x","model":"gpt-4o","object":"chat.completion.chunk","usage":null}"#;

    fn chunk(text: &str) -> Bytes {
        Bytes::from(format!("data: {}\n\n", AZURE_CHUNK.replace("TEXT", text)))
    }

    #[test]
    fn azure_chunks_with_the_annotations_of_the_one_before_are_read_the_same_without_them() {
        let mut events = ChatEvents::new(false, 0);
        let mut out = Vec::new();
        for text in ["Hel", "lo", " world", "é"] {
            events.translate(chunk(text), &mut out);
        }
        assert!(
            !events.annotations.known.is_empty(),
            "the first chunk taught the beginning"
        );
        assert_eq!(events.completion_chars, 3 + 2 + 6 + 1);
        assert!(out
            .iter()
            .all(|(kind, _)| *kind == EventKind::Content { finished: false }));
        let mut shortened = Vec::new();
        assert!(events.annotations.shorten(
            chunk("x").trim_ascii_end().strip_prefix(b"data: ").unwrap(),
            &mut shortened
        ));
        let other = AZURE_CHUNK
            .replace("\"safe\"", "\"low\"")
            .replace("TEXT", "x");
        assert!(!events.annotations.shorten(other.as_bytes(), &mut shortened));
        let known = events.annotations.known.clone();
        let closing = [&known[..], b"}]}"].concat();
        assert!(!events.annotations.shorten(&closing, &mut shortened));
    }

    #[test]
    fn a_chunk_read_without_its_known_annotations_is_json_exactly_when_it_is_whole() {
        use rand::{Rng, SeedableRng};
        let mut annotations = Annotations::default();
        let first = AZURE_CHUNK.replace("TEXT", "a");
        let chunk: Passing<'_> = serde_json::from_str(&first).unwrap();
        annotations.learn(first.as_bytes(), chunk.choices.first_filter);
        assert!(!annotations.known.is_empty());
        let known = annotations.known.clone();
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let tail = first.as_bytes()[known.len()..].to_vec();
        let mut shortened = Vec::new();
        for _ in 0..3000 {
            let mut rest = tail.clone();
            for _ in 0..rng.random_range(1..4) {
                if rest.is_empty() {
                    break;
                }
                let at = rng.random_range(0..rest.len());
                match rng.random_range(0..4) {
                    0 => rest[at] ^= 1 << rng.random_range(0..8),
                    1 => rest.truncate(at),
                    2 => {
                        const BYTES: &[u8] = b"{}[],:\"\\ 0}";
                        rest.insert(at, BYTES[rng.random_range(0..BYTES.len())]);
                    }
                    _ => drop(rest.remove(at)),
                }
            }
            let whole = [&known[..], &rest[..]].concat();
            if annotations.shorten(&whole, &mut shortened) {
                assert_eq!(
                    serde_json::from_slice::<Value>(&shortened).is_ok(),
                    serde_json::from_slice::<Value>(&whole).is_ok(),
                    "{}",
                    String::from_utf8_lossy(&whole)
                );
            }
        }
    }

    #[test]
    fn a_chunk_that_differs_from_the_last_in_its_text_alone_is_told_by_its_bytes() {
        let texts = [
            "Hel",
            "lo",
            "",
            " w\\\"or\\u00e9ld",
            "é",
            "\\n",
            "x",
            "a\\\"b",
            "y",
            "z",
        ];
        let mut events = ChatEvents::new(false, 0);
        let mut out = Vec::new();
        let mut chars = 0;
        let mut learned = false;
        for text in texts {
            let event = chunk(text);
            let whole: Value = serde_json::from_slice(&event_data(&event)).unwrap();
            let expected = classify(&event);
            chars += whole["choices"][0]["delta"]["content"]
                .as_str()
                .map_or(0, |t| t.chars().count());
            let told = events
                .last_text
                .chars_instead(&event_data(&event))
                .is_some();
            let simple = !text.is_empty() && !text.contains(['\\', '"']);
            assert_eq!(told, simple && learned, "{text}");
            learned = simple;
            events.translate(event, &mut out);
            assert_eq!(out.pop().map(|(kind, _)| kind), Some(expected), "{text}");
        }
        assert_eq!(events.completion_chars, chars);
        let finished = AZURE_CHUNK
            .replace("TEXT", "z")
            .replace("\"finish_reason\":null", "\"finish_reason\":\"stop\"");
        events.translate(Bytes::from(format!("data: {finished}\n\n")), &mut out);
        assert_eq!(
            out.pop().map(|(kind, _)| kind),
            Some(EventKind::Content { finished: true })
        );
        assert_eq!(events.finish_reason.as_deref(), Some("stop"));
    }

    #[test]
    fn the_first_chunk_with_an_id_gives_the_stream_its_identity() {
        let role = r#"{"choices":[{"delta":{"content":"","role":"assistant"},"finish_reason":null,"index":0}],"created":1796280434,"id":"chatcmpl-1","model":"gpt-4o-2024-11-20","object":"chat.completion.chunk"}"#;
        let done = Bytes::from_static(b"data: [DONE]\n\n");
        let cases = [
            (
                role.to_owned(),
                json!({"id": "chatcmpl-1", "created": 1796280434, "model": "gpt-4o-2024-11-20"}),
            ),
            (
                role.replace(r#","model":"gpt-4o-2024-11-20""#, ""),
                json!({"id": "chatcmpl-1", "created": 1796280434, "model": null}),
            ),
            (
                role.replace("1796280434", "null"),
                json!({"id": "chatcmpl-1", "created": null, "model": "gpt-4o-2024-11-20"}),
            ),
        ];
        for (first, identity) in cases {
            let mut events = ChatEvents::new(true, 0);
            let mut out = Vec::new();
            let later = first.replace("chatcmpl-1", "chatcmpl-2");
            for chunk in [&first, &later] {
                events.translate(Bytes::from(format!("data: {chunk}\n\n")), &mut out);
            }
            assert_eq!(
                out.drain(..).map(|(kind, _)| kind).collect::<Vec<_>>(),
                [EventKind::Meta; 2]
            );
            assert_eq!(events.answer_so_far().id, Some("chatcmpl-1"));
            events.translate(done.clone(), &mut out);
            let usage: Value = serde_json::from_slice(&event_data(&out[0].1)).unwrap();
            for key in ["id", "created", "model"] {
                assert_eq!(usage[key], identity[key], "{key} of {first}");
            }
        }
    }

    #[test]
    fn a_usage_chunk_is_read_and_goes_out_only_when_the_client_asked_for_it() {
        let usage = r#"{"choices":[],"id":"chatcmpl-1","usage":{"completion_tokens":20,"prompt_tokens":12,"prompt_tokens_details":{"cached_tokens":2},"total_tokens":32}}"#;
        let with_choices = usage.replace(
            r#""choices":[]"#,
            r#""choices":[{"delta":{"content":"x"},"finish_reason":null,"index":0}]"#,
        );
        for (chunk, asked, kinds) in [
            (usage.to_owned(), false, vec![EventKind::Done]),
            (
                usage.to_owned(),
                true,
                vec![EventKind::Meta, EventKind::Done],
            ),
            (
                with_choices.clone(),
                false,
                vec![EventKind::Content { finished: false }, EventKind::Done],
            ),
            (
                with_choices,
                true,
                vec![EventKind::Content { finished: false }, EventKind::Done],
            ),
        ] {
            let mut events = ChatEvents::new(asked, 0);
            let mut out = Vec::new();
            events.translate(Bytes::from(format!("data: {chunk}\n\n")), &mut out);
            events.translate(Bytes::from_static(b"data: [DONE]\n\n"), &mut out);
            let told: Vec<EventKind> = out.iter().map(|(kind, _)| *kind).collect();
            assert_eq!(told, kinds, "{chunk} asked {asked}");
            assert_eq!(tokens(events.usage), Some((12, 20, 2)), "{chunk}");
        }
    }

    #[test]
    fn a_chunk_told_by_its_bytes_is_the_last_one_with_other_text() {
        use rand::{Rng, SeedableRng};
        let mut events = ChatEvents::new(false, 0);
        let mut out = Vec::new();
        events.translate(chunk("first"), &mut out);
        events.translate(chunk("second"), &mut out);
        let known = event_data(&chunk("second")).into_owned();
        let learned: Value = serde_json::from_slice(&known).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let mut told = 0;
        let at = memchr::memmem::find(&known, b"\"second\"").unwrap() + 1;
        let text = at..at + "second".len();
        let shape = events.last_text.shape.unwrap();
        assert_eq!(
            (shape.before, shape.after),
            (text.start, known.len() - text.end)
        );
        for _ in 0..5000 {
            let mut data = known.clone();
            for _ in 0..rng.random_range(1..4) {
                // Mostly in and around the text, where a change can keep the chunk's shape.
                let at = match rng.random_bool(0.8) {
                    true => rng.random_range(text.start - 2..(text.end + 2).min(data.len())),
                    false => rng.random_range(0..data.len()),
                };
                match rng.random_range(0..4) {
                    0 => data[at] ^= 1 << rng.random_range(0..8),
                    1 => drop(data.remove(at)),
                    _ => {
                        const BYTES: &[u8] = b"{}[],:\"\\ 0a\x01\xc3\xa9";
                        data.insert(at, BYTES[rng.random_range(0..BYTES.len())]);
                    }
                }
            }
            let Some(chars) = events.last_text.chars_instead(&data) else {
                continue;
            };
            told += 1;
            let mut value: Value = serde_json::from_slice(&data)
                .unwrap_or_else(|_| panic!("{}", String::from_utf8_lossy(&data)));
            let text = value["choices"][0]["delta"]["content"].take();
            assert_eq!(text.as_str().map(|t| t.chars().count()), Some(chars));
            assert!(chars > 0);
            let mut expected = learned.clone();
            expected["choices"][0]["delta"]["content"] = Value::Null;
            assert_eq!(value, expected, "{}", String::from_utf8_lossy(&data));
        }
        assert!(told > 100, "only {told} chunks were told by their bytes");
    }

    #[test]
    fn a_new_id_on_a_taken_index_is_a_new_call() {
        let mut tools = ToolIndex::default();
        assert_eq!(tools.position(0, Some("a")), 0);
        assert_eq!(tools.position(0, None), 0);
        assert_eq!(tools.position(0, Some("a")), 0);
        assert_eq!(tools.position(0, Some("b")), 1);
        assert_eq!(tools.position(0, None), 1);
        assert_eq!(tools.position(1, Some("c")), 2);
    }
}
