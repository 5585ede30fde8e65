//! Simulated Azure OpenAI, OpenAI and Anthropic upstreams: an independent witness for the gateway's tests,
//! benchmarks and demo. It shares no code with the gateway on purpose, so a wire-format mistake on one
//! side is not silently mirrored on the other.

mod behavior;
mod quota;
mod server;
mod state;
mod fleet;
mod spec;
mod yaml;

pub use behavior::Behavior;
pub use fleet::{Endpoint, Fleet};
pub use spec::{DeploymentSpec, Dialect, EndpointSpec};
pub use yaml::{run_from_yaml, specs_from_yaml};
