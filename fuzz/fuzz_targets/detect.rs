//! Layout detection and `verify` on whole checkpoints built from the input in a per-process
//! directory under /dev/shm. The first byte picks the layout (and `--deep`), the rest is the file:
//! - 0: `model.safetensors`   1: `pytorch_model.bin`   2: `model.pt` with no magic check
//! - 3: a DCP directory: a u32 length, that many bytes of `.metadata`, the rest `__0_0.distcp`
//! - 4: a DCP safetensors directory of one rank file
//! - 5: a Hugging Face split: a u32 length, that much `model.safetensors.index.json`, the rest
//!   `model-00001-of-00001.safetensors`
#![no_main]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;

fn scratch() -> &'static PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let dir = if Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        dir.join(format!("ckpt-fuzz-detect-{}", std::process::id()))
    })
}

/// Split `rest` at a leading u32 length.
fn split(rest: &[u8]) -> (&[u8], &[u8]) {
    let Some((len, body)) = rest.split_first_chunk::<4>() else {
        return (rest, &[]);
    };
    let n = (u32::from_le_bytes(*len) as usize).min(body.len());
    body.split_at(n)
}

fuzz_target!(|data: &[u8]| {
    let Some((&choice, rest)) = data.split_first() else {
        return;
    };
    let dir = scratch();
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).expect("scratch dir");
    let path = match choice % 6 {
        0 => {
            std::fs::write(dir.join("model.safetensors"), rest).unwrap();
            dir.join("model.safetensors")
        }
        1 => {
            std::fs::write(dir.join("pytorch_model.bin"), rest).unwrap();
            dir.join("pytorch_model.bin")
        }
        2 => {
            std::fs::write(dir.join("model.pt"), rest).unwrap();
            dir.join("model.pt")
        }
        3 => {
            let (meta, item) = split(rest);
            std::fs::write(dir.join(".metadata"), meta).unwrap();
            std::fs::write(dir.join("__0_0.distcp"), item).unwrap();
            dir.clone()
        }
        4 => {
            std::fs::write(
                dir.join("shard-00001-model-00001-of-00001.safetensors"),
                rest,
            )
            .unwrap();
            dir.clone()
        }
        _ => {
            let (index, file) = split(rest);
            std::fs::write(dir.join("model.safetensors.index.json"), index).unwrap();
            std::fs::write(dir.join("model-00001-of-00001.safetensors"), file).unwrap();
            dir.clone()
        }
    };
    let _ = ckpt::detect::read(&path);
    let opts = ckpt::verify::VerifyOptions {
        deep: choice & 0x80 != 0,
        threads: 1,
        ..Default::default()
    };
    let _ = ckpt::verify::verify(&path, &opts);
});
