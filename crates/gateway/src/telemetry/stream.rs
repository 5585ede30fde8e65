//! What a traced stream tells its request's spans while it runs: the answer's id (the first the
//! stream gave) and finish reason (the last), and for a stream that was cut and continued by
//! another target (`continue_cut_streams`), where each part was cut and the continuation's own
//! attempts. Only a traced request's stream has one; the others pay an `Option` check.

use std::sync::{Mutex, MutexGuard};

use http::StatusCode;
use tokio::time::Instant;

use super::{new_span_id, Attempt, Failed, Traceparent};
use crate::provider::StreamAnswer;
use crate::router::Candidate;
use crate::upstream::Failure;
use crate::usage::Usage;

/// A traced stream's account, written by the relay and read once when the request span ends.
#[derive(Debug, Default)]
pub struct StreamTrace(Mutex<Told>);

/// What the stream told so far.
#[derive(Debug, Default)]
pub(super) struct Told {
    pub(super) id: Option<String>,
    pub(super) finish_reason: Option<String>,
    /// One part per attempt whose stream reached the caller, in order: all but the last were
    /// cut and continued.
    pub(super) parts: Vec<Part>,
    /// The attempts at continuing the stream after a cut, in order.
    pub(super) continuations: Vec<Attempt>,
}

/// The part of the caller's stream one attempt sent.
#[derive(Debug)]
pub(super) struct Part {
    pub(super) usage: Usage,
    pub(super) cut: Option<Cut>,
}

/// Where a part of a stream broke off.
#[derive(Debug)]
pub(super) struct Cut {
    pub(super) at: Instant,
    pub(super) reason: String,
}

/// How one attempt at continuing a cut stream went.
pub enum Continued<'a> {
    /// Its stream took over the caller's.
    Streaming,
    /// It answered, but with a whole answer, which cannot continue a stream.
    Unstreamed(StatusCode),
    Failed(&'a Failure),
}

impl StreamTrace {
    /// One attempt's part of the caller's stream ended: what it said and used, and when and why
    /// it was cut, if it was (a cut part is followed by a continuation's, unless none could be
    /// had). The caller's stream ends with its last part, or when the caller goes away.
    pub fn ended(&self, answer: StreamAnswer<'_>, usage: Usage, cut: Option<(Instant, &str)>) {
        let mut told = self.told();
        if told.id.is_none() {
            told.id = answer.id.map(str::to_owned);
        }
        if let Some(reason) = answer.finish_reason {
            told.finish_reason = Some(reason.to_owned());
        }
        let cut = cut.map(|(at, reason)| Cut {
            at,
            reason: reason.to_owned(),
        });
        told.parts.push(Part { usage, cut });
    }

    /// An attempt at continuing the stream on `candidate`, begun at `began`, has just ended; its
    /// span takes the id its upstream request carried in `traceparent`.
    pub fn continuation(
        &self,
        candidate: &Candidate,
        began: Instant,
        traceparent: Option<&Traceparent>,
        outcome: Continued<'_>,
    ) {
        let failure = match outcome {
            Continued::Streaming => None,
            Continued::Unstreamed(status) => Some(Failed {
                label: status.as_u16().to_string(),
                status: Some(status.as_u16()),
                reason: format!("{} answered without a stream", status.as_u16()),
            }),
            Continued::Failed(failure) => Some(Failed::of(failure)),
        };
        let attempt = Attempt {
            id: traceparent
                .and_then(Traceparent::take)
                .unwrap_or_else(new_span_id),
            backend: candidate.backend,
            deployment: candidate.deployment.to_string(),
            began,
            ended: Instant::now(),
            failure,
            part: None,
        };
        self.told().continuations.push(attempt);
    }

    /// Everything told, once, for the spans.
    pub(super) fn take(&self) -> Told {
        std::mem::take(&mut *self.told())
    }

    fn told(&self) -> MutexGuard<'_, Told> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}
