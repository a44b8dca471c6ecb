//! Blockwise-FP8 releases dequantized (DeepSeek-V3, Kimi K2, Qwen3-FP8): each `F8_E4M3` weight
//! with a `<name>_scale_inv` of one `F32` per `weight_block_size` tile becomes a tensor of the
//! values `fp8 × scale_inv` of its tile, computed in f32 and rounded to the dtype written
//! (bf16 unless `--dtype` says otherwise), exactly as DeepSeek's `weight_dequant` and its
//! `fp8_cast_bf16.py` make them. The scales are consumed.
//!
//! The values are computed where they are copied ([`crate::model::Compute`]), as a LoRA fold
//! is: the weight keeps its FP8 pieces, and each box the executor gathers of them is turned into
//! values with the scales of its tiles, read whole when the weight's first box is (a few floats
//! per tile). Memory stays a copy block per worker.

use std::sync::{Arc, Mutex};

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::exec::IoMode;
use crate::model::{Checkpoint, Compute, Computed, Tensor};
use crate::transform::{Report, Step};

/// The suffix a weight's scales are named with.
const SCALE_INV: &str = "_scale_inv";

/// `quantization_config.weight_block_size` of a blockwise-FP8 release.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Block {
    pub rows: u64,
    pub cols: u64,
}

/// The step: every FP8 weight with scales dequantized to `dtype`.
pub(crate) struct Dequantize {
    pub block: Block,
    /// The dtype the values are written as (what `--dtype` asks, bf16 by default).
    pub dtype: DType,
    pub io: IoMode,
}

impl Step for Dequantize {
    fn apply(&self, ckpt: Checkpoint, report: &mut Report) -> Result<Checkpoint> {
        let mut tensors = Vec::with_capacity(ckpt.tensors.len());
        let mut scales_of = std::collections::HashMap::new();
        for (i, t) in ckpt.tensors.iter().enumerate() {
            if let Some(weight) = t.name.strip_suffix(SCALE_INV) {
                scales_of.insert(weight.to_string(), i);
            }
        }
        let mut done = 0;
        for t in &ckpt.tensors {
            if t.name.ends_with(SCALE_INV) && t.dtype == DType::F32 {
                let weight = &t.name[..t.name.len() - SCALE_INV.len()];
                if ckpt.tensors.iter().any(|w| w.name == weight && is_fp8(w)) {
                    continue;
                }
            }
            if !is_fp8(t) {
                tensors.push(t.clone());
                continue;
            }
            let Some(&si) = scales_of.get(&t.name) else {
                return Err(Error::usage(format!(
                    "an {} weight without `{}{SCALE_INV}`: ckpt dequantizes blockwise FP8, whose scales name their weight",
                    t.dtype, t.name
                ))
                .tensor(&t.name));
            };
            tensors.push(self.dequantized(t, &ckpt.tensors[si], &ckpt)?);
            done += 1;
        }
        report.notes.push(format!(
            "dequantized {done} blockwise-FP8 weights ({}x{} tiles) to {}",
            self.block.rows, self.block.cols, self.dtype
        ));
        Ok(Checkpoint { tensors, ..ckpt })
    }
}

fn is_fp8(t: &Tensor) -> bool {
    t.dtype == DType::F8E4M3
}

impl Dequantize {
    /// `t` (FP8 codes) as a tensor of its values, computed from its pieces and `scales`.
    fn dequantized(&self, t: &Tensor, scales: &Tensor, ckpt: &Checkpoint) -> Result<Tensor> {
        let &[rows, cols] = &t.shape[..] else {
            return Err(Error::usage(format!(
                "a blockwise-FP8 weight is 2-D, and this one has shape {:?}",
                t.shape
            ))
            .tensor(&t.name));
        };
        let grid = [
            rows.div_ceil(self.block.rows),
            cols.div_ceil(self.block.cols),
        ];
        if scales.shape != grid || scales.dtype != DType::F32 {
            return Err(Error::usage(format!(
                "`{}` is {} {:?}, but a [{rows}, {cols}] weight in {}x{} tiles has F32 scales of shape {grid:?}",
                scales.name, scales.dtype, scales.shape, self.block.rows, self.block.cols
            ))
            .tensor(&scales.name)
            .hint("check config.json's quantization_config.weight_block_size"));
        }
        if t.pieces.computed().is_some() {
            return Err(Error::bug("an FP8 weight already computed").tensor(&t.name));
        }
        let compute = Dequantized {
            scales: Checkpoint {
                tensors: vec![scales.clone()],
                values: Vec::new(),
                unsupported: Vec::new(),
                details: Vec::new(),
                world_size: None,
                root: ckpt.root.clone(),
                format: ckpt.format,
            },
            grid_cols: grid[1],
            block: self.block,
            out: self.dtype,
            io: self.io,
            loaded: Mutex::new(None),
        };
        let mut pieces = t.pieces.clone();
        pieces.set_computed(Computed(Arc::new(compute)));
        Ok(Tensor {
            pieces,
            key_path: Vec::new(),
            ..t.clone()
        })
    }
}

/// One weight's values, box by box.
struct Dequantized {
    /// The scales alone, read whole on the first box.
    scales: Checkpoint,
    grid_cols: u64,
    block: Block,
    out: DType,
    io: IoMode,
    loaded: Mutex<Option<Arc<Vec<f32>>>>,
}

impl Dequantized {
    fn scales(&self) -> Result<Arc<Vec<f32>>> {
        let mut held = self.loaded.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = &*held {
            return Ok(s.clone());
        }
        let bytes = crate::exec::read_tensors(&self.scales, self.io)?
            .pop()
            .unwrap_or_default();
        let s: Arc<Vec<f32>> = Arc::new(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        );
        *held = Some(s.clone());
        Ok(s)
    }
}

impl Compute for Dequantized {
    fn compute(
        &self,
        start: &[u64],
        sizes: &[u64],
        src: &[u8],
        dst: &mut [u8],
        dst_dtype: DType,
    ) -> Result<()> {
        let (&[r0, c0], &[nr, nc]) = (start, sizes) else {
            return Err(Error::bug("an FP8 weight's box is not 2-D"));
        };
        if src.len() as u64 != nr * nc || dst.len() as u64 != nr * nc * dst_dtype.size() as u64 {
            return Err(Error::bug("an FP8 weight's box of the wrong size"));
        }
        let scales = self.scales()?;
        let mut row = vec![0f32; nc as usize];
        let es = dst_dtype.size();
        for i in 0..nr {
            let r = r0 + i;
            let codes = &src[(i * nc) as usize..((i + 1) * nc) as usize];
            let tiles = &scales[((r / self.block.rows) * self.grid_cols) as usize..];
            for (j, (v, &code)) in row.iter_mut().zip(codes).enumerate() {
                let s = tiles[((c0 + j as u64) / self.block.cols) as usize];
                *v = crate::cast::f8e4m3_to_f32(code) * s;
            }
            let f32s: Vec<u8> = row.iter().flat_map(|v| v.to_le_bytes()).collect();
            let out = &mut dst[(i * nc) as usize * es..((i + 1) * nc) as usize * es];
            crate::cast::convert(&f32s, DType::F32, out, dst_dtype);
        }
        Ok(())
    }

    fn out_dtype(&self) -> Option<DType> {
        Some(self.out)
    }
}
