//! End-to-end checks of the mock upstreams over real sockets, one module per dialect or concern.
//! A single test binary, so the suite links once.

mod anthropic;
mod azure;
mod client;
mod control;
mod faults;
mod openai;
