//! Criterion benches of the hot paths BENCHMARKS.md quotes: the pickle parse of
//! a DCP `.metadata` (the reader's cost per piece at millions of pieces), the safetensors header
//! parse, and the `--dtype` casts (f32 -> bf16, f32 -> fp16, bf16 -> f32).
//!
//! `cargo bench --bench hot_paths` (add a filter such as `cast` to run one group). The inputs are
//! made here, with ckpt's own writers, so the benches need no fixture and no torch.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

use ckpt::cast;
use ckpt::dtype::DType;
use ckpt::formats::dcp::metadata::{
    self, Chunk, DcpEntry, DcpMetadata, MetadataIndex, StorageInfo,
};
use ckpt::formats::safetensors;
use ckpt::model::KeyPart;

/// The `.metadata` of an FSDP2 run: `tensors` bf16 tensors of [16 * ranks, 1024], each cut in
/// `ranks` row blocks (`Shard(0)`), one storage record per chunk in `__{rank}_0.distcp`.
fn fsdp2_metadata(tensors: usize, ranks: u64) -> DcpMetadata {
    let mut meta = DcpMetadata {
        entries: Vec::with_capacity(tensors),
        storage: Vec::with_capacity(tensors * ranks as usize),
        planner_data: Vec::with_capacity(tensors),
        version: Some("1.0.0".into()),
    };
    for t in 0..tensors {
        let fqn = format!("model.layers.{t}.weight");
        let chunks: Vec<Chunk> = (0..ranks)
            .map(|r| Chunk {
                offsets: vec![16 * r, 0],
                sizes: vec![16, 1024],
            })
            .collect();
        for (r, c) in chunks.iter().enumerate() {
            meta.storage.push((
                MetadataIndex {
                    fqn: fqn.clone(),
                    offset: Some(c.offsets.clone()),
                    index: Some(0),
                },
                StorageInfo {
                    relative_path: format!("__{r}_0.distcp"),
                    offset: t as u64 * 33_792,
                    length: 33_792,
                    transforms: Vec::new(),
                },
            ));
        }
        meta.entries.push(DcpEntry::Tensor {
            fqn: fqn.clone(),
            dtype: DType::BF16,
            size: vec![16 * ranks, 1024],
            chunks,
        });
        let path = vec![
            KeyPart::Key("model".into()),
            KeyPart::Key(format!("layers.{t}.weight")),
        ];
        meta.planner_data.push((fqn, path));
    }
    meta
}

fn dcp_metadata(c: &mut Criterion) {
    let mut group = c.benchmark_group("dcp_metadata_parse");
    group.sample_size(10);
    for (tensors, ranks) in [(64, 64), (256, 256)] {
        let bytes = metadata::write(&fsdp2_metadata(tensors, ranks));
        let pieces = tensors as u64 * ranks;
        group.throughput(Throughput::Elements(pieces));
        group.bench_with_input(BenchmarkId::new("pieces", pieces), &bytes, |b, bytes| {
            b.iter(|| metadata::parse(black_box(bytes)).unwrap())
        });
    }
    group.finish();
}

/// A safetensors file of `tensors` small f32 tensors; only its header is read, so the data is a
/// hole of the right length.
fn safetensors_file(dir: &std::path::Path, tensors: usize) -> std::path::PathBuf {
    let specs: Vec<(String, DType, Vec<u64>)> = (0..tensors)
        .map(|t| {
            (
                format!("model.layers.{}.mlp.w{}.weight", t / 4, t % 4),
                DType::F32,
                vec![4, 4],
            )
        })
        .collect();
    let (header, spans) = safetensors::header_bytes(&specs, &[("format".into(), "pt".into())]);
    let data_len = spans.last().map_or(0, |s| s.1);
    let path = dir.join(format!("{tensors}.safetensors"));
    let file = std::fs::File::create(&path).unwrap();
    std::io::Write::write_all(&mut &file, &header).unwrap();
    file.set_len(header.len() as u64 + data_len).unwrap();
    path
}

fn safetensors_header(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let mut group = c.benchmark_group("safetensors_header_parse");
    for tensors in [256, 4096] {
        let path = safetensors_file(dir.path(), tensors);
        group.throughput(Throughput::Elements(tensors as u64));
        group.bench_with_input(BenchmarkId::new("tensors", tensors), &path, |b, path| {
            b.iter(|| safetensors::read_header(black_box(path)).unwrap())
        });
    }
    group.finish();
}

fn casts(c: &mut Criterion) {
    // 1 Mi elements: 4 MiB of f32, past the L2 cache as the 8 MiB blocks of a real cast are.
    const N: usize = 1 << 20;
    let f32_bytes: Vec<u8> = (0..N)
        .flat_map(|i| ((i as f32 - 5e5) * 1.37e-3).to_le_bytes())
        .collect();
    let mut bf16_bytes = vec![0u8; N * 2];
    cast::convert(&f32_bytes, DType::F32, &mut bf16_bytes, DType::BF16);
    let mut group = c.benchmark_group("cast");
    group.throughput(Throughput::Elements(N as u64));
    for (name, src, from, to) in [
        ("f32_to_bf16", &f32_bytes, DType::F32, DType::BF16),
        ("f32_to_f16", &f32_bytes, DType::F32, DType::F16),
        ("bf16_to_f32", &bf16_bytes, DType::BF16, DType::F32),
    ] {
        let mut dst = vec![0u8; N * to.size()];
        group.bench_function(name, |b| {
            b.iter(|| cast::convert(black_box(src), from, &mut dst, to))
        });
    }
    group.finish();
}

criterion_group!(benches, dcp_metadata, safetensors_header, casts);
criterion_main!(benches);
