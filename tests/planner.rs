//! Property tests of the planner and executor on random checkpoints: every destination byte is
//! written exactly once, and resharding N -> M -> K then consolidating gives back the input.

// ckpt's error carries file, tensor, offset and hint; the library allows its size the same way.
#![allow(clippy::result_large_err)]

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use ckpt::dtype::DType;
use ckpt::exec::{self, ExecOptions, IoMode, NoProgress};
use ckpt::geometry::Placement;
use ckpt::model::{
    contiguous_strides, Checkpoint, DataRef, Encoding, Format, Piece, Pieces, Tensor,
};
use ckpt::plan::{self, MeshSpec, Plan, PlanOptions, Target};
use proptest::prelude::*;

fn dtype() -> impl Strategy<Value = DType> {
    prop::sample::select(DType::ALL.to_vec())
}

/// The dtypes safetensors holds (complex128, complex32 and packed fp4 it does not).
fn safetensors_dtype() -> impl Strategy<Value = DType> {
    let held: Vec<DType> = DType::ALL
        .into_iter()
        .filter(|d| d.safetensors_code().is_some())
        .collect();
    prop::sample::select(held)
}

/// Random tensors (name, dtype, shape) with small dims, zero-length ones and 0-dim ones included.
fn tensors() -> impl Strategy<Value = Vec<(DType, Vec<u64>)>> {
    prop::collection::vec((dtype(), prop::collection::vec(0u64..7, 0..4)), 1..6)
}

/// [`tensors`] of the dtypes safetensors holds.
fn safetensors_tensors() -> impl Strategy<Value = Vec<(DType, Vec<u64>)>> {
    prop::collection::vec(
        (safetensors_dtype(), prop::collection::vec(0u64..7, 0..4)),
        1..6,
    )
}

fn mesh() -> impl Strategy<Value = MeshSpec> {
    (
        prop::collection::vec(1usize..4, 1..3),
        prop::collection::vec(0usize..4, 2),
    )
        .prop_map(|(shape, dims)| {
            let placements = shape
                .iter()
                .zip(&dims)
                .map(|(_, &d)| {
                    if d == 3 {
                        Placement::Replicate
                    } else {
                        Placement::Shard(d)
                    }
                })
                .collect();
            MeshSpec {
                shape,
                placements,
                replicated: Default::default(),
            }
        })
}

/// A FULL checkpoint model over one virtual file: tensors back to back, row-major.
fn full_model(specs: &[(DType, Vec<u64>)]) -> Checkpoint {
    let mut offset = 0;
    let tensors = specs
        .iter()
        .enumerate()
        .map(|(i, (dtype, shape))| {
            let piece = Piece {
                offsets: vec![0; shape.len()],
                sizes: shape.clone(),
                data: DataRef {
                    file: std::path::Path::new("data").into(),
                    offset,
                    strides: contiguous_strides(shape),
                    encoding: Encoding::Raw,
                },
            };
            offset += shape.iter().product::<u64>() * dtype.size() as u64;
            Tensor {
                name: format!("t{i}"),
                key_path: vec![],
                dtype: *dtype,
                shape: shape.clone(),
                pieces: Pieces::single(piece).unwrap(),
            }
        })
        .collect();
    Checkpoint {
        root: PathBuf::from("/nonexistent"),
        format: Format::Safetensors,
        world_size: None,
        tensors,
        values: vec![],
        unsupported: vec![],
        details: Vec::new(),
    }
}

/// Every file of `plan` that is written from regions and literals (a streamed `.metadata` is not).
fn files(plan: &Plan) -> Vec<ckpt::plan::FilePlan> {
    (0..plan.file_count())
        .filter(|&i| !plan.is_streamed(i))
        .map(|i| plan.file(i).unwrap().into_owned())
        .collect()
}

/// How many times each byte of each destination file is written by `plan`.
fn write_counts(plan: &Plan) -> Vec<Vec<u32>> {
    files(plan)
        .iter()
        .map(|f| {
            let mut count = vec![0u32; f.len as usize];
            fn mark(count: &mut [u32], from: u64, len: u64) {
                for c in &mut count[from as usize..(from + len) as usize] {
                    *c += 1;
                }
            }
            f.for_each_literal(|at, bytes| {
                mark(&mut count, at, bytes.len() as u64);
                Ok(())
            })
            .unwrap();
            for r in &f.regions {
                // Each element of the region must be filled by exactly one fill.
                let strides = contiguous_strides(&r.shape);
                let elem = r.dtype.size() as u64;
                for fill in plan.fills(r, None).unwrap().iter() {
                    let n: u64 = fill.sizes.iter().product();
                    for k in 0..n {
                        let mut rest = k;
                        let mut at = 0;
                        for d in (0..fill.sizes.len()).rev() {
                            let i = rest % fill.sizes[d];
                            rest /= fill.sizes[d];
                            at += (fill.start[d] + i) * strides[d];
                        }
                        mark(&mut count, r.offset + at * elem, elem);
                    }
                }
            }
            count
        })
        .collect()
}

fn targets(mesh: MeshSpec) -> Vec<Target> {
    vec![
        Target::Safetensors {
            file_name: "m.safetensors".into(),
        },
        Target::SafetensorsSplit {
            max_shard_bytes: 40,
        },
        Target::TorchSave {
            file_name: "m.bin".into(),
        },
        Target::Dcp(mesh.clone()),
        Target::DcpSafetensors(mesh),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn every_destination_byte_is_written_exactly_once(specs in tensors(), mesh in mesh(), cast in any::<bool>()) {
        let model = full_model(&specs);
        let opts = PlanOptions { cast: cast.then_some(DType::BF16) };
        for target in targets(mesh.clone()) {
            let plan = plan::plan(&model, &target, &opts).unwrap();
            for i in (0..plan.file_count()).filter(|&i| !plan.is_streamed(i)) {
                // What partitioned runs lay their shares out by, without planning regions.
                prop_assert_eq!(plan.file_len(i), plan.file(i).unwrap().len, "{:?} file {}", target, i);
            }
            for (f, counts) in files(&plan).iter().zip(write_counts(&plan)) {
                // A CRC is patched into framing bytes (a literal) after its region is written.
                let mut literals = Vec::new();
                f.for_each_literal(|at, b| {
                    literals.push((at, at + b.len() as u64));
                    Ok(())
                })
                .unwrap();
                for slot in f.regions.iter().flat_map(|r| &r.crc_slots) {
                    prop_assert!(literals.iter().any(|&(at, end)| at <= *slot && slot + 4 <= end));
                }
                let bad = counts.iter().position(|&c| c != 1);
                prop_assert!(bad.is_none(), "{target:?}: `{}` byte {bad:?} written {:?} times", f.path.display(), bad.map(|b| counts[b]));
            }
        }
    }
}

fn run(input: &Path, output: &Path, target: Target) {
    let ckpt = ckpt::detect::read(input).unwrap();
    let plan = plan::plan(&ckpt, &target, &PlanOptions::default()).unwrap();
    std::fs::create_dir_all(output).unwrap();
    let dest: Vec<PathBuf> = plan.paths().iter().map(|p| output.join(p)).collect();
    let cancel = AtomicBool::new(false);
    let opts = ExecOptions {
        threads: 2,
        io: IoMode::Mmap,
        progress: &NoProgress,
        cancel: &cancel,
        durable: false,
    };
    exec::execute(&plan, &dest, &opts).unwrap();
}

fn world(n: usize) -> MeshSpec {
    MeshSpec {
        shape: vec![n],
        placements: vec![Placement::Shard(0)],
        replicated: Default::default(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]

    #[test]
    fn resharding_n_m_k_then_consolidating_is_the_identity(
        specs in safetensors_tensors(),
        n in 1usize..6, m in mesh(), k in 1usize..6,
        seed in any::<u64>(),
    ) {
        let tmp = tempfile::tempdir().unwrap();
        // A FULL safetensors input with random bytes.
        let entries: Vec<(String, DType, Vec<u64>)> =
            specs.iter().enumerate().map(|(i, (d, s))| (format!("t{i}"), *d, s.clone())).collect();
        let (header, ranges) = ckpt::formats::safetensors::header_bytes(&entries, &[]);
        let data_len = ranges.last().map_or(0, |r| r.1) as usize;
        let mut state = seed | 1;
        let data: Vec<u8> = (0..data_len).map(|_| { state ^= state << 13; state ^= state >> 7; state ^= state << 17; state as u8 }).collect();
        let input = tmp.path().join("in.safetensors");
        std::fs::write(&input, [header, data.clone()].concat()).unwrap();

        let (a, b, c, full) = (tmp.path().join("a"), tmp.path().join("b"), tmp.path().join("c"), tmp.path().join("full"));
        run(&input, &a, Target::Dcp(world(n)));
        run(&a, &b, Target::DcpSafetensors(m));
        run(&b, &c, Target::Dcp(world(k)));
        run(&c, &full, Target::Safetensors { file_name: "out.safetensors".into() });
        let out = std::fs::read(full.join("out.safetensors")).unwrap();
        prop_assert_eq!(&out[out.len() - data_len..], &data[..]);
        let back = ckpt::detect::read(&full.join("out.safetensors")).unwrap();
        let shapes: Vec<(DType, Vec<u64>)> = back.tensors.iter().map(|t| (t.dtype, t.shape.clone())).collect();
        prop_assert_eq!(shapes, specs);
    }
}

/// Every file under `dir`, relative, with its bytes.
fn tree(dir: &Path) -> std::collections::BTreeMap<PathBuf, Vec<u8>> {
    let mut out = std::collections::BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.insert(
                    p.strip_prefix(dir).unwrap().to_path_buf(),
                    std::fs::read(&p).unwrap(),
                );
            }
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(60))]

    /// A plan executed as N shares (cut every `align` bytes: inside headers, CRC slots and
    /// regions alike), in reverse order into shared files, then finished as a committer does
    /// (streamed files, CRCs that span parts), gives the bytes of one run, for every target.
    #[test]
    fn parts_of_a_plan_write_the_bytes_of_one_run(
        specs in safetensors_tensors(),
        mesh in mesh(),
        count in 1usize..7,
        align in prop::sample::select(vec![1u64, 3, 64]),
        seed in any::<u64>(),
    ) {
        let tmp = tempfile::tempdir().unwrap();
        let entries: Vec<(String, DType, Vec<u64>)> =
            specs.iter().enumerate().map(|(i, (d, s))| (format!("t{i}"), *d, s.clone())).collect();
        let (header, ranges) = ckpt::formats::safetensors::header_bytes(&entries, &[]);
        let data_len = ranges.last().map_or(0, |r| r.1) as usize;
        let mut state = seed | 1;
        let data: Vec<u8> = (0..data_len).map(|_| { state ^= state << 13; state ^= state >> 7; state ^= state << 17; state as u8 }).collect();
        let input = tmp.path().join("in.safetensors");
        std::fs::write(&input, [header, data].concat()).unwrap();
        let ckpt = ckpt::detect::read(&input).unwrap();
        let cancel = AtomicBool::new(false);
        let opts = ExecOptions {
            threads: 2,
            io: IoMode::Mmap,
            progress: &NoProgress,
            cancel: &cancel,
            durable: false,
        };
        for (t, target) in targets(mesh).into_iter().enumerate() {
            let plan = plan::plan(&ckpt, &target, &PlanOptions::default()).unwrap();
            let (one, parts) = (tmp.path().join(format!("one{t}")), tmp.path().join(format!("parts{t}")));
            let dest_one: Vec<PathBuf> = plan.paths().iter().map(|p| one.join(p)).collect();
            exec::execute(&plan, &dest_one, &opts).unwrap();

            let lens: Vec<u64> = (0..plan.file_count())
                .map(|i| if plan.is_streamed(i) { 0 } else { plan.file_len(i) })
                .collect();
            let dest: Vec<PathBuf> = plan.paths().iter().map(|p| parts.join(p)).collect();
            std::fs::create_dir_all(&parts).unwrap();
            let (mut crcs, mut slots) = (Vec::new(), Vec::new());
            for index in (0..count).rev() {
                let share = ckpt::part::share_aligned(&lens, ckpt::part::PartSpec { index, count }, align);
                let outcome = exec::execute_share(&plan, &dest, &share, &opts).unwrap();
                crcs.extend(outcome.crcs);
                slots.extend(outcome.open_slots);
            }
            exec::write_streamed_files(&plan, &dest, false, &Default::default()).unwrap();
            exec::patch_crcs(&dest, &crcs, &slots, false).unwrap();
            let (a, b) = (tree(&one), tree(&parts));
            prop_assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>(), "{:?}", target);
            for (path, bytes) in &a {
                prop_assert!(bytes == &b[path], "{:?} in {} parts every {} bytes: `{}` differs", target, count, align, path.display());
            }
        }
    }
}
