//! A realtime session against its tenant's and key's token limits (`tpm`, `tokens_per_day`,
//! `usd_per_month`). A session reserves nothing ahead: it was admitted at its handshake, which is
//! refused (403 `quota_exceeded`) when a day's tokens or a month's dollars are already spent. Each
//! `response.done`'s usage is then counted on the meters as it happens, priced as the session's
//! usage record is, so the tenant's other requests see it at once; once a period quota is spent,
//! the client's next `response.create` is answered with a realtime `error` event instead of
//! reaching the upstream, and the session stays open. A caller without token limits costs
//! nothing here.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use onedoor_config::{Key, Price, Tenant};
use onedoor_state::{MeterKey, MeterLimits, MeterUsage, State, Store};
use serde::Deserialize;

use crate::admission;
use crate::errors::GatewayError;

/// One session's token limits and what they say now.
pub struct Quota {
    store: Arc<Store>,
    /// The meters with token limits (tenant, key), in the order the store answers for them.
    keys: Vec<MeterKey>,
    /// Each meter's limits and whose they are (`tenant `team``).
    limits: Vec<(MeterLimits, String)>,
    price: Option<Price>,
    /// The period quota the last count found spent, and when its period ends (Unix ms).
    spent: Mutex<Option<(GatewayError, u64)>>,
}

/// A client event, as far as the quota reads it.
#[derive(Deserialize)]
struct ClientEvent<'a> {
    #[serde(rename = "type", borrow)]
    kind: Option<&'a str>,
    #[serde(borrow)]
    event_id: Option<&'a str>,
}

impl Quota {
    /// The quota of a session `tenant` opens with `key`, or the period quota that refuses it.
    pub async fn check(
        store: &Arc<Store>,
        tenant: &Tenant,
        key: &Key,
    ) -> Result<Quota, GatewayError> {
        let mut quota = Quota {
            store: store.clone(),
            keys: Vec::new(),
            limits: Vec::new(),
            price: None,
            spent: Mutex::new(None),
        };
        let meters = [
            (
                MeterKey::tenant(&tenant.name),
                &tenant.limits,
                format!("tenant `{}`", tenant.name),
            ),
            (
                MeterKey::key(&tenant.name, &key.id),
                &key.limits,
                format!("key `{}`", key.id),
            ),
        ];
        for (meter, limits, whose) in meters {
            let Some(limits) = admission::meter_limits(limits) else {
                continue;
            };
            if admission::needs_tokens(&limits) {
                quota.keys.push(meter);
                quota.limits.push((limits, whose));
            }
        }
        let periods = quota
            .limits
            .iter()
            .any(|(l, _)| l.tokens_per_day.is_some() || l.micro_usd_per_month.is_some());
        if periods {
            let usage = store
                .usage(&quota.keys)
                .await
                .map_err(|_| GatewayError::StateUnavailable)?;
            if let Some((refusal, _)) = quota.spent_in(&usage) {
                return Err(refusal);
            }
        }
        Ok(quota)
    }

    /// Prices the session's responses at the price of the target that serves it.
    pub fn priced(mut self, price: Option<Price>) -> Self {
        self.price = price;
        self
    }

    /// Counts one response's tokens and cost on every limited meter, as spent now.
    pub async fn spend(&self, input: u64, output: u64) {
        if self.keys.is_empty() {
            return;
        }
        let micro_usd = admission::micro_usd(self.price.as_ref(), input, output);
        match self.store.charge(&self.keys, input + output, micro_usd).await {
            Ok(usage) => *self.spent() = self.spent_in(&usage),
            Err(_) => tracing::warn!(
                tokens = input + output,
                "a realtime response's tokens were not counted against its limits: the state store is unavailable"
            ),
        }
    }

    /// The `error` event that answers the client's `frame` instead of the upstream, when it is
    /// a `response.create` and a period quota is spent; only then is the frame parsed.
    pub fn refuses(&self, frame: &str) -> Option<String> {
        if self.keys.is_empty() {
            return None;
        }
        let mut spent = self.spent();
        let (refusal, until) = spent.as_ref()?;
        if onedoor_state::now_ms() >= *until {
            // The period renewed: the next response is charged to the new one.
            *spent = None;
            return None;
        }
        if !frame.contains("response.create") {
            return None;
        }
        let event: ClientEvent<'_> = serde_json::from_str(frame).ok()?;
        (event.kind == Some("response.create")).then(|| refusal.realtime_event(event.event_id))
    }

    /// The first period quota `usage` (one entry per meter) shows spent, as the refusal, with
    /// the end of its period (Unix ms).
    fn spent_in(&self, usage: &[MeterUsage]) -> Option<(GatewayError, u64)> {
        let now = onedoor_state::now_ms();
        self.limits.iter().zip(usage).find_map(|((limits, whose), used)| {
            if let Some(cap) = limits.tokens_per_day.filter(|cap| used.day_tokens >= *cap) {
                let ends_in = onedoor_state::day_ends_in(now);
                let wait = Duration::from_millis(ends_in);
                let refusal = GatewayError::QuotaExceeded {
                    message: format!(
                        "quota exceeded: the {whose}'s tokens_per_day of {cap} is spent ({} used); the day renews (00:00 UTC) in {}",
                        used.day_tokens,
                        admission::seconds(wait)
                    ),
                    period_ends_in: wait,
                };
                return Some((refusal, now + ends_in));
            }
            let cap = limits
                .micro_usd_per_month
                .filter(|cap| used.month_micro_usd >= *cap)?;
            let ends_in = onedoor_state::month_ends_in(now);
            let wait = Duration::from_millis(ends_in);
            let refusal = GatewayError::QuotaExceeded {
                message: format!(
                    "quota exceeded: the {whose}'s usd_per_month of ${:.2} is spent (${:.4} used); the month renews (UTC) in {}",
                    cap as f64 / 1e6,
                    used.month_micro_usd as f64 / 1e6,
                    admission::seconds(wait)
                ),
                period_ends_in: wait,
            };
            Some((refusal, now + ends_in))
        })
    }

    fn spent(&self) -> MutexGuard<'_, Option<(GatewayError, u64)>> {
        self.spent
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot() -> onedoor_config::Snapshot {
        let yaml = "tenants:\n  - name: team\n    limits: { tokens_per_day: 10 }\n    keys: [{ id: k, sha256: 0000000000000000000000000000000000000000000000000000000000000000 }]\n";
        onedoor_config::parse(yaml, std::path::Path::new("t.yaml"), &|_| None).unwrap()
    }

    #[tokio::test]
    async fn only_a_response_create_is_refused_and_only_until_the_period_ends() {
        let snapshot = snapshot();
        let tenant = &snapshot.tenants[0];
        let store = Arc::new(Store::memory());
        let quota = Quota::check(&store, tenant, &tenant.keys[0]).await.unwrap();
        let create = r#"{"type":"response.create","event_id":"e1"}"#;
        assert_eq!(quota.refuses(create), None);
        quota.spend(4, 8).await;
        let error: serde_json::Value =
            serde_json::from_str(&quota.refuses(create).unwrap()).unwrap();
        assert_eq!(error["error"]["code"], "quota_exceeded");
        assert_eq!(error["error"]["event_id"], "e1");
        let mentions = r#"{"type":"conversation.item.create","item":{"content":[{"text":"response.create"}]}}"#;
        assert_eq!(quota.refuses(mentions), None);
        assert!(Quota::check(&store, tenant, &tenant.keys[0]).await.is_err());
        if let Some((_, until)) = quota.spent().as_mut() {
            *until = 0;
        }
        assert_eq!(quota.refuses(create), None);
    }
}
