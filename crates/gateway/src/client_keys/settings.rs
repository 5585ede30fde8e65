//! What a runtime key is allowed: its models (within its tenant's), limits that may only tighten
//! the tenant's, a monthly budget, an expiry, traces and whether it is disabled; read from the
//! admin API's JSON (each field named in the error that refuses it) and kept as JSON in the store.

use std::time::{Duration, UNIX_EPOCH};

use onedoor_config::{Key, KeyOrigin, Limits, Snapshot, Tenant};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// The one budget period: the meters keep spend per UTC month.
pub const MONTH: &str = "month";

/// The fields a create or an update may carry (`tenant` only a create).
pub const FIELDS: &[&str] = &[
    "name",
    "models",
    "limits",
    "usd_budget",
    "budget_period",
    "expires_at",
    "trace_until",
    "disabled",
];

const LIMIT_FIELDS: &[&str] = &[
    "rpm",
    "tpm",
    "max_in_flight",
    "max_sessions",
    "tokens_per_day",
    "usd_per_month",
];

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Settings {
    pub name: Option<String>,
    pub models: Option<Vec<String>>,
    pub limits: KeyLimits,
    pub usd_budget: Option<f64>,
    pub budget_period: Option<String>,
    pub expires_at_ms: Option<u64>,
    pub trace_until_ms: Option<u64>,
    pub disabled: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KeyLimits {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rpm: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tpm: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_in_flight: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_sessions: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_per_day: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usd_per_month: Option<f64>,
}

impl KeyLimits {
    fn as_limits(&self) -> Limits {
        Limits {
            rpm: self.rpm,
            tpm: self.tpm,
            max_in_flight: self.max_in_flight,
            max_sessions: self.max_sessions,
            tokens_per_day: self.tokens_per_day,
            usd_per_month: self.usd_per_month,
        }
    }
}

impl Settings {
    /// `self` with the fields of `body` applied: a field set to `null` goes back to its default
    /// (no limit, no budget, no expiry); a field left out stays as it is.
    pub fn apply(&self, body: &Map<String, Value>) -> Result<Settings, String> {
        let mut next = self.clone();
        for (field, value) in body {
            next.set(field, value)?;
        }
        Ok(next)
    }

    fn set(&mut self, field: &str, value: &Value) -> Result<(), String> {
        let null = value.is_null();
        match field {
            "name" => self.name = (!null).then(|| text(field, value)).transpose()?,
            "models" => self.models = (!null).then(|| names(value)).transpose()?,
            "limits" => {
                self.limits = (!null)
                    .then(|| limits(value))
                    .transpose()?
                    .unwrap_or_default()
            }
            "usd_budget" => {
                self.usd_budget = (!null).then(|| dollars(field, value)).transpose()?;
                // No budget, no period: `{"usd_budget": null}` alone removes the budget.
                if null {
                    self.budget_period = None;
                }
            }
            "budget_period" => {
                self.budget_period = (!null).then(|| text(field, value)).transpose()?
            }
            "expires_at" => {
                self.expires_at_ms = (!null).then(|| instant(field, value)).transpose()?
            }
            "trace_until" => {
                self.trace_until_ms = (!null).then(|| instant(field, value)).transpose()?
            }
            "disabled" => {
                self.disabled = value
                    .as_bool()
                    .ok_or_else(|| "`disabled` must be true or false".to_owned())?
            }
            other => {
                return Err(format!(
                    "unknown field `{other}` (known: tenant, {})",
                    FIELDS.join(", ")
                ))
            }
        }
        Ok(())
    }

    /// Whether these settings fit `tenant` on `snapshot` (an expiry is checked against the clock
    /// only when it is being set).
    pub fn check(
        &self,
        tenant: &Tenant,
        snapshot: &Snapshot,
        now_ms: u64,
        setting_expiry: bool,
    ) -> Result<(), String> {
        if let Some(models) = &self.models {
            check_models(models, tenant, snapshot)?;
        }
        check_limits(&self.limits, &tenant.limits, &tenant.name)?;
        match (self.usd_budget, self.budget_period.as_deref()) {
            (Some(_), None) => {
                return Err(format!(
                "`usd_budget` needs a `budget_period`: budgets renew each UTC month (\"{MONTH}\")"
            ))
            }
            (None, Some(_)) => return Err("`budget_period` without a `usd_budget`".to_owned()),
            (Some(_), Some(period)) if period != MONTH => {
                return Err(format!(
                    "unknown budget_period \"{period}\": budgets renew each UTC month (\"{MONTH}\")"
                ))
            }
            _ => {}
        }
        if let Some(expires) = self.expires_at_ms.filter(|_| setting_expiry) {
            if expires <= now_ms {
                return Err(format!(
                    "`expires_at` {} is in the past",
                    timestamp(expires)
                ));
            }
        }
        Ok(())
    }

    /// The key the pipeline authenticates, meters and routes with.
    pub fn key(&self, id: &str) -> Key {
        let mut limits = self.limits.as_limits();
        if let Some(budget) = self.usd_budget {
            limits.usd_per_month = Some(limits.usd_per_month.map_or(budget, |l| l.min(budget)));
        }
        Key {
            id: id.into(),
            trace_until: self.trace_until_ms.map(|ms| (ms / 1000) as i64),
            limits,
            models: self.models.clone(),
            usd_budget: self.usd_budget,
            origin: KeyOrigin::Runtime,
        }
    }

    /// The settings as the admin API shows them.
    pub fn view(&self) -> Value {
        serde_json::json!({
            "name": self.name,
            "models": self.models,
            "limits": self.limits,
            "usd_budget": self.usd_budget,
            "budget_period": self.budget_period,
            "expires_at": self.expires_at_ms.map(timestamp),
            "trace_until": self.trace_until_ms.map(timestamp),
            "disabled": self.disabled,
        })
    }
}

fn check_models(models: &[String], tenant: &Tenant, snapshot: &Snapshot) -> Result<(), String> {
    if models.is_empty() {
        return Err(
            "`models: []` would refuse every request; leave it out for the tenant's models"
                .to_owned(),
        );
    }
    for model in models {
        let known = snapshot.alias_by_name.contains_key(model.as_str())
            || (model == "*" && snapshot.wildcard.is_some());
        if !known {
            return Err(format!("unknown model \"{model}\""));
        }
        if !tenant.may_use(model) {
            return Err(format!(
                "the tenant `{}` may not use the model \"{model}\"",
                tenant.name
            ));
        }
    }
    Ok(())
}

/// Each limit of the key may only be as tight as the tenant's or tighter.
fn check_limits(key: &KeyLimits, tenant: &Limits, name: &str) -> Result<(), String> {
    let counts = [
        ("rpm", key.rpm, tenant.rpm),
        ("tpm", key.tpm, tenant.tpm),
        ("max_in_flight", key.max_in_flight, tenant.max_in_flight),
        ("max_sessions", key.max_sessions, tenant.max_sessions),
        ("tokens_per_day", key.tokens_per_day, tenant.tokens_per_day),
    ];
    for (field, own, theirs) in counts {
        match (own, theirs) {
            (Some(0), _) => return Err(format!("limits.{field} must be at least 1")),
            (Some(own), Some(theirs)) if own > theirs => {
                return Err(looser(field, own, theirs, name))
            }
            _ => {}
        }
    }
    if let (Some(own), Some(theirs)) = (key.usd_per_month, tenant.usd_per_month) {
        if own > theirs {
            return Err(looser("usd_per_month", own, theirs, name));
        }
    }
    Ok(())
}

fn looser(
    field: &str,
    own: impl std::fmt::Display,
    theirs: impl std::fmt::Display,
    tenant: &str,
) -> String {
    format!("limits.{field} {own} is looser than the tenant `{tenant}`'s {theirs}: a key's limits may only tighten its tenant's")
}

fn text(field: &str, value: &Value) -> Result<String, String> {
    value
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| format!("`{field}` must be a string"))
}

fn names(value: &Value) -> Result<Vec<String>, String> {
    let list = value
        .as_array()
        .ok_or_else(|| "`models` must be a list of model names".to_owned())?;
    list.iter().map(|item| text("models", item)).collect()
}

fn limits(value: &Value) -> Result<KeyLimits, String> {
    serde_json::from_value(value.clone()).map_err(|e| {
        format!(
            "`limits`: {e} (known: {}; counts are whole numbers)",
            LIMIT_FIELDS.join(", ")
        )
    })
}

fn dollars(field: &str, value: &Value) -> Result<f64, String> {
    match value.as_f64() {
        Some(usd) if usd > 0.0 && usd.is_finite() => Ok(usd),
        _ => Err(format!("`{field}` must be a number of dollars above 0")),
    }
}

/// An RFC 3339 UTC time (`2026-12-31T23:59:59Z`) as Unix milliseconds.
fn instant(field: &str, value: &Value) -> Result<u64, String> {
    let text = text(field, value)?;
    let at = humantime::parse_rfc3339_weak(text.trim_end_matches('Z')).map_err(|_| {
        format!("`{field}` must be a UTC time such as 2026-12-31T23:59:59Z, found \"{text}\"")
    })?;
    let since = at.duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO);
    Ok(since.as_millis() as u64)
}

/// Unix milliseconds as an RFC 3339 UTC time, to the second.
pub fn timestamp(ms: u64) -> String {
    /// The last second RFC 3339 can write (9999-12-31T23:59:59Z).
    const LAST_MS: u64 = 253_402_300_799_000;
    let at = UNIX_EPOCH + Duration::from_millis(ms.min(LAST_MS));
    humantime::format_rfc3339_seconds(at).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot() -> Snapshot {
        let yaml = "backends:
  - { name: a, provider: azure, url: https://a.example.com, region: westeurope, api_key: k }
models:
  - { name: chat, targets: [{ backend: a, deployment: gpt-4o }] }
  - { name: mini, targets: [{ backend: a, deployment: gpt-4o-mini }] }
tenants:
  - name: t
    models: [chat]
    limits: { rpm: 100, usd_per_month: 50 }
";
        onedoor_config::parse(yaml, std::path::Path::new("t.yaml"), &|_| None).unwrap()
    }

    fn checked(body: Value) -> Result<Settings, String> {
        let s = snapshot();
        let settings = Settings::default().apply(body.as_object().unwrap())?;
        settings.check(&s.tenants[0], &s, 1_000_000, true)?;
        Ok(settings)
    }

    #[test]
    fn a_key_may_only_tighten_its_tenant() {
        let ok = checked(serde_json::json!({"limits": {"rpm": 10}, "models": ["chat"]})).unwrap();
        assert_eq!(ok.key("k").limits.rpm, Some(10));
        assert!(checked(serde_json::json!({"limits": {"rpm": 101}}))
            .unwrap_err()
            .contains("looser than the tenant `t`'s 100"));
        assert!(
            checked(serde_json::json!({"limits": {"usd_per_month": 60}}))
                .unwrap_err()
                .contains("usd_per_month 60 is looser")
        );
        assert_eq!(
            checked(serde_json::json!({"models": ["mini"]})).unwrap_err(),
            "the tenant `t` may not use the model \"mini\""
        );
        assert_eq!(
            checked(serde_json::json!({"models": ["gpt"]})).unwrap_err(),
            "unknown model \"gpt\""
        );
        assert!(checked(serde_json::json!({"limits": {"rpn": 1}}))
            .unwrap_err()
            .contains("unknown field `rpn`"));
    }

    #[test]
    fn a_budget_needs_a_monthly_period_and_an_expiry_the_future() {
        assert!(checked(serde_json::json!({"usd_budget": 5}))
            .unwrap_err()
            .contains("needs a `budget_period`"));
        assert!(
            checked(serde_json::json!({"usd_budget": 5, "budget_period": "week"}))
                .unwrap_err()
                .contains("unknown budget_period \"week\"")
        );
        let budget =
            checked(serde_json::json!({"usd_budget": 5, "budget_period": "month"})).unwrap();
        let key = budget.key("k");
        assert_eq!(
            (key.usd_budget, key.limits.usd_per_month),
            (Some(5.0), Some(5.0))
        );
        assert_eq!(
            checked(serde_json::json!({"expires_at": "1970-01-01T00:00:01Z"})).unwrap_err(),
            "`expires_at` 1970-01-01T00:00:01Z is in the past"
        );
        let removed = budget
            .apply(serde_json::json!({"usd_budget": null}).as_object().unwrap())
            .unwrap();
        assert_eq!((removed.usd_budget, removed.budget_period), (None, None));
        let later = checked(serde_json::json!({"expires_at": "2030-01-02T03:04:05Z"})).unwrap();
        assert_eq!(
            timestamp(later.expires_at_ms.unwrap()),
            "2030-01-02T03:04:05Z"
        );
        assert!(checked(serde_json::json!({"expires_at": "tomorrow"}))
            .unwrap_err()
            .contains("must be a UTC time"));
    }
}
