//! OpenAI chat chunks -> the Anthropic event stream a Claude-speaking client receives.
#![no_main]

use libfuzzer_sys::fuzz_target;
use onedoor_gateway::translate;

fuzz_target!(|data: &[u8]| {
    let _ = translate::messages_stream(data);
});
