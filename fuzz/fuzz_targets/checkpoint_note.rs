#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| executor_arm::fuzzing::checkpoint_note(data));
