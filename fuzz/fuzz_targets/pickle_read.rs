//! The data-only pickle reader on arbitrary bytes, under a policy that allows every global (so the
//! fuzzer reaches the opcodes behind them) and under DCP's whitelist via the `.metadata` parser.
//! Whatever it accepts must survive a write and read back.
#![no_main]

use ckpt::pickle::{self, Globals, Limits, Protocol};
use libfuzzer_sys::fuzz_target;

struct Any;

impl Globals for Any {
    fn allows(&self, _module: &str, _name: &str) -> bool {
        true
    }
}

fuzz_target!(|data: &[u8]| {
    if let Ok(value) = pickle::read(data, &Any, Limits::default()) {
        for protocol in [Protocol::V2, Protocol::V4] {
            let bytes = pickle::write(&value, protocol);
            pickle::read(&bytes, &Any, Limits::default())
                .expect("a value the reader produced must read back from the writer's bytes");
        }
    }
    let _ = ckpt::formats::dcp::metadata::parse(data);
});
