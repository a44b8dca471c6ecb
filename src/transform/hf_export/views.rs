//! The changes of layout an export to Hugging Face names needs, each a pure function from a
//! tensor's pieces to new pieces: a new box for each run of the source's elements and a byte
//! offset and strides that reach them where they already are. No byte is read or gathered here;
//! the planner and the executor copy the new pieces like any others, so a permuted or unstacked
//! tensor costs what a renamed one does.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::model::{Pieces, Tensor};

/// The closed set of views a name map row may apply (see `tables`). A row whose target has a
/// placeholder its source lacks (`{L}` of a layer-stacked Megatron weight, `{E}` of an
/// expert-stacked one) first takes one index of the source's leading axis ([`unstack`]); the
/// view then applies to what that leaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ViewKind {
    /// Same elements, new name.
    Rename,
    /// torchtitan's interleaved RoPE rows of `wq` (over the query heads) to Hugging Face's
    /// half-split rows: `HF[h*hd + j*hd/2 + i] = TT[h*hd + 2i + j]`.
    RopeQuery,
    /// The same over the key/value heads, for `wk`.
    RopeKv,
    /// Part `part` of `of` equal parts of the rows: a `[gate; up]` stack (Megatron's
    /// `linear_fc1`, transformers' in-memory `gate_up_proj`).
    Split { part: u64, of: u64 },
    /// Megatron's fused QKV rows, interleaved per query group:
    /// `qkv.view(groups, heads_per_group + 2, head_dim, ...)` holds each group's query heads,
    /// then its key head, then its value head; the bias alike.
    Qkv(QkvPart),
    /// The first `vocab_size` rows: Megatron pads its vocabulary to a multiple of 128 × TP.
    TrimVocab,
    /// The last two axes swapped: torchtitan's gpt-oss experts `[E, 2F, D]` as transformers'
    /// `[E, D, 2F]`.
    Transpose,
}

/// Which of a fused QKV's projections a [`ViewKind::Qkv`] takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum QkvPart {
    Q,
    K,
    V,
}

/// The sizes of the config the views need.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sizes {
    pub heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    pub vocab: u64,
}

impl ViewKind {
    /// How `inspect` names the view.
    pub(crate) fn describe(self) -> &'static str {
        match self {
            ViewKind::Rename => "rename",
            ViewKind::RopeQuery => "rope rows (query heads)",
            ViewKind::RopeKv => "rope rows (kv heads)",
            ViewKind::Split { part: 0, of: 2 } => "first half of rows",
            ViewKind::Split { part: 1, of: 2 } => "second half of rows",
            ViewKind::Split { .. } => "part of rows",
            ViewKind::Qkv(QkvPart::Q) => "q rows of each query group",
            ViewKind::Qkv(QkvPart::K) => "k rows of each query group",
            ViewKind::Qkv(QkvPart::V) => "v rows of each query group",
            ViewKind::TrimVocab => "rows up to vocab_size",
            ViewKind::Transpose => "last two axes swapped",
        }
    }

    /// The runs of rows (start, length) the view takes of `rows` rows, in order; `None` for a
    /// view of every row; an error saying why the rows do not fit.
    fn runs(self, rows: u64, s: &Sizes) -> Result<Option<Vec<(u64, u64)>>, String> {
        match self {
            ViewKind::Rename | ViewKind::RopeQuery | ViewKind::RopeKv | ViewKind::Transpose => {
                Ok(None)
            }
            ViewKind::Split { part, of } => {
                if of == 0 || rows % of != 0 {
                    return Err(format!("{rows} rows are not {of} equal parts"));
                }
                Ok(Some(vec![(part * (rows / of), rows / of)]))
            }
            ViewKind::TrimVocab => {
                if rows < s.vocab {
                    return Err(format!(
                        "{rows} rows are fewer than config.json's `vocab_size` = {}",
                        s.vocab
                    ));
                }
                Ok(Some(vec![(0, s.vocab)]))
            }
            ViewKind::Qkv(part) => {
                let (heads, groups, hd) = (s.heads, s.kv_heads, s.head_dim);
                let per_group = if groups > 0 && heads % groups == 0 {
                    heads / groups
                } else {
                    0
                };
                // Saturating: the sizes come from config.json.
                let block = (per_group + 2).saturating_mul(hd);
                if per_group == 0 {
                    return Err(format!(
                        "config.json's `num_attention_heads` {heads} is not a multiple of its \
                         `num_key_value_heads` {groups}"
                    ));
                }
                if rows != groups.saturating_mul(block) {
                    return Err(format!(
                        "{rows} rows are not config.json's (`num_attention_heads` + 2 × \
                         `num_key_value_heads`) × `head_dim` = ({heads} + 2 × {groups}) × {hd} = {}",
                        heads
                            .saturating_add(groups.saturating_mul(2))
                            .saturating_mul(hd)
                    ));
                }
                let (at, len) = match part {
                    QkvPart::Q => (0, per_group * hd),
                    QkvPart::K => (per_group * hd, hd),
                    QkvPart::V => ((per_group + 1) * hd, hd),
                };
                Ok(Some((0..groups).map(|g| (g * block + at, len)).collect()))
            }
        }
    }

    /// The runs of rows (start, length) the view takes of a tensor of `rows` rows, in order, laid
    /// end to end in the view; one run of every row for a view that moves none.
    pub(crate) fn source_runs(self, rows: u64, s: &Sizes) -> Result<Vec<(u64, u64)>, String> {
        Ok(self.runs(rows, s)?.unwrap_or_else(|| vec![(0, rows)]))
    }

    /// The shape of the view of a tensor of `shape`, or why it does not fit.
    pub(crate) fn shape(self, shape: &[u64], s: &Sizes) -> Result<Vec<u64>, String> {
        let mut out = shape.to_vec();
        if self == ViewKind::Rename {
            return Ok(out);
        }
        if self == ViewKind::Transpose {
            let n = out.len();
            if n < 2 {
                return Err(format!("a {n}-dim tensor has no two axes to swap"));
            }
            out.swap(n - 2, n - 1);
            return Ok(out);
        }
        let Some(rows) = out.first_mut() else {
            return Err("a 0-dim tensor has no rows".into());
        };
        if let Some(runs) = self.runs(*rows, s)? {
            *rows = runs.iter().map(|(_, n)| n).sum();
        }
        Ok(out)
    }

    /// The view of `pieces` (of a tensor of `shape` and `elem`-byte elements).
    pub(crate) fn apply(
        self,
        pieces: &Pieces,
        shape: &[u64],
        elem: u64,
        s: &Sizes,
    ) -> Result<Pieces> {
        let rows = shape.first().copied().unwrap_or(0);
        let heads = match self {
            ViewKind::RopeQuery => s.heads,
            ViewKind::RopeKv => s.kv_heads,
            ViewKind::Transpose => return transpose(pieces),
            _ => {
                return match self.runs(rows, s).map_err(Error::usage)? {
                    None => Ok(pieces.clone()),
                    Some(runs) => gather_rows(pieces, elem, &runs),
                }
            }
        };
        rope_rows(pieces, rows, heads, elem)
    }
}

/// Refuse a tensor whose elements are computed from its pieces (a LoRA fold): the fold works
/// on the boxes of the tensor it was made for, which a view would move.
pub(crate) fn check_copied(t: &Tensor) -> Result<()> {
    if t.pieces.computed().is_some() {
        return Err(Error::usage(
            "a tensor merged with --merge-lora cannot be permuted, split or unstacked on export",
        )
        .tensor(&t.name)
        .hint("consolidate with --merge-lora first, then export that output with --hf-config"));
    }
    Ok(())
}

/// Pieces with the rows of their dim 0 permuted from torchtitan's interleaved RoPE order to Hugging
/// Face's, over `heads` heads of `shape[0] / heads` rows each (the other dims pass through).
///
/// Head `h`'s rows `2i + j` go to `j*hd/2 + i`: each (head, j) run of `hd/2` rows is one new
/// piece per source piece it meets, reading every other row (row stride doubled).
fn rope_rows(pieces: &Pieces, rows: u64, heads: u64, elem: u64) -> Result<Pieces> {
    if heads == 0 || rows % heads != 0 || (rows / heads) % 2 != 0 {
        return Err(Error::usage(format!(
            "its {rows} rows are not {heads} heads of an even number of rows each"
        )));
    }
    let hd = rows / heads;
    let half = hd / 2;
    let mut out = Pieces::new(pieces.ndim());
    for p in pieces.iter() {
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

/// Pieces with their last two axes swapped: each piece's box and strides swapped, its bytes
/// where they are (the executor gathers them in the new order).
fn transpose(pieces: &Pieces) -> Result<Pieces> {
    let n = pieces.ndim();
    if n < 2 {
        return Err(Error::bug("a transpose of a tensor of fewer than 2 dims"));
    }
    let mut out = Pieces::new(n);
    for p in pieces.iter() {
        let (mut offsets, mut sizes) = (p.offsets().to_vec(), p.sizes().to_vec());
        let mut strides = p.strides().to_vec();
        for v in [&mut offsets, &mut sizes, &mut strides] {
            v.swap(n - 2, n - 1);
        }
        out.push_parts(
            &offsets,
            &sizes,
            Arc::clone(p.file()),
            p.offset(),
            &strides,
            p.encoding(),
        )?;
    }
    Ok(out)
}

/// Index `index` of the leading axis of pieces of a tensor of `shape` (`elem`-byte elements),
/// that axis dropped: one layer of a layer-stacked weight, one expert of an expert-stacked one.
pub(crate) fn unstack(pieces: &Pieces, shape: &[u64], elem: u64, index: u64) -> Result<Pieces> {
    let n = shape.first().copied().unwrap_or(0);
    if shape.is_empty() || index >= n {
        return Err(Error::bug(format!(
            "index {index} of a leading axis of {n} (shape {shape:?})"
        )));
    }
    let mut out = Pieces::new(pieces.ndim() - 1);
    for p in pieces.iter() {
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

/// The rows of `runs` (start, length) of pieces of `elem`-byte elements, one after the other,
/// as a tensor of their own.
fn gather_rows(pieces: &Pieces, elem: u64, runs: &[(u64, u64)]) -> Result<Pieces> {
    let mut out = Pieces::new(pieces.ndim());
    let mut dst = 0;
    for &(start, len) in runs {
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
            offsets[0] = dst + lo - start;
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
        dst += len;
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
                let pieces = rope_rows(&t.pieces, rows, heads, 4).unwrap();
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
        let got = materialize(&t.shape, &rope_rows(&t.pieces, 8, 2, 4).unwrap(), &buf);
        assert_eq!(got, vec![0, 2, 1, 3, 4, 6, 5, 7]);
    }

    #[test]
    fn rope_rows_refuse_heads_that_do_not_divide() {
        let (t, _) = saved(&[12, 2], 0, 1);
        for heads in [0, 5, 4, 12] {
            assert!(rope_rows(&t.pieces, 12, heads, 4).is_err(), "{heads}");
        }
    }

    #[test]
    fn unstack_gives_each_slice_of_the_leading_axis() {
        for (dim, cuts) in [(0, 1), (0, 2), (0, 3), (1, 2), (2, 3)] {
            let shape = [3u64, 4, 5];
            let (t, buf) = saved(&shape, dim, cuts);
            for e in 0..3 {
                let got = materialize(
                    &shape[1..],
                    &unstack(&t.pieces, &t.shape, 4, e).unwrap(),
                    &buf,
                );
                let want: Vec<u32> = (0..20).map(|i| (e * 20 + i) as u32).collect();
                assert_eq!(got, want, "cut {dim}/{cuts} expert {e}");
            }
        }
        let (t, _) = saved(&[3, 4, 5], 0, 1);
        assert!(unstack(&t.pieces, &t.shape, 4, 3).is_err());
    }

    const SIZES: Sizes = Sizes {
        heads: 4,
        kv_heads: 2,
        head_dim: 2,
        vocab: 5,
    };

    /// Each row view against its formula: `rows` rows of 3 columns, cut in pieces every way.
    fn check_rows(view: ViewKind, rows: u64, want_rows: &[u64]) {
        for (dim, cuts) in [(0, 1), (0, 3), (0, 5), (1, 2), (0, 7)] {
            let (t, buf) = saved(&[rows, 3], dim, cuts);
            let shape = view.shape(&t.shape, &SIZES).unwrap();
            assert_eq!(shape, vec![want_rows.len() as u64, 3], "{view:?}");
            let pieces = view.apply(&t.pieces, &t.shape, 4, &SIZES).unwrap();
            let got = materialize(&shape, &pieces, &buf);
            let want: Vec<u32> = want_rows
                .iter()
                .flat_map(|r| (r * 3..r * 3 + 3).map(|i| i as u32))
                .collect();
            assert_eq!(got, want, "{view:?} cut {dim}/{cuts}");
        }
    }

    #[test]
    fn row_views_match_their_formulas() {
        check_rows(ViewKind::Split { part: 0, of: 2 }, 6, &[0, 1, 2]);
        check_rows(ViewKind::Split { part: 1, of: 2 }, 6, &[3, 4, 5]);
        check_rows(ViewKind::TrimVocab, 8, &[0, 1, 2, 3, 4]);
        // 2 groups of (2 query heads, 1 key head, 1 value head) of 2 rows each:
        // qkv.view(groups, per_group + 2, head_dim, cols).
        let (groups, per_group, hd) = (2u64, 2u64, 2u64);
        let naive = |part: u64, count: u64| -> Vec<u64> {
            (0..groups)
                .flat_map(|g| {
                    (0..count * hd).map(move |r| g * (per_group + 2) * hd + part * hd + r)
                })
                .collect()
        };
        check_rows(ViewKind::Qkv(QkvPart::Q), 16, &naive(0, per_group));
        check_rows(ViewKind::Qkv(QkvPart::K), 16, &naive(per_group, 1));
        check_rows(ViewKind::Qkv(QkvPart::V), 16, &naive(per_group + 1, 1));
        check_rows(ViewKind::Rename, 4, &[0, 1, 2, 3]);
    }

    #[test]
    fn row_views_refuse_rows_that_do_not_fit() {
        let e = ViewKind::Qkv(QkvPart::Q)
            .shape(&[15, 3], &SIZES)
            .unwrap_err();
        assert!(e.contains("`num_key_value_heads`"), "{e}");
        assert!(ViewKind::TrimVocab
            .shape(&[4, 3], &SIZES)
            .unwrap_err()
            .contains("`vocab_size` = 5"));
        assert!(ViewKind::Split { part: 0, of: 2 }
            .shape(&[5, 3], &SIZES)
            .is_err());
        assert!(ViewKind::Split { part: 0, of: 2 }
            .shape(&[], &SIZES)
            .is_err());
    }
}
