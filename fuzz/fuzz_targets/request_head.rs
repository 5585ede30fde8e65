//! The framing rules the gateway checks on a client's request head itself (hyper parses the
//! rest): `Host` values and `Transfer-Encoding` codings of any bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut fields = data.split(|&b| b == b'\n');
    let mut request = http::Request::builder().uri("/");
    if let Some(host) = fields.next() {
        request = request.header("host", host);
    }
    for coding in fields {
        request = request.header("transfer-encoding", coding);
    }
    if let Ok(request) = request.body(()) {
        let _ = onedoor_gateway::framing_refusal(&request);
    }
});
