#![no_main]

use hmac::{Hmac, Mac};

fn hmac_sha256(key: &[u8], message: &[u8]) -> [u8; 32] {
    let Ok(mut mac) = Hmac::<sha2::Sha256>::new_from_slice(key) else {
        panic!("HMAC takes a key of any length");
    };
    mac.update(message);
    mac.finalize().into_bytes().into()
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| executor_arm::fuzzing::token(data, hmac_sha256));
