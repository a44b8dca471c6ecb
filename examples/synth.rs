//! Writes a synthetic FULL bf16 checkpoint (one safetensors file) with Llama-like shapes, for
//! benchmarks: `cargo run --release --example synth -- --size 4GB --out PATH.safetensors [--seed N]
//! [--layers L]`, or N tensors of one shape: `synth --tensors N --shape AxB[xC..] --out PATH
//! [--dtype bf16|f16|f32] [--seed N]`.
//!
//! The model is scaled to the requested size: the widest hidden size (from a fixed ladder) that
//! still gives at least 16 layers, then as many layers as fit. At 2.7GB this is TinyLlama-like
//! (d=2048, ffn=5632, vocab 32000, 24 layers, 219 tensors), the shape of the reference figures.
//! `--layers L` fixes the layer count (so the tensor count, 3 + 9L) and picks the hidden size, a
//! multiple of 64, instead: inputs of different sizes then differ only in bytes, which is what a
//! memory-flatness check needs.
//! `--tensors N --shape AxB` writes N tensors `layers.{i}.weight` (i = 0..N) of that shape instead,
//! in that order, for many-piece inputs (2048 tensors of [1024, 32] resharded to 1024 ranks is
//! 2,097,152 pieces); `--dtype` picks bf16 (default), f16 or f32 for them.
//! Bytes are xorshift noise with the top exponent bit cleared, so every value is finite
//! (|x| < 2) and `ckpt verify --deep` stays quiet. Memory is bounded: one 8 MiB buffer.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use ckpt::dtype::DType;

const VOCAB: u64 = 32_000;
const DIMS: [u64; 11] = [
    256, 512, 768, 1024, 1536, 2048, 2560, 3072, 4096, 5120, 8192,
];
const MIN_LAYERS: u64 = 16;
const BUF: usize = 8 << 20;

const USAGE: &str = "usage: synth --size 4GB --out PATH.safetensors [--seed N] [--layers L]\n       \
                     synth --tensors N --shape AxB[xC..] --out PATH.safetensors [--dtype bf16|f16|f32] [--seed N]";

/// What to write: a Llama-like model scaled to a size, or `count` tensors of one shape.
enum Model {
    Llama {
        size: u64,
        layers: Option<u64>,
    },
    Uniform {
        count: u64,
        shape: Vec<u64>,
        dtype: DType,
    },
}

struct Args {
    model: Model,
    out: PathBuf,
    seed: u64,
}

/// `1024x32` -> [1024, 32]; every dimension at least 1.
fn parse_shape(s: &str) -> Result<Vec<u64>, String> {
    s.split(['x', 'X'])
        .map(|d| match d.trim().parse::<u64>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!(
                "--shape: `{s}` is not AxB[xC..] of positive integers"
            )),
        })
        .collect()
}

fn parse_args() -> Result<Args, String> {
    let mut size = None;
    let mut out = None;
    let mut seed = 0u64;
    let mut layers = None;
    let mut count = None;
    let mut shape = None;
    let mut dtype = None;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--size" => size = Some(ckpt::cli::parse_size(&value()?)?),
            "--out" | "-o" => out = Some(PathBuf::from(value()?)),
            "--seed" => seed = value()?.parse().map_err(|e| format!("--seed: {e}"))?,
            "--layers" => {
                let n: u64 = value()?.parse().map_err(|e| format!("--layers: {e}"))?;
                layers = Some(n.max(1));
            }
            "--tensors" => {
                let n: u64 = value()?.parse().map_err(|e| format!("--tensors: {e}"))?;
                count = Some(n);
            }
            "--shape" => shape = Some(parse_shape(&value()?)?),
            "--dtype" => {
                let v = value()?;
                let d = DType::parse(&v)
                    .filter(|d| matches!(d, DType::BF16 | DType::F16 | DType::F32))
                    .ok_or_else(|| format!("--dtype: `{v}` is not one of bf16, f16, f32"))?;
                dtype = Some(d);
            }
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    let out = out.ok_or("--out is required")?;
    let model = match (count, shape) {
        (Some(count), Some(shape)) => {
            if size.is_some() || layers.is_some() {
                return Err("--tensors/--shape do not go with --size/--layers".into());
            }
            Model::Uniform {
                count,
                shape,
                dtype: dtype.unwrap_or(DType::BF16),
            }
        }
        (Some(_), None) | (None, Some(_)) => return Err("--tensors and --shape go together".into()),
        (None, None) => {
            if dtype.is_some() {
                return Err("--dtype goes with --tensors/--shape".into());
            }
            Model::Llama {
                size: size.ok_or("--size (or --tensors with --shape) is required")?,
                layers,
            }
        }
    };
    Ok(Args { model, out, seed })
}

/// Llama's feed-forward width: 2/3 of 4d, rounded up to a multiple of 256.
fn ffn_of(d: u64) -> u64 {
    (8 * d / 3).div_ceil(256) * 256
}

/// Bytes of one layer and of everything else, in bf16.
fn bytes_of(d: u64) -> (u64, u64) {
    let per_layer = 2 * (4 * d * d + 3 * d * ffn_of(d) + 2 * d);
    let fixed = 2 * (2 * VOCAB * d + d);
    (per_layer, fixed)
}

/// (hidden size, layers) whose bf16 total is closest to `size` under the rule in the module doc.
fn scale(size: u64, layers: Option<u64>) -> (u64, u64) {
    if let Some(layers) = layers {
        let total = |d: u64| {
            let (per_layer, fixed) = bytes_of(d);
            fixed + layers * per_layer
        };
        let d = (1..=1024u64)
            .map(|k| 64 * k)
            .min_by_key(|&d| total(d).abs_diff(size))
            .unwrap_or(64);
        return (d, layers);
    }
    let fit = |d: u64| {
        let (per_layer, fixed) = bytes_of(d);
        let layers = (size.saturating_sub(fixed) + per_layer / 2) / per_layer;
        (d, layers.max(1))
    };
    DIMS.iter()
        .rev()
        .map(|&d| fit(d))
        .find(|&(_, layers)| layers >= MIN_LAYERS)
        .unwrap_or_else(|| fit(DIMS[0]))
}

fn tensors(d: u64, layers: u64) -> Vec<(String, DType, Vec<u64>)> {
    let ffn = ffn_of(d);
    let mut t = vec![(
        "model.embed_tokens.weight".to_string(),
        DType::BF16,
        vec![VOCAB, d],
    )];
    for i in 0..layers {
        let p = format!("model.layers.{i}");
        for w in ["q", "k", "v", "o"] {
            t.push((
                format!("{p}.self_attn.{w}_proj.weight"),
                DType::BF16,
                vec![d, d],
            ));
        }
        t.push((
            format!("{p}.mlp.gate_proj.weight"),
            DType::BF16,
            vec![ffn, d],
        ));
        t.push((format!("{p}.mlp.up_proj.weight"), DType::BF16, vec![ffn, d]));
        t.push((
            format!("{p}.mlp.down_proj.weight"),
            DType::BF16,
            vec![d, ffn],
        ));
        t.push((format!("{p}.input_layernorm.weight"), DType::BF16, vec![d]));
        t.push((
            format!("{p}.post_attention_layernorm.weight"),
            DType::BF16,
            vec![d],
        ));
    }
    t.push(("model.norm.weight".to_string(), DType::BF16, vec![d]));
    t.push(("lm_head.weight".to_string(), DType::BF16, vec![VOCAB, d]));
    t
}

/// xorshift64*, seeded through splitmix64 so that seed 0 works.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Rng((z ^ (z >> 31)) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Random finite values under `mask`: clearing the top exponent bit keeps every exponent
    /// below all ones (bit 14 of each u16 for bf16 and f16, bit 30 of each u32 for f32).
    fn fill(&mut self, buf: &mut [u8], mask: u64) {
        for chunk in buf.chunks_exact_mut(8) {
            let v = self.next() & mask;
            chunk.copy_from_slice(&v.to_le_bytes());
        }
    }
}

fn uniform(count: u64, shape: &[u64], dtype: DType) -> Vec<(String, DType, Vec<u64>)> {
    (0..count)
        .map(|i| (format!("layers.{i}.weight"), dtype, shape.to_vec()))
        .collect()
}

fn run(args: &Args) -> std::io::Result<()> {
    let (tensors, what) = match &args.model {
        Model::Llama { size, layers } => {
            let (d, layers) = scale(*size, *layers);
            let what = format!("d={d} ffn={} vocab={VOCAB} layers={layers}", ffn_of(d));
            (tensors(d, layers), what)
        }
        Model::Uniform {
            count,
            shape,
            dtype,
        } => {
            let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
            let what = format!("{dtype} [{}] each", dims.join(", "));
            (uniform(*count, shape, *dtype), what)
        }
    };
    let mask = match &args.model {
        Model::Uniform {
            dtype: DType::F32, ..
        } => 0xBFFF_FFFF_BFFF_FFFF,
        _ => 0xBFFF_BFFF_BFFF_BFFF,
    };
    let meta = [("format".to_string(), "pt".to_string())];
    let (header, ranges) = ckpt::formats::safetensors::header_bytes(&tensors, &meta);
    let data = ranges.last().map_or(0, |r| r.1);
    let mut out = BufWriter::with_capacity(BUF, File::create(&args.out)?);
    out.write_all(&header)?;
    let mut rng = Rng::new(args.seed);
    let mut buf = vec![0u8; BUF];
    let mut left = data;
    while left > 0 {
        let n = left.min(BUF as u64) as usize;
        rng.fill(&mut buf[..n], mask);
        out.write_all(&buf[..n])?;
        left -= n as u64;
    }
    out.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    println!(
        "{}: {} tensors, {what}, {} bytes ({} of data)",
        args.out.display(),
        tensors.len(),
        header.len() as u64 + data,
        data
    );
    Ok(())
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("synth: {e}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("synth: `{}`: {e}", args.out.display());
            ExitCode::FAILURE
        }
    }
}
