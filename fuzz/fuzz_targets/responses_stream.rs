//! Responses API event streams, as relayed.
#![no_main]

use libfuzzer_sys::fuzz_target;
use onedoor_gateway::translate;

fuzz_target!(|data: &[u8]| {
    let _ = translate::responses_stream(data);
});
