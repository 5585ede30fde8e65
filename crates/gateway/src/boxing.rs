//! Futures boxed where they are made. `Box::pin(make(arg))` makes the future on the stack, then
//! copies it whole into its box: the pipeline's request future is over 4 KB and an attempt's
//! over 2 KB, most of it room for states the future has not reached, copied for each request.
//! [`in_place`] allocates the box first and has the future returned into it.
//!
//! The compiler writes a returned value straight into the box only when the call that makes it
//! cannot unwind: a `make` that may panic (one that loads a runtime, say) is made on the stack
//! and copied as before. Making an async fn's future only moves its arguments, which cannot.

use std::pin::Pin;

/// The future `make(arg)` returns, in a box allocated before it is made. Out of line, so the
/// call is the allocation and the making alone wherever it is used.
#[inline(never)]
pub fn in_place<A, F>(make: impl FnOnce(A) -> F, arg: A) -> Pin<Box<F>> {
    Box::into_pin(Box::write(Box::new_uninit(), made(make, arg)))
}

/// Out of line: a call that returns a large value is given the place to write it, here the box.
#[inline(never)]
fn made<A, F>(make: impl FnOnce(A) -> F, arg: A) -> F {
    make(arg)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn a_future_boxed_in_place_runs_as_made() {
        let said = String::from("in place");
        let future = in_place(|end: &str| async move { said + end }, ".");
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        assert_eq!(runtime.block_on(future), "in place.");
    }
}
