//! Reading a fleet description from YAML (the `onedoor mock --config` file).

use crate::{EndpointSpec, Fleet};

/// Parses a mock fleet description into endpoint specs.
pub fn specs_from_yaml(text: &str) -> Result<Vec<EndpointSpec>, String> {
    let _ = text;
    Ok(Vec::new())
}

/// Parses a fleet description and starts it.
pub async fn run_from_yaml(text: &str) -> Result<Fleet, String> {
    let specs = specs_from_yaml(text)?;
    Fleet::start(specs).await.map_err(|e| e.to_string())
}
