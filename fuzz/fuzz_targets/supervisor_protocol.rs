#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| executor_arm::fuzzing::supervisor_protocol(data));
