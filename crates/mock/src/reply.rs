//! The text a simulated model answers with: it names who answered, so tests can tell upstreams apart.

/// Words padding a reply to the requested length.
const FILLER: [&str; 6] = ["this", "is", "a", "simulated", "reply", "indeed"];

const DEFAULT_WORDS: u32 = 8;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    Stop,
    /// The reply was cut at the request's max tokens.
    Length,
}

/// A reply as its stream chunks, one word each, leading space included.
pub struct Reply {
    pub chunks: Vec<String>,
    pub finish: Finish,
}

impl Reply {
    /// "Hello from {who} this is a ..." — or, continuing an assistant prefill,
    /// " continued by {who} this is ...". One word is one completion token.
    pub fn compose(who: &str, words: Option<u32>, prefill: bool, max_tokens: Option<u64>) -> Reply {
        let opening = if prefill {
            ["continued", "by", who]
        } else {
            ["Hello", "from", who]
        };
        let wanted = words.unwrap_or(DEFAULT_WORDS) as usize;
        let allowed = max_tokens.map_or(usize::MAX, |m| usize::try_from(m).unwrap_or(usize::MAX));
        let chunks = opening
            .into_iter()
            .chain(FILLER.into_iter().cycle())
            .take(wanted.min(allowed))
            .enumerate()
            .map(|(i, w)| {
                if i == 0 && !prefill {
                    w.to_owned()
                } else {
                    format!(" {w}")
                }
            })
            .collect();
        let finish = if allowed < wanted {
            Finish::Length
        } else {
            Finish::Stop
        };
        Reply { chunks, finish }
    }

    pub fn text(&self) -> String {
        self.chunks.concat()
    }

    pub fn tokens(&self) -> u64 {
        self.chunks.len() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_who_answered_and_pads() {
        let r = Reply::compose("ep/dep", None, false, None);
        assert_eq!(r.text(), "Hello from ep/dep this is a simulated reply");
        assert_eq!((r.tokens(), r.finish), (8, Finish::Stop));
    }

    #[test]
    fn continues_prefill_and_truncates() {
        let r = Reply::compose("ep/dep", Some(10), true, Some(4));
        assert_eq!(r.text(), " continued by ep/dep this");
        assert_eq!(r.finish, Finish::Length);
    }
}
