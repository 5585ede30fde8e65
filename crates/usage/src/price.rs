//! What a request costs: the target's price per million input and output tokens (the config
//! gives every target its own or its alias's; PTU targets are priced at zero marginal cost).
//! Tenant budgets (`usd_per_month`) and usage records read the same function.

use onedoor_config::{Alias, BackendId, Price};

use crate::record::Tokens;

/// The cost in USD of `input` prompt and `output` completion tokens at `price`; zero without a
/// price. Cached prompt tokens are billed as input: the config has no separate cached price.
pub fn cost_usd(price: Option<&Price>, input: u64, output: u64) -> f64 {
    let Some(price) = price else {
        return 0.0;
    };
    (input as f64 * price.input_per_1m + output as f64 * price.output_per_1m) / 1_000_000.0
}

/// [`cost_usd`] of a request's tokens.
pub fn cost_of(price: Option<&Price>, tokens: &Tokens) -> f64 {
    cost_usd(price, tokens.input, tokens.output)
}

/// The price of the target of `alias` that sent `deployment` to `backend`: that target's own
/// (which already defaults to the alias price), or the alias price for a name the `"*"` alias
/// discovered.
pub fn price_of<'a>(alias: &'a Alias, backend: BackendId, deployment: &str) -> Option<&'a Price> {
    let named = alias
        .targets
        .iter()
        .find(|t| t.backend == backend && t.deployment.as_deref() == Some(deployment));
    let discovered = || {
        alias
            .targets
            .iter()
            .find(|t| t.backend == backend && t.deployment.is_none())
    };
    match named.or_else(discovered) {
        Some(target) => target.price.as_ref().or(alias.price.as_ref()),
        None => alias.price.as_ref(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Source;

    const GPT_4O: Price = Price {
        input_per_1m: 2.50,
        output_per_1m: 10.00,
        batch_input_per_1m: 1.25,
        batch_output_per_1m: 5.00,
    };

    #[test]
    fn cost_is_per_million_tokens() {
        let tokens = Tokens {
            input: 1_000,
            output: 500,
            cached: 200,
            cache_write: 0,
            source: Source::Measured,
        };
        let cost = cost_of(Some(&GPT_4O), &tokens);
        assert!((cost - 0.0075).abs() < 1e-12, "{cost}");
        assert_eq!(cost_usd(None, 1_000, 500), 0.0);
    }

    #[test]
    fn a_target_price_wins_over_the_alias_price_and_ptu_is_free() {
        let snapshot = onedoor_config::parse(
            r#"
backends:
  - { name: ptu, provider: azure, url: "http://127.0.0.1:1", region: se }
  - { name: paygo, provider: azure, url: "http://127.0.0.1:2", region: fr }
models:
  - name: chat
    price: { input_per_1m: 2.5, output_per_1m: 10 }
    targets:
      - { backend: ptu, deployment: gpt-4o, price: { input_per_1m: 0, output_per_1m: 0 } }
      - { backend: paygo, deployment: gpt-4o }
  - name: "*"
    targets:
      - { backends: [paygo] }
"#,
            std::path::Path::new("t.yaml"),
            &|_| None,
        )
        .unwrap();
        let chat = &snapshot.aliases[0];
        assert_eq!(cost_usd(price_of(chat, 0, "gpt-4o"), 1_000_000, 0), 0.0);
        assert_eq!(cost_usd(price_of(chat, 1, "gpt-4o"), 1_000_000, 0), 2.5);
        let wildcard = snapshot.wildcard.as_ref().unwrap();
        assert_eq!(price_of(wildcard, 1, "gpt-4o-mini"), None);
    }
}
