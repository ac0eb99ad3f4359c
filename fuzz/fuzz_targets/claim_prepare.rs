//! Arbitrary bytes as a `ClaimPrepare`, through what the gRPC Prepare path runs before it
//! looks anything up or changes anything: `validate_claim` then `authorize`, against a
//! fixed inventory. Never a panic; what passes must be consistent with the inventory.
#![no_main]

use libfuzzer_sys::fuzz_target;
use prost::Message;
use shareguard::validate::{authorize, check_share_id, validate_claim};
use shareguard_proto::v1::ClaimPrepare;

fuzz_target!(|data: &[u8]| {
    // tonic decodes the request with prost exactly like this; what fails here is a gRPC
    // decode error that never reaches the agent.
    let Ok(claim) = ClaimPrepare::decode(data) else {
        return;
    };
    let cfg = shareguard_fuzz::inventory();
    // Then the API layer's translation, field for field, as the Prepare handler does.
    let claim: shareguard::request::ClaimPrepare = claim.into();
    let valid = match validate_claim(cfg, 0, &claim) {
        Ok(valid) => valid,
        Err(e) => {
            // Refusals are shown to the caller and written to the audit log.
            let _ = e.to_string();
            return;
        }
    };
    // Whatever validation lets through names known devices with well-formed amounts:
    // admission relies on that.
    for a in &valid.allocs {
        let Some(dev) = cfg.device(&a.device) else {
            panic!("validated allocation names unknown device {:?}", a.device);
        };
        assert_eq!(
            (a.driver.as_str(), a.pool.as_str()),
            (dev.driver.as_str(), dev.pool.as_str())
        );
        match &a.share_id {
            None => assert!(a.consumed.is_empty(), "dedicated allocation with amounts"),
            Some(id) => {
                assert!(check_share_id(id).is_ok(), "share id {id:?}");
                assert_eq!(
                    a.consumed.keys().collect::<Vec<_>>(),
                    dev.capacities.keys().collect::<Vec<_>>(),
                    "a share consumes exactly its device's capacities"
                );
                for (name, q) in &a.consumed {
                    assert!(!q.is_negative(), "{name}: {q}");
                    assert!(dev.capacities[name].policy.allows(q).is_ok(), "{name}: {q}");
                }
            }
        }
    }
    if let Err(e) = authorize(cfg, &valid) {
        let _ = e.to_string();
    }
});
