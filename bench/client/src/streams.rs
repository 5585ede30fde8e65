//! N concurrent SSE streams held for a while: each of N connections asks for one streamed chat
//! completion after another, and every stream's time to first token and whole time are recorded.
//!
//! Connections start spread over the ramp; streams that begin during the ramp (new connections,
//! the gateway's upstream pool still growing) count for errors but not for the timings.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http_body_util::BodyExt;
use tokio::time::Instant;

use crate::target::{Sender, Target};

pub struct Plan {
    pub streams: usize,
    pub ramp: Duration,
    /// How long after the ramp new streams keep starting (and are recorded).
    pub duration: Duration,
}

/// One finished stream.
struct Timing {
    /// Request sent → the first body bytes carrying a non-empty content delta.
    ttft: Duration,
    total: Duration,
    events: usize,
}

#[derive(Default)]
pub struct Outcome {
    pub ttft_us: Vec<u64>,
    pub total_us: Vec<u64>,
    pub events: usize,
    pub started: usize,
    pub errors: usize,
    pub first_error: Option<String>,
}

impl Outcome {
    fn error(&mut self, e: String) {
        self.errors += 1;
        self.first_error.get_or_insert(e);
    }

    fn merge(&mut self, other: Outcome) {
        self.ttft_us.extend(other.ttft_us);
        self.total_us.extend(other.total_us);
        self.events += other.events;
        self.started += other.started;
        self.errors += other.errors;
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
    }
}

/// Streams open right now, and the most that were open at once.
#[derive(Default)]
pub struct Open {
    now: AtomicUsize,
    pub peak: AtomicUsize,
}

pub async fn run(target: Arc<Target>, plan: &Plan, open: Arc<Open>) -> Outcome {
    let start = Instant::now();
    let recorded_from = start + plan.ramp;
    let deadline = recorded_from + plan.duration;
    let mut workers = tokio::task::JoinSet::new();
    for i in 0..plan.streams {
        let offset = plan.ramp.mul_f64(i as f64 / plan.streams as f64);
        let (target, open) = (target.clone(), open.clone());
        workers.spawn(async move {
            tokio::time::sleep_until(start + offset).await;
            worker(&target, recorded_from, deadline, &open).await
        });
    }
    let mut outcome = Outcome::default();
    while let Some(joined) = workers.join_next().await {
        match joined {
            Ok(o) => outcome.merge(o),
            Err(e) => outcome.error(format!("worker: {e}")),
        }
    }
    outcome
}

/// One connection's streams, one after another, until the deadline.
async fn worker(
    target: &Target,
    recorded_from: Instant,
    deadline: Instant,
    open: &Open,
) -> Outcome {
    let mut outcome = Outcome::default();
    let mut sender: Option<Sender> = None;
    while Instant::now() < deadline {
        let s = match sender.as_mut().filter(|s| !s.is_closed()) {
            Some(s) => s,
            None => match target.connect().await {
                Ok(s) => sender.insert(s),
                Err(e) => {
                    outcome.error(e);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let began = Instant::now();
        outcome.started += 1;
        let now = open.now.fetch_add(1, Ordering::Relaxed) + 1;
        open.peak.fetch_max(now, Ordering::Relaxed);
        let result = one_stream(s, target).await;
        open.now.fetch_sub(1, Ordering::Relaxed);
        match result {
            Ok(t) if began >= recorded_from => {
                outcome.ttft_us.push(t.ttft.as_micros() as u64);
                outcome.total_us.push(t.total.as_micros() as u64);
                outcome.events += t.events;
            }
            Ok(_) => {}
            Err(e) => {
                outcome.error(e);
                sender = None;
            }
        }
    }
    outcome
}

async fn one_stream(sender: &mut Sender, target: &Target) -> Result<Timing, String> {
    sender
        .ready()
        .await
        .map_err(|e| format!("connection: {e}"))?;
    let sent = Instant::now();
    let response = sender
        .send_request(target.request()?)
        .await
        .map_err(|e| format!("request: {e}"))?;
    if response.status() != 200 {
        return Err(format!("status {}", response.status()));
    }
    let mut body = response.into_body();
    let mut ttft = None;
    let mut events = 0;
    // The last bytes seen, enough to find the closing `data: [DONE]` split across frames.
    let mut tail: Vec<u8> = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| format!("body: {e}"))?;
        let Some(data) = frame.data_ref() else {
            continue;
        };
        if ttft.is_none() && has_content(data) {
            ttft = Some(sent.elapsed());
        }
        events += data.windows(6).filter(|w| w == b"data: ").count();
        tail.extend_from_slice(data);
        let keep = tail.len().saturating_sub(64);
        tail.drain(..keep);
    }
    if find(&tail, b"data: [DONE]").is_none() {
        return Err("stream ended without data: [DONE]".to_owned());
    }
    let ttft = ttft.ok_or("stream without a content delta")?;
    Ok(Timing {
        ttft,
        total: sent.elapsed(),
        events,
    })
}

/// A non-empty `"content":"…"` (the first delta often carries an empty one with the role).
fn has_content(data: &[u8]) -> bool {
    const KEY: &[u8] = b"\"content\":\"";
    data.windows(KEY.len() + 1)
        .any(|w| &w[..KEY.len()] == KEY && w[KEY.len()] != b'"')
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}
