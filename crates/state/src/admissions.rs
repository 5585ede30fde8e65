//! The Redis store's admission queue, per hash tag: while one admission call for a tag is in
//! flight, the asks that come for the same tag wait, and the first of them, when that call is
//! back, sends them all in one script call (admit_all.lua admits each in turn, exactly as calls
//! one after another would). A lone ask is sent at once.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

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
    Turn(Vec<Waiter>),
}

/// Tags with an admission call in flight, and the asks waiting behind each.
#[derive(Default)]
pub(crate) struct Admissions {
    tags: Mutex<HashMap<String, Vec<Waiter>>>,
}

pub(crate) enum Entered<'a> {
    /// No call for the tag is in flight: send now, holding the turn.
    Turn(Turn<'a>),
    /// Wait for the call in flight.
    Queued(oneshot::Receiver<Reply>),
}

/// The right to send the tag's next call. Dropped (its call answered, or its request ended),
/// it passes to the first ask still waiting, with everything queued behind it.
pub(crate) struct Turn<'a> {
    admissions: &'a Admissions,
    tag: String,
}

impl Admissions {
    fn tags(&self) -> MutexGuard<'_, HashMap<String, Vec<Waiter>>> {
        self.tags.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes the turn for `tag`, or queues the ask `asked` makes behind the call in flight.
    pub fn enter(&self, tag: &str, asked: impl FnOnce() -> Asked) -> Entered<'_> {
        let mut tags = self.tags();
        if let Some(waiting) = tags.get_mut(tag) {
            let (reply, answer) = oneshot::channel();
            waiting.push(Waiter {
                asked: asked(),
                reply,
            });
            return Entered::Queued(answer);
        }
        tags.insert(tag.to_owned(), Vec::new());
        Entered::Turn(self.turn(tag))
    }

    /// The turn for `tag` when no call for it is in flight.
    pub fn try_turn(&self, tag: &str) -> Option<Turn<'_>> {
        let mut tags = self.tags();
        if tags.contains_key(tag) {
            return None;
        }
        tags.insert(tag.to_owned(), Vec::new());
        Some(self.turn(tag))
    }

    /// The turn for `tag`, handed to this ask ([`Reply::Turn`]).
    pub fn turn(&self, tag: &str) -> Turn<'_> {
        Turn {
            admissions: self,
            tag: tag.to_owned(),
        }
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        let mut tags = self.admissions.tags();
        let Some(waiting) = tags.get_mut(&self.tag) else {
            return;
        };
        let mut batch = std::mem::take(waiting);
        while !batch.is_empty() {
            let next = batch.remove(0);
            match next.reply.send(Reply::Turn(batch)) {
                Ok(()) => return,
                Err(Reply::Turn(rest)) => batch = rest,
                Err(Reply::Verdict(_)) => return,
            }
        }
        tags.remove(&self.tag);
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
            Ok(Reply::Turn(rest)) => assert_eq!(rest.len(), 1, "the second rides along"),
            _ => panic!("the first waiting ask sends next"),
        }
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
