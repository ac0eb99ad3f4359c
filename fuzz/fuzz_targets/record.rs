//! Store values: arbitrary bytes decoded as the two record types the store holds. Never a
//! panic, and whatever decodes re-encodes (in the format the store writes it in) to bytes
//! that decode to the same record: a record the agent rewrites must not change on the way.
#![no_main]

use std::fmt::Debug;

use libfuzzer_sys::fuzz_target;
use serde::{Deserialize, Serialize};
use shareguard::record::{self, ClaimRecord, ShareRecord};

fn round_trip<T>(data: &[u8], encode: fn(&T) -> Vec<u8>)
where
    T: Serialize + for<'de> Deserialize<'de> + PartialEq + Debug,
{
    let Ok(value) = record::decode::<T>(data) else {
        return;
    };
    let bytes = encode(&value);
    let again = match record::decode::<T>(&bytes) {
        Ok(again) => again,
        Err(e) => panic!("{value:?} encodes to bytes that do not decode: {e}"),
    };
    assert_eq!(again, value, "changed by a round trip");
    // Bytes may change once (a quantity's text settles, see the quantity target), never
    // twice: a record rewritten unchanged stays the same in the store.
    let settled = encode(&again);
    match record::decode::<T>(&settled) {
        Ok(third) => assert_eq!(encode(&third), settled, "encoding never settles"),
        Err(e) => panic!("{again:?} encodes to bytes that do not decode: {e}"),
    }
}

fuzz_target!(|data: &[u8]| {
    round_trip::<ShareRecord>(data, record::encode_share);
    round_trip::<ClaimRecord>(data, record::encode);
});
