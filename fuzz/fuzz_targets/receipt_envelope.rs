#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| executor_arm::fuzzing::receipt_envelope(data));
