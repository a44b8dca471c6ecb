//! Where each box of a tensor comes from: the checkpoint's input files, numbered once, and an
//! index of each tensor's pieces, checked to cover it exactly once.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use super::torch_save::archive_into;
use super::{FilePlan, Fill, PlanOptions, Region, RegionSource};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::formats::torch_save;
use crate::geometry::{self, NdBox};
use crate::model::{Checkpoint, Encoding, NonTensor, PieceRef, Tensor};

/// The dtype `t` is written as under `cast`: its computation's own ([`crate::model::Compute`]),
/// else the cast for floating-point tensors.
pub(super) fn out_dtype(t: &Tensor, cast: Option<DType>) -> DType {
    if let Some(d) = t.pieces.computed().and_then(|c| c.0.out_dtype()) {
        return d;
    }
    match cast {
        Some(to) if t.dtype.is_float() => to,
        _ => t.dtype,
    }
}

/// Where each tensor's bytes come from: the checkpoint, its input files numbered once, and an
/// index of each tensor's pieces. All a [`Region`] needs, and read-only, so rank files can be
/// planned one at a time long after planning started.
pub(super) struct Sourcing<'a> {
    pub(super) ckpt: &'a Checkpoint,
    pub(super) cast: Option<DType>,
    /// Absolute paths, in the order the checkpoint first names them.
    pub(super) inputs: Vec<PathBuf>,
    /// Index into `inputs` of each file, as the checkpoint names it (relative).
    input_of: HashMap<&'a Path, usize>,
    /// One per tensor of `ckpt`.
    indexes: Vec<PieceIndex>,
}

impl<'a> Sourcing<'a> {
    pub(super) fn new(ckpt: &'a Checkpoint, opts: &PlanOptions) -> Result<Sourcing<'a>> {
        let indexes = ckpt
            .tensors
            .iter()
            .map(|t| {
                check_tensor(t)?;
                Ok(PieceIndex::new(t))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut inputs = Vec::new();
        let mut input_of = HashMap::new();
        let pieces = ckpt.tensors.iter().flat_map(|t| t.pieces.iter());
        let files = pieces.map(|p| &**p.file()).chain(
            ckpt.values
                .iter()
                .filter_map(|v| Some(v.raw.as_ref()?.file.as_path())),
        );
        for file in files {
            input_of.entry(file).or_insert_with(|| {
                inputs.push(ckpt.path_of(file));
                inputs.len() - 1
            });
        }
        Ok(Sourcing {
            ckpt,
            cast: opts.cast,
            inputs,
            input_of,
            indexes,
        })
    }

    /// The dtype a tensor is written as.
    pub(super) fn out_dtype(&self, t: &Tensor) -> DType {
        out_dtype(t, self.cast)
    }

    pub(super) fn out_nbytes(&self, t: &Tensor) -> u64 {
        crate::model::numel(&t.shape).unwrap_or(0) * self.out_dtype(t).size() as u64
    }

    fn input(&self, file: &Path) -> usize {
        // Every file of the checkpoint was numbered in `new`.
        self.input_of.get(file).copied().unwrap_or(usize::MAX)
    }

    /// A region at `offset` holding box `b` of tensor `ti`, filled from the pieces that meet it.
    pub(super) fn region(&self, ti: usize, b: &NdBox, offset: u64) -> Region {
        let t = &self.ckpt.tensors[ti];
        Region {
            name: t.name.clone(),
            offset,
            dtype: self.out_dtype(t),
            shape: b.sizes.clone(),
            source: RegionSource::Tensor {
                tensor: ti,
                b: b.clone(),
            },
            crc_slots: Vec::new(),
        }
    }

    /// The fills of box `b` of tensor `ti` from the pieces that meet its sub-box at `start` of
    /// `sizes` (relative to `b`), or all of it.
    pub(super) fn fills(
        &self,
        ti: usize,
        b: &NdBox,
        within: Option<(&[u64], &[u64])>,
    ) -> Result<Vec<Fill>> {
        let (Some(t), Some(index)) = (self.ckpt.tensors.get(ti), self.indexes.get(ti)) else {
            return Err(Error::bug(format!(
                "a region of tensor {ti} in a plan of {} tensors",
                self.ckpt.tensors.len()
            )));
        };
        let query = match within {
            Some((start, sizes)) => NdBox {
                offsets: b.offsets.iter().zip(start).map(|(o, s)| o + s).collect(),
                sizes: sizes.to_vec(),
            },
            None => b.clone(),
        };
        let mut fills = Vec::new();
        for k in index.meeting(&query) {
            let piece = t.pieces.get(k);
            let pb = NdBox {
                offsets: piece.offsets().to_vec(),
                sizes: piece.sizes().to_vec(),
            };
            if within.is_some() && pb.intersect(&query).is_none_or(|c| c.is_empty()) {
                continue;
            }
            let Some(common) = pb.intersect(b) else {
                continue;
            };
            if common.is_empty() {
                continue;
            }
            let elem = t.dtype.size() as u64;
            let strides = piece.strides().into_owned();
            let skip: u64 = (0..common.offsets.len())
                .map(|d| (common.offsets[d] - pb.offsets[d]) * strides[d])
                .sum();
            fills.push(Fill {
                input: self.input(piece.file()),
                encoding: piece.encoding(),
                dtype: t.dtype,
                offset: piece.offset() + skip * elem,
                strides,
                start: (0..common.offsets.len())
                    .map(|d| common.offsets[d] - b.offsets[d])
                    .collect(),
                sizes: common.sizes,
            });
        }
        Ok(fills)
    }

    /// Append a non-tensor entry's torch.save bytes to `file`: the original bytes when the source
    /// had them (so DCP values survive byte for byte), else a fresh archive of the value.
    pub(super) fn value_item(&self, file: &mut FilePlan, v: &NonTensor) -> Result<u64> {
        let base = file.len;
        if let Some(blob) = &v.raw {
            file.regions.push(Region {
                name: v.name.clone(),
                offset: base,
                dtype: DType::U8,
                shape: vec![blob.length],
                source: RegionSource::Fills(vec![Fill {
                    input: self.input(&blob.file),
                    encoding: Encoding::Raw,
                    dtype: DType::U8,
                    offset: blob.offset,
                    strides: vec![1],
                    start: vec![0],
                    sizes: vec![blob.length],
                }]),
                crc_slots: Vec::new(),
            });
            file.len = base + blob.length;
            return Ok(blob.length);
        }
        let Some(value) = &v.value else {
            // Every reader keeps a value's original bytes, its decoded value, or both.
            return Err(
                Error::bug("non-tensor entry has neither bytes nor a value").tensor(&v.name)
            );
        };
        let pkl =
            torch_save::data_pkl(&[(Vec::new(), torch_save::WriteLeaf::Value(value.clone()))]);
        let records = torch_save::records("archive", pkl, &[]);
        archive_into(file, base, &records, |_| None)?;
        Ok(file.len - base)
    }
}

/// Pieces of `t`, with exact duplicates (replicas saved by several ranks) dropped.
fn unique_pieces(t: &Tensor) -> impl Iterator<Item = (usize, PieceRef<'_>)> {
    let mut seen = BTreeSet::new();
    t.pieces
        .iter()
        .enumerate()
        .filter(move |(_, p)| seen.insert((p.offsets(), p.sizes())))
}

/// A tensor's distinct pieces, sorted by where they start on the dim they are cut on, so that the
/// pieces meeting a box are found by binary search: a reshard from 1024 ranks to 1024 asks for
/// 1024 boxes of each tensor, and testing every piece for each would cost a million per tensor.
pub(super) struct PieceIndex {
    /// The dim with the most distinct piece starts; 0 for a 0-dim tensor (never read then).
    dim: usize,
    /// Piece indices, sorted by their start on `dim`.
    pub(super) order: Vec<usize>,
    /// `starts[k]` is where piece `order[k]` starts on `dim`.
    starts: Vec<u64>,
    /// The longest extent of any piece on `dim`.
    max_len: u64,
}

impl PieceIndex {
    pub(super) fn new(t: &Tensor) -> PieceIndex {
        let unique: Vec<usize> = unique_pieces(t).map(|(k, _)| k).collect();
        let dim = (0..t.shape.len())
            .max_by_key(|&d| {
                let starts: BTreeSet<u64> = unique
                    .iter()
                    .map(|&k| t.pieces.get(k).offsets()[d])
                    .collect();
                starts.len()
            })
            .unwrap_or(0);
        let at = |k: usize| t.pieces.get(k).offsets().get(dim).copied().unwrap_or(0);
        let mut order = unique;
        order.sort_by_key(|&k| (at(k), k));
        let starts = order.iter().map(|&k| at(k)).collect();
        let max_len = order
            .iter()
            .map(|&k| t.pieces.get(k).sizes().get(dim).copied().unwrap_or(0))
            .max()
            .unwrap_or(0);
        PieceIndex {
            dim,
            order,
            starts,
            max_len,
        }
    }

    /// Indices of the pieces that may meet `b` (those whose span on `dim` overlaps `b`'s), in
    /// piece order.
    pub(super) fn meeting(&self, b: &NdBox) -> Vec<usize> {
        let (Some(&lo), Some(&len)) = (b.offsets.get(self.dim), b.sizes.get(self.dim)) else {
            return self.order.clone();
        };
        let hi = lo.saturating_add(len);
        // A piece meets [lo, hi) only if it starts before `hi` and after `lo - max_len`.
        let first = self
            .starts
            .partition_point(|&s| s.saturating_add(self.max_len) <= lo);
        let last = self.starts.partition_point(|&s| s < hi);
        let mut found = self.order[first..last.max(first)].to_vec();
        found.sort_unstable();
        found
    }
}

/// A tensor can be planned when its pieces are well-formed and cover it exactly once.
fn check_tensor(t: &Tensor) -> Result<()> {
    let rank = t.shape.len();
    if t.pieces.ndim() != rank {
        return Err(Error::invalid(format!(
            "its pieces have {} dims but the tensor has {rank}",
            t.pieces.ndim()
        ))
        .tensor(&t.name));
    }
    let boxes: Vec<NdBox> = unique_pieces(t)
        .map(|(_, p)| NdBox {
            offsets: p.offsets().to_vec(),
            sizes: p.sizes().to_vec(),
        })
        .collect();
    if let Some(problem) = geometry::check_coverage(&t.shape, &boxes).first() {
        return Err(Error::invalid(problem.describe(&t.shape, &boxes))
            .tensor(&t.name)
            .hint("run `ckpt verify` on the input for details"));
    }
    Ok(())
}
