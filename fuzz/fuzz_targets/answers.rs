//! Whole answers and error bodies, in both directions.
#![no_main]

use libfuzzer_sys::fuzz_target;
use onedoor_gateway::translate;

fuzz_target!(|data: &[u8]| {
    let _ = translate::anthropic_answer(data);
    let _ = translate::anthropic_error(data);
    let _ = translate::chat_answer(data);
    let _ = translate::messages_answer(data);
    let status = data.first().map_or(500, |b| 400 + u16::from(*b));
    let _ = translate::messages_error(status, data);
});
