//! One open realtime session: frames pumped both ways as they come (text and binary; pings are
//! answered hop by hop, and the gateway pings both sides when they are quiet), the gateway's own
//! ends (idle, `max_session`, shutdown), close frames passed across ([`super::close`]), and the
//! session's tokens summed from the upstream's `response.done` events into one usage record
//! when it ends, each response counted against the caller's token limits as it is done
//! ([`super::quota`]). No event is parsed except those that name `response.done` (and, once a
//! period quota is spent, the client's `response.create`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::{Sink, SinkExt, Stream, StreamExt};
use onedoor_config::Price;
use onedoor_usage::{Source, Tokens, UsageRecord};
use serde_json::Value;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, Role};
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use tokio_tungstenite::WebSocketStream;

use super::close;
use super::limit::Slot;
use super::quota::Quota;
use super::upstream::{config, UpstreamSocket};
use crate::runtime::Runtime;
use crate::server::OnUpgrade;
use crate::telemetry::RequestSpan;

/// The gateway's own answers to client events waiting to be sent; more are dropped (a client
/// that sends events it is refused faster than it reads the refusals).
const ANSWERS: usize = 16;
/// A quiet side is pinged this often, so proxies with idle timeouts keep the connection.
const KEEPALIVE: Duration = Duration::from_secs(20);
/// How long a close handshake may take before the connection is dropped anyway.
const CLOSE_WAIT: Duration = Duration::from_secs(5);

/// Every session of one gateway, whatever config it started on: shutdown closes them all.
pub struct Sessions {
    going_away: watch::Sender<bool>,
    open: watch::Sender<usize>,
}

impl Default for Sessions {
    fn default() -> Self {
        Sessions {
            going_away: watch::Sender::new(false),
            open: watch::Sender::new(0),
        }
    }
}

impl Sessions {
    /// Closes every open session with 1001 (going away) and refuses new ones: the gateway stops.
    pub fn close_all(&self) {
        self.going_away.send_replace(true);
    }

    /// Sessions open now.
    pub fn open(&self) -> usize {
        *self.open.borrow()
    }

    /// Waits until every session has ended, at most `within`; whether they all did.
    pub async fn drained(&self, within: Duration) -> bool {
        let mut open = self.open.subscribe();
        let ended = tokio::time::timeout(within, open.wait_for(|n| *n == 0))
            .await
            .is_ok_and(|waited| waited.is_ok());
        ended
    }

    /// Room for one more session, unless the gateway is going away.
    pub fn enter(self: &Arc<Self>) -> Option<Entered> {
        if *self.going_away.borrow() {
            return None;
        }
        self.open.send_modify(|n| *n += 1);
        Some(Entered {
            sessions: self.clone(),
            going_away: self.going_away.subscribe(),
        })
    }
}

/// One session's place among the open ones, given back when it is dropped.
pub struct Entered {
    sessions: Arc<Sessions>,
    going_away: watch::Receiver<bool>,
}

impl Drop for Entered {
    fn drop(&mut self) {
        self.sessions.open.send_modify(|n| *n = n.saturating_sub(1));
    }
}

/// The tokens of one session: the sum of the usage blocks of its `response.done` events.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SessionUsage {
    /// `response.done` events seen (with or without a usage block).
    pub responses: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// Input tokens served from the upstream's cache (part of `input_tokens`).
    pub cached_tokens: u64,
    /// Audio tokens among the input and the output.
    pub input_audio_tokens: u64,
    pub output_audio_tokens: u64,
}

impl SessionUsage {
    /// Adds the usage of `frame` when it is a `response.done` event, and returns that
    /// response's (input, output) tokens; any other frame costs a substring search.
    pub fn observe(&mut self, frame: &str) -> Option<(u64, u64)> {
        if !frame.contains("response.done") {
            return None;
        }
        let event = serde_json::from_str::<Value>(frame).ok()?;
        if event["type"] != "response.done" {
            return None;
        }
        self.responses += 1;
        let usage = &event["response"]["usage"];
        let n = |v: &Value| v.as_u64().unwrap_or(0);
        let (input, output) = (n(&usage["input_tokens"]), n(&usage["output_tokens"]));
        self.input_tokens += input;
        self.output_tokens += output;
        self.cached_tokens += n(&usage["input_token_details"]["cached_tokens"]);
        self.input_audio_tokens += n(&usage["input_token_details"]["audio_tokens"]);
        self.output_audio_tokens += n(&usage["output_token_details"]["audio_tokens"]);
        Some((input, output))
    }

    /// The session's tokens for its usage record: measured once the upstream reported any.
    pub fn tokens(&self) -> Tokens {
        Tokens {
            input: self.input_tokens,
            output: self.output_tokens,
            cached: self.cached_tokens,
            cache_write: 0,
            source: match self.responses {
                0 => Source::Estimated,
                _ => Source::Measured,
            },
        }
    }
}

/// Which hop of the session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Client,
    Upstream,
}

impl Side {
    fn other(self) -> Side {
        match self {
            Side::Client => Side::Upstream,
            Side::Upstream => Side::Client,
        }
    }
}

/// Why a session ended.
#[derive(Debug)]
enum End {
    /// That side sent a close frame.
    Closed(Side, Option<CloseFrame>),
    /// That side's connection broke or ended without a close frame.
    Gone(Side, String),
    Idle(Duration),
    MaxSession(Duration),
    ShuttingDown,
}

impl End {
    /// For the log line.
    fn describe(&self) -> String {
        let code = |frame: &Option<CloseFrame>| {
            frame
                .as_ref()
                .map_or("no status".to_owned(), |f| u16::from(f.code).to_string())
        };
        match self {
            End::Closed(Side::Client, frame) => format!("client closed ({})", code(frame)),
            End::Closed(Side::Upstream, frame) => format!("upstream closed ({})", code(frame)),
            End::Gone(Side::Client, why) => format!("client gone: {why}"),
            End::Gone(Side::Upstream, why) => format!("upstream gone: {why}"),
            End::Idle(_) => "idle".into(),
            End::MaxSession(_) => "max_session".into(),
            End::ShuttingDown => "shutdown".into(),
        }
    }

    /// The close code the client saw: the one it sent (1005: none), the one it was sent, or
    /// 1006 when its connection ended without a close frame.
    fn client_code(&self) -> u16 {
        match self {
            End::Closed(Side::Client, frame) => frame.as_ref().map_or(1005, |f| u16::from(f.code)),
            End::Closed(Side::Upstream, frame) => u16::from(close::to_client(frame.as_ref()).code),
            End::Gone(Side::Client, _) => 1006,
            End::Gone(Side::Upstream, _) => 1011,
            End::Idle(_) => 1000,
            End::MaxSession(_) => 1008,
            End::ShuttingDown => 1001,
        }
    }

    /// What ended the session, in one word.
    fn ended_by(&self) -> &'static str {
        match self {
            End::Closed(Side::Client, _) | End::Gone(Side::Client, _) => "client",
            End::Closed(Side::Upstream, _) | End::Gone(Side::Upstream, _) => "upstream",
            End::Idle(_) => "idle",
            End::MaxSession(_) => "max_session",
            End::ShuttingDown => "shutdown",
        }
    }
}

/// An accepted session, from the 101 to its end.
pub struct Session {
    pub runtime: Arc<Runtime>,
    pub upstream: UpstreamSocket,
    pub client: OnUpgrade,
    pub entered: Entered,
    /// The tenant's `max_sessions` place, given back when the session ends.
    pub slot: Slot,
    /// The caller's token limits, charged each response.
    pub quota: Quota,
    /// The usage record, complete but for the tokens, cost and duration.
    pub record: UsageRecord,
    pub price: Option<Price>,
    pub started: Instant,
    /// The session's span, when it is traced: it ends with the session.
    pub span: Option<Box<RequestSpan>>,
}

impl Session {
    pub async fn run(mut self) {
        let mut upstream = self.upstream;
        let (end, usage) = match self.client.await {
            Ok(upgraded) => {
                let client =
                    WebSocketStream::from_raw_socket(upgraded, Role::Server, Some(config())).await;
                pump(
                    client,
                    upstream,
                    &self.runtime,
                    &self.quota,
                    &mut self.entered.going_away,
                )
                .await
            }
            Err(error) => {
                let frame = close::make(1001, "the client did not complete the upgrade");
                let _ = upstream.close(Some(frame)).await;
                (
                    End::Gone(Side::Client, error.to_string()),
                    SessionUsage::default(),
                )
            }
        };
        let mut record = self.record;
        record.tokens = usage.tokens();
        record.cost_usd = onedoor_usage::cost_of(self.price.as_ref(), &record.tokens);
        record.duration_ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        record.stream_cut = matches!(end, End::Gone(Side::Upstream, _));
        tracing::info!(
            request_id = %record.request_id,
            tenant = %record.tenant,
            alias = %record.alias,
            backend = record.backend.as_deref().unwrap_or("-"),
            ended = %end.describe(),
            responses = usage.responses,
            input_tokens = usage.input_tokens,
            output_tokens = usage.output_tokens,
            duration_ms = record.duration_ms,
            "realtime session ended"
        );
        if let Some(mut span) = self.span.take() {
            span.session_closed(end.client_code(), end.ended_by(), usage.responses);
            span.end(&record, None);
        }
        self.runtime.recorder.record(record);
        drop(self.slot);
    }
}

/// Pumps frames both ways until a side closes, breaks, idles out, runs out of time or the
/// gateway goes away; then closes both hops properly. Returns why, and the session's usage.
async fn pump<C, U>(
    client: WebSocketStream<C>,
    upstream: WebSocketStream<U>,
    runtime: &Runtime,
    quota: &Quota,
    going_away: &mut watch::Receiver<bool>,
) -> (End, SessionUsage)
where
    WebSocketStream<C>: Stream<Item = Result<Message, WsError>> + Sink<Message, Error = WsError>,
    WebSocketStream<U>: Stream<Item = Result<Message, WsError>> + Sink<Message, Error = WsError>,
{
    let limits = runtime.snapshot.realtime;
    let (mut to_client, mut from_client) = client.split();
    let (mut to_upstream, mut from_upstream) = upstream.split();
    let activity = Activity::new();
    let mut usage = SessionUsage::default();
    let (answers, answered) = mpsc::channel(ANSWERS);
    let end = {
        let up = forward(
            &mut from_client,
            &mut to_upstream,
            &activity,
            Duty::Guard { quota, answers },
        );
        let down = forward(
            &mut from_upstream,
            &mut to_client,
            &activity,
            Duty::Meter {
                usage: &mut usage,
                quota,
                answers: answered,
            },
        );
        tokio::select! {
            end = up => end,
            end = down => end,
            () = activity.idle_for(limits.idle) => End::Idle(limits.idle),
            () = tokio::time::sleep(limits.max_session) => End::MaxSession(limits.max_session),
            _ = going_away.wait_for(|gone| *gone) => End::ShuttingDown,
        }
    };
    let mut client = (&mut to_client, &mut from_client);
    let mut upstream = (&mut to_upstream, &mut from_upstream);
    match &end {
        End::Closed(Side::Client, frame) => {
            // tungstenite queued its reply to the client's close; send it, then tell the upstream.
            let _ = client.0.flush().await;
            closing(&mut upstream, close::to_upstream(frame.as_ref())).await;
        }
        End::Closed(Side::Upstream, frame) => {
            let _ = upstream.0.flush().await;
            closing(&mut client, close::to_client(frame.as_ref())).await;
        }
        End::Gone(Side::Client, _) => {
            closing(&mut upstream, close::make(1001, "the client went away")).await;
        }
        End::Gone(Side::Upstream, _) => {
            let frame = close::make(1011, "the upstream connection was lost");
            closing(&mut client, frame).await;
        }
        End::Idle(idle) => {
            let reason = format!("no frame either way for {} (realtime.idle)", written(*idle));
            both(&mut client, &mut upstream, close::make(1000, &reason)).await;
        }
        End::MaxSession(max) => {
            let reason = format!(
                "the session reached its maximum duration of {} (realtime.max_session)",
                written(*max)
            );
            both(&mut client, &mut upstream, close::make(1008, &reason)).await;
        }
        End::ShuttingDown => {
            let frame = close::make(
                1001,
                "onedoor is shutting down; connect again to start a new session",
            );
            both(&mut client, &mut upstream, frame).await;
        }
    }
    (end, usage)
}

/// The gateway's own part in one direction of a session, besides passing frames.
enum Duty<'a> {
    /// Client to upstream: a `response.create` while a period quota is spent is not forwarded;
    /// its `error` event goes to `answers`, which the other direction sends to the client.
    Guard {
        quota: &'a Quota,
        answers: mpsc::Sender<Message>,
    },
    /// Upstream to client: each `response.done` is summed into `usage` and counted on `quota`
    /// before it goes on (so the client cannot ask again before it counts); the other
    /// direction's `answers` are sent to the client too.
    Meter {
        usage: &'a mut SessionUsage,
        quota: &'a Quota,
        answers: mpsc::Receiver<Message>,
    },
}

impl Duty<'_> {
    /// Where the frames come from.
    fn side(&self) -> Side {
        match self {
            Duty::Guard { .. } => Side::Client,
            Duty::Meter { .. } => Side::Upstream,
        }
    }

    /// The next frame the gateway itself sends this way.
    async fn answer(&mut self) -> Option<Message> {
        match self {
            Duty::Meter { answers, .. } => answers.recv().await,
            Duty::Guard { .. } => std::future::pending().await,
        }
    }

    /// Whether the text frame goes on.
    async fn passes(&mut self, text: &str) -> bool {
        match self {
            Duty::Guard { quota, answers } => match quota.refuses(text) {
                Some(error) => {
                    let _ = answers.try_send(Message::text(error));
                    false
                }
                None => true,
            },
            Duty::Meter { usage, quota, .. } => {
                if let Some((input, output)) = usage.observe(text) {
                    quota.spend(input, output).await;
                }
                true
            }
        }
    }
}

/// Sends `from`'s text and binary frames to `to` as they come, until `from` closes or either
/// breaks, doing the direction's `duty` on the way. `to` is pinged when quiet.
async fn forward<R, W>(from: &mut R, to: &mut W, activity: &Activity, mut duty: Duty<'_>) -> End
where
    R: Stream<Item = Result<Message, WsError>> + Unpin,
    W: Sink<Message, Error = WsError> + Unpin,
{
    let side = duty.side();
    let mut keepalive = tokio::time::interval_at(Instant::now() + KEEPALIVE, KEEPALIVE);
    keepalive.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let message = tokio::select! {
            message = from.next() => message,
            Some(answer) = duty.answer() => {
                if let Err(error) = to.send(answer).await {
                    return End::Gone(side.other(), error.to_string());
                }
                continue;
            }
            _ = keepalive.tick() => {
                if let Err(error) = to.send(Message::Ping(Bytes::new())).await {
                    return End::Gone(side.other(), error.to_string());
                }
                continue;
            }
        };
        let data = match message {
            None => return End::Gone(side, "the connection ended without a close frame".into()),
            Some(Err(error)) => return End::Gone(side, error.to_string()),
            Some(Ok(Message::Close(frame))) => return End::Closed(side, frame),
            Some(Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_))) => continue,
            Some(Ok(data)) => data,
        };
        activity.touch();
        keepalive.reset();
        if let Message::Text(text) = &data {
            if !duty.passes(text.as_str()).await {
                continue;
            }
        }
        if let Err(error) = to.send(data).await {
            return End::Gone(side.other(), error.to_string());
        }
    }
}

/// Closes one hop with `frame` and waits (a little) for its answering close.
async fn closing<R, W>(hop: &mut (&mut W, &mut R), frame: CloseFrame)
where
    R: Stream<Item = Result<Message, WsError>> + Unpin,
    W: Sink<Message, Error = WsError> + Unpin,
{
    if hop.0.send(Message::Close(Some(frame))).await.is_err() {
        return;
    }
    let answered = async {
        while let Some(Ok(message)) = hop.1.next().await {
            if let Message::Close(_) = message {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(CLOSE_WAIT, answered).await;
}

/// Closes both hops at once.
async fn both<C, D, U, V>(
    client: &mut (&mut C, &mut D),
    upstream: &mut (&mut U, &mut V),
    frame: CloseFrame,
) where
    C: Sink<Message, Error = WsError> + Unpin,
    D: Stream<Item = Result<Message, WsError>> + Unpin,
    U: Sink<Message, Error = WsError> + Unpin,
    V: Stream<Item = Result<Message, WsError>> + Unpin,
{
    tokio::join!(closing(client, frame.clone()), closing(upstream, frame));
}

fn written(d: Duration) -> String {
    let secs = d.as_secs();
    match secs {
        s if s % 3600 == 0 && s > 0 => format!("{}h", s / 3600),
        s if s % 60 == 0 && s > 0 => format!("{}m", s / 60),
        s if s > 0 => format!("{s}s"),
        _ => format!("{}ms", d.as_millis()),
    }
}

/// When the last text or binary frame went either way.
struct Activity {
    started: Instant,
    last_ms: AtomicU64,
}

impl Activity {
    fn new() -> Self {
        Activity {
            started: Instant::now(),
            last_ms: AtomicU64::new(0),
        }
    }

    fn touch(&self) {
        let ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    /// Returns once no frame has gone either way for `idle`.
    async fn idle_for(&self, idle: Duration) {
        loop {
            let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
            let due = self.started + last + idle;
            if Instant::now() >= due {
                return;
            }
            tokio::time::sleep_until(due).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_is_the_sum_of_the_response_done_events_and_nothing_else_is_parsed() {
        let mut usage = SessionUsage::default();
        usage.observe(r#"{"type":"response.text.delta","delta":"not json at all {"#);
        usage.observe(r#"{"type":"response.done","response":{"usage":{"total_tokens":30,"input_tokens":20,"output_tokens":10,"input_token_details":{"cached_tokens":4,"audio_tokens":6},"output_token_details":{"audio_tokens":3}}}}"#);
        usage.observe(r#"{"type": "response.done", "response": {"status": "cancelled", "usage": {"input_tokens": 5, "output_tokens": 1}}}"#);
        usage.observe(
            r#"{"type":"conversation.item.created","item":{"content":[{"text":"response.done"}]}}"#,
        );
        assert_eq!(
            usage,
            SessionUsage {
                responses: 2,
                input_tokens: 25,
                output_tokens: 11,
                cached_tokens: 4,
                input_audio_tokens: 6,
                output_audio_tokens: 3,
            }
        );
        assert_eq!(usage.tokens().source, Source::Measured);
        assert_eq!(SessionUsage::default().tokens().source, Source::Estimated);
    }

    #[test]
    fn durations_read_as_the_config_writes_them() {
        assert_eq!(written(Duration::from_secs(300)), "5m");
        assert_eq!(written(Duration::from_secs(3600)), "1h");
        assert_eq!(written(Duration::from_secs(45)), "45s");
        assert_eq!(written(Duration::from_millis(200)), "200ms");
    }
}
