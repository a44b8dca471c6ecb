//! The safetensors header parser (it reads from a path, so each input is written to a
//! per-process file in /dev/shm), then the single-file reader on top of it.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;

fn scratch() -> &'static PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let dir = if std::path::Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        dir.join(format!("ckpt-fuzz-{}.safetensors", std::process::id()))
    })
}

fuzz_target!(|data: &[u8]| {
    let path = scratch();
    std::fs::write(path, data).expect("write scratch file");
    let len = data.len() as u64;
    if let Ok(header) = ckpt::formats::safetensors::read_header(path) {
        for t in &header.tensors {
            assert!(t.begin <= t.end, "accepted a backwards range");
            assert!(
                header.data_start + t.end <= len,
                "accepted a range past the file"
            );
        }
    }
    let _ = ckpt::formats::safetensors::read(path);
});
