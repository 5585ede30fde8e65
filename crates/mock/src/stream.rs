//! Answer bodies played out over time: pacing, cuts, hangs, and noticing a client that went away.

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::stream::{self, BoxStream, StreamExt};
use http_body_util::StreamBody;
use hyper::body::Frame;
use serde_json::Value;

use crate::state::Counters;
use crate::Behavior;

pub type Body = StreamBody<BoxStream<'static, Result<Frame<Bytes>, io::Error>>>;

/// Counts the request as cancelled if dropped before `complete`: hyper drops the service future
/// or the body when the client goes away, and the watch travels with whichever is in flight.
pub struct Watch(Option<Arc<Counters>>);

impl Watch {
    pub fn new(counters: Arc<Counters>) -> Self {
        Self(Some(counters))
    }

    /// For answers that are not upstream requests (the control surface).
    pub fn detached() -> Self {
        Self(None)
    }

    pub fn complete(&mut self) {
        self.0 = None;
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        if let Some(counters) = self.0.take() {
            counters.cancelled.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The events of a stream, split where pacing applies: the preamble goes out at once, the
/// content chunks are paced by time-to-first-token and inter-token gaps, the tail ends it.
pub struct Script {
    pub preamble: Vec<Bytes>,
    pub content: Vec<Bytes>,
    pub tail: Vec<Bytes>,
}

/// One server-sent event carrying only data (the OpenAI framing).
pub fn data_event(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// One server-sent event with a name (the Anthropic framing).
pub fn named_event(name: &str, v: &Value) -> Bytes {
    Bytes::from(format!("event: {name}\ndata: {v}\n\n"))
}

pub fn done_event() -> Bytes {
    Bytes::from_static(b"data: [DONE]\n\n")
}

/// What happens once the scheduled frames are out.
#[derive(Clone, Copy, PartialEq, Eq)]
enum End {
    Finish,
    /// Fail the body, so hyper drops the connection without the chunked terminator.
    Cut,
    Hang,
}

struct Playback {
    frames: VecDeque<(Duration, Bytes)>,
    /// Played again each time `frames` runs out (an endless stream); empty for the others.
    again: Vec<(Duration, Bytes)>,
    end: End,
    watch: Watch,
}

fn play(frames: VecDeque<(Duration, Bytes)>, end: End, watch: Watch) -> Body {
    play_over(frames, Vec::new(), end, watch)
}

fn play_over(
    frames: VecDeque<(Duration, Bytes)>,
    again: Vec<(Duration, Bytes)>,
    end: End,
    watch: Watch,
) -> Body {
    let playback = Playback {
        frames,
        again,
        end,
        watch,
    };
    StreamBody::new(stream::unfold(playback, next_frame).boxed())
}

async fn next_frame(mut p: Playback) -> Option<(Result<Frame<Bytes>, io::Error>, Playback)> {
    if p.frames.is_empty() {
        p.frames.extend(p.again.iter().cloned());
    }
    if let Some((delay, bytes)) = p.frames.pop_front() {
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        // Complete on handing over the last bytes: hyper may not poll again once a sized body is written.
        if p.frames.is_empty() && p.end != End::Hang {
            p.watch.complete();
        }
        return Some((Ok(Frame::data(bytes)), p));
    }
    match p.end {
        End::Finish => None,
        End::Cut => {
            // Go pending once so hyper flushes the chunks already written: failing straight
            // away would discard them together with the headers.
            tokio::task::yield_now().await;
            p.watch.complete();
            p.end = End::Finish;
            Some((Err(io::Error::other("mock: stream cut")), p))
        }
        End::Hang => std::future::pending().await,
    }
}

/// A whole body sent at once.
pub fn full(bytes: Bytes, watch: Watch) -> Body {
    play(
        VecDeque::from([(Duration::ZERO, bytes)]),
        End::Finish,
        watch,
    )
}

/// A body that never sends a byte, for answers whose headers are all the client gets.
pub fn silent(watch: Watch) -> Body {
    play(VecDeque::new(), End::Hang, watch)
}

/// Plays a stream script: the first event waits for time-to-first-token, each later content
/// chunk (and the finish after them) for the inter-token gap; `cut_after` fails the body
/// after that many content chunks.
pub fn scripted(script: Script, b: &Behavior, watch: Watch) -> Body {
    let gap = Duration::from_millis(b.inter_token_ms);
    let cut = b
        .cut_after
        .map(|n| n as usize)
        .filter(|&n| n < script.content.len());
    let had_content = !script.content.is_empty();
    let mut frames: VecDeque<_> = script
        .preamble
        .into_iter()
        .map(|e| (Duration::ZERO, e))
        .collect();
    if b.endless {
        let again: Vec<_> = script.content.into_iter().map(|e| (gap, e)).collect();
        frames.extend(again.iter().cloned());
        if let Some(first) = frames.front_mut() {
            first.0 = Duration::from_millis(b.ttft_ms);
        }
        return play_over(frames, again, End::Hang, watch);
    }
    let paced = script.content.into_iter().take(cut.unwrap_or(usize::MAX));
    frames.extend(
        paced
            .enumerate()
            .map(|(i, e)| (if i == 0 { Duration::ZERO } else { gap }, e)),
    );
    let end = if cut.is_some() {
        End::Cut
    } else {
        let mut tail = script.tail.into_iter();
        frames.extend(
            tail.next()
                .map(|e| (if had_content { gap } else { Duration::ZERO }, e)),
        );
        frames.extend(tail.map(|e| (Duration::ZERO, e)));
        End::Finish
    };
    if let Some(first) = frames.front_mut() {
        first.0 = Duration::from_millis(b.ttft_ms);
    }
    play(frames, end, watch)
}
