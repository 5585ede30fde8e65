//! Prompt token estimates for admission (reference/wire-protocols.md section 6): the model family
//! picks the encoding (o200k_base, cl100k_base) and the image and tool costs; text is counted by
//! `bpe-openai`, whose byte-pair encoder is exact against tiktoken and linear in the input (no
//! quadratic blow-up on a long run without spaces), with its vocabularies built into the binary.
//! Chat overhead follows OpenAI's cookbook: 3 tokens a message, 1 more for a `name`, 3 to prime
//! the reply; tool schemas and image tiles follow its recipes. Claude has no public tokenizer:
//! its models get an estimate of 3.5 characters a token. Every number here is an estimate that
//! the measured usage replaces.

use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, Ordering};

use base64::Engine;
use serde::de::{self, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

const TOKENS_PER_MESSAGE: u64 = 3;
const TOKENS_PER_NAME: u64 = 1;
const REPLY_PRIMING: u64 = 3;
/// tiktoken-rs's per-call overhead for a tool or function call in an assistant message.
const FUNCTION_CALL_OVERHEAD: u64 = 1;
/// An image whose size cannot be read without fetching it (a remote URL) is counted as this.
const UNKNOWN_IMAGE: (u32, u32) = (1024, 1024);
/// At most this much of a base64 data URL is decoded to find the image's size.
const IMAGE_HEADER_BASE64: usize = 1 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    O200k,
    Cl100k,
    /// No public tokenizer (Claude): characters / 3.5.
    Approximate,
}

/// How a model family charges an image.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Images {
    /// 512 px tiles after fitting into 2048 and scaling the short side to 768.
    Tiles { base: u64, per_tile: u64 },
    /// 32 px patches, at most 1536, times a factor.
    Patches { factor: f64 },
}

/// The cookbook's tool-schema constants (`func_init` differs between the families).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ToolCosts {
    func_init: i64,
    prop_init: i64,
    prop_key: i64,
    enum_init: i64,
    enum_item: i64,
    func_end: i64,
}

/// The estimator for one model family.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Estimator {
    pub encoding: Encoding,
    images: Images,
    tools: ToolCosts,
}

const O200K_TOOLS: ToolCosts = ToolCosts {
    func_init: 7,
    prop_init: 3,
    prop_key: 3,
    enum_init: -3,
    enum_item: 3,
    func_end: 12,
};
const CL100K_TOOLS: ToolCosts = ToolCosts {
    func_init: 10,
    ..O200K_TOOLS
};

/// Whether `name` starts with one of `prefixes`, ignoring ASCII case.
fn starts(name: &str, prefixes: &[&str]) -> bool {
    prefixes.iter().any(|p| {
        name.as_bytes()
            .get(..p.len())
            .is_some_and(|head| head.eq_ignore_ascii_case(p.as_bytes()))
    })
}

impl Estimator {
    /// The estimator for a model or deployment name, by the reference's prefix table; a name it
    /// does not know (an Azure deployment called `prod-chat`) gets the current family, o200k.
    pub fn for_model(name: &str) -> Self {
        let o200k = [
            "gpt-5",
            "gpt-4.1",
            "gpt-4.5",
            "gpt-4o",
            "chatgpt-4o-",
            "o1",
            "o3",
            "o4",
            "codex-mini",
            "gpt-oss-",
        ];
        let cl100k = [
            "gpt-4",
            "gpt-3.5",
            "gpt-35",
            "text-embedding-",
            "davinci",
            "babbage",
            "text-davinci",
            "code-davinci",
        ];
        let encoding = if starts(name, &o200k) {
            Encoding::O200k
        } else if starts(name, &cl100k) {
            Encoding::Cl100k
        } else if starts(name, &["claude"]) {
            Encoding::Approximate
        } else {
            Encoding::O200k
        };
        let images = if starts(name, &["gpt-4.1-mini", "gpt-5-mini"]) {
            Images::Patches { factor: 1.62 }
        } else if starts(name, &["gpt-4.1-nano", "gpt-5-nano"]) {
            Images::Patches { factor: 2.46 }
        } else if starts(name, &["o4-mini"]) {
            Images::Patches { factor: 1.72 }
        } else if starts(name, &["gpt-4o-mini"]) {
            Images::Tiles {
                base: 2833,
                per_tile: 5667,
            }
        } else if starts(name, &["o1", "o3"]) {
            Images::Tiles {
                base: 75,
                per_tile: 150,
            }
        } else if starts(name, &["computer-use"]) {
            Images::Tiles {
                base: 65,
                per_tile: 129,
            }
        } else {
            Images::Tiles {
                base: 85,
                per_tile: 170,
            }
        };
        let tools = match encoding {
            Encoding::Cl100k => CL100K_TOOLS,
            _ => O200K_TOOLS,
        };
        Estimator {
            encoding,
            images,
            tools,
        }
    }

    /// Tokens of plain text.
    pub fn text(&self, text: &str) -> u64 {
        if self.encoding == Encoding::Approximate {
            return (text.chars().count() as u64 * 2).div_ceil(7);
        }
        let encoding = self.encoding;
        recent::count(encoding, text, |text| {
            vocabulary(encoding).map_or(0, |tokenizer| tokenizer.count(text) as u64)
        })
    }

    /// Loads this encoding's vocabulary off the async threads, once: the requests that need it
    /// while it loads wait for that one load, instead of each holding a blocking thread.
    pub async fn load(&self) {
        if self.ready() {
            return;
        }
        let encoding = self.encoding;
        loading(encoding)
            .once
            .get_or_init(|| async move {
                let started = std::time::Instant::now();
                match tokio::task::spawn_blocking(move || vocabulary(encoding)).await {
                    Ok(_) => tracing::info!(
                        ?encoding,
                        ms = started.elapsed().as_millis() as u64,
                        "tokenizer vocabulary loaded"
                    ),
                    Err(_) => tracing::warn!(?encoding, "the tokenizer's vocabulary did not load"),
                }
            })
            .await;
    }

    /// Whether counting can start at once: the vocabulary is loaded, or none is needed. Each
    /// encoding's is loaded once (o200k_base about 160 ms and some 40 MB of tables,
    /// cl100k_base a third of that): at start by a gateway whose limits count tokens, else by
    /// its first count; a gateway whose limits never count tokens never pays.
    pub fn ready(&self) -> bool {
        self.encoding == Encoding::Approximate
            || loading(self.encoding).loaded.load(Ordering::Relaxed)
    }

    /// The prompt tokens of a chat request's `messages` (and `tools`, `functions`, Anthropic's
    /// top-level `system`); `None` when they are not in a shape this counts.
    pub fn chat(&self, request: ChatFields<'_>) -> Option<u64> {
        let mut read = serde_json::Deserializer::from_slice(request.messages?);
        let messages = de::DeserializeSeed::deserialize(Messages(self), &mut read).ok()?;
        read.end().ok()?;
        let mut total = REPLY_PRIMING + messages;
        if let Some(system) = request.system {
            total += TOKENS_PER_MESSAGE + self.text("system") + self.content(system)?;
        }
        let tools = [request.tools, request.functions];
        for list in tools.into_iter().flatten() {
            total += self.tools(list)?;
        }
        Some(total)
    }

    fn message(&self, message: &Message<'_>) -> u64 {
        let strings = [&message.role, &message.tool_call_id, &message.refusal];
        let mut total = TOKENS_PER_MESSAGE
            + strings
                .into_iter()
                .flatten()
                .map(|s| self.text(s))
                .sum::<u64>();
        if let Some(name) = &message.name {
            total += self.text(name) + TOKENS_PER_NAME;
        }
        if let Some(content) = &message.content {
            total += self.counted(content);
        }
        let calls = message.tool_calls.iter().flatten().map(|c| &c.function);
        for call in calls.chain(&message.function_call) {
            total += FUNCTION_CALL_OVERHEAD
                + call.name.as_deref().map_or(0, |n| self.text(n))
                + call.arguments.as_deref().map_or(0, |a| self.text(a));
        }
        total
    }

    /// A message content (its JSON): a string, or parts (text, images; other kinds count
    /// nothing).
    fn content(&self, raw: &[u8]) -> Option<u64> {
        let content: Content<'_> = serde_json::from_slice(raw).ok()?;
        Some(self.counted(&content))
    }

    fn counted(&self, content: &Content<'_>) -> u64 {
        match content {
            Content::Text(text) => self.text(text),
            Content::Parts(parts) => parts.iter().map(|p| self.part(p)).sum(),
            Content::Other => 0,
        }
    }

    fn part(&self, part: &Part<'_>) -> u64 {
        if let Some(text) = &part.text {
            return self.text(text);
        }
        if let Some(image) = &part.image_url {
            let size = data_url_size(&image.url).unwrap_or(UNKNOWN_IMAGE);
            return self.image(size, image.detail.as_deref());
        }
        if let Some(source) = &part.source {
            let size = source
                .data
                .as_deref()
                .and_then(base64_image_size)
                .unwrap_or(UNKNOWN_IMAGE);
            return self.image(size, None);
        }
        // Anthropic tool results carry their text one level down.
        part.content
            .map_or(0, |c| self.content(c.get().as_bytes()).unwrap_or(0))
    }

    /// The tokens of one image of `(width, height)` pixels.
    fn image(&self, (width, height): (u32, u32), detail: Option<&str>) -> u64 {
        let (w, h) = (f64::from(width.max(1)), f64::from(height.max(1)));
        match self.images {
            Images::Tiles { base, .. } if detail == Some("low") => base,
            Images::Tiles { base, per_tile } => {
                let (mut w, mut h) = (w, h);
                let long = w.max(h);
                if long > 2048.0 {
                    (w, h) = (w * 2048.0 / long, h * 2048.0 / long);
                }
                let short = w.min(h);
                if short > 768.0 {
                    (w, h) = (w * 768.0 / short, h * 768.0 / short);
                }
                let tiles = (w / 512.0).ceil() * (h / 512.0).ceil();
                base + per_tile * tiles as u64
            }
            Images::Patches { factor } => {
                let mut patches = (w / 32.0).ceil() * (h / 32.0).ceil();
                if patches > 1536.0 {
                    let mut r = (32.0 * 32.0 * 1536.0 / (w * h)).sqrt();
                    r *= ((w * r / 32.0).floor() / (w * r / 32.0))
                        .min((h * r / 32.0).floor() / (h * r / 32.0));
                    patches = ((w * r / 32.0).ceil() * (h * r / 32.0).ceil()).min(1536.0);
                }
                (patches * factor).ceil() as u64
            }
        }
    }

    /// The cookbook recipe for tool (or legacy function) schemas.
    fn tools(&self, raw: &[u8]) -> Option<u64> {
        let list: Vec<serde_json::Value> = serde_json::from_slice(raw).ok()?;
        if list.is_empty() {
            return Some(0);
        }
        let c = self.tools;
        let mut total = c.func_end;
        for tool in &list {
            let function = tool.get("function").unwrap_or(tool);
            let name = function.get("name").and_then(|v| v.as_str()).unwrap_or("");
            let description = text_field(function, "description");
            total +=
                c.func_init + self.text(&format!("{name}:{}", trim_period(&description))) as i64;
            let properties = function
                .get("parameters")
                .and_then(|p| p.get("properties"))
                .and_then(|p| p.as_object());
            let Some(properties) = properties.filter(|p| !p.is_empty()) else {
                continue;
            };
            total += c.prop_init;
            for (key, property) in properties {
                total += c.prop_key;
                if let Some(items) = property.get("enum").and_then(|e| e.as_array()) {
                    total += c.enum_init;
                    for item in items {
                        total += c.enum_item + self.text(&plain(item)) as i64;
                    }
                }
                let kind = text_field(property, "type");
                let description = text_field(property, "description");
                total += self.text(&format!("{key}:{kind}:{}", trim_period(&description))) as i64;
            }
        }
        u64::try_from(total).ok()
    }

    /// The tokens of an embeddings `input`: a string, strings, or token arrays.
    pub fn embeddings(&self, input: &[u8]) -> Option<u64> {
        let value: serde_json::Value = serde_json::from_slice(input).ok()?;
        Some(self.embedding_input(&value))
    }

    fn embedding_input(&self, value: &serde_json::Value) -> u64 {
        match value {
            serde_json::Value::String(s) => self.text(s),
            serde_json::Value::Number(_) => 1,
            serde_json::Value::Array(items) => items.iter().map(|i| self.embedding_input(i)).sum(),
            _ => 0,
        }
    }
}

/// Set once an encoding's vocabulary has counted something (is loaded).
/// Texts this thread counted recently: system prompts, tool schemas and few-shot examples repeat
/// from request to request, and hashing a text costs about a hundredth of counting it. Only a
/// 64-bit hash of each text is kept, never the text; a collision costs an estimate, which the
/// measured usage replaces anyway.
mod recent {
    use std::cell::RefCell;
    use std::collections::HashMap;
    use std::hash::BuildHasher;

    use super::Encoding;

    /// Past this many texts the memory starts over.
    const TEXTS: usize = 4096;

    /// The texts' hashes (seeded at random per thread, so texts cannot be made to collide on
    /// purpose) and their counts.
    struct Counts {
        seed: foldhash::fast::RandomState,
        counts: HashMap<u64, u64, foldhash::fast::RandomState>,
    }

    thread_local! {
        static COUNTS: RefCell<Counts> = RefCell::new(Counts {
            seed: foldhash::fast::RandomState::default(),
            counts: HashMap::default(),
        });
    }

    pub fn count(encoding: Encoding, text: &str, count: impl FnOnce(&str) -> u64) -> u64 {
        let (key, known) = COUNTS.with_borrow(|c| {
            let key = c.seed.hash_one((encoding as u8, text));
            (key, c.counts.get(&key).copied())
        });
        if let Some(known) = known {
            return known;
        }
        let counted = count(text);
        COUNTS.with_borrow_mut(|c| {
            if c.counts.len() >= TEXTS {
                c.counts.clear();
            }
            c.counts.insert(key, counted);
        });
        counted
    }
}

/// The tokenizer of `encoding`, loaded on first use (which takes a while: see
/// [`Estimator::ready`]); `None` for the approximate count, which has none.
fn vocabulary(encoding: Encoding) -> Option<&'static bpe_openai::Tokenizer> {
    let tokenizer = match encoding {
        Encoding::O200k => bpe_openai::o200k_base(),
        Encoding::Cl100k => bpe_openai::cl100k_base(),
        Encoding::Approximate => return None,
    };
    loading(encoding).loaded.store(true, Ordering::Relaxed);
    Some(tokenizer)
}

/// One encoding's vocabulary as the process knows it: whether it is loaded (by whichever
/// path), and the one load off the async threads that [`Estimator::load`] waits for.
struct Loading {
    loaded: AtomicBool,
    once: tokio::sync::OnceCell<()>,
}

impl Loading {
    const fn new() -> Loading {
        Loading {
            loaded: AtomicBool::new(false),
            once: tokio::sync::OnceCell::const_new(),
        }
    }
}

fn loading(encoding: Encoding) -> &'static Loading {
    static O200K: Loading = Loading::new();
    static CL100K: Loading = Loading::new();
    match encoding {
        Encoding::Cl100k => &CL100K,
        Encoding::O200k | Encoding::Approximate => &O200K,
    }
}

/// The tokens of a `messages` array, each message counted as it is read: no list of them is
/// built. An element that is not a message fails the whole read, as it failed the list's.
struct Messages<'e>(&'e Estimator);

impl<'de> de::DeserializeSeed<'de> for Messages<'_> {
    type Value = u64;

    fn deserialize<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<u64, D::Error> {
        deserializer.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for Messages<'_> {
    type Value = u64;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a list of messages")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<u64, A::Error> {
        let mut total = 0;
        while let Some(message) = seq.next_element::<Message<'de>>()? {
            total += self.0.message(&message);
        }
        Ok(total)
    }
}

/// The fields of a chat body the estimate reads, each its JSON text.
#[derive(Debug, Clone, Copy, Default)]
pub struct ChatFields<'a> {
    pub messages: Option<&'a [u8]>,
    pub tools: Option<&'a [u8]>,
    pub functions: Option<&'a [u8]>,
    /// Anthropic Messages' top-level system prompt.
    pub system: Option<&'a [u8]>,
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow, default)]
    role: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Option<Content<'a>>,
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    tool_call_id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    refusal: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    tool_calls: Option<Vec<ToolCall<'a>>>,
    #[serde(borrow, default)]
    function_call: Option<FunctionCall<'a>>,
}

#[derive(Deserialize)]
struct ToolCall<'a> {
    #[serde(borrow)]
    function: FunctionCall<'a>,
}

#[derive(Deserialize)]
struct FunctionCall<'a> {
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    arguments: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Part<'a> {
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    image_url: Option<ImageUrl<'a>>,
    /// An Anthropic image block's `source`.
    #[serde(borrow, default)]
    source: Option<Source<'a>>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct ImageUrl<'a> {
    #[serde(borrow)]
    url: Cow<'a, str>,
    #[serde(borrow, default)]
    detail: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Source<'a> {
    #[serde(borrow, default)]
    data: Option<Cow<'a, str>>,
}

/// A message's `content`, read in the one pass over the messages: text, parts, or anything
/// else (which counts nothing).
enum Content<'a> {
    Text(Cow<'a, str>),
    Parts(Vec<Part<'a>>),
    Other,
}

impl<'de: 'a, 'a> Deserialize<'de> for Content<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(ContentVisitor(std::marker::PhantomData))
    }
}

struct ContentVisitor<'a>(std::marker::PhantomData<Content<'a>>);

impl<'de: 'a, 'a> Visitor<'de> for ContentVisitor<'a> {
    type Value = Content<'a>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a message content")
    }

    fn visit_borrowed_str<E: de::Error>(self, text: &'de str) -> Result<Content<'a>, E> {
        Ok(Content::Text(Cow::Borrowed(text)))
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<Content<'a>, E> {
        Ok(Content::Text(Cow::Owned(text.to_owned())))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Content<'a>, A::Error> {
        let mut parts = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
        while let Some(part) = seq.next_element()? {
            parts.push(part);
        }
        Ok(Content::Parts(parts))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Content<'a>, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Content::Other)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Content<'a>, E> {
        Ok(Content::Other)
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Content<'a>, E> {
        Ok(Content::Other)
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Content<'a>, E> {
        Ok(Content::Other)
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Content<'a>, E> {
        Ok(Content::Other)
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Content<'a>, E> {
        Ok(Content::Other)
    }
}

/// A field as the cookbook's f-strings print it: strings bare, anything else as JSON.
fn text_field(value: &serde_json::Value, key: &str) -> String {
    value.get(key).map(plain).unwrap_or_default()
}

fn plain(value: &serde_json::Value) -> String {
    match value {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn trim_period(text: &str) -> &str {
    text.strip_suffix('.').unwrap_or(text)
}

/// The (width, height) of a `data:image/...;base64,` URL, read from its header only.
fn data_url_size(url: &str) -> Option<(u32, u32)> {
    let rest = url.strip_prefix("data:")?;
    let (_, data) = rest.split_once(";base64,")?;
    base64_image_size(data)
}

fn base64_image_size(data: &str) -> Option<(u32, u32)> {
    let mut end = data.len().min(IMAGE_HEADER_BASE64);
    end -= end % 4;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(data.get(..end)?)
        .ok()?;
    let size = imagesize::blob_size(&bytes).ok()?;
    Some((
        u32::try_from(size.width).ok()?,
        u32::try_from(size.height).ok()?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_names_pick_the_encoding_of_their_family() {
        assert_eq!(
            Estimator::for_model("gpt-4o-2024-11-20").encoding,
            Encoding::O200k
        );
        assert_eq!(
            Estimator::for_model("gpt-35-turbo").encoding,
            Encoding::Cl100k
        );
        assert_eq!(
            Estimator::for_model("gpt-4-turbo").encoding,
            Encoding::Cl100k
        );
        assert_eq!(
            Estimator::for_model("GPT-4.1-mini").encoding,
            Encoding::O200k
        );
        assert_eq!(
            Estimator::for_model("claude-sonnet-4-5").encoding,
            Encoding::Approximate
        );
        assert_eq!(Estimator::for_model("prod-chat").encoding, Encoding::O200k);
    }

    #[test]
    fn a_text_counted_again_gets_the_tokenizer_count_of_its_own_encoding() {
        let o200k = Estimator::for_model("gpt-4o");
        let cl100k = Estimator::for_model("gpt-35-turbo");
        // Tokenized differently by the two encodings (o200k joins more of it).
        let text = "The quick brown fox jumps over the lazy dog, again and again.";
        let once = o200k.text(text);
        assert_eq!(once, bpe_openai::o200k_base().count(text) as u64);
        assert_eq!(o200k.text(text), once);
        assert_eq!(
            cl100k.text(text),
            bpe_openai::cl100k_base().count(text) as u64
        );
        assert_eq!(cl100k.text(text), cl100k.text(text));
        let other = "The quick brown fox jumps over the lazy dog, again and again!";
        assert_eq!(
            o200k.text(other),
            bpe_openai::o200k_base().count(other) as u64
        );
    }

    #[test]
    fn images_follow_the_tile_and_patch_rules() {
        let gpt4o = Estimator::for_model("gpt-4o");
        assert_eq!(gpt4o.image((1024, 1024), Some("high")), 765);
        assert_eq!(gpt4o.image((2048, 4096), None), 1105);
        assert_eq!(gpt4o.image((4000, 3000), Some("low")), 85);
        let mini = Estimator::for_model("gpt-4.1-mini");
        // 1024 x 1024 is 32 x 32 = 1024 patches, times 1.62.
        assert_eq!(mini.image((1024, 1024), None), 1659);
        assert!(mini.image((4096, 4096), None) <= (1536.0f64 * 1.62).ceil() as u64);
    }

    #[test]
    fn a_tiny_png_header_gives_its_size() {
        // An 8-byte signature and an IHDR chunk declaring 640 x 480.
        let mut png = vec![0x89, b'P', b'N', b'G', 0x0d, 0x0a, 0x1a, 0x0a, 0, 0, 0, 13];
        png.extend_from_slice(b"IHDR");
        png.extend_from_slice(&640u32.to_be_bytes());
        png.extend_from_slice(&480u32.to_be_bytes());
        png.extend_from_slice(&[8, 6, 0, 0, 0, 0, 0, 0, 0]);
        let url = format!(
            "data:image/png;base64,{}",
            base64::engine::general_purpose::STANDARD.encode(&png)
        );
        assert_eq!(data_url_size(&url), Some((640, 480)));
        assert_eq!(data_url_size("https://example.com/cat.png"), None);
    }

    /// The committed corpus (`tests/data/tokens/corpus.json`), whose expected counts come from
    /// OpenAI's own `tiktoken` (see `tests/data/tokens/generate.py`).
    #[test]
    fn estimates_match_the_reference_tokenizer_on_the_corpus() {
        #[derive(Deserialize)]
        struct Case {
            name: String,
            model: String,
            body: serde_json::Value,
            prompt_tokens: u64,
        }
        let corpus: Vec<Case> =
            serde_json::from_str(include_str!("../tests/data/tokens/corpus.json")).unwrap();
        assert!(corpus.len() >= 20, "the corpus has {} cases", corpus.len());
        let mut wrong = Vec::new();
        for case in &corpus {
            let raw = |key: &str| case.body.get(key).map(|v| v.to_string().into_bytes());
            let (messages, tools, functions) = (raw("messages"), raw("tools"), raw("functions"));
            let fields = ChatFields {
                messages: messages.as_deref(),
                tools: tools.as_deref(),
                functions: functions.as_deref(),
                system: None,
            };
            let estimate = Estimator::for_model(&case.model).chat(fields);
            if estimate != Some(case.prompt_tokens) {
                wrong.push(format!(
                    "{} ({}): {estimate:?} != {}",
                    case.name, case.model, case.prompt_tokens
                ));
            }
        }
        assert!(wrong.is_empty(), "{wrong:#?}");
    }
}
