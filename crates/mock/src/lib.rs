//! Simulated Azure OpenAI, OpenAI and Anthropic upstreams: an independent witness for the gateway's tests,
//! benchmarks and demo. It shares no code with the gateway on purpose, so a wire-format mistake on one
//! side is not silently mirrored on the other.
//!
//! Each endpoint listens on its own port and also serves a control surface under `/_mock/`
//! (`GET stats`, `GET last_request`, `PUT behavior`, `PUT deployments/{d}/behavior`, `POST
//! reset` (which also forgets its files and batches), `POST revoke-tokens`). Azure and OpenAI endpoints also accept realtime WebSocket
//! sessions at their dialect's realtime URLs. A simulated Entra ID ([`IdentityServer`];
//! `identity:` in the fleet YAML) issues the tokens that endpoints with an `entra_audience` take
//! instead of a key.
//!
//! An [`Issuer`] simulates an OIDC identity provider whose tokens callers present to the gateway.

mod anthropic;
mod azure;
mod batch;
mod behavior;
mod control;
mod dialect;
mod dispatch;
mod embeddings;
mod fleet;
mod ident;
mod identity;
mod oidc;
mod openai;
mod quota;
mod realtime;
mod reply;
mod request;
mod response;
mod responses;
mod server;
mod spec;
mod state;
mod stream;
mod thinking;
mod yaml;

pub use behavior::Behavior;
pub use fleet::{refusing_port, Endpoint, Fleet};
pub use identity::{IdentityBehavior, IdentityServer, IdentitySpec, TokenProblem};
pub use oidc::{Issuer, Mint, DEFAULT_AUDIENCE};
pub use realtime::RealtimeHandshake;
pub use spec::{DeploymentSpec, Dialect, EndpointSpec};
pub use yaml::{issuers_from_yaml, run_from_yaml, specs_from_yaml};
