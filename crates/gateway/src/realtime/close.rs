//! Close frames across the two hops of a session (RFC 6455 section 7.4): a code one side sent is
//! passed to the other when it may be sent there, and replaced when it may not. Codes that must
//! never appear on the wire (1005, 1006, 1015), reserved or unassigned ones, and codes that only
//! describe one hop (1002 protocol error, 1010 missing extension) become 1011 toward the client
//! and 1000 toward the upstream, with the original in the reason.

use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;

/// The longest reason a close frame can carry (125 bytes of payload, 2 of them the code).
const MAX_REASON: usize = 123;

/// The frame for the client when the upstream closed with `frame` (`None`: no status code).
pub fn to_client(frame: Option<&CloseFrame>) -> CloseFrame {
    let Some(frame) = frame else {
        return make(1000, "the upstream closed the session");
    };
    match u16::from(frame.code) {
        code @ (1000 | 1001 | 1003 | 1007 | 1008 | 1009 | 1011..=1014 | 3000..=4999) => {
            make(code, frame.reason.as_str())
        }
        code => make(
            1011,
            &format!("upstream closed with code {code}: {}", frame.reason),
        ),
    }
}

/// The frame for the upstream when the client closed with `frame`.
pub fn to_upstream(frame: Option<&CloseFrame>) -> CloseFrame {
    let Some(frame) = frame else {
        return make(1000, "");
    };
    match u16::from(frame.code) {
        code @ (1000 | 1001 | 1003 | 1007..=1009 | 3000..=4999) => {
            make(code, frame.reason.as_str())
        }
        code => make(
            1000,
            &format!("client closed with code {code}: {}", frame.reason),
        ),
    }
}

/// A close frame with `reason` cut to what fits, at a character boundary.
pub fn make(code: u16, reason: &str) -> CloseFrame {
    let mut end = reason.len().min(MAX_REASON);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    CloseFrame {
        code: CloseCode::from(code),
        reason: reason[..end].to_owned().into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(code: u16, reason: &str) -> CloseFrame {
        CloseFrame {
            code: CloseCode::from(code),
            reason: reason.to_owned().into(),
        }
    }

    fn code(frame: &CloseFrame) -> u16 {
        u16::from(frame.code)
    }

    #[test]
    fn sendable_codes_pass_with_their_reasons() {
        for c in [1000, 1001, 1008, 1011, 1013, 4000, 4999] {
            let passed = to_client(Some(&frame(c, "why")));
            assert_eq!((code(&passed), passed.reason.as_str()), (c, "why"));
        }
        assert_eq!(code(&to_upstream(Some(&frame(4002, "")))), 4002);
    }

    #[test]
    fn codes_that_may_not_be_sent_become_1011_toward_the_client_and_1000_upstream() {
        for c in [999, 1002, 1004, 1005, 1006, 1010, 1015, 2000, 5000] {
            let replaced = to_client(Some(&frame(c, "gone")));
            assert_eq!(code(&replaced), 1011, "{c}");
            assert!(replaced.reason.as_str().contains(&c.to_string()));
            assert_eq!(code(&to_upstream(Some(&frame(c, "")))), 1000, "{c}");
        }
        assert_eq!(code(&to_client(None)), 1000);
        assert_eq!(code(&to_upstream(None)), 1000);
    }

    #[test]
    fn reasons_are_cut_to_123_bytes_at_a_character_boundary() {
        let long = "é".repeat(100);
        let cut = make(1000, &long);
        assert!(cut.reason.len() <= 123);
        assert_eq!(cut.reason.len(), 122);
    }
}
