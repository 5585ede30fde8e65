//! The shared store: Redis through one [`Link`] (one server, a Cluster or the master a Sentinel
//! names). Every decision is one Lua script (atomic, one round trip, timed by Redis `TIME`); every
//! key carries a hash tag (`{prefix:routing}`, `{prefix:t:TENANT}`), so the keys one script
//! touches share a Cluster slot; calls for several tags go in one pipeline (on a Cluster, the
//! link sends them to their nodes at once). What a request owes after its answer (settlements, a
//! backend's count) waits in the settlement queue ([`Ledger`]) for the next admission under its
//! tag, or a moment. Admissions under one tag that come while a call for it is in flight go
//! together in the next one ([`Admissions`]); a routing view is shared by the requests that ask
//! while it is read and reused for a few milliseconds ([`Views`]). While Redis cannot be reached, `fail_open` serves from a local
//! [`MemoryState`] (each instance enforcing the limits on its own) and `fail_closed` refuses
//! decisions.

use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::LazyLock;
use std::time::Duration;

use redis::{Cmd, RedisResult, Script, ServerErrorKind, Value};
use smallvec::SmallVec;

use crate::admissions::{Admissions, Asked, Entered, Reply, Turn, Waiter};
use crate::breaker::{Backoff, BreakerPhase, BreakerRecord, Claim};
use crate::ledger::{settlement_debts, Debts, Ledger};
use crate::meter::{
    day_of, month_of, Ask, Limit, MeterKey, MeterLimits, MeterUsage, Refusal, Reservation,
    Settlement, Verdict,
};
use crate::redis_link::{Link, LinkSettings};
use crate::views::{landed, Flight, Lookup, Mark, Views, Waiting};
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
    /// Any form [`onedoor_config::RedisAddress`] reads: one server, a Cluster, a Sentinel.
    pub url: String,
    /// PEM CA certificates for a `rediss` URL; `None`: the system's roots.
    pub ca_file: Option<PathBuf>,
    /// Keys start with `{<key_prefix>:`.
    pub key_prefix: String,
    pub on_error: OnError,
}

struct Scripts {
    routing: Script,
    admit: Script,
    admit_all: Script,
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
        include_str!("lua/window.lua"),
        include_str!("lua/routing.lua")
    )),
    admit: Script::new(concat!(
        include_str!("lua/clock.lua"),
        include_str!("lua/window.lua"),
        include_str!("lua/meter.lua"),
        include_str!("lua/debts.lua"),
        include_str!("lua/admit.lua")
    )),
    admit_all: Script::new(concat!(
        include_str!("lua/clock.lua"),
        "local function admit_one(KEYS, ARGV)\n",
        include_str!("lua/window.lua"),
        include_str!("lua/meter.lua"),
        include_str!("lua/debts.lua"),
        include_str!("lua/admit.lua"),
        "end\n",
        include_str!("lua/admit_all.lua")
    )),
    settle: Script::new(concat!(
        include_str!("lua/clock.lua"),
        include_str!("lua/window.lua"),
        include_str!("lua/meter.lua"),
        include_str!("lua/debts.lua"),
        include_str!("lua/settle.lua")
    )),
    charge: Script::new(concat!(
        include_str!("lua/clock.lua"),
        include_str!("lua/window.lua"),
        include_str!("lua/meter.lua"),
        include_str!("lua/charge.lua")
    )),
    usage: Script::new(concat!(
        include_str!("lua/clock.lua"),
        include_str!("lua/window.lua"),
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

    /// The targets' hash: not-served, cooldown and served entries, each a [`Kind`] letter and
    /// the target's [`field`].
    fn targets(&self) -> String {
        [&self.routing, ":tg"].concat()
    }

    fn breaker(&self, id: &str) -> String {
        [&self.routing, ":br:", id].concat()
    }

    /// One hash per collection of records.
    fn records(&self, collection: &str) -> String {
        [&self.prefix, ":rec:", collection].concat()
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

/// The kinds of entry the targets' hash keeps, each a letter before the target's field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    NotServed,
    CoolingDown,
    Served,
}

impl Kind {
    fn letter(self) -> &'static str {
        match self {
            Kind::NotServed => "n",
            Kind::CoolingDown => "c",
            Kind::Served => "s",
        }
    }

    fn entry(self, target: &str) -> String {
        [self.letter(), target].concat()
    }
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

/// The first two arguments of every meter script: the UTC day and month by this instance's
/// clock, which the script takes when Redis's day is the same (meter.lua).
fn calendar_hints(cmd: &mut Cmd) {
    let day = day_of(now_ms());
    cmd.arg(day).arg(month_of(day));
}

/// Sends script calls in one pipeline, in order, and reads each one's numbers. A script this
/// Redis does not hold yet (after a restart or a `SCRIPT FLUSH`) is loaded and only that call
/// is sent again: a call that ran is never repeated.
async fn pipelined<const N: usize>(
    connection: &mut Link,
    calls: [(&Script, Cmd); N],
) -> RedisResult<[Vec<i64>; N]> {
    let replies = pipelined_all(connection, &calls).await?;
    let mut out: [Vec<i64>; N] = std::array::from_fn(|_| Vec::new());
    for (slot, reply) in out.iter_mut().zip(replies) {
        *slot = reply;
    }
    Ok(out)
}

/// [`pipelined`] for any number of calls, each answer read as `T`.
async fn pipelined_all<T: redis::FromRedisValue>(
    connection: &mut Link,
    calls: &[(&Script, Cmd)],
) -> RedisResult<Vec<T>> {
    let mut pipe = redis::pipe();
    for (_, cmd) in calls {
        pipe.add_command(cmd.clone());
    }
    let replies: Vec<Value> = pipe.ignore_errors().query_async(connection).await?;
    let mut out = Vec::with_capacity(calls.len());
    for ((script, cmd), reply) in calls.iter().zip(replies) {
        out.push(match reply {
            Value::ServerError(error) if error.kind() == Some(ServerErrorKind::NoScript) => {
                script.load_async(connection).await?;
                cmd.query_async(connection).await?
            }
            reply => redis::from_redis_value(reply.extract_error()?)?,
        });
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
    connection: Link,
    keys: Keys,
    on_error: OnError,
    local: MemoryState,
    /// Local time until which calls skip Redis after a failure.
    skip_until_ms: AtomicU64,
    /// In an outage now (between the first failure and the first success after it).
    down: AtomicBool,
    errors: AtomicU64,
    outages: AtomicU64,
    /// What ended requests still owe their meters, paid with the next admission under their
    /// tag or a moment later.
    pub(crate) ledger: Ledger,
    /// Admissions waiting behind the call in flight under their tag (boxed, as `views`).
    admissions: Box<Admissions>,
    /// Routing views read lately, shared by the requests that ask meanwhile (boxed: the store
    /// enum stays near the memory store's size).
    views: Box<Views>,
}

impl Drop for RedisState {
    fn drop(&mut self) {
        // The paying task wakes, finds the store gone and ends.
        self.ledger.bell.notify_one();
    }
}

impl RedisState {
    /// A store for `config`. It connects lazily and reconnects by itself, so a Redis that is
    /// down at start or goes down later is an outage, never a startup failure.
    pub fn new(config: &RedisConfig) -> Self {
        let connection = Link::open(&LinkSettings {
            url: &config.url,
            ca_file: config.ca_file.as_deref(),
            timeout: CALL_TIMEOUT,
        });
        if let Some(problem) = connection.problem() {
            tracing::error!(error = %problem, "every decision takes the on_store_error path");
        }
        RedisState {
            connection,
            keys: Keys::new(&config.key_prefix),
            on_error: config.on_error,
            local: MemoryState::new(),
            skip_until_ms: AtomicU64::new(0),
            down: AtomicBool::new(false),
            errors: AtomicU64::new(0),
            outages: AtomicU64::new(0),
            ledger: Ledger::default(),
            views: Box::default(),
            admissions: Box::default(),
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

    /// Why the last call failed, as Redis or the connection said it, until one succeeds.
    pub fn problem(&self) -> Option<String> {
        self.connection.problem()
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
        F: FnOnce(Link) -> Fut,
        Fut: Future<Output = RedisResult<T>>,
    {
        if now_ms() < self.skip_until_ms.load(Ordering::Relaxed) {
            return None;
        }
        let connection = self.connection.clone();
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

    /// Settles a reservation made in this instance's own memory (during an outage).
    pub(crate) fn settle_locally(&self, reservation: &Reservation, settlement: Settlement) {
        self.local.settle_now(reservation, settlement);
    }

    /// A backend's count while Redis is unreachable: in this instance's own memory under
    /// `fail_open`, none under `fail_closed`.
    pub(crate) fn admit_locally(&self, ask: &Ask) -> Option<Reservation> {
        match self.fallback(|local| local.admit_now(ask)) {
            Ok(Verdict::Admitted(reservation)) => Some(reservation),
            _ => None,
        }
    }

    fn fallback<T>(&self, local: impl FnOnce(&MemoryState) -> T) -> Result<T, Unavailable> {
        match self.on_error {
            OnError::FailOpen => Ok(local(&self.local)),
            OnError::FailClosed => Err(Unavailable),
        }
    }

    async fn mark(&self, kind: Kind, key: &TargetKey, ms: u64) {
        let hash = self.keys.targets();
        let target = field(&key.backend, &key.deployment);
        let entry = kind.entry(&target);
        let not_served = Kind::NotServed.entry(&target);
        let op = match kind {
            Kind::NotServed => "set",
            Kind::CoolingDown => "extend",
            Kind::Served => "served",
        };
        let done = self
            .call(|mut c| async move {
                SCRIPTS
                    .mark
                    .key(hash)
                    .arg(op)
                    .arg(entry)
                    .arg(ms)
                    .arg(not_served)
                    .invoke_async::<i64>(&mut c)
                    .await
            })
            .await;
        self.views.apply(match kind {
            Kind::NotServed => Mark::NotServed {
                target: &target,
                ms,
            },
            Kind::CoolingDown => Mark::CoolingDown {
                target: &target,
                ms,
            },
            Kind::Served => Mark::Served { target: &target },
        });
        if done.is_none() {
            match kind {
                Kind::NotServed => self.local.mark_not_served_now(key, ms),
                Kind::Served => self.local.mark_served_now(key, ms),
                Kind::CoolingDown => self.local.cool_down_now(key, ms),
            }
        }
    }

    async fn list(&self, kind: Kind) -> Option<Vec<Entry>> {
        let key = self.keys.targets();
        let flat: Vec<String> = self
            .call(|mut c| async move {
                SCRIPTS
                    .list
                    .key(key)
                    .arg(kind.letter())
                    .invoke_async(&mut c)
                    .await
            })
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
        let mut keys = vec![self.keys.targets()];
        let mut args = Vec::with_capacity(1 + 3 * query.targets.len() + query.backends.len());
        args.push(query.targets.len().to_string());
        for (backend, deployment) in query.targets {
            let target = field(backend, deployment);
            for kind in [Kind::NotServed, Kind::CoolingDown, Kind::Served] {
                args.push(kind.entry(&target));
            }
        }
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

    /// The usage of `meters`, all under one hash tag, each paired with its meter.
    async fn usage_of<'a>(
        &self,
        meters: Vec<&'a MeterKey>,
    ) -> Option<Vec<(&'a MeterKey, MeterUsage)>> {
        let keys: Vec<String> = self.keys.meters(meters.iter().copied()).collect();
        let values: Vec<i64> = self
            .call(|mut c| async move {
                let mut invocation = SCRIPTS.usage.prepare_invoke();
                for key in keys {
                    invocation.key(key);
                }
                let day = day_of(now_ms());
                invocation.arg(day).arg(month_of(day));
                invocation.invoke_async(&mut c).await
            })
            .await?;
        let usage = usage_at(&values, 0, meters.len());
        Some(meters.into_iter().zip(usage).collect())
    }

    /// The admission script's call for `ask`, as [`State::admit`] sends it, paying `debts`
    /// (of the ask's tag) first.
    fn admit_cmd(&self, ask: &Ask, member: u64, debts: Option<&Debts>) -> Cmd {
        let asked = self.asked(ask, member, debts);
        let mut cmd = evalsha(&SCRIPTS.admit, asked.keys);
        asked.body.args_iter().for_each(|arg| push(&mut cmd, arg));
        cmd
    }

    /// The keys and arguments admit.lua takes for `ask`.
    fn asked(&self, ask: &Ask, member: u64, debts: Option<&Debts>) -> Asked {
        let asked = || ask.meters.iter().map(|(meter, _)| meter);
        let others: SmallVec<[&MeterKey; 2]> = debts
            .map(|debts| {
                debts
                    .meters()
                    .filter(|key| !asked().any(|k| k == *key))
                    .collect()
            })
            .unwrap_or_default();
        let keys = 3 * (ask.meters.len() + others.len());
        let mut cmd = Cmd::new();
        for key in self.keys.meters(asked().chain(others.iter().copied())) {
            cmd.arg(key);
        }
        calendar_hints(&mut cmd);
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
        if let Some(debts) = debts {
            debts.write(&mut cmd, |key| {
                let at = asked().position(|k| k == key);
                1 + at.unwrap_or_else(|| {
                    ask.meters.len() + others.iter().position(|k| *k == key).unwrap_or(0)
                })
            });
        }
        Asked { keys, body: cmd }
    }

    /// Admits `ask` in a call of its own, paying its tag's debts.
    async fn admit_alone(&self, ask: &Ask, member: u64) -> Result<Verdict, Unavailable> {
        let debts = self.debts_for(ask);
        let calls = [(&SCRIPTS.admit, self.admit_cmd(ask, member, debts.as_ref()))];
        let values = self
            .call(|mut c| async move { pipelined(&mut c, calls).await })
            .await;
        self.verdict_of(values.map(|[values]| values), ask, member)
    }

    /// Admits `ask` (with its tag's debts) and then the asks of `batch`, in one call, and
    /// hands each of those its answer.
    async fn admit_with(
        &self,
        ask: &Ask,
        member: u64,
        batch: Vec<Waiter>,
        turn: Turn,
    ) -> Result<Verdict, Unavailable> {
        let debts = self.debts_for(ask);
        let own = self.asked(ask, member, debts.as_ref());
        let calls = [(
            &SCRIPTS.admit_all,
            admit_all_cmd(std::iter::once(&own).chain(batch.iter().map(|w| &w.asked))),
        )];
        let answers: Option<Vec<Vec<Vec<i64>>>> = self
            .call(|mut c| async move { pipelined_all(&mut c, &calls).await })
            .await;
        let mut answers = answers.into_iter().flatten().flatten();
        let own = answers.next();
        for waiter in batch {
            let _ = waiter.reply.send(Reply::Verdict(answers.next()));
        }
        drop(turn);
        self.verdict_of(own, ask, member)
    }

    /// The verdict in a script's answer, or the fallback's when there is none.
    fn verdict_of(
        &self,
        values: Option<Vec<i64>>,
        ask: &Ask,
        member: u64,
    ) -> Result<Verdict, Unavailable> {
        match values {
            Some(values) => Ok(read_verdict(&values, ask, member)),
            None => self.fallback(|local| local.admit_now(ask)),
        }
    }

    /// Reads the routing view for everyone waiting on `flight`.
    async fn lead_routing(
        &self,
        flight: Flight<'_>,
        cmd: Cmd,
        query: RoutingQuery<'_>,
    ) -> Result<RoutingView, Unavailable> {
        let calls = [(&SCRIPTS.routing, cmd)];
        let values = self
            .call(|mut c| async move { pipelined(&mut c, calls).await })
            .await;
        let view = values.map(|[values]| read_routing(&values, &query));
        flight.land(view.as_ref());
        match view {
            Some(view) => Ok(view),
            None => self.fallback(|local| local.routing_now(query)),
        }
    }

    /// The settlement script's call paying `debts` (of one tag).
    fn settle_cmd(&self, debts: &Debts) -> Cmd {
        let owed: SmallVec<[&MeterKey; 2]> = debts.meters().collect();
        let mut cmd = evalsha(&SCRIPTS.settle, 3 * owed.len());
        for key in self.keys.meters(owed.iter().copied()) {
            cmd.arg(key);
        }
        calendar_hints(&mut cmd);
        debts.write(&mut cmd, |key| {
            1 + owed.iter().position(|k| *k == key).unwrap_or(0)
        });
        cmd
    }

    /// The debts of the tag `ask` charges (all its meters share one), for its admission to pay.
    fn debts_for(&self, ask: &Ask) -> Option<Debts> {
        self.ledger.take(tag_of(ask)?)
    }

    /// Pays every queued debt, one script call a tag, in one pipeline. Debts that cannot be
    /// paid now are dropped: their estimates stay charged, their time in flight ends with their
    /// leases (as a settlement that fails).
    pub(crate) async fn pay_debts(&self) {
        let owed = self.ledger.take_all();
        if owed.is_empty() {
            return;
        }
        let calls: Vec<(&Script, Cmd)> = owed
            .values()
            .map(|debts| (&SCRIPTS.settle, self.settle_cmd(debts)))
            .collect();
        let _ = self
            .call(|mut c| async move { pipelined_all::<Vec<i64>>(&mut c, &calls).await })
            .await;
    }

    /// The routing script's call for `query`, as [`State::routing`] sends it, and the name of
    /// its view among the recent ones (its keys and arguments).
    fn routing_cmd(&self, query: &RoutingQuery<'_>) -> (Cmd, String) {
        let (keys, args) = self.routing_keys(query);
        let mut cmd = evalsha(&SCRIPTS.routing, keys.len());
        cmd.arg(&keys).arg(&args);
        (cmd, [keys.join(" "), args.join(" ")].join("|"))
    }

    /// Reads the routing view of `query` now, with no view shared.
    async fn read_routing_now(
        &self,
        cmd: Cmd,
        query: RoutingQuery<'_>,
    ) -> Result<RoutingView, Unavailable> {
        let calls = [(&SCRIPTS.routing, cmd)];
        let values = self
            .call(|mut c| async move { pipelined(&mut c, calls).await })
            .await;
        match values {
            Some([values]) => Ok(read_routing(&values, &query)),
            None => self.fallback(|local| local.routing_now(query)),
        }
    }

    /// The view another request is reading: what it read, or (when it ended first) a read of
    /// this request's own.
    async fn routing_landed(
        &self,
        waiting: Waiting,
        cmd: Cmd,
        query: RoutingQuery<'_>,
    ) -> Result<RoutingView, Unavailable> {
        match landed(waiting).await {
            Some(Some(view)) => Ok(view),
            Some(None) => self.fallback(|local| local.routing_now(query)),
            None => self.read_routing_now(cmd, query).await,
        }
    }

    /// A breaker's new `phase`, as this instance set it, into the views it holds.
    fn learn_breaker(&self, id: &str, phase: BreakerPhase) {
        self.views.apply(Mark::Breaker { id, phase });
    }
}

/// The hash tag all of `ask`'s meters share, when they share one.
fn tag_of(ask: &Ask) -> Option<&str> {
    let (first, _) = ask.meters.first()?;
    let shared = ask.meters.iter().all(|(key, _)| key.tag == first.tag);
    shared.then_some(first.tag.as_str())
}

/// Appends one argument of another command.
fn push(cmd: &mut Cmd, arg: redis::Arg<&[u8]>) {
    if let redis::Arg::Simple(bytes) = arg {
        cmd.arg(bytes);
    }
}

/// One admit_all.lua call admitting `asks` in their order.
fn admit_all_cmd<'a>(asks: impl Iterator<Item = &'a Asked> + Clone) -> Cmd {
    let mut cmd = evalsha(&SCRIPTS.admit_all, asks.clone().map(|a| a.keys).sum());
    for asked in asks.clone() {
        let keys = asked.body.args_iter().take(asked.keys);
        keys.for_each(|arg| push(&mut cmd, arg));
    }
    cmd.arg(asks.clone().count());
    for asked in asks.clone() {
        cmd.arg(asked.keys)
            .arg(asked.body.args_iter().len() - asked.keys);
    }
    for asked in asks {
        let args = asked.body.args_iter().skip(asked.keys);
        args.for_each(|arg| push(&mut cmd, arg));
    }
    cmd
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
    /// A fresh view as it is, a read in flight shared, or a read of this request's own that
    /// others may share ([`Views`]).
    async fn routing(&self, query: RoutingQuery<'_>) -> Result<RoutingView, Unavailable> {
        let (cmd, key) = self.routing_cmd(&query);
        match self.views.lookup(key, &query, field) {
            Lookup::Fresh(view) => Ok(view),
            Lookup::Wait(waiting) => self.routing_landed(waiting, cmd, query).await,
            Lookup::Lead(flight) => self.lead_routing(flight, cmd, query).await,
        }
    }

    async fn mark_not_served(&self, key: &TargetKey, ttl_ms: u64) {
        self.mark(Kind::NotServed, key, ttl_ms).await
    }

    async fn mark_served(&self, key: &TargetKey, ttl_ms: u64) {
        self.mark(Kind::Served, key, ttl_ms).await
    }

    async fn cool_down(&self, key: &TargetKey, wait_ms: u64) {
        self.mark(Kind::CoolingDown, key, wait_ms).await
    }

    async fn not_served(&self) -> Result<Vec<Entry>, Unavailable> {
        match self.list(Kind::NotServed).await {
            Some(entries) => Ok(entries),
            None => self.fallback(MemoryState::not_served_now),
        }
    }

    async fn cooldowns(&self) -> Result<Vec<Entry>, Unavailable> {
        match self.list(Kind::CoolingDown).await {
            Some(entries) => Ok(entries),
            None => self.fallback(MemoryState::cooldowns_now),
        }
    }

    /// Sent at once when no admission under the ask's tag is in flight; otherwise queued, to
    /// go with the others waiting in one call when that one is back ([`Admissions`]).
    async fn admit(&self, ask: &Ask) -> Result<Verdict, Unavailable> {
        let member: u64 = rand::random();
        let Some(tag) = tag_of(ask) else {
            return self.admit_alone(ask, member).await;
        };
        loop {
            let answer = match self.admissions.enter(tag, || self.asked(ask, member, None)) {
                Entered::Turn(_turn) => return self.admit_alone(ask, member).await,
                Entered::Queued(answer) => answer,
            };
            match answer.await {
                Ok(Reply::Verdict(values)) => return self.verdict_of(values, ask, member),
                Ok(Reply::Turn(turn, batch)) => {
                    return self.admit_with(ask, member, batch, turn).await
                }
                // The ask that was to send it, or the call it went in, ended with its request
                // before the answer came: asked again (after a call that ran, counted twice at
                // worst, never admitted past a limit).
                Err(_) => continue,
            }
        }
    }

    /// The admission, and the routing view as [`State::routing`] finds it: when this request
    /// reads the view, both scripts go in one pipeline (Redis runs the admission, then reads the
    /// view, in one round trip; each script keeps to its own hash tag).
    async fn admit_and_route(
        &self,
        ask: &Ask,
        query: RoutingQuery<'_>,
    ) -> (
        Result<Verdict, Unavailable>,
        Result<RoutingView, Unavailable>,
    ) {
        let (cmd, key) = self.routing_cmd(&query);
        let flight = match self.views.lookup(key, &query, field) {
            Lookup::Fresh(view) => return (self.admit(ask).await, Ok(view)),
            Lookup::Wait(waiting) => {
                let routing = self.routing_landed(waiting, cmd, query);
                return futures_util::future::join(self.admit(ask), routing).await;
            }
            Lookup::Lead(flight) => flight,
        };
        let turn = tag_of(ask).map(|tag| self.admissions.try_turn(tag));
        if let Some(None) = turn {
            let routing = self.lead_routing(flight, cmd, query);
            return futures_util::future::join(self.admit(ask), routing).await;
        }
        let member: u64 = rand::random();
        let debts = self.debts_for(ask);
        let calls = [
            (&SCRIPTS.admit, self.admit_cmd(ask, member, debts.as_ref())),
            (&SCRIPTS.routing, cmd),
        ];
        let values = self
            .call(|mut c| async move { pipelined(&mut c, calls).await })
            .await;
        drop(turn);
        let Some([admitted, routing]) = values else {
            flight.land(None);
            return (
                self.fallback(|local| local.admit_now(ask)),
                self.fallback(|local| local.routing_now(query)),
            );
        };
        let view = read_routing(&routing, &query);
        flight.land(Some(&view));
        (Ok(read_verdict(&admitted, ask, member)), Ok(view))
    }

    async fn settle(&self, reservation: &Reservation, settlement: Settlement) {
        if !reservation.shared {
            self.local.settle_now(reservation, settlement);
            return;
        }
        // A shared reservation that cannot be settled now keeps its estimate; its time in
        // flight ends with its lease.
        let calls = [(
            &SCRIPTS.settle,
            self.settle_cmd(&settlement_debts(reservation, settlement)),
        )];
        let _ = self
            .call(|mut c| async move { pipelined(&mut c, calls).await })
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
                let day = day_of(now_ms());
                invocation
                    .arg(day)
                    .arg(month_of(day))
                    .arg(tokens)
                    .arg(micro_usd);
                invocation.invoke_async(&mut c).await
            })
            .await;
        match values {
            Some(values) => Ok(usage_at(&values, 0, meters.len())),
            None => self.fallback(|local| local.charge_now(meters, tokens, micro_usd)),
        }
    }

    /// One script call per hash tag (a Cluster runs a script on the keys of one slot only), all
    /// at once; the answers come back in the order of `meters`. This instance's queued debts are
    /// paid first, so what it reports includes its own ended requests.
    async fn usage(&self, meters: &[MeterKey]) -> Result<Vec<MeterUsage>, Unavailable> {
        self.pay_debts().await;
        let mut tags: Vec<&str> = meters.iter().map(|m| m.tag.as_str()).collect();
        tags.sort_unstable();
        tags.dedup();
        let reads = tags.iter().map(|tag| {
            let group: Vec<&MeterKey> = meters.iter().filter(|m| m.tag == *tag).collect();
            self.usage_of(group)
        });
        let groups = futures_util::future::join_all(reads).await;
        let Some(groups) = groups.into_iter().collect::<Option<Vec<_>>>() else {
            return self.fallback(|local| local.usage_now(meters));
        };
        let mut found: Vec<(&MeterKey, MeterUsage)> = groups.into_iter().flatten().collect();
        Ok(meters
            .iter()
            .map(|meter| {
                found
                    .iter()
                    .position(|(m, _)| *m == meter)
                    .map(|at| found.swap_remove(at).1)
                    .unwrap_or_default()
            })
            .collect())
    }
    async fn trip(&self, id: &str, wait_ms: u64) -> BreakerRecord {
        let record = match self.breaker_op(id, "trip", &[wait_ms as f64]).await {
            Some(values) => record(&values),
            None => self.local.trip_now(id, wait_ms),
        };
        self.learn_breaker(id, record.phase);
        record
    }

    async fn reopen(&self, id: &str, base_ms: u64, backoff: Backoff) -> BreakerRecord {
        let args = [base_ms as f64, backoff.factor, backoff.max_ms as f64];
        let record = match self.breaker_op(id, "reopen", &args).await {
            Some(values) => record(&values),
            None => self.local.reopen_now(id, base_ms, backoff),
        };
        self.learn_breaker(id, record.phase);
        record
    }

    async fn claim_probe(&self, id: &str, lease_ms: u64) -> Claim {
        let Some(values) = self.breaker_op(id, "claim", &[lease_ms as f64]).await else {
            return self.local.claim_now(id, lease_ms);
        };
        if values.get(4).copied() == Some(1) {
            self.learn_breaker(id, BreakerPhase::HalfOpen { probing: true });
            return Claim::Probe;
        }
        let phase = record(&values).phase;
        self.learn_breaker(id, phase);
        match phase {
            BreakerPhase::Closed => Claim::Closed,
            BreakerPhase::Open { remaining_ms } => Claim::Open { remaining_ms },
            BreakerPhase::HalfOpen { .. } => Claim::Busy,
        }
    }

    async fn close(&self, id: &str) {
        if self.breaker_op(id, "close", &[]).await.is_none() {
            self.local.close_now(id);
        }
        self.learn_breaker(id, BreakerPhase::Closed);
    }

    async fn release_probe(&self, id: &str) {
        if self.breaker_op(id, "release", &[]).await.is_none() {
            self.local.release_now(id);
        }
        self.learn_breaker(id, BreakerPhase::HalfOpen { probing: false });
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

    async fn keep(&self, collection: &str, id: &str, value: &str) -> Result<(), Unavailable> {
        let (name, field, text) = (
            self.keys.records(collection),
            id.to_owned(),
            value.to_owned(),
        );
        let done = self
            .call(|mut c| async move {
                redis::cmd("HSET")
                    .arg(name)
                    .arg(field)
                    .arg(text)
                    .query_async::<()>(&mut c)
                    .await
            })
            .await;
        match done {
            Some(()) => Ok(()),
            None => self.fallback(|local| local.keep_now(collection, id, value)),
        }
    }

    async fn recall(&self, collection: &str, id: &str) -> Result<Option<String>, Unavailable> {
        let (name, field) = (self.keys.records(collection), id.to_owned());
        let found = self
            .call(|mut c| async move {
                redis::cmd("HGET")
                    .arg(name)
                    .arg(field)
                    .query_async::<Option<String>>(&mut c)
                    .await
            })
            .await;
        match found {
            Some(found) => Ok(found),
            None => self.fallback(|local| local.recall_now(collection, id)),
        }
    }

    async fn records(&self, collection: &str) -> Result<Vec<(String, String)>, Unavailable> {
        let name = self.keys.records(collection);
        let found = self
            .call(|mut c| async move {
                redis::cmd("HGETALL")
                    .arg(name)
                    .query_async::<Vec<(String, String)>>(&mut c)
                    .await
            })
            .await;
        match found {
            Some(found) => Ok(found),
            None => self.fallback(|local| local.records_now(collection)),
        }
    }

    async fn forget(&self, collection: &str, id: &str) -> Result<bool, Unavailable> {
        let (name, field) = (self.keys.records(collection), id.to_owned());
        let removed = self
            .call(|mut c| async move {
                redis::cmd("HDEL")
                    .arg(name)
                    .arg(field)
                    .query_async::<i64>(&mut c)
                    .await
            })
            .await;
        match removed {
            Some(count) => Ok(count > 0),
            None => self.fallback(|local| local.forget_now(collection, id)),
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
