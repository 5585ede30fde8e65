//! Anthropic Messages requests -> OpenAI chat requests.
#![no_main]

use libfuzzer_sys::fuzz_target;
use onedoor_gateway::translate;

fuzz_target!(|data: &[u8]| {
    let _ = translate::messages_request(data);
});
