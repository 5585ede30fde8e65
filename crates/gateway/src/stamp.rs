//! The gateway's own headers on an answer (`x-onedoor-request-id`, `-attempts`, `-backend`,
//! `-region` and the caller's `x-ratelimit-*`), written once as header lines and carried in the
//! answer's extensions. The HTTP/1.1 connection writes the lines as they are, so these headers
//! are never hashed into a header map nor dropped from one; an answer that leaves some other
//! way (h2, by hyper) gets them as header entries first ([`Stamp::into_headers`]).

use http::{HeaderMap, HeaderName, HeaderValue, Response};

/// Header lines, each `name: value\r\n`, in the order they were added.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stamp {
    lines: Vec<u8>,
}

impl Stamp {
    /// A stamp with room for `bytes` of lines.
    pub fn with_capacity(bytes: usize) -> Stamp {
        Stamp {
            lines: Vec::with_capacity(bytes),
        }
    }

    /// Adds `name: value`. A value with a byte no header value may hold (a control character
    /// other than tab, or DEL) is left out, as `HeaderValue::from_str` refuses it.
    pub fn add(&mut self, name: &HeaderName, value: &[u8]) {
        // Every byte looked at, with no early exit, so the check runs on vectors.
        let fits = value.iter().fold(true, |fits, &b| {
            fits & (((b >= 32) & (b != 127)) | (b == b'\t'))
        });
        if fits {
            self.line(name, value);
        }
    }

    /// Adds `name: value` for a value already checked.
    pub fn add_value(&mut self, name: &HeaderName, value: &HeaderValue) {
        self.line(name, value.as_bytes());
    }

    /// Adds `name: number`.
    pub fn add_number(&mut self, name: &HeaderName, number: u64) {
        self.line(name, itoa::Buffer::new().format(number).as_bytes());
    }

    fn line(&mut self, name: &HeaderName, value: &[u8]) {
        let name = name.as_str().as_bytes();
        self.lines.reserve(name.len() + value.len() + 4);
        self.lines.extend_from_slice(name);
        self.lines.extend_from_slice(b": ");
        self.lines.extend_from_slice(value);
        self.lines.extend_from_slice(b"\r\n");
    }

    /// The lines, as an HTTP/1.1 head would carry them.
    #[cfg(test)]
    fn lines(&self) -> &[u8] {
        &self.lines
    }

    /// Each header as its name and value.
    pub fn fields(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.lines
            .split(|&b| b == b'\n')
            .filter_map(|line| line.strip_suffix(b"\r"))
            .filter_map(|line| {
                let colon = line.iter().position(|&b| b == b':')?;
                Some((&line[..colon], line.get(colon + 2..).unwrap_or_default()))
            })
    }

    /// The value of the header `name`, if the stamp has it.
    #[cfg(test)]
    pub fn get(&self, name: &str) -> Option<&[u8]> {
        self.fields()
            .find(|(field, _)| *field == name.as_bytes())
            .map(|(_, value)| value)
    }

    /// Puts the stamp on `response`, in place of any it had.
    pub fn put<B>(self, response: &mut Response<B>) {
        response.extensions_mut().insert(self);
    }

    /// Moves the stamp `response` carries into its header map, for a writer that reads only
    /// the map.
    pub fn into_headers<B>(response: &mut Response<B>) {
        if let Some(stamp) = response.extensions_mut().remove::<Stamp>() {
            stamp.insert_into(response.headers_mut());
        }
    }

    fn insert_into(&self, headers: &mut HeaderMap) {
        for (name, value) in self.fields() {
            if let (Ok(name), Ok(value)) =
                (HeaderName::from_bytes(name), HeaderValue::from_bytes(value))
            {
                headers.insert(name, value);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    const ID: HeaderName = HeaderName::from_static("x-onedoor-request-id");
    const LEFT: HeaderName = HeaderName::from_static("x-ratelimit-remaining-requests");
    const REGION: HeaderName = HeaderName::from_static("x-onedoor-region");

    #[test]
    fn lines_are_written_in_order_and_read_back_by_name() {
        let mut stamp = Stamp::default();
        stamp.add(&ID, b"0192abc");
        stamp.add_number(&LEFT, 42);
        stamp.add(&REGION, "sweden central, \u{e9}".as_bytes());
        assert_eq!(
            stamp.lines(),
            "x-onedoor-request-id: 0192abc\r\nx-ratelimit-remaining-requests: 42\r\n\
             x-onedoor-region: sweden central, \u{e9}\r\n"
                .as_bytes()
        );
        assert_eq!(
            stamp.get("x-ratelimit-remaining-requests"),
            Some(&b"42"[..])
        );
        assert_eq!(stamp.get("x-onedoor-attempts"), None);
        assert_eq!(stamp.fields().count(), 3);
    }

    #[test]
    fn a_value_no_header_may_hold_is_left_out() {
        let mut stamp = Stamp::default();
        stamp.add(&ID, b"split\r\ninjected: yes");
        stamp.add(&REGION, b"del\x7f");
        stamp.add(&LEFT, b"tab\tis fine");
        assert_eq!(
            stamp.lines(),
            b"x-ratelimit-remaining-requests: tab\tis fine\r\n"
        );
    }

    #[test]
    fn an_empty_value_is_a_header_with_nothing_after_its_colon() {
        let mut stamp = Stamp::default();
        stamp.add(&REGION, b"");
        assert_eq!(stamp.get("x-onedoor-region"), Some(&b""[..]));
    }

    #[test]
    fn a_stamp_moves_into_the_header_map_of_its_answer() {
        let mut response = Response::new(());
        response
            .headers_mut()
            .insert(LEFT, HeaderValue::from_static("7"));
        let mut stamp = Stamp::default();
        stamp.add(&ID, b"abc");
        stamp.add_number(&LEFT, 3);
        stamp.put(&mut response);
        let put = response.extensions().get::<Stamp>().unwrap();
        assert_eq!(put.get("x-onedoor-request-id"), Some(&b"abc"[..]));
        Stamp::into_headers(&mut response);
        assert!(response.extensions().get::<Stamp>().is_none());
        assert_eq!(response.headers()["x-onedoor-request-id"], "abc");
        assert_eq!(response.headers()["x-ratelimit-remaining-requests"], "3");
        assert_eq!(response.headers().len(), 2);
    }
}
