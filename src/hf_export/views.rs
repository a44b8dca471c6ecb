//! The changes of layout an export to Hugging Face names needs, each a pure function from a
//! tensor's pieces to new pieces: a new box for each run of the source's elements and a byte
//! offset and strides that reach them where they already are. No byte is read or gathered here;
//! the planner and the executor copy the new pieces like any others, so a permuted or unstacked
//! tensor costs what a renamed one does.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::model::{Pieces, Tensor};

/// The closed set of views a name map row may apply (see `tables`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ViewKind {
    /// Same elements, new name.
    Rename,
    /// torchtitan's interleaved RoPE rows of `wq` (over the query heads) to Hugging Face's
    /// half-split rows: `HF[h*hd + j*hd/2 + i] = TT[h*hd + 2i + j]`.
    RopeQuery,
    /// The same over the key/value heads, for `wk`.
    RopeKv,
    /// One tensor per index of the leading axis (expert-stacked weights): the row's target has
    /// an `{E}` its source lacks, filled with the index.
    Unstack,
    /// [`ViewKind::Unstack`], then part `part` of `of` equal parts of the rows: transformers'
    /// in-memory `gate_up_proj` `[E, 2F, D]` holds each expert's gate rows, then its up rows.
    UnstackSplit { part: u64, of: u64 },
}

impl ViewKind {
    /// How `inspect` names the view.
    pub(crate) fn describe(self) -> &'static str {
        match self {
            ViewKind::Rename => "rename",
            ViewKind::RopeQuery => "rope rows (query heads)",
            ViewKind::RopeKv => "rope rows (kv heads)",
            ViewKind::Unstack => "unstack",
            ViewKind::UnstackSplit { part: 0, .. } => "unstack, first half of rows",
            ViewKind::UnstackSplit { .. } => "unstack, second half of rows",
        }
    }

    /// Whether the view makes one tensor per index of the leading axis.
    pub(crate) fn unstacks(self) -> bool {
        matches!(self, ViewKind::Unstack | ViewKind::UnstackSplit { .. })
    }

    /// The shape of the view of a tensor of `shape`, or `None` where it does not fit.
    pub(crate) fn shape(self, shape: &[u64]) -> Option<Vec<u64>> {
        match self {
            ViewKind::Rename | ViewKind::RopeQuery | ViewKind::RopeKv => Some(shape.to_vec()),
            ViewKind::Unstack => Some(shape.get(1..)?.to_vec()),
            ViewKind::UnstackSplit { of, .. } => {
                let mut rest = shape.get(1..)?.to_vec();
                let rows = rest.first_mut()?;
                if of == 0 || *rows % of != 0 {
                    return None;
                }
                *rows /= of;
                Some(rest)
            }
        }
    }
}

/// Refuse a tensor whose elements are computed from its pieces (a LoRA fold): the fold works
/// on the boxes of the tensor it was made for, which a view would move.
fn check_copied(t: &Tensor) -> Result<()> {
    if t.pieces.computed().is_some() {
        return Err(Error::usage(
            "a tensor merged with --merge-lora cannot be permuted, split or unstacked on export",
        )
        .tensor(&t.name)
        .hint("consolidate with --merge-lora first, then export that output with --hf-config"));
    }
    Ok(())
}

/// `t` with the rows of its dim 0 permuted from torchtitan's interleaved RoPE order to Hugging
/// Face's, over `heads` heads of `shape[0] / heads` rows each (the other dims pass through).
///
/// Head `h`'s rows `2i + j` go to `j*hd/2 + i`: each (head, j) run of `hd/2` rows is one new
/// piece per source piece it meets, reading every other row (row stride doubled).
pub(crate) fn rope_rows(t: &Tensor, heads: u64) -> Result<Pieces> {
    check_copied(t)?;
    let rows = t.shape.first().copied().unwrap_or(0);
    if heads == 0 || rows % heads != 0 || (rows / heads) % 2 != 0 {
        return Err(Error::usage(format!(
            "its {rows} rows are not {heads} heads of an even number of rows each"
        ))
        .tensor(&t.name));
    }
    let hd = rows / heads;
    let half = hd / 2;
    let elem = t.dtype.size() as u64;
    let mut out = Pieces::new(t.pieces.ndim());
    for p in t.pieces.iter() {
        let (r0, nr) = (p.offsets()[0], p.sizes()[0]);
        if nr == 0 || p.sizes().contains(&0) {
            continue;
        }
        let strides = p.strides();
        let r1 = r0 + nr;
        for h in r0 / hd..=(r1 - 1) / hd {
            for j in 0..2u64 {
                // Source rows h*hd + 2i + j in [r0, r1).
                let base = h * hd + j;
                let lo = r0.saturating_sub(base).div_ceil(2);
                let hi = if r1 > base {
                    ((r1 - 1 - base) / 2 + 1).min(half)
                } else {
                    0
                };
                if lo >= hi {
                    continue;
                }
                let src_row = base + 2 * lo;
                let mut offsets = p.offsets().to_vec();
                let mut sizes = p.sizes().to_vec();
                let mut new_strides = strides.to_vec();
                offsets[0] = h * hd + j * half + lo;
                sizes[0] = hi - lo;
                new_strides[0] = strides[0] * 2;
                let offset = p.offset() + (src_row - r0) * strides[0] * elem;
                out.push_parts(
                    &offsets,
                    &sizes,
                    Arc::clone(p.file()),
                    offset,
                    &new_strides,
                    p.encoding(),
                )?;
            }
        }
    }
    Ok(out)
}

/// Index `index` of `t`'s leading axis, that axis dropped: one layer of a layer-stacked weight,
/// one expert of an expert-stacked one.
pub(crate) fn unstack(t: &Tensor, index: u64) -> Result<Pieces> {
    check_copied(t)?;
    let n = t.shape.first().copied().unwrap_or(0);
    if t.shape.is_empty() || index >= n {
        return Err(Error::bug(format!(
            "index {index} of a leading axis of {n} (shape {:?})",
            t.shape
        ))
        .tensor(&t.name));
    }
    let elem = t.dtype.size() as u64;
    let mut out = Pieces::new(t.pieces.ndim() - 1);
    for p in t.pieces.iter() {
        let (o, s) = (p.offsets()[0], p.sizes()[0]);
        if index < o || index >= o + s {
            continue;
        }
        let strides = p.strides();
        out.push_parts(
            &p.offsets()[1..],
            &p.sizes()[1..],
            Arc::clone(p.file()),
            p.offset() + (index - o) * strides[0] * elem,
            &strides[1..],
            p.encoding(),
        )?;
    }
    Ok(out)
}

/// Rows `start..start + len` of pieces of a tensor of `elem`-byte elements, as a tensor of their
/// own: part of a `[gate; up]` stack.
pub(crate) fn rows(pieces: &Pieces, elem: u64, start: u64, len: u64) -> Result<Pieces> {
    let mut out = Pieces::new(pieces.ndim());
    for p in pieces.iter() {
        let (Some(&o), Some(&n)) = (p.offsets().first(), p.sizes().first()) else {
            return Err(Error::bug("rows of a 0-dim tensor"));
        };
        let (lo, hi) = (o.max(start), (o + n).min(start + len));
        if lo >= hi {
            continue;
        }
        let strides = p.strides();
        let mut offsets = p.offsets().to_vec();
        let mut sizes = p.sizes().to_vec();
        offsets[0] = lo - start;
        sizes[0] = hi - lo;
        out.push_parts(
            &offsets,
            &sizes,
            Arc::clone(p.file()),
            p.offset() + (lo - o) * strides[0] * elem,
            &strides,
            p.encoding(),
        )?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::model::{DataRef, Encoding, Piece};
    use std::path::Path;

    /// A tensor of u32 elements whose value is their row-major index, saved in `cuts` pieces
    /// along `dim` (torch.chunk geometry), each piece's bytes at its own place in one buffer,
    /// some of them transposed (a view with its own strides) to exercise strides.
    fn saved(shape: &[u64], dim: usize, cuts: u64) -> (Tensor, Vec<u8>) {
        let total: u64 = shape.iter().product();
        let chunk = shape[dim].div_ceil(cuts);
        let mut buf = Vec::new();
        let mut pieces = Pieces::new(shape.len());
        for k in 0..cuts {
            let start = (k * chunk).min(shape[dim]);
            let end = ((k + 1) * chunk).min(shape[dim]);
            if start == end {
                continue;
            }
            let mut offsets = vec![0; shape.len()];
            let mut sizes = shape.to_vec();
            offsets[dim] = start;
            sizes[dim] = end - start;
            // Odd pieces of a 2-D tensor stored column-major.
            let strides = if shape.len() == 2 && k % 2 == 1 {
                vec![1, sizes[0]]
            } else {
                crate::model::contiguous_strides(&sizes)
            };
            let at = buf.len() as u64;
            let n: u64 = sizes.iter().product();
            let mut local = vec![0u32; n as usize];
            for_each_index(&sizes, |idx| {
                let global: Vec<u64> = idx.iter().zip(&offsets).map(|(i, o)| i + o).collect();
                let pos: u64 = idx.iter().zip(&strides).map(|(i, s)| i * s).sum();
                local[pos as usize] = row_major(shape, &global) as u32;
            });
            buf.extend(local.iter().flat_map(|v| v.to_le_bytes()));
            pieces
                .push(Piece {
                    offsets,
                    sizes,
                    data: DataRef {
                        file: Path::new("f").into(),
                        offset: at,
                        strides,
                        encoding: Encoding::Raw,
                    },
                })
                .unwrap();
        }
        assert_eq!(buf.len() as u64, total * 4);
        let t = Tensor {
            name: "t".into(),
            key_path: Vec::new(),
            dtype: DType::F32,
            shape: shape.to_vec(),
            pieces,
        };
        (t, buf)
    }

    fn row_major(shape: &[u64], idx: &[u64]) -> u64 {
        idx.iter().zip(shape).fold(0, |acc, (i, n)| acc * n + i)
    }

    fn for_each_index(shape: &[u64], mut f: impl FnMut(&[u64])) {
        if shape.contains(&0) {
            return;
        }
        let mut idx = vec![0u64; shape.len()];
        loop {
            f(&idx);
            let mut d = shape.len();
            loop {
                if d == 0 {
                    return;
                }
                d -= 1;
                idx[d] += 1;
                if idx[d] < shape[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
    }

    /// Every element of a tensor of `shape` read through `pieces` from `buf`, row-major; each
    /// element covered exactly once.
    fn materialize(shape: &[u64], pieces: &Pieces, buf: &[u8]) -> Vec<u32> {
        let total: u64 = shape.iter().product();
        let mut out = vec![None; total as usize];
        for p in pieces.iter() {
            let strides = p.strides();
            for_each_index(p.sizes(), |idx| {
                let global: Vec<u64> = idx.iter().zip(p.offsets()).map(|(i, o)| i + o).collect();
                let at =
                    p.offset() + 4 * idx.iter().zip(&*strides).map(|(i, s)| i * s).sum::<u64>();
                let b = &buf[at as usize..at as usize + 4];
                let slot = &mut out[row_major(shape, &global) as usize];
                assert!(slot.is_none(), "element {global:?} covered twice");
                *slot = Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            });
        }
        out.into_iter()
            .enumerate()
            .map(|(i, v)| v.unwrap_or_else(|| panic!("element {i} not covered")))
            .collect()
    }

    #[test]
    fn rope_rows_match_the_element_formula() {
        // (rows, cols, heads) and cuts along rows, along cols, and none.
        for (rows, cols, heads) in [(8, 3, 1), (16, 4, 2), (24, 5, 3), (12, 2, 6)] {
            for (dim, cuts) in [(0, 1), (0, 2), (0, 3), (0, 5), (1, 2), (0, 7)] {
                let (t, buf) = saved(&[rows, cols], dim, cuts);
                let pieces = rope_rows(&t, heads).unwrap();
                let got = materialize(&t.shape, &pieces, &buf);
                let hd = rows / heads;
                for h in 0..heads {
                    for j in 0..2 {
                        for i in 0..hd / 2 {
                            for c in 0..cols {
                                let hf = (h * hd + j * hd / 2 + i) * cols + c;
                                let tt = (h * hd + 2 * i + j) * cols + c;
                                assert_eq!(
                                    got[hf as usize], tt as u32,
                                    "rows {rows} heads {heads} cut {dim}/{cuts}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn rope_rows_of_a_vector() {
        let (t, buf) = saved(&[8], 0, 3);
        let got = materialize(&t.shape, &rope_rows(&t, 2).unwrap(), &buf);
        assert_eq!(got, vec![0, 2, 1, 3, 4, 6, 5, 7]);
    }

    #[test]
    fn rope_rows_refuse_heads_that_do_not_divide() {
        let (t, _) = saved(&[12, 2], 0, 1);
        for heads in [0, 5, 4, 12] {
            let e = rope_rows(&t, heads).unwrap_err();
            assert_eq!(e.tensor.as_deref(), Some("t"), "{heads}");
        }
    }

    #[test]
    fn unstack_gives_each_slice_of_the_leading_axis() {
        for (dim, cuts) in [(0, 1), (0, 2), (0, 3), (1, 2), (2, 3)] {
            let shape = [3u64, 4, 5];
            let (t, buf) = saved(&shape, dim, cuts);
            for e in 0..3 {
                let got = materialize(&shape[1..], &unstack(&t, e).unwrap(), &buf);
                let want: Vec<u32> = (0..20).map(|i| (e * 20 + i) as u32).collect();
                assert_eq!(got, want, "cut {dim}/{cuts} expert {e}");
            }
        }
        let (t, _) = saved(&[3, 4, 5], 0, 1);
        assert!(unstack(&t, 3).is_err());
    }

    #[test]
    fn rows_give_a_slice_of_the_first_dim() {
        for (dim, cuts) in [(0, 1), (0, 3), (0, 5), (1, 2), (0, 7)] {
            let (t, buf) = saved(&[6, 3], dim, cuts);
            for (start, len) in [(0, 3), (3, 3), (1, 4), (5, 1)] {
                let got = materialize(&[len, 3], &rows(&t.pieces, 4, start, len).unwrap(), &buf);
                let want: Vec<u32> = (start * 3..(start + len) * 3).map(|i| i as u32).collect();
                assert_eq!(got, want, "cut {dim}/{cuts} rows {start}+{len}");
            }
        }
    }
}
