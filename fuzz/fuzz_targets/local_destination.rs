#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ferry_fuzz::local_destination(data));
