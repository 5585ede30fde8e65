//! `max_sessions` (contract section 2, `tenants[].limits` and `keys[].limits`): open realtime
//! sessions per tenant and per key, counted in the state store like requests in flight (so one
//! limit holds across instances sharing Redis), checked at the handshake and held until the
//! session ends. A place is leased for `realtime.max_session` and a margin, so an instance that
//! dies mid-session does not hold it for ever.

use std::sync::Arc;
use std::time::Duration;

use onedoor_config::{Key, Snapshot, Tenant};
use onedoor_state::{
    Ask, Charge, MeterKey, MeterLimits, Reservation, Settlement, State, Store, Verdict,
};

use crate::errors::GatewayError;

/// How much longer than `max_session` a place is leased.
const LEASE_MARGIN: Duration = Duration::from_secs(60);

/// A session's place under its tenant's and key's `max_sessions`; given back when dropped.
pub struct Slot {
    held: Option<(Arc<Store>, Reservation)>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some((store, reservation)) = self.held.take() {
            let settlement = Settlement {
                tokens: 0,
                micro_usd: 0,
                release: true,
            };
            store.settle_detached(&reservation, settlement);
        }
    }
}

/// The sessions meter of a tenant: it shares the tenant's hash tag, so tenant and key are
/// checked together in one script.
fn meter(tenant: &str, key: Option<&str>) -> MeterKey {
    MeterKey {
        tag: format!("t:{tenant}"),
        path: match key {
            None => "sessions".into(),
            Some(key) => format!("key:{key}:sessions").into(),
        },
    }
}

/// Takes a place for one more session, or says which limit refuses it.
pub async fn admit(
    snapshot: &Snapshot,
    store: &Arc<Store>,
    tenant: &Tenant,
    key: &Key,
) -> Result<Slot, GatewayError> {
    let limits = [
        (
            meter(&tenant.name, None),
            tenant.limits.max_sessions,
            "tenant",
            &*tenant.name,
        ),
        (
            meter(&tenant.name, Some(&key.id)),
            key.limits.max_sessions,
            "key",
            &*key.id,
        ),
    ];
    let meters: Vec<(MeterKey, MeterLimits)> = limits
        .iter()
        .filter_map(|(meter, max, _, _)| {
            let max = (*max)?;
            let limits = MeterLimits {
                max_in_flight: Some(max),
                ..MeterLimits::default()
            };
            Some((meter.clone(), limits))
        })
        .collect();
    if meters.is_empty() {
        return Ok(Slot { held: None });
    }
    let lease = snapshot.realtime.max_session + LEASE_MARGIN;
    let ask = Ask {
        meters,
        charge: Charge {
            tokens: 0,
            micro_usd: 0,
            lease_ms: u64::try_from(lease.as_millis()).unwrap_or(u64::MAX),
        },
        enforce: true,
    };
    match store.admit(&ask).await {
        Err(_) => Err(GatewayError::StateUnavailable),
        Ok(Verdict::Admitted(reservation)) => Ok(Slot {
            held: Some((store.clone(), reservation)),
        }),
        Ok(Verdict::Refused(refusal)) => {
            let refusing = ask.meters.get(refusal.meter).map(|(m, _)| m.clone());
            let (scope, name) = limits
                .iter()
                .find(|(m, ..)| Some(m) == refusing.as_ref())
                .map_or(("tenant", &*tenant.name), |(_, _, scope, name)| {
                    (*scope, *name)
                });
            Err(GatewayError::RateLimited {
                message: format!(
                    "rate limited: the {scope} `{name}` allows {} open realtime sessions at once (max_sessions); close one before opening another",
                    refusal.cap
                ),
                retry_after: Duration::from_millis(refusal.retry_after_ms.max(1000)),
            })
        }
    }
}
