//! Test support for the HTTP/1.1 readers: wire bytes damaged at random, for tests that hold
//! that nothing a peer sends makes the gateway hang or panic.

/// `bytes` damaged one to three times, by a
/// cut, an overwritten byte, random noise, or a piece that breaks framing (a size too large,
/// negative or not hexadecimal, an early blank line, a second length) put in at random.
pub(crate) fn damage(rng: &mut impl rand::Rng, bytes: &mut Vec<u8>) {
    const BAD: [&[u8]; 5] = [
        b"ffffffffffffffffffff\r\n",
        b"-1\r\n",
        b"zz\r\n",
        b"\r\n\r\n",
        b"content-length: 9\r\n",
    ];
    for _ in 0..rng.random_range(1..=3) {
        let at = rng.random_range(0..=bytes.len());
        match rng.random_range(0..4) {
            0 => bytes.truncate(at),
            1 if at < bytes.len() => bytes[at] = rng.random(),
            2 => {
                let noise: Vec<u8> = (0..rng.random_range(1..40)).map(|_| rng.random()).collect();
                bytes.splice(at..at, noise);
            }
            _ => {
                let bad = BAD[rng.random_range(0..BAD.len())];
                bytes.splice(at..at, bad.iter().copied());
            }
        }
    }
}
