//! The unix-socket authority normaliser (shareguard-uds) on arbitrary client bytes:
//! never a panic, and the same output however the bytes arrive (split in two at the
//! point the first byte gives), since a socket read can end anywhere.
#![no_main]

use libfuzzer_sys::fuzz_target;
use shareguard_uds::normalize::Normalizer;

fuzz_target!(|data: &[u8]| {
    let Some((&cut, input)) = data.split_first() else {
        return;
    };
    let mut whole = Vec::new();
    let mut one = Normalizer::new();
    one.feed(input, &mut whole);
    one.finish(&mut whole);

    let cut = usize::from(cut).min(input.len());
    let mut parts = Vec::new();
    let mut two = Normalizer::new();
    two.feed(&input[..cut], &mut parts);
    two.feed(&input[cut..], &mut parts);
    two.finish(&mut parts);
    assert_eq!(whole, parts, "split at {cut}");
    assert_eq!(one.rewritten(), two.rewritten());
});
