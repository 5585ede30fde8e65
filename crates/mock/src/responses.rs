//! The OpenAI Responses API (`POST /v1/responses`, Azure `/openai/v1/responses`): a `response`
//! object with its output and usage, or the named-event stream from `response.created` through
//! `response.output_text.delta` to `response.completed`.

use serde_json::{json, Value};

use crate::dialect::Payload;
use crate::ident;
use crate::reply::{Finish, Reply};
use crate::request::Chat;
use crate::stream::{named_event, Script};

struct Response<'a> {
    id: &'a str,
    item_id: String,
    model: &'a str,
    created_at: u64,
    previous: Option<&'a str>,
}

impl Response<'_> {
    fn object(&self, status: &str, output: Value, usage: Value, incomplete: Value) -> Value {
        json!({
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "error": null, "incomplete_details": incomplete, "instructions": null,
            "max_output_tokens": null, "model": self.model, "output": output,
            "parallel_tool_calls": true, "previous_response_id": self.previous, "store": true,
            "temperature": 1.0, "text": {"format": {"type": "text"}}, "tool_choice": "auto",
            "tools": [], "top_p": 1.0, "truncation": "disabled", "usage": usage,
            "user": null, "metadata": {},
        })
    }

    fn item(&self, status: &str, text: Option<&str>) -> Value {
        let content = match text {
            Some(text) => json!([{"type": "output_text", "text": text, "annotations": []}]),
            None => json!([]),
        };
        json!({"type": "message", "id": self.item_id, "status": status, "role": "assistant", "content": content})
    }

    fn finished(&self, chat: &Chat, reply: &Reply) -> Value {
        let (status, incomplete) = match reply.finish {
            Finish::Length => ("incomplete", json!({"reason": "max_output_tokens"})),
            Finish::Stop | Finish::ToolCalls => ("completed", Value::Null),
        };
        let text = reply.text();
        let output = json!([self.item("completed", Some(&text))]);
        self.object(status, output, usage(chat, reply), incomplete)
    }
}

fn usage(chat: &Chat, reply: &Reply) -> Value {
    json!({
        "input_tokens": chat.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": reply.tokens(),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat.prompt_tokens + reply.tokens(),
    })
}

pub fn answer(chat: &Chat, reply: &Reply, model: &str, id: &str) -> Payload {
    let response = Response {
        id,
        item_id: ident::token("msg_", 40),
        model,
        created_at: ident::unix_now(),
        previous: chat.previous_response_id.as_deref(),
    };
    if !chat.stream {
        return Payload::Json(response.finished(chat, reply));
    }
    let mut sequence = 0u64;
    let mut event = |name: &str, mut data: Value| {
        data["type"] = json!(name);
        data["sequence_number"] = json!(sequence);
        sequence += 1;
        named_event(name, &data)
    };
    let started = response.object("in_progress", json!([]), Value::Null, Value::Null);
    let part = |text: &str| json!({"type": "output_text", "text": text, "annotations": []});
    let at = |extra: Value| {
        let mut v = json!({"item_id": response.item_id, "output_index": 0, "content_index": 0});
        if let (Some(v), Some(extra)) = (v.as_object_mut(), extra.as_object()) {
            v.extend(extra.clone());
        }
        v
    };
    let preamble = vec![
        event("response.created", json!({"response": started})),
        event("response.in_progress", json!({"response": started})),
        event(
            "response.output_item.added",
            json!({"output_index": 0, "item": response.item("in_progress", None)}),
        ),
        event("response.content_part.added", at(json!({"part": part("")}))),
    ];
    let content = reply
        .chunks
        .iter()
        .map(|w| {
            event(
                "response.output_text.delta",
                at(json!({"delta": w, "logprobs": []})),
            )
        })
        .collect();
    let text = reply.text();
    let tail = vec![
        event(
            "response.output_text.done",
            at(json!({"text": text, "logprobs": []})),
        ),
        event(
            "response.content_part.done",
            at(json!({"part": part(&text)})),
        ),
        event(
            "response.output_item.done",
            json!({"output_index": 0, "item": response.item("completed", Some(&text))}),
        ),
        event(
            "response.completed",
            json!({"response": response.finished(chat, reply)}),
        ),
    ];
    Payload::Stream(Script {
        preamble,
        content,
        tail,
    })
}
