//! The arithmetic of folding one LoRA module into its base weight, step by step as PEFT's
//! `merge` does it on the CPU: the product `B @ A` and its scaling in f32, each intermediate
//! rounded to the dtype torch would hold it in (nearest even), the result to the base dtype.

use crate::dtype::DType;
use crate::error::{Error, Result};

/// What kind of module is folded, which fixes how `B @ A` lies over the weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// `nn.Linear`: `W [out, in] += s * B [out, r] @ A [r, in]`; with `fan_in_fan_out` the weight
    /// is `[in, out]` and the update is transposed.
    Linear { fan_in_fan_out: bool },
    /// `nn.Embedding`: `W [num, dim] += s * (B [dim, r] @ A [r, num])^T`.
    Embedding,
}

/// One module's fold: everything but the tensors.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Fold {
    pub kind: Kind,
    /// PEFT's `scaling` (a Python float, which torch applies to an f32 tensor as an f32).
    pub scaling: f64,
    /// The base weight's dtype.
    pub weight: DType,
    /// The adapter's dtype (`lora_B`'s, which PEFT computes the update in).
    pub adapter: DType,
    /// The DoRA magnitude's dtype, when there is one.
    pub magnitude: Option<DType>,
}

/// `x` rounded to `dtype` as torch rounds (nearest even), as an f32.
pub(crate) fn round_to(dtype: DType, x: f32) -> f32 {
    match dtype {
        DType::BF16 => f32::from_bits(u32::from(bf16_bits(x)) << 16),
        DType::F16 => half::f16::from_f32(x).to_f32(),
        _ => x,
    }
}

/// The bf16 nearest to `x` (ties to even), as `half::bf16::from_f32` gives it, without branches
/// the compiler cannot turn into selects, so that loops of it vectorize.
#[inline(always)]
fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
    let nan = ((b >> 16) | 0x40) as u16;
    if b & 0x7fff_ffff > 0x7f80_0000 {
        nan
    } else {
        rounded
    }
}

/// Every value of `xs` rounded to `dtype` (nearest even), in place.
fn round_all(dtype: DType, xs: &mut [f32]) {
    match dtype {
        DType::BF16 => xs
            .iter_mut()
            .for_each(|x| *x = f32::from_bits(u32::from(bf16_bits(*x)) << 16)),
        DType::F16 => xs
            .iter_mut()
            .for_each(|x| *x = half::f16::from_f32(*x).to_f32()),
        _ => {}
    }
}

/// `bytes`, little-endian values of `dtype` (f32, bf16 or f16), as f32s into `out`.
fn decode(bytes: &[u8], dtype: DType, out: &mut [f32]) {
    match dtype {
        DType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16);
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        _ => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
    }
}

/// `vals`, each already a value of `dtype` (f32, bf16 or f16), as its little-endian bytes into
/// `out`.
fn encode_into(vals: &[f32], dtype: DType, out: &mut [u8]) {
    match dtype {
        DType::BF16 => {
            for (c, &v) in out.chunks_exact_mut(2).zip(vals) {
                c.copy_from_slice(&bf16_bits(v).to_le_bytes());
            }
        }
        DType::F16 => {
            for (c, &v) in out.chunks_exact_mut(2).zip(vals) {
                c.copy_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes());
            }
        }
        _ => {
            for (c, &v) in out.chunks_exact_mut(4).zip(vals) {
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
    }
}

/// `vals`, each already a value of `dtype`, as `dtype`'s little-endian bytes.
#[cfg(test)]
pub(crate) fn encode(vals: &[f32], dtype: DType) -> Vec<u8> {
    let mut out = vec![0u8; vals.len() * dtype.size()];
    encode_into(vals, dtype, &mut out);
    out
}

/// The dtype torch gives an elementwise operation on tensors of dtypes `a` and `b`.
fn promote(a: DType, b: DType) -> DType {
    if a == b {
        a
    } else {
        DType::F32
    }
}

/// One module's adapter, as f32s (each value one of its own dtype).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Adapter<'a> {
    /// `A [r, in]`, row-major.
    pub a: &'a [f32],
    /// `B [out, r]`, row-major.
    pub b: &'a [f32],
    pub r: usize,
    /// DoRA's factor per output, `magnitude / ‖W + s·B@A‖` ([`dora_factor`]).
    pub factor: Option<&'a [f32]>,
}

impl Adapter<'_> {
    fn out(&self) -> usize {
        self.b.len() / self.r.max(1)
    }

    fn inn(&self) -> usize {
        self.a.len() / self.r.max(1)
    }
}

impl Fold {
    /// Whether the weight is the update transposed: `[in, out]`.
    fn transposed(&self) -> bool {
        match self.kind {
            Kind::Linear { fan_in_fan_out } => fan_in_fan_out,
            Kind::Embedding => true,
        }
    }
}

/// Values of the update computed at a time (256 KiB of f32): a few rows of the weight, which
/// stay in cache from the product to the bytes written.
const CHUNK: usize = 64 * 1024;

/// `s · (B @ A)` over rows `row0..row0 + rows` and columns `col0..col0 + cols` of the weight
/// (its layout: `(B @ A)^T` when transposed), each value rounded to the adapter's dtype, row-major
/// into `d` (`rows * cols` values). The box must lie in the weight.
fn delta(
    f: &Fold,
    ad: &Adapter,
    row0: usize,
    rows: usize,
    col0: usize,
    cols: usize,
    d: &mut [f32],
) {
    product(ad, f.transposed(), row0, rows, col0, cols, d);
    let s = f.scaling as f32;
    d.iter_mut().for_each(|x| *x *= s);
    round_all(f.adapter, d);
}

/// `W + s·d` of the box whose base values are `w` and whose `B @ A` is `d` (f32, unscaled),
/// written as `dtype` (bf16 or f32, the weight's) into `dst`: [`delta`] and the Linear case of
/// [`combine`] in one pass, each operation rounded as there.
fn add_scaled(dtype: DType, s: f32, w: &[u8], d: &[f32], dst: &mut [u8]) {
    if dtype == DType::BF16 {
        for ((o, c), &d) in dst.chunks_exact_mut(2).zip(w.chunks_exact(2)).zip(d) {
            let w = f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16);
            o.copy_from_slice(&bf16_bits(w + d * s).to_le_bytes());
        }
    } else {
        for ((o, c), &d) in dst.chunks_exact_mut(4).zip(w.chunks_exact(4)).zip(d) {
            let w = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            o.copy_from_slice(&(w + d * s).to_le_bytes());
        }
    }
}

/// `B @ A` over a box of the weight, as [`delta`] before scaling.
fn product(
    ad: &Adapter,
    transposed: bool,
    row0: usize,
    rows: usize,
    col0: usize,
    cols: usize,
    d: &mut [f32],
) {
    let (r, inn) = (ad.r, ad.inn());
    if rows == 0 || cols == 0 {
        return;
    }
    if r == 0 {
        d.fill(0.0);
        return;
    }
    // Element (o, i) of `B @ A` is `sum_k B[o, k] A[k, i]`; transposed, row i of the weight is
    // column i of A times B^T. Either way each value is the same sum, in the same order of k.
    let (lhs, rsa, csa, rhs, rsb, csb) = if transposed {
        (
            &ad.a[row0..],
            1,
            inn as isize,
            &ad.b[col0 * r..],
            1,
            r as isize,
        )
    } else {
        (
            &ad.b[row0 * r..],
            r as isize,
            1,
            &ad.a[col0..],
            inn as isize,
            1,
        )
    };
    // SAFETY: the caller's box lies in the weight, so every element the product reads, row
    // `row0 + m` and column `k` of the left factor and row `k`, column `col0 + n` of the right one
    // (m < rows, n < cols, k < r), is inside `ad.a` or `ad.b` (of `r * inn` and `out * r`
    // values), which the slices above start at; `d` holds `rows * cols` values, row stride
    // `cols`, and is not aliased by either factor.
    unsafe {
        matrixmultiply::sgemm(
            rows,
            r,
            cols,
            1.0,
            lhs.as_ptr(),
            rsa,
            csa,
            rhs.as_ptr(),
            rsb,
            csb,
            0.0,
            d.as_mut_ptr(),
            cols as isize,
            1,
        );
    }
}

/// Fold the adapter into the box of the weight at `start` ([row, column]) of `sizes`: `w` holds
/// the box's base values (row-major, the weight's dtype), `dst` receives the merged ones in
/// `dst_dtype` (the weight's, or another one a cast asks for, reached as a cast of the weight's
/// values would). For DoRA, `ad.factor` must be set.
pub(crate) fn fold_box(
    f: &Fold,
    ad: &Adapter,
    start: [usize; 2],
    sizes: [usize; 2],
    w: &[u8],
    dst: &mut [u8],
    dst_dtype: DType,
) -> Result<()> {
    let (out, inn) = (ad.out(), ad.inn());
    let (nrows, ncols) = if f.transposed() {
        (inn, out)
    } else {
        (out, inn)
    };
    let [row0, col0] = start;
    let [rows, cols] = sizes;
    let n = rows * cols;
    let (ws, ds) = (f.weight.size(), dst_dtype.size());
    if row0 + rows > nrows
        || col0 + cols > ncols
        || w.len() != n * ws
        || dst.len() != n * ds
        || ad.a.len() != ad.r * inn
        || ad.b.len() != out * ad.r
        || (f.magnitude.is_some() && ad.factor.is_none_or(|x| x.len() != out))
    {
        return Err(Error::bug(format!(
            "a LoRA fold of a box at {start:?} of {sizes:?} in a [{nrows}, {ncols}] weight does not fit"
        )));
    }
    // The common case in one pass over each chunk: a Linear's update in f32 added to a bf16 or
    // f32 weight, written in the weight's dtype.
    let fused = matches!(f.kind, Kind::Linear { .. })
        && f.magnitude.is_none()
        && f.adapter == DType::F32
        && dst_dtype == f.weight
        && matches!(f.weight, DType::BF16 | DType::F32);
    let step = (CHUNK / cols.max(1)).max(1);
    let mut d = vec![0f32; step.min(rows) * cols];
    let mut wv = vec![0f32; if fused { 0 } else { d.len() }];
    let mut tmp = Vec::new();
    let mut r = 0;
    while r < rows {
        let k = step.min(rows - r);
        let d = &mut d[..k * cols];
        let (w, dst) = (
            &w[r * cols * ws..(r + k) * cols * ws],
            &mut dst[r * cols * ds..(r + k) * cols * ds],
        );
        if fused {
            product(ad, f.transposed(), row0 + r, k, col0, cols, d);
            add_scaled(f.weight, f.scaling as f32, w, d, dst);
            r += k;
            continue;
        }
        let wv = &mut wv[..k * cols];
        delta(f, ad, row0 + r, k, col0, cols, d);
        decode(w, f.weight, wv);
        combine(f, ad, [row0 + r, col0], cols, wv, d);
        if dst_dtype == f.weight {
            encode_into(d, f.weight, dst);
        } else {
            tmp.resize(d.len() * ws, 0);
            encode_into(d, f.weight, &mut tmp);
            crate::cast::convert(&tmp, f.weight, dst, dst_dtype);
        }
        r += k;
    }
    Ok(())
}

/// The merged values of the box at `[row0, col0]` of the weight (`cols` wide) from their base
/// values `w` and their update `d` (from [`delta`]), into `d`.
fn combine(f: &Fold, ad: &Adapter, start: [usize; 2], cols: usize, w: &[f32], d: &mut [f32]) {
    let [row0, col0] = start;
    match (f.kind, f.magnitude, ad.factor) {
        (Kind::Embedding, None, _) => {
            // `get_delta_weight(...).to(orig_dtype)`, then added in the weight's dtype.
            round_all(f.weight, d);
            d.iter_mut().zip(w).for_each(|(d, &w)| *d += w);
            round_all(f.weight, d);
        }
        (Kind::Linear { .. }, None, _) => {
            // `weight.data += delta`: added in f32, stored in the weight's dtype.
            d.iter_mut().zip(w).for_each(|(d, &w)| *d += w);
            round_all(f.weight, d);
        }
        // DoRA on a Linear, or on an embedding (one magnitude per embedding column, the delta
        // not rounded first).
        (_, Some(mag_t), factor) => {
            let sum_t = promote(f.weight, f.adapter);
            d.iter_mut().zip(w).for_each(|(d, &w)| *d += w);
            round_all(sum_t, d);
            let prod_t = promote(promote(mag_t, sum_t), sum_t);
            let factor = factor.unwrap_or(&[]);
            for (k, v) in d.iter_mut().enumerate() {
                let o = if f.transposed() {
                    col0 + k % cols.max(1)
                } else {
                    row0 + k / cols.max(1)
                };
                *v = round_to(prod_t, factor.get(o).copied().unwrap_or(f32::NAN) * *v);
            }
            round_all(f.weight, d);
        }
    }
}

/// DoRA's factor per output, `magnitude / ‖W + s·B@A‖` as PEFT computes it: the norm of each
/// output row of the sum (a column when transposed) in f64, rounded to the sum's dtype, the
/// quotient rounded to the dtype torch gives it. `w` is the whole base weight (its dtype's bytes).
pub(crate) fn dora_factor(f: &Fold, ad: &Adapter, w: &[u8], magnitude: &[f32]) -> Result<Vec<f32>> {
    let (out, inn) = (ad.out(), ad.inn());
    let (rows, cols) = if f.transposed() {
        (inn, out)
    } else {
        (out, inn)
    };
    if w.len() != rows * cols * f.weight.size() || magnitude.len() != out {
        return Err(Error::bug("a DoRA weight or magnitude of the wrong size"));
    }
    let sum_t = promote(f.weight, f.adapter);
    let mut sq = vec![0f64; out];
    let step = (CHUNK / cols.max(1)).max(1);
    let mut d = vec![0f32; step.min(rows) * cols];
    let mut wv = vec![0f32; d.len()];
    let ws = f.weight.size();
    let mut r = 0;
    while r < rows {
        let k = step.min(rows - r);
        let (d, wv) = (&mut d[..k * cols], &mut wv[..k * cols]);
        delta(f, ad, r, k, 0, cols, d);
        decode(&w[r * cols * ws..(r + k) * cols * ws], f.weight, wv);
        d.iter_mut().zip(wv.iter()).for_each(|(d, &w)| *d += w);
        round_all(sum_t, d);
        for (j, &v) in d.iter().enumerate() {
            let o = if f.transposed() {
                j % cols.max(1)
            } else {
                r + j / cols.max(1)
            };
            sq[o] += f64::from(v) * f64::from(v);
        }
        r += k;
    }
    let mag_t = f.magnitude.unwrap_or(DType::F32);
    let factor_t = promote(mag_t, sum_t);
    Ok(sq
        .iter()
        .zip(magnitude)
        .map(|(&q, &m)| {
            let norm = round_to(sum_t, q.sqrt() as f32);
            round_to(factor_t, m / norm)
        })
        .collect())
}

/// Fold `b [out, r] @ a [r, in]` into the whole weight `w` (f32 values of the weight's dtype,
/// the weight's shape): the merged values. `magnitude` (`[out]`) is DoRA's.
#[cfg(test)]
pub(crate) fn fold(
    f: &Fold,
    w: &[f32],
    a: &[f32],
    b: &[f32],
    r: usize,
    magnitude: Option<&[f32]>,
) -> Vec<f32> {
    let mut ad = Adapter {
        a,
        b,
        r,
        factor: None,
    };
    let wb = encode(w, f.weight);
    let factor = magnitude.map(|m| dora_factor(f, &ad, &wb, m).unwrap());
    ad.factor = factor.as_deref();
    let (rows, cols) = if f.transposed() {
        (ad.inn(), ad.out())
    } else {
        (ad.out(), ad.inn())
    };
    let mut dst = vec![0u8; wb.len()];
    fold_box(f, &ad, [0, 0], [rows, cols], &wb, &mut dst, f.weight).unwrap();
    let mut vals = vec![0f32; w.len()];
    decode(&dst, f.weight, &mut vals);
    vals
}

#[cfg(test)]
mod tests {
    use super::*;

    fn linear(fan_in_fan_out: bool, weight: DType) -> Fold {
        Fold {
            kind: Kind::Linear { fan_in_fan_out },
            scaling: 0.5,
            weight,
            adapter: DType::F32,
            magnitude: None,
        }
    }

    // B [3, 2], A [2, 4]: B @ A by hand.
    const B: [f32; 6] = [1.0, 2.0, 0.0, 1.0, -1.0, 3.0];
    const A: [f32; 8] = [1.0, 0.0, 2.0, -1.0, 0.5, 1.0, 0.0, 2.0];
    fn ba() -> Vec<f32> {
        let mut m = vec![0f32; 12];
        for o in 0..3 {
            for i in 0..4 {
                m[o * 4 + i] = (0..2).map(|k| B[o * 2 + k] * A[k * 4 + i]).sum();
            }
        }
        m
    }

    #[test]
    fn adds_scaled_product() {
        let w: Vec<f32> = (0..12).map(|x| x as f32).collect();
        let got = fold(&linear(false, DType::F32), &w, &A, &B, 2, None);
        let want: Vec<f32> = w.iter().zip(ba()).map(|(w, d)| w + 0.5 * d).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn fan_in_fan_out_transposes_the_update() {
        let w = vec![0f32; 12];
        let got = fold(&linear(true, DType::F32), &w, &A, &B, 2, None);
        let d = ba();
        for o in 0..3 {
            for i in 0..4 {
                assert_eq!(got[i * 3 + o], 0.5 * d[o * 4 + i]);
            }
        }
    }

    #[test]
    fn rounds_to_bf16_nearest_even() {
        // 1 + 2^-8 is halfway between two bf16 values: nearest even is 1.
        let f = Fold {
            kind: Kind::Linear {
                fan_in_fan_out: false,
            },
            scaling: 1.0,
            weight: DType::BF16,
            adapter: DType::F32,
            magnitude: None,
        };
        let got = fold(&f, &[1.0], &[1.0], &[1.0 / 256.0], 1, None);
        assert_eq!(got, vec![1.0]);
        let got = fold(&f, &[1.0], &[1.0], &[3.0 / 256.0], 1, None);
        assert_eq!(got, vec![1.0 + 2.0 / 128.0]);
    }

    #[test]
    fn dora_rescales_rows_to_the_magnitude() {
        let mut f = linear(false, DType::F32);
        f.magnitude = Some(DType::F32);
        let w: Vec<f32> = (0..12).map(|x| x as f32 - 5.0).collect();
        let mag = [1.0, 2.0, 3.0];
        let got = fold(&f, &w, &A, &B, 2, Some(&mag));
        for o in 0..3 {
            let row = &got[o * 4..o * 4 + 4];
            let norm: f32 = row.iter().map(|v| v * v).sum::<f32>().sqrt();
            assert!((norm - mag[o]).abs() < 1e-5, "row {o}: {norm}");
        }
    }

    #[test]
    fn embedding_update_is_transposed() {
        let f = Fold {
            kind: Kind::Embedding,
            scaling: 2.0,
            weight: DType::F32,
            adapter: DType::F32,
            magnitude: None,
        };
        // A [r=1, num=2], B [dim=3, r=1]: W [2, 3].
        let got = fold(&f, &[0.0; 6], &[1.0, 2.0], &[1.0, 10.0, 100.0], 1, None);
        assert_eq!(got, vec![2.0, 20.0, 200.0, 4.0, 40.0, 400.0]);
    }

    #[test]
    fn bf16_rounding_is_halfs() {
        let mut x = 0x1234_5678u32;
        let mut cases = vec![
            0.0,
            -0.0,
            1.0 + 1.0 / 256.0,
            f32::MAX,
            f32::MIN_POSITIVE / 3.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::from_bits(0x7f7f_ffff),
            f32::from_bits(0xff80_0001),
        ];
        for _ in 0..100_000 {
            // xorshift: every exponent and mantissa pattern, ties and NaNs among them.
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            cases.push(f32::from_bits(x));
            cases.push(f32::from_bits(x & 0xffff_8000));
        }
        for v in cases {
            assert_eq!(bf16_bits(v), half::bf16::from_f32(v).to_bits(), "{v:e}");
        }
    }

    /// Every box of a weight, folded on its own, gives the bytes of the whole weight folded.
    #[test]
    fn boxes_fold_as_the_whole() {
        let (out, inn, r) = (7, 5, 3);
        let a: Vec<f32> = (0..r * inn).map(|k| (k as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..out * r).map(|k| (k as f32 * 0.91).cos()).collect();
        let mag: Vec<f32> = (0..out).map(|k| 1.0 + k as f32 * 0.1).collect();
        for (kind, magnitude, weight, dst_dtype) in [
            (
                Kind::Linear {
                    fan_in_fan_out: false,
                },
                None,
                DType::BF16,
                DType::BF16,
            ),
            (
                Kind::Linear {
                    fan_in_fan_out: false,
                },
                None,
                DType::F32,
                DType::F32,
            ),
            (
                Kind::Linear {
                    fan_in_fan_out: true,
                },
                None,
                DType::BF16,
                DType::F32,
            ),
            (Kind::Embedding, None, DType::F16, DType::F16),
            (
                Kind::Linear {
                    fan_in_fan_out: false,
                },
                Some(DType::F32),
                DType::BF16,
                DType::BF16,
            ),
            (
                Kind::Linear {
                    fan_in_fan_out: true,
                },
                Some(DType::BF16),
                DType::F32,
                DType::BF16,
            ),
        ] {
            let f = Fold {
                kind,
                scaling: 0.75,
                weight,
                adapter: DType::F32,
                magnitude,
            };
            let mut ad = Adapter {
                a: &a,
                b: &b,
                r,
                factor: None,
            };
            let (rows, cols) = if f.transposed() {
                (inn, out)
            } else {
                (out, inn)
            };
            let w: Vec<f32> = (0..rows * cols)
                .map(|k| round_to(weight, (k as f32 * 0.13).tan().clamp(-4.0, 4.0)))
                .collect();
            let wb = encode(&w, weight);
            let factor = magnitude.map(|_| dora_factor(&f, &ad, &wb, &mag).unwrap());
            ad.factor = factor.as_deref();
            let (ws, ds) = (weight.size(), dst_dtype.size());
            let mut whole = vec![0u8; rows * cols * ds];
            fold_box(&f, &ad, [0, 0], [rows, cols], &wb, &mut whole, dst_dtype).unwrap();
            // Boxes of 2 rows and 2 columns (ragged at the ends).
            for r0 in (0..rows).step_by(2) {
                for c0 in (0..cols).step_by(2) {
                    let (nr, nc) = (2.min(rows - r0), 2.min(cols - c0));
                    let src: Vec<u8> = (r0..r0 + nr)
                        .flat_map(|i| wb[(i * cols + c0) * ws..(i * cols + c0 + nc) * ws].to_vec())
                        .collect();
                    let mut got = vec![0u8; nr * nc * ds];
                    fold_box(&f, &ad, [r0, c0], [nr, nc], &src, &mut got, dst_dtype).unwrap();
                    for i in 0..nr {
                        let want =
                            &whole[((r0 + i) * cols + c0) * ds..((r0 + i) * cols + c0 + nc) * ds];
                        assert_eq!(
                            &got[i * nc * ds..(i + 1) * nc * ds],
                            want,
                            "{f:?} at {r0},{c0}"
                        );
                    }
                }
            }
            // A box outside the weight, or of the wrong length, is an error.
            let mut one = vec![0u8; ds];
            assert!(fold_box(&f, &ad, [rows, 0], [1, 1], &wb[..ws], &mut one, dst_dtype).is_err());
            assert!(fold_box(&f, &ad, [0, 0], [1, 1], &wb[..2 * ws], &mut one, dst_dtype).is_err());
        }
    }
}
