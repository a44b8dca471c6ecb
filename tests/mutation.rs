//! Damaged checkpoints never make ckpt panic: each fixture's bytes are mutated 1000 times and
//! `inspect`'s reader and `verify` (deep every tenth case) must return, sound or not.

use std::path::{Path, PathBuf};

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

fn files_of(path: &Path) -> Vec<PathBuf> {
    if path.is_dir() {
        let mut v: Vec<PathBuf> = std::fs::read_dir(path)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        v.sort();
        v
    } else {
        vec![path.to_path_buf()]
    }
}

fn fuzz_fixture(name: &str) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name);
    let tmp = tempfile::tempdir().unwrap();
    let dst = tmp.path().join(name);
    let originals: Vec<(PathBuf, Vec<u8>)> = files_of(&src)
        .into_iter()
        .map(|f| {
            let bytes = std::fs::read(&f).unwrap();
            let rel = f.strip_prefix(&src).unwrap();
            (
                if rel.as_os_str().is_empty() {
                    dst.clone()
                } else {
                    dst.join(rel)
                },
                bytes,
            )
        })
        .collect();
    if src.is_dir() {
        std::fs::create_dir_all(&dst).unwrap();
    }
    let dst = if src.is_dir() {
        dst
    } else {
        originals[0].0.clone()
    };
    let mut runner = TestRunner::new(Config {
        cases: 1000,
        failure_persistence: None,
        ..Config::default()
    });
    let strategy = (
        0..originals.len(),
        prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        prop::option::weighted(0.2, any::<prop::sample::Index>()),
        0u32..10,
    );
    let case = std::cell::Cell::new(0u32);
    runner
        .run(&strategy, |(which, edits, truncate, deep)| {
            for (path, bytes) in &originals {
                std::fs::write(path, bytes).unwrap();
            }
            let (path, bytes) = &originals[which];
            let mut damaged = bytes.clone();
            if !damaged.is_empty() {
                for (pos, value) in edits {
                    let i = pos.index(damaged.len());
                    damaged[i] = value;
                }
                if let Some(cut) = truncate {
                    damaged.truncate(cut.index(damaged.len()));
                }
            }
            std::fs::write(path, &damaged).unwrap();
            case.set(case.get() + 1);
            let _ = ckpt::detect::read(&dst);
            let opts = ckpt::verify::VerifyOptions {
                deep: deep == 0,
                threads: 1,
                ..Default::default()
            };
            let _ = ckpt::verify::verify(&dst, &opts);
            Ok(())
        })
        .unwrap();
    assert_eq!(case.get(), 1000);
}

#[test]
fn mutated_dcp_never_panics() {
    fuzz_fixture("fsdp2_adamw");
}

#[test]
fn mutated_mesh_never_panics() {
    fuzz_fixture("mesh_2x2");
}

#[test]
fn mutated_dtypes_never_panics() {
    fuzz_fixture("dtypes");
}

#[test]
fn mutated_dcp_safetensors_never_panics() {
    fuzz_fixture("dcp_hf");
}

#[test]
fn mutated_zstd_dcp_never_panics() {
    fuzz_fixture("dcp_zstd");
}

#[test]
fn mutated_safetensors_never_panics() {
    fuzz_fixture("single.safetensors");
}

#[test]
fn mutated_split_never_panics() {
    fuzz_fixture("hf_split");
}

#[test]
fn mutated_torch_save_never_panics() {
    fuzz_fixture("torch_save.bin");
}

#[test]
fn mutated_per_rank_dtensor_files_never_panic() {
    fuzz_fixture("per_rank_mesh_2x2");
}

#[test]
fn mutated_per_rank_sharded_tensor_files_never_panic() {
    fuzz_fixture("per_rank_fsdp1");
}
