//! End-to-end checks of the mock upstreams over real sockets, one module per dialect or concern.
//! A single test binary, so the suite links once.

// clippy.toml's test allowances only cover #[test] functions, not the helpers they share.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test code fails loudly"
)]

mod anthropic;
mod azure;
mod client;
mod control;
mod faults;
mod openai;
mod realtime;
mod tools;
