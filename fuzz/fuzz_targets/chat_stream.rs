//! OpenAI-shaped chat streams (Azure, OpenAI-compatible servers and their quirks), as relayed.
#![no_main]

use libfuzzer_sys::fuzz_target;
use onedoor_gateway::translate;

fuzz_target!(|data: &[u8]| {
    let include_usage = data.first().is_some_and(|b| b & 1 == 1);
    let _ = translate::chat_stream(data, include_usage);
});
