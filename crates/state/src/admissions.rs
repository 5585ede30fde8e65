//! The Redis store's admission queue, per hash tag: while one admission call for a tag is in
//! flight, the asks that come for the same tag wait, and the first of them, when that call is
//! back, sends them all in one script call (admit_all.lua admits each in turn, exactly as calls
//! one after another would). A lone ask is sent at once.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use redis::Cmd;
use tokio::sync::oneshot;

/// One ask as admit.lua reads it: its keys, then its arguments, in `body`.
pub(crate) struct Asked {
    pub keys: usize,
    pub body: Cmd,
}

/// An ask waiting for the call in flight under its tag.
pub(crate) struct Waiter {
    pub asked: Asked,
    pub reply: oneshot::Sender<Reply>,
}

pub(crate) enum Reply {
    /// What the script answered for this ask (`None`: Redis could not be reached).
    Verdict(Option<Vec<i64>>),
    /// This ask sends next, with these asks after its own.
    Turn(Turn, Vec<Waiter>),
}

/// Tags with an admission call in flight, each with the asks waiting behind it.
type Tags = Arc<Mutex<HashMap<String, Vec<Waiter>>>>;

fn lock(tags: &Tags) -> MutexGuard<'_, HashMap<String, Vec<Waiter>>> {
    tags.lock().unwrap_or_else(PoisonError::into_inner)
}

#[derive(Default)]
pub(crate) struct Admissions {
    tags: Tags,
}

pub(crate) enum Entered {
    /// No call for the tag is in flight: send now, holding the turn.
    Turn(Turn),
    /// Wait for the call in flight.
    Queued(oneshot::Receiver<Reply>),
}

/// The right to send the tag's next call. Dropped (its call answered, its request ended, or
/// handed over and never read), it passes to the first ask still waiting, with everything
/// queued behind it.
pub(crate) struct Turn {
    tags: Tags,
    tag: String,
    /// False for a turn that came back undelivered: it was never held.
    held: bool,
}

impl Admissions {
    /// Takes the turn for `tag`, or queues the ask `asked` makes behind the call in flight.
    pub fn enter(&self, tag: &str, asked: impl FnOnce() -> Asked) -> Entered {
        let mut tags = lock(&self.tags);
        if let Some(waiting) = tags.get_mut(tag) {
            let (reply, answer) = oneshot::channel();
            waiting.push(Waiter {
                asked: asked(),
                reply,
            });
            return Entered::Queued(answer);
        }
        tags.insert(tag.to_owned(), Vec::new());
        Entered::Turn(Turn::of(&self.tags, tag))
    }

    /// The turn for `tag` when no call for it is in flight.
    pub fn try_turn(&self, tag: &str) -> Option<Turn> {
        let mut tags = lock(&self.tags);
        if tags.contains_key(tag) {
            return None;
        }
        tags.insert(tag.to_owned(), Vec::new());
        Some(Turn::of(&self.tags, tag))
    }
}

impl Turn {
    fn of(tags: &Tags, tag: &str) -> Self {
        Turn {
            tags: tags.clone(),
            tag: tag.to_owned(),
            held: true,
        }
    }

    /// Hands the turn to the first ask still waiting (the lock is not held while it is sent:
    /// a turn dropped unread passes itself on); frees the tag when none waits.
    fn pass(&self) {
        loop {
            let mut batch = {
                let mut tags = lock(&self.tags);
                match tags.get_mut(&self.tag) {
                    Some(waiting) if !waiting.is_empty() => std::mem::take(waiting),
                    Some(_) => {
                        tags.remove(&self.tag);
                        return;
                    }
                    None => return,
                }
            };
            while !batch.is_empty() {
                let next = batch.remove(0);
                match next
                    .reply
                    .send(Reply::Turn(Turn::of(&self.tags, &self.tag), batch))
                {
                    Ok(()) => return,
                    Err(Reply::Turn(mut undelivered, rest)) => {
                        undelivered.held = false;
                        batch = rest;
                    }
                    Err(Reply::Verdict(_)) => return,
                }
            }
        }
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        if self.held {
            self.pass();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn asked() -> Asked {
        Asked {
            keys: 0,
            body: Cmd::new(),
        }
    }

    #[test]
    fn asks_behind_a_call_in_flight_go_to_the_first_of_them_when_it_is_back() {
        let admissions = Admissions::default();
        let Entered::Turn(turn) = admissions.enter("t", asked) else {
            panic!("a lone ask is sent at once");
        };
        let Entered::Queued(mut first) = admissions.enter("t", asked) else {
            panic!("queued behind the call in flight");
        };
        let Entered::Queued(_second) = admissions.enter("t", asked) else {
            panic!("queued too");
        };
        assert!(
            matches!(admissions.enter("u", asked), Entered::Turn(_)),
            "another tag"
        );
        drop(turn);
        match first.try_recv() {
            Ok(Reply::Turn(_, rest)) => assert_eq!(rest.len(), 1, "the second rides along"),
            _ => panic!("the first waiting ask sends next"),
        }
    }

    #[test]
    fn a_turn_handed_to_an_ask_whose_request_ended_before_reading_it_frees_the_tag() {
        let admissions = Admissions::default();
        let Entered::Turn(turn) = admissions.enter("t", asked) else {
            panic!("a lone ask is sent at once");
        };
        let Entered::Queued(ended) = admissions.enter("t", asked) else {
            panic!("queued");
        };
        let Entered::Queued(mut behind) = admissions.enter("t", asked) else {
            panic!("queued");
        };
        drop(turn);
        drop(ended);
        assert!(
            matches!(behind.try_recv(), Err(oneshot::error::TryRecvError::Closed)),
            "the ask behind it is told to ask again"
        );
        assert!(matches!(admissions.enter("t", asked), Entered::Turn(_)));
    }

    #[test]
    fn a_turn_skips_asks_whose_requests_ended_and_frees_the_tag_when_none_wait() {
        let admissions = Admissions::default();
        let Entered::Turn(turn) = admissions.enter("t", asked) else {
            panic!("a lone ask is sent at once");
        };
        let Entered::Queued(gone) = admissions.enter("t", asked) else {
            panic!("queued");
        };
        drop(gone);
        drop(turn);
        assert!(matches!(admissions.enter("t", asked), Entered::Turn(_)));
    }
}
