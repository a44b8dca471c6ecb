//! Blockwise FP8 weights (`--quantize fp8-block`): a step after the export to Hugging Face
//! names, like [`crate::transform::hf_export::apply`], that turns each linear weight of attention, MLPs and
//! experts into an `F8_E4M3` tensor and an `F32` `<name>_scale_inv` of one scale per 128×128
//! tile, the format DeepSeek-V3 and Qwen3-FP8 ship and vLLM, SGLang and transformers load.
//!
//! Both are computed where they are copied ([`crate::model::Compute`]), as a LoRA fold is, so
//! the quantizer streams: the FP8 weight keeps its source's pieces and asks the executor for
//! boxes of whole 128-row bands, whose scales it computes from the rows the box holds; the
//! scales are a tensor of their own, which may land in another file or another `--part`'s
//! share, so they take the scales the weight's boxes computed where those are done, and read
//! the other bands again (one band of 128 rows at a time) rather than wait for them. Memory
//! stays one copy block per worker and a few floats per band. The arithmetic is in [`quant`].

pub(crate) mod dequant;
pub(crate) mod quant;

use std::collections::BTreeSet;
use std::sync::Arc;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::exec::IoMode;
use crate::model::{Checkpoint, Compute, Computed, Pieces, Tensor};
use quant::TILE;

/// What `--quantize fp8-block` adds to config.json and why a module was kept.
pub(crate) struct Quantized {
    /// Modules whose weights were left in `--dtype`, by full module path (embeddings, norms,
    /// routers, the head), for `quantization_config.modules_to_not_convert`.
    pub not_converted: Vec<String>,
}

/// The usage error of `--quantize` without `--hf-config`, which the CLI gives before reading
/// anything and the library gives too.
pub(crate) fn needs_hf_config() -> Error {
    Error::usage(
        "--quantize fp8-block writes a Hugging Face model directory, so it needs --hf-config",
    )
    .hint("pass --hf-config HF: the model directory (or its config.json) of the checkpoint; for a Hugging Face model directory, that directory itself")
}

/// config.json's `quantization_config` for blockwise FP8 with `not_converted` kept.
pub(crate) fn quantization_config(not_converted: &[String]) -> serde_json::Value {
    serde_json::json!({
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [TILE, TILE],
        "modules_to_not_convert": not_converted,
    })
}

/// Quantize the tensors of `ckpt` named in `linear` (each followed by its scales); every other
/// tensor is kept as it is, its module listed as not converted.
///
/// `cast` is `--dtype`: a weight is quantized from the values the export would write without
/// `--quantize` (an f32 weight exported `--dtype bf16` from its bf16 values), so that the FP8
/// codes and scales are those of quantizing the plain export, as a released FP8 model is made
/// from its bf16 one.
pub(crate) fn apply(
    ckpt: Checkpoint,
    linear: &BTreeSet<String>,
    cast: Option<DType>,
    io: IoMode,
) -> Result<(Checkpoint, Quantized)> {
    let mut tensors = Vec::with_capacity(ckpt.tensors.len() + linear.len());
    let mut not_converted = Vec::new();
    for t in &ckpt.tensors {
        if !linear.contains(&t.name) {
            if let Some(module) = t.name.strip_suffix(".weight") {
                not_converted.push(module.to_string());
            }
            tensors.push(t.clone());
            continue;
        }
        let (weight, scales) = quantized(t, &ckpt, cast, io)?;
        tensors.push(weight);
        tensors.push(scales);
    }
    Ok((Checkpoint { tensors, ..ckpt }, Quantized { not_converted }))
}

/// The FP8 weight and the scales of `t`.
fn quantized(
    t: &Tensor,
    ckpt: &Checkpoint,
    cast: Option<DType>,
    io: IoMode,
) -> Result<(Tensor, Tensor)> {
    let &[rows, cols] = &t.shape[..] else {
        return Err(Error::usage(format!(
            "a linear weight is quantized as a 2-D tensor, and this one has shape {:?}",
            t.shape
        ))
        .tensor(&t.name));
    };
    if !matches!(t.dtype, DType::F32 | DType::BF16 | DType::F16) {
        return Err(Error::usage(format!(
            "fp8-block quantizes f32, bf16 or f16 weights, not {}",
            t.dtype
        ))
        .tensor(&t.name)
        .hint("an already quantized model needs no --quantize"));
    }
    let weight = Arc::new(Weight {
        alone: Checkpoint {
            root: ckpt.root.clone(),
            format: ckpt.format,
            world_size: None,
            tensors: vec![t.clone()],
            values: Vec::new(),
            unsupported: Vec::new(),
            details: Vec::new(),
        },
        dtype: t.dtype,
        values: match cast {
            Some(d @ (DType::F32 | DType::BF16 | DType::F16)) => d,
            _ => t.dtype,
        },
        rows,
        cols,
        io,
        computed: Default::default(),
    });
    let mut pieces = t.pieces.clone();
    let inner = t.pieces.computed().cloned();
    pieces.set_computed(Computed(Arc::new(Fp8Weight {
        w: weight.clone(),
        inner,
    })));
    let grid = [rows.div_ceil(TILE), cols.div_ceil(TILE)];
    let mut scale_pieces = corners(t, grid)?;
    scale_pieces.set_computed(Computed(Arc::new(Fp8Scales { w: weight })));
    Ok((
        Tensor {
            pieces,
            key_path: Vec::new(),
            ..t.clone()
        },
        Tensor {
            name: format!("{}_scale_inv", t.name),
            key_path: Vec::new(),
            dtype: t.dtype,
            shape: grid.to_vec(),
            pieces: scale_pieces,
        },
    ))
}

/// Pieces for the scale grid of `t`: scale (i, j) reads the weight's element (128 i, 128 j),
/// through views of the weight's own pieces with strides 128 times theirs. The scales are
/// computed from whole bands ([`Fp8Scales`]), not from these elements; the pieces only give the
/// planner a tensor of the grid's shape with each element sourced once, wherever the weight is.
fn corners(t: &Tensor, grid: [u64; 2]) -> Result<Pieces> {
    let elem = t.dtype.size() as u64;
    let mut out = Pieces::new(2);
    for p in t.pieces.iter() {
        let (o, s) = (p.offsets(), p.sizes());
        let first = |d: usize| o[d].div_ceil(TILE);
        let end = |d: usize| (o[d] + s[d]).div_ceil(TILE).min(grid[d]);
        let (i0, j0) = (first(0), first(1));
        let (i1, j1) = (end(0), end(1));
        if i0 >= i1 || j0 >= j1 {
            continue;
        }
        let st = p.strides();
        let skip = (i0 * TILE - o[0]) * st[0] + (j0 * TILE - o[1]) * st[1];
        out.push_parts(
            &[i0, j0],
            &[i1 - i0, j1 - j0],
            Arc::clone(p.file()),
            p.offset() + skip * elem,
            &[st[0] * TILE, st[1] * TILE],
            p.encoding(),
        )?;
    }
    Ok(out)
}

/// A weight being quantized: what reading a band of its rows needs.
struct Weight {
    /// The weight alone (named as it is), with a LoRA fold's computation if it has one: bands
    /// are read as merged values.
    alone: Checkpoint,
    /// The dtype of the weight's elements as read (after a LoRA fold).
    dtype: DType,
    /// The dtype whose values are quantized: `--dtype` when it is a float the quantizer takes,
    /// else [`Weight::dtype`].
    values: DType,
    rows: u64,
    cols: u64,
    io: IoMode,
    /// Scales of bands the FP8 weight has computed and its scales not yet written, by band:
    /// the scales' tensor comes after the weight, so it mostly finds its bands here instead of
    /// reading them again.
    computed: std::sync::Mutex<std::collections::HashMap<u64, Vec<f32>>>,
}

impl Weight {
    fn cache(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<u64, Vec<f32>>> {
        self.computed.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The scales of band `band` (rows `128 band ..`), one per 128-column tile, read from the
    /// weight.
    fn band_scales(&self, band: u64) -> Result<Vec<f32>> {
        let r0 = band * TILE;
        let n = TILE.min(self.rows.saturating_sub(r0));
        let bytes = crate::exec::read_box(&self.alone, 0, &[r0, 0], &[n, self.cols], self.io)?;
        let values = self.values_of(&bytes);
        Ok(quant::band_scales(
            &values,
            self.values,
            n as usize,
            self.cols as usize,
        ))
    }

    /// Elements read as [`Weight::dtype`] as the values quantized ([`Weight::values`]).
    fn values_of<'a>(&self, src: &'a [u8]) -> std::borrow::Cow<'a, [u8]> {
        if self.values == self.dtype {
            return std::borrow::Cow::Borrowed(src);
        }
        let n = src.len() / self.dtype.size();
        let mut out = vec![0u8; n * self.values.size()];
        crate::cast::convert(src, self.dtype, &mut out, self.values);
        std::borrow::Cow::Owned(out)
    }
}

/// The FP8 values of a weight, box by box.
struct Fp8Weight {
    w: Arc<Weight>,
    /// A LoRA fold that makes the values quantized from the pieces' (fold, then quantize).
    inner: Option<Computed>,
}

impl Compute for Fp8Weight {
    fn compute(
        &self,
        start: &[u64],
        sizes: &[u64],
        src: &[u8],
        dst: &mut [u8],
        dst_dtype: DType,
    ) -> Result<()> {
        let w = &self.w;
        let (&[r0, c0], &[nr, nc]) = (start, sizes) else {
            return Err(Error::bug("an fp8 weight's box is not 2-D"));
        };
        if dst_dtype != DType::F8E4M3 || dst.len() as u64 != nr * nc {
            return Err(Error::bug(format!(
                "an fp8 weight's box written as {dst_dtype} in {} bytes",
                dst.len()
            )));
        }
        let folded;
        let src = match &self.inner {
            Some(c) => {
                let mut out = vec![0u8; src.len()];
                c.0.compute(start, sizes, src, &mut out, w.dtype)?;
                folded = out;
                &folded[..]
            }
            None => src,
        };
        let values = w.values_of(src);
        let (src, dtype) = (&values[..], w.values);
        let (b0, b1) = (r0 / TILE, (r0 + nr).div_ceil(TILE));
        // A box of whole bands, full width (as the executor cuts them: `block_rows`) holds every
        // value its scales need; any other box reads its bands again.
        let whole = r0 % TILE == 0
            && ((r0 + nr) % TILE == 0 || r0 + nr == w.rows)
            && c0 == 0
            && nc == w.cols;
        let es = dtype.size() as u64;
        let scales: Vec<Vec<f32>> = (b0..b1)
            .map(|b| match whole {
                true => {
                    let lo = (b * TILE - r0) * nc * es;
                    let n = TILE.min(r0 + nr - b * TILE);
                    let band = &src[lo as usize..(lo + n * nc * es) as usize];
                    let scales = quant::band_scales(band, dtype, n as usize, nc as usize);
                    w.cache().insert(b, scales.clone());
                    Ok(scales)
                }
                false => w.band_scales(b),
            })
            .collect::<Result<_>>()?;
        quant::quantize_rows(
            src,
            dtype,
            nr as usize,
            nc as usize,
            c0 as usize,
            |i| &scales[((r0 + i as u64) / TILE - b0) as usize],
            dst,
        );
        Ok(())
    }

    fn out_dtype(&self) -> Option<DType> {
        Some(DType::F8E4M3)
    }

    fn block_rows(&self) -> u64 {
        TILE
    }
}

/// The scales of a weight, box by box of the grid, each band of the weight read once.
struct Fp8Scales {
    w: Arc<Weight>,
}

impl Compute for Fp8Scales {
    fn compute(
        &self,
        start: &[u64],
        sizes: &[u64],
        _corners: &[u8],
        dst: &mut [u8],
        dst_dtype: DType,
    ) -> Result<()> {
        let (&[i0, j0], &[ni, nj]) = (start, sizes) else {
            return Err(Error::bug("an fp8 scale box is not 2-D"));
        };
        if dst_dtype != DType::F32 || dst.len() as u64 != ni * nj * 4 {
            return Err(Error::bug("fp8 scales are not written as f32"));
        }
        for (k, band) in (i0..i0 + ni).enumerate() {
            let cached = self.w.cache().remove(&band);
            let scales = match cached {
                Some(s) => s,
                None => self.w.band_scales(band)?,
            };
            let row = &mut dst[k * nj as usize * 4..(k + 1) * nj as usize * 4];
            for (o, j) in row.chunks_exact_mut(4).zip(j0..j0 + nj) {
                let s = scales.get(j as usize).copied().unwrap_or(1.0);
                o.copy_from_slice(&s.to_le_bytes());
            }
        }
        Ok(())
    }

    fn out_dtype(&self) -> Option<DType> {
        Some(DType::F32)
    }
}

#[cfg(test)]
mod tests;
