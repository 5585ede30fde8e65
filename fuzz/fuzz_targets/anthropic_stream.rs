//! Anthropic Messages events -> OpenAI chunks, and those chunks back into Anthropic events.
#![no_main]

use libfuzzer_sys::fuzz_target;
use onedoor_gateway::translate;

fuzz_target!(|data: &[u8]| {
    let include_usage = data.first().is_some_and(|b| b & 1 == 1);
    let translated = translate::anthropic_stream(data, include_usage);
    let _ = translate::messages_stream(&translated.output);
});
