//! ckpt's safetensors header reader against the reference, the `safetensors` crate, on arbitrary
//! bytes: a crash is a file one reads and the other refuses (outside the documented exceptions in
//! tests/oracle/mod.rs, shared with tests/safetensors_oracle.rs), or that both read differently.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;

#[path = "../../tests/oracle/mod.rs"]
mod oracle;

fn scratch() -> &'static PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let dir = if std::path::Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        dir.join(format!("ckpt-fuzz-oracle-{}.safetensors", std::process::id()))
    })
}

fuzz_target!(|data: &[u8]| {
    let path = scratch();
    std::fs::write(path, data).expect("write scratch file");
    let ours = ckpt::formats::safetensors::read_header(path);
    if let oracle::Verdict::Disagree(e) = oracle::compare(ours, data) {
        panic!("{e}");
    }
});
