//! OpenAI chat requests -> Anthropic Messages requests.
#![no_main]

use libfuzzer_sys::fuzz_target;
use onedoor_gateway::translate;

fuzz_target!(|data: &[u8]| {
    let _ = translate::chat_request_to_anthropic(data, "claude-sonnet-4-5");
});
