//! The gateway's own headers on an answer (`x-onedoor-request-id`, `-attempts`, `-backend`,
//! `-region` and the caller's `x-ratelimit-*`), gathered as the answer is made and carried in
//! its extensions; the server moves them into the answer's header map ([`Stamp::into_headers`])
//! in one pass: names as the constants they are, values as slices of one buffer.

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Response};
use smallvec::SmallVec;

/// Headers in the order they were added: each name, and where its value lies in `values`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stamp {
    names: SmallVec<[(HeaderName, usize, usize); 8]>,
    values: Vec<u8>,
}

impl Stamp {
    /// A stamp with room for `bytes` of values.
    pub fn with_capacity(bytes: usize) -> Stamp {
        Stamp {
            names: SmallVec::new(),
            values: Vec::with_capacity(bytes),
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
            self.field(name, value);
        }
    }

    /// Adds `name: value` for a value already checked.
    pub fn add_value(&mut self, name: &HeaderName, value: &HeaderValue) {
        self.field(name, value.as_bytes());
    }

    /// Adds `name: number`.
    pub fn add_number(&mut self, name: &HeaderName, number: u64) {
        self.field(name, itoa::Buffer::new().format(number).as_bytes());
    }

    fn field(&mut self, name: &HeaderName, value: &[u8]) {
        let start = self.values.len();
        self.values.extend_from_slice(value);
        self.names.push((name.clone(), start, self.values.len()));
    }

    /// Each header as its name and value.
    #[cfg(test)]
    pub fn fields(&self) -> impl Iterator<Item = (&HeaderName, &[u8])> {
        self.names
            .iter()
            .map(|(name, start, end)| (name, self.values.get(*start..*end).unwrap_or_default()))
    }

    /// The value of the header `name`, if the stamp has it.
    #[cfg(test)]
    pub fn get(&self, name: &str) -> Option<&[u8]> {
        self.fields()
            .find(|(field, _)| field.as_str() == name)
            .map(|(_, value)| value)
    }

    /// Puts the stamp on `response`, in place of any it had.
    pub fn put<B>(self, response: &mut Response<B>) {
        response.extensions_mut().insert(self);
    }

    /// Moves the stamp `response` carries into its header map, in place of any headers of the
    /// same names.
    pub fn into_headers<B>(response: &mut Response<B>) {
        if let Some(stamp) = response.extensions_mut().remove::<Stamp>() {
            stamp.insert_into(response.headers_mut());
        }
    }

    fn insert_into(self, headers: &mut HeaderMap) {
        let values = Bytes::from(self.values);
        headers.reserve(self.names.len());
        for (name, start, end) in self.names {
            if let Ok(value) = HeaderValue::from_maybe_shared(values.slice(start..end)) {
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
        let fields: Vec<(&str, &[u8])> = stamp.fields().map(|(n, v)| (n.as_str(), v)).collect();
        assert_eq!(
            fields,
            [
                ("x-onedoor-request-id", &b"0192abc"[..]),
                ("x-ratelimit-remaining-requests", b"42"),
                ("x-onedoor-region", "sweden central, \u{e9}".as_bytes()),
            ]
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
        let fields: Vec<(&str, &[u8])> = stamp.fields().map(|(n, v)| (n.as_str(), v)).collect();
        assert_eq!(
            fields,
            [("x-ratelimit-remaining-requests", &b"tab\tis fine"[..])]
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
