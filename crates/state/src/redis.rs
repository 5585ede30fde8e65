//! The shared store: Redis (or Redis Cluster) through one reconnecting connection manager. Every
//! decision is one Lua script (atomic, one round trip, timed by Redis `TIME`); every key carries a
//! hash tag (`{prefix:routing}`, `{prefix:t:TENANT}`), so the keys one script touches share a
//! Cluster slot. While Redis cannot be reached, `fail_open` serves from a local [`MemoryState`]
//! (each instance enforcing the limits on its own) and `fail_closed` refuses decisions.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::LazyLock;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Cmd, RedisResult, Script, ServerErrorKind, Value};

use crate::breaker::{Backoff, BreakerPhase, BreakerRecord, Claim};
use crate::meter::{
    Ask, Limit, MeterKey, MeterLimits, MeterUsage, Refusal, Reservation, Settlement, Verdict,
};
use crate::{
    now_ms, BackendView, Entry, Exclusion, MemoryState, RoutingQuery, RoutingView, State,
    TargetKey, TargetView, Unavailable,
};

/// After a failed call, decisions go straight to the fallback for this long before Redis is
/// tried again, so an outage costs no time per request.
const RETRY_AFTER_FAILURE_MS: u64 = 250;
/// The longest any one call may take before the store counts as unreachable.
const CALL_TIMEOUT: Duration = Duration::from_millis(500);

/// What to do when Redis cannot be reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnError {
    /// Keep deciding with this instance's own memory (limits hold per instance).
    FailOpen,
    /// Refuse every decision ([`Unavailable`]).
    FailClosed,
}

#[derive(Debug, Clone)]
pub struct RedisConfig {
    pub url: String,
    /// Keys start with `{<key_prefix>:`.
    pub key_prefix: String,
    pub on_error: OnError,
}

struct Scripts {
    routing: Script,
    admit: Script,
    settle: Script,
    charge: Script,
    usage: Script,
    breaker: Script,
    mark: Script,
    list: Script,
}

static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts {
    routing: Script::new(concat!(
        include_str!("lua/clock.lua"),
        include_str!("lua/recent.lua"),
        include_str!("lua/routing.lua")
    )),
    admit: Script::new(concat!(
        include_str!("lua/clock.lua"),
        include_str!("lua/recent.lua"),
        include_str!("lua/meter.lua"),
        include_str!("lua/admit.lua")
    )),
    settle: Script::new(include_str!("lua/settle.lua")),
    charge: Script::new(concat!(
        include_str!("lua/clock.lua"),
        include_str!("lua/recent.lua"),
        include_str!("lua/meter.lua"),
        include_str!("lua/charge.lua")
    )),
    usage: Script::new(concat!(
        include_str!("lua/clock.lua"),
        include_str!("lua/recent.lua"),
        include_str!("lua/meter.lua"),
        include_str!("lua/usage.lua")
    )),
    breaker: Script::new(concat!(
        include_str!("lua/clock.lua"),
        include_str!("lua/breaker.lua")
    )),
    mark: Script::new(concat!(
        include_str!("lua/clock.lua"),
        include_str!("lua/mark.lua")
    )),
    list: Script::new(concat!(
        include_str!("lua/clock.lua"),
        include_str!("lua/list.lua")
    )),
});

/// Redis key names. Everything routing reads is under one tag; each tenant's meters under its own.
struct Keys {
    prefix: String,
    routing: String,
}

impl Keys {
    fn new(prefix: &str) -> Self {
        Keys {
            prefix: prefix.to_owned(),
            routing: format!("{{{prefix}:routing}}"),
        }
    }

    fn hash(&self, name: &str) -> String {
        [&self.routing, ":", name].concat()
    }

    fn breaker(&self, id: &str) -> String {
        [&self.routing, ":br:", id].concat()
    }

    /// One plain key a pin, expiring by itself.
    fn pin(&self, key: &str) -> String {
        [&self.prefix, ":pin:", key].concat()
    }

    fn meter(&self, meter: &MeterKey) -> [String; 3] {
        let base = ["{", &self.prefix, ":", &meter.tag, "}:m:", &meter.path].concat();
        [
            [&base, ":w"].concat(),
            [&base, ":f"].concat(),
            [&base, ":p"].concat(),
        ]
    }

    /// The keys of each of `meters` in turn, three a meter, as every meter script takes them.
    fn meters<'a>(
        &'a self,
        meters: impl IntoIterator<Item = &'a MeterKey> + 'a,
    ) -> impl Iterator<Item = String> + 'a {
        meters.into_iter().flat_map(|meter| self.meter(meter))
    }
}

/// A (backend, deployment) as one hash field; the length prefix keeps any pair of names apart.
fn field(backend: &str, deployment: &str) -> String {
    [&backend.len().to_string(), ":", backend, deployment].concat()
}

fn unfield(field: &str) -> Option<TargetKey> {
    let (len, rest) = field.split_once(':')?;
    let len: usize = len.parse().ok()?;
    let backend = rest.get(..len)?;
    let deployment = rest.get(len..)?;
    Some(TargetKey::new(backend, deployment))
}

/// An `EVALSHA` of `script` with `keys` keys, for a pipeline; the keys and arguments follow.
fn evalsha(script: &Script, keys: usize) -> Cmd {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(script.get_hash()).arg(keys);
    cmd
}

/// Sends script calls in one pipeline, in order, and reads each one's numbers. A script this
/// Redis does not hold yet (after a restart or a `SCRIPT FLUSH`) is loaded and only that call
/// is sent again: a call that ran is never repeated.
async fn pipelined<const N: usize>(
    connection: &mut ConnectionManager,
    calls: [(&Script, Cmd); N],
) -> RedisResult<[Vec<i64>; N]> {
    let mut pipe = redis::pipe();
    for (_, cmd) in &calls {
        pipe.add_command(cmd.clone());
    }
    let replies: Vec<Value> = pipe.ignore_errors().query_async(connection).await?;
    let mut out: [Vec<i64>; N] = std::array::from_fn(|_| Vec::new());
    for ((slot, (script, cmd)), reply) in out.iter_mut().zip(&calls).zip(replies) {
        *slot = match reply {
            Value::ServerError(error) if error.kind() == Some(ServerErrorKind::NoScript) => {
                script.load_async(connection).await?;
                cmd.query_async(connection).await?
            }
            reply => redis::from_redis_value(reply.extract_error()?)?,
        };
    }
    Ok(out)
}

fn limit_arg(limit: Option<u64>) -> i64 {
    limit.map_or(-1, |l| i64::try_from(l).unwrap_or(i64::MAX))
}

fn u(values: &[i64], i: usize) -> u64 {
    values
        .get(i)
        .copied()
        .and_then(|v| u64::try_from(v).ok())
        .unwrap_or(0)
}

fn usage_at(values: &[i64], at: usize, meters: usize) -> Vec<MeterUsage> {
    (0..meters)
        .map(|m| {
            let b = at + 7 * m;
            MeterUsage {
                requests: u(values, b),
                tokens: u(values, b + 1),
                in_flight: u(values, b + 2),
                day_tokens: u(values, b + 3),
                month_micro_usd: u(values, b + 4),
                requests_10s: u(values, b + 5),
                tokens_10s: u(values, b + 6),
            }
        })
        .collect()
}

fn phase(code: i64, left: i64) -> BreakerPhase {
    match code {
        1 => BreakerPhase::Open {
            remaining_ms: u64::try_from(left).unwrap_or(1).max(1),
        },
        2 => BreakerPhase::HalfOpen { probing: false },
        3 => BreakerPhase::HalfOpen { probing: true },
        _ => BreakerPhase::Closed,
    }
}

fn record(values: &[i64]) -> BreakerRecord {
    BreakerRecord {
        phase: phase(
            values.first().copied().unwrap_or(0),
            values.get(1).copied().unwrap_or(0),
        ),
        reopens: u32::try_from(u(values, 2)).unwrap_or(u32::MAX),
        trips: u(values, 3),
    }
}

pub struct RedisState {
    /// `None` when the URL could not even be parsed: every call takes the fallback.
    connection: Option<ConnectionManager>,
    keys: Keys,
    on_error: OnError,
    local: MemoryState,
    /// Local time until which calls skip Redis after a failure.
    skip_until_ms: AtomicU64,
    /// In an outage now (between the first failure and the first success after it).
    down: AtomicBool,
    errors: AtomicU64,
    outages: AtomicU64,
}

impl RedisState {
    /// A store for `config`. It connects lazily and reconnects by itself, so a Redis that is
    /// down at start or goes down later is an outage, never a startup failure.
    pub fn new(config: &RedisConfig) -> Self {
        let manager_config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(CALL_TIMEOUT))
            .set_response_timeout(Some(CALL_TIMEOUT))
            .set_number_of_retries(1)
            .set_min_delay(Duration::from_millis(10))
            .set_max_delay(Duration::from_millis(100));
        let connection = redis::Client::open(config.url.as_str())
            .and_then(|client| ConnectionManager::new_lazy_with_config(client, manager_config));
        let connection = match connection {
            Ok(connection) => Some(connection),
            Err(error) => {
                tracing::error!(%error, "the state store URL cannot be used; every decision takes the on_store_error path");
                None
            }
        };
        RedisState {
            connection,
            keys: Keys::new(&config.key_prefix),
            on_error: config.on_error,
            local: MemoryState::new(),
            skip_until_ms: AtomicU64::new(0),
            down: AtomicBool::new(false),
            errors: AtomicU64::new(0),
            outages: AtomicU64::new(0),
        }
    }

    pub fn on_error(&self) -> OnError {
        self.on_error
    }

    /// Calls that failed (or timed out) since start.
    pub fn errors(&self) -> u64 {
        self.errors.load(Ordering::Relaxed)
    }

    /// Outages since start: runs of failures ended by a success.
    pub fn outages(&self) -> u64 {
        self.outages.load(Ordering::Relaxed)
    }

    /// Whether the last call reached Redis.
    pub fn reachable(&self) -> bool {
        !self.down.load(Ordering::Relaxed)
    }

    /// Asks Redis now (ignoring the pause after a failure), for readiness checks.
    pub async fn ping(&self) -> bool {
        self.skip_until_ms.store(0, Ordering::Relaxed);
        self.call(|mut c| async move { redis::cmd("PING").query_async::<String>(&mut c).await })
            .await
            .is_some()
    }

    /// Runs `remote` against Redis unless an outage is under way; `None` means take the fallback.
    async fn call<T, F, Fut>(&self, remote: F) -> Option<T>
    where
        F: FnOnce(ConnectionManager) -> Fut,
        Fut: Future<Output = RedisResult<T>>,
    {
        if now_ms() < self.skip_until_ms.load(Ordering::Relaxed) {
            return None;
        }
        let connection = self.connection.clone()?;
        let outcome = tokio::time::timeout(CALL_TIMEOUT, remote(connection)).await;
        match outcome {
            Ok(Ok(value)) => {
                if self.down.swap(false, Ordering::Relaxed) {
                    tracing::warn!(
                        "the state store is reachable again: shared limits, breakers and caches resume"
                    );
                }
                Some(value)
            }
            Ok(Err(error)) => {
                self.failed(&error.to_string());
                None
            }
            Err(_) => {
                self.failed("no answer in time");
                None
            }
        }
    }

    fn failed(&self, why: &str) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        self.skip_until_ms
            .store(now_ms() + RETRY_AFTER_FAILURE_MS, Ordering::Relaxed);
        if !self.down.swap(true, Ordering::Relaxed) {
            self.outages.fetch_add(1, Ordering::Relaxed);
            match self.on_error {
                OnError::FailOpen => tracing::error!(error = why, "the state store is unreachable: serving with this instance's own limits, breakers and caches until it is back (on_store_error: fail_open)"),
                OnError::FailClosed => tracing::error!(error = why, "the state store is unreachable: answering 503 state_unavailable until it is back (on_store_error: fail_closed)"),
            }
        }
    }

    fn fallback<T>(&self, local: impl FnOnce(&MemoryState) -> T) -> Result<T, Unavailable> {
        match self.on_error {
            OnError::FailOpen => Ok(local(&self.local)),
            OnError::FailClosed => Err(Unavailable),
        }
    }

    async fn mark(&self, op: &'static str, hash: &str, key: &TargetKey, ms: u64) {
        let keys = [self.keys.hash(hash), self.keys.hash("ns")];
        let field = field(&key.backend, &key.deployment);
        let done = self
            .call(|mut c| async move {
                SCRIPTS
                    .mark
                    .key(&keys[0])
                    .key(&keys[1])
                    .arg(op)
                    .arg(field)
                    .arg(ms)
                    .invoke_async::<i64>(&mut c)
                    .await
            })
            .await;
        if done.is_none() {
            match op {
                "set" => self.local.mark_not_served_now(key, ms),
                "served" => self.local.mark_served_now(key, ms),
                _ => self.local.cool_down_now(key, ms),
            }
        }
    }

    async fn list(&self, hash: &str) -> Option<Vec<Entry>> {
        let key = self.keys.hash(hash);
        let flat: Vec<String> = self
            .call(|mut c| async move { SCRIPTS.list.key(key).invoke_async(&mut c).await })
            .await?;
        let mut entries: Vec<Entry> = flat
            .chunks(2)
            .filter_map(|pair| {
                let key = unfield(pair.first()?)?;
                let remaining_ms = pair.get(1)?.parse().ok()?;
                Some(Entry { key, remaining_ms })
            })
            .collect();
        entries.sort_by(|a, b| {
            (&a.key.backend, &a.key.deployment).cmp(&(&b.key.backend, &b.key.deployment))
        });
        Some(entries)
    }

    /// One transition of breaker `id` (breaker.lua): `op` with its numbers.
    async fn breaker_op(&self, id: &str, op: &'static str, args: &[f64]) -> Option<Vec<i64>> {
        let key = self.keys.breaker(id);
        self.call(|mut c| async move {
            let mut call = SCRIPTS.breaker.key(key);
            call.arg(op);
            for number in args {
                call.arg(*number);
            }
            call.invoke_async(&mut c).await
        })
        .await
    }

    fn routing_keys(&self, query: &RoutingQuery<'_>) -> (Vec<String>, Vec<String>) {
        let mut keys = vec![
            self.keys.hash("ns"),
            self.keys.hash("cd"),
            self.keys.hash("sv"),
        ];
        let mut args = Vec::with_capacity(1 + query.targets.len() + query.backends.len());
        args.push(query.targets.len().to_string());
        args.extend(query.targets.iter().map(|(b, d)| field(b, d)));
        for backend in query.backends {
            keys.push(self.keys.breaker(backend.breaker.unwrap_or("-")));
            let [w, f, _] = self.keys.meter(&MeterKey::backend(backend.name));
            keys.push(w);
            keys.push(f);
            let flags = match (backend.breaker.is_some(), backend.metered) {
                (true, true) => "11",
                (true, false) => "10",
                (false, true) => "01",
                (false, false) => "00",
            };
            args.push(flags.to_owned());
        }
        if query.target_breakers.iter().any(Option::is_some) {
            for i in 0..query.targets.len() {
                keys.push(self.keys.breaker(query.target_breaker(i).unwrap_or("-")));
            }
        }
        (keys, args)
    }

    /// The admission script's call for `ask`, as [`State::admit`] sends it.
    fn admit_cmd(&self, ask: &Ask, member: u64) -> Cmd {
        let mut cmd = evalsha(&SCRIPTS.admit, 3 * ask.meters.len());
        for key in self.keys.meters(ask.meters.iter().map(|(meter, _)| meter)) {
            cmd.arg(key);
        }
        cmd.arg(ask.meters.len())
            .arg(ask.charge.tokens)
            .arg(ask.charge.micro_usd)
            .arg(ask.charge.lease_ms)
            .arg(member)
            .arg(u8::from(ask.enforce));
        for (_, limits) in &ask.meters {
            for limit in limits_args(limits) {
                cmd.arg(limit);
            }
        }
        cmd
    }

    /// The routing script's call for `query`, as [`State::routing`] sends it.
    fn routing_cmd(&self, query: &RoutingQuery<'_>) -> Cmd {
        let (keys, args) = self.routing_keys(query);
        let mut cmd = evalsha(&SCRIPTS.routing, keys.len());
        cmd.arg(&keys).arg(&args);
        cmd
    }
}

fn read_routing(values: &[i64], query: &RoutingQuery<'_>) -> RoutingView {
    let remaining = |v: i64| u64::try_from(v).ok().filter(|v| *v > 0);
    let mut targets: Vec<TargetView> = (0..query.targets.len())
        .map(|i| {
            let at = 3 * i;
            let not_served = remaining(values.get(at).copied().unwrap_or(-1));
            let cooling = remaining(values.get(at + 1).copied().unwrap_or(-1));
            TargetView {
                exclusion: match (not_served, cooling) {
                    (Some(remaining_ms), _) => Some(Exclusion::NotServed { remaining_ms }),
                    (None, Some(remaining_ms)) => Some(Exclusion::CoolingDown { remaining_ms }),
                    (None, None) => None,
                },
                served: values.get(at + 2).copied() == Some(1),
                breaker: BreakerPhase::Closed,
            }
        })
        .collect();
    let base = 3 * query.targets.len();
    let backends = query
        .backends
        .iter()
        .enumerate()
        .map(|(j, backend)| {
            let at = base + 7 * j;
            let get = |k: usize| values.get(at + k).copied().unwrap_or(0);
            BackendView {
                breaker: phase(get(0), get(1)),
                usage: backend.metered.then(|| MeterUsage {
                    requests: u(values, at + 2),
                    tokens: u(values, at + 3),
                    in_flight: u(values, at + 4),
                    requests_10s: u(values, at + 5),
                    tokens_10s: u(values, at + 6),
                    ..MeterUsage::default()
                }),
            }
        })
        .collect();
    let breakers = base + 7 * query.backends.len();
    if values.len() > breakers {
        for (i, target) in targets.iter_mut().enumerate() {
            let at = breakers + 2 * i;
            let get = |k: usize| values.get(at + k).copied().unwrap_or(0);
            target.breaker = phase(get(0), get(1));
        }
    }
    RoutingView { targets, backends }
}

fn read_verdict(values: &[i64], ask: &Ask, member: u64) -> Verdict {
    let meters = ask.meters.len();
    if values.first().copied() == Some(1) {
        return Verdict::Admitted(Reservation {
            meters: ask.meters.iter().map(|(k, _)| k.clone()).collect(),
            second: u(values, 1),
            day: u(values, 2),
            month: u(values, 3),
            tokens: ask.charge.tokens,
            micro_usd: ask.charge.micro_usd,
            member,
            usage: usage_at(values, 4, meters),
            shared: true,
        });
    }
    Verdict::Refused(Refusal {
        meter: usize::try_from(u(values, 1)).unwrap_or(0),
        limit: Limit::from_code(u(values, 2)).unwrap_or(Limit::Rpm),
        retry_after_ms: u(values, 3).max(1),
        used: u(values, 4),
        cap: u(values, 5),
        asked: u(values, 6),
        usage: usage_at(values, 7, meters),
    })
}

fn limits_args(limits: &MeterLimits) -> [i64; 5] {
    [
        limit_arg(limits.rpm),
        limit_arg(limits.tpm),
        limit_arg(limits.max_in_flight),
        limit_arg(limits.tokens_per_day),
        limit_arg(limits.micro_usd_per_month),
    ]
}

impl State for RedisState {
    async fn routing(&self, query: RoutingQuery<'_>) -> Result<RoutingView, Unavailable> {
        let calls = [(&SCRIPTS.routing, self.routing_cmd(&query))];
        let values = self
            .call(|mut c| async move { pipelined(&mut c, calls).await })
            .await;
        match values {
            Some([values]) => Ok(read_routing(&values, &query)),
            None => self.fallback(|local| local.routing_now(query)),
        }
    }

    async fn mark_not_served(&self, key: &TargetKey, ttl_ms: u64) {
        self.mark("set", "ns", key, ttl_ms).await
    }

    async fn mark_served(&self, key: &TargetKey, ttl_ms: u64) {
        self.mark("served", "sv", key, ttl_ms).await
    }

    async fn cool_down(&self, key: &TargetKey, wait_ms: u64) {
        self.mark("extend", "cd", key, wait_ms).await
    }

    async fn not_served(&self) -> Result<Vec<Entry>, Unavailable> {
        match self.list("ns").await {
            Some(entries) => Ok(entries),
            None => self.fallback(MemoryState::not_served_now),
        }
    }

    async fn cooldowns(&self) -> Result<Vec<Entry>, Unavailable> {
        match self.list("cd").await {
            Some(entries) => Ok(entries),
            None => self.fallback(MemoryState::cooldowns_now),
        }
    }

    async fn admit(&self, ask: &Ask) -> Result<Verdict, Unavailable> {
        let member: u64 = rand::random();
        let calls = [(&SCRIPTS.admit, self.admit_cmd(ask, member))];
        let values = self
            .call(|mut c| async move { pipelined(&mut c, calls).await })
            .await;
        match values {
            Some([values]) => Ok(read_verdict(&values, ask, member)),
            None => self.fallback(|local| local.admit_now(ask)),
        }
    }

    /// Both scripts in one pipeline: Redis runs the admission, then reads the routing view, as
    /// the two calls would, in one round trip. Each script still keeps to its own hash tag.
    async fn admit_and_route(
        &self,
        ask: &Ask,
        query: RoutingQuery<'_>,
    ) -> (
        Result<Verdict, Unavailable>,
        Result<RoutingView, Unavailable>,
    ) {
        let member: u64 = rand::random();
        let calls = [
            (&SCRIPTS.admit, self.admit_cmd(ask, member)),
            (&SCRIPTS.routing, self.routing_cmd(&query)),
        ];
        let values = self
            .call(|mut c| async move { pipelined(&mut c, calls).await })
            .await;
        match values {
            Some([admitted, routing]) => (
                Ok(read_verdict(&admitted, ask, member)),
                Ok(read_routing(&routing, &query)),
            ),
            None => (
                self.fallback(|local| local.admit_now(ask)),
                self.fallback(|local| local.routing_now(query)),
            ),
        }
    }

    async fn settle(&self, reservation: &Reservation, settlement: Settlement) {
        if !reservation.shared {
            self.local.settle_now(reservation, settlement);
            return;
        }
        let tokens = settlement.tokens as i64 - reservation.tokens as i64;
        let usd = settlement.micro_usd as i64 - reservation.micro_usd as i64;
        // A shared reservation that cannot be settled now keeps its estimate; its time in
        // flight ends with its lease.
        let _ = self
            .call(|mut c| async move {
                let mut invocation = SCRIPTS.settle.prepare_invoke();
                for key in self.keys.meters(&reservation.meters) {
                    invocation.key(key);
                }
                invocation
                    .arg(reservation.second)
                    .arg(reservation.day)
                    .arg(reservation.month)
                    .arg(tokens)
                    .arg(usd)
                    .arg(reservation.member)
                    .arg(u8::from(settlement.release));
                invocation.invoke_async::<i64>(&mut c).await
            })
            .await;
    }

    async fn charge(
        &self,
        meters: &[MeterKey],
        tokens: u64,
        micro_usd: u64,
    ) -> Result<Vec<MeterUsage>, Unavailable> {
        let values: Option<Vec<i64>> = self
            .call(|mut c| async move {
                let mut invocation = SCRIPTS.charge.prepare_invoke();
                for key in self.keys.meters(meters) {
                    invocation.key(key);
                }
                invocation.arg(tokens).arg(micro_usd);
                invocation.invoke_async(&mut c).await
            })
            .await;
        match values {
            Some(values) => Ok(usage_at(&values, 0, meters.len())),
            None => self.fallback(|local| local.charge_now(meters, tokens, micro_usd)),
        }
    }

    async fn usage(&self, meters: &[MeterKey]) -> Result<Vec<MeterUsage>, Unavailable> {
        let values: Option<Vec<i64>> = self
            .call(|mut c| async move {
                let mut invocation = SCRIPTS.usage.prepare_invoke();
                for key in self.keys.meters(meters) {
                    invocation.key(key);
                }
                invocation.invoke_async(&mut c).await
            })
            .await;
        match values {
            Some(values) => Ok(usage_at(&values, 0, meters.len())),
            None => self.fallback(|local| local.usage_now(meters)),
        }
    }

    async fn trip(&self, id: &str, wait_ms: u64) -> BreakerRecord {
        match self.breaker_op(id, "trip", &[wait_ms as f64]).await {
            Some(values) => record(&values),
            None => self.local.trip_now(id, wait_ms),
        }
    }

    async fn reopen(&self, id: &str, base_ms: u64, backoff: Backoff) -> BreakerRecord {
        let args = [base_ms as f64, backoff.factor, backoff.max_ms as f64];
        match self.breaker_op(id, "reopen", &args).await {
            Some(values) => record(&values),
            None => self.local.reopen_now(id, base_ms, backoff),
        }
    }

    async fn claim_probe(&self, id: &str, lease_ms: u64) -> Claim {
        let Some(values) = self.breaker_op(id, "claim", &[lease_ms as f64]).await else {
            return self.local.claim_now(id, lease_ms);
        };
        if values.get(4).copied() == Some(1) {
            return Claim::Probe;
        }
        match record(&values).phase {
            BreakerPhase::Closed => Claim::Closed,
            BreakerPhase::Open { remaining_ms } => Claim::Open { remaining_ms },
            BreakerPhase::HalfOpen { .. } => Claim::Busy,
        }
    }

    async fn close(&self, id: &str) {
        if self.breaker_op(id, "close", &[]).await.is_none() {
            self.local.close_now(id);
        }
    }

    async fn release_probe(&self, id: &str) {
        if self.breaker_op(id, "release", &[]).await.is_none() {
            self.local.release_now(id);
        }
    }

    async fn breaker(&self, id: &str) -> Result<BreakerRecord, Unavailable> {
        match self.breaker_op(id, "read", &[]).await {
            Some(values) => Ok(record(&values)),
            None => self.fallback(|local| local.breaker_now(id)),
        }
    }

    async fn pin(&self, key: &str, backend: &str, ttl_ms: u64) {
        let name = self.keys.pin(key);
        let holder = backend.to_owned();
        let done = self
            .call(|mut c| async move {
                redis::cmd("SET")
                    .arg(name)
                    .arg(holder)
                    .arg("PX")
                    .arg(ttl_ms.max(1))
                    .query_async::<()>(&mut c)
                    .await
            })
            .await;
        if done.is_none() {
            self.local.pin_now(key, backend, ttl_ms);
        }
    }

    async fn pinned(&self, key: &str) -> Result<Option<String>, Unavailable> {
        let name = self.keys.pin(key);
        let found = self
            .call(|mut c| async move {
                redis::cmd("GET")
                    .arg(name)
                    .query_async::<Option<String>>(&mut c)
                    .await
            })
            .await;
        match found {
            Some(found) => Ok(found),
            None => self.fallback(|local| local.pinned_now(key)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pair_of_names_is_one_field_that_reads_back() {
        let f = field("sub:1", "gpt-4o:x");
        assert_eq!(f, "5:sub:1gpt-4o:x");
        assert_eq!(unfield(&f), Some(TargetKey::new("sub:1", "gpt-4o:x")));
        assert_ne!(field("ab", "c"), field("a", "bc"));
    }

    #[test]
    fn every_key_of_one_tenant_shares_its_hash_tag() {
        let keys = Keys::new("run-7");
        let [w, f, p] = keys.meter(&MeterKey::key("legal", "k1"));
        assert_eq!(w, "{run-7:t:legal}:m:key:k1:w");
        assert!(f.starts_with("{run-7:t:legal}") && p.starts_with("{run-7:t:legal}"));
        assert_eq!(keys.breaker("b#1"), "{run-7:routing}:br:b#1");
        assert!(keys.meter(&MeterKey::backend("b"))[0].starts_with("{run-7:routing}"));
    }
}
