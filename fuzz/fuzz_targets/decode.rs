//! `decode` is total, and whatever it accepts re-encodes to bytes that decode to the same packet.
#![no_main]

use efa::proto::wire::decode;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok((packet, payload)) = decode(data) {
        let again = packet.to_vec(payload).expect("a decoded packet re-encodes");
        let (packet2, payload2) = decode(&again).expect("a re-encoded packet decodes");
        assert_eq!(packet2, packet);
        assert_eq!(payload2, payload);
    }
});
