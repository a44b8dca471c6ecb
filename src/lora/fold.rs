//! The arithmetic of folding one LoRA module into its base weight, step by step as PEFT's
//! `merge` does it on the CPU: the product `B @ A` and its scaling in f32, each intermediate
//! rounded to the dtype torch would hold it in (nearest even), the result to the base dtype.

use crate::dtype::DType;

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
        DType::BF16 => half::bf16::from_f32(x).to_f32(),
        DType::F16 => half::f16::from_f32(x).to_f32(),
        _ => x,
    }
}

/// `vals`, each already a value of `dtype`, as `dtype`'s little-endian bytes.
pub(crate) fn encode(vals: &[f32], dtype: DType) -> Vec<u8> {
    let mut out = Vec::with_capacity(vals.len() * dtype.size());
    for &v in vals {
        match dtype {
            DType::BF16 => out.extend(half::bf16::from_f32(v).to_bits().to_le_bytes()),
            DType::F16 => out.extend(half::f16::from_f32(v).to_bits().to_le_bytes()),
            _ => out.extend(v.to_le_bytes()),
        }
    }
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

/// Fold `b [out, r] @ a [r, in]` into `w` (row-major, the base weight's shape). `magnitude`
/// (`[out]`) is DoRA's. Every value is already an f32 exactly representable in its dtype.
pub(crate) fn fold(
    f: &Fold,
    w: &[f32],
    a: &[f32],
    b: &[f32],
    r: usize,
    magnitude: Option<&[f32]>,
) -> Vec<f32> {
    let out = b.len() / r.max(1);
    let inn = a.len() / r.max(1);
    // The update in the weight's layout: element (o, i) of `B @ A` at `o * inn + i`, or at
    // `i * out + o` when transposed.
    let transposed = match f.kind {
        Kind::Linear { fan_in_fan_out } => fan_in_fan_out,
        Kind::Embedding => true,
    };
    let mut delta = vec![0f32; out * inn];
    let (rsc, csc) = if transposed {
        (1, out as isize)
    } else {
        (inn as isize, 1)
    };
    // SAFETY: `b` holds `out * r` elements row-major (row stride r), `a` holds `r * inn`
    // (row stride inn) and `delta` holds `out * inn`, every index `o * rsc + i * csc` of which is
    // below its length for o < out, i < inn; the three do not overlap.
    unsafe {
        matrixmultiply::sgemm(
            out,
            r,
            inn,
            1.0,
            b.as_ptr(),
            r as isize,
            1,
            a.as_ptr(),
            inn as isize,
            1,
            0.0,
            delta.as_mut_ptr(),
            rsc,
            csc,
        );
    }
    let s = f.scaling as f32;
    for d in &mut delta {
        *d = round_to(f.adapter, *d * s);
    }
    match (f.kind, magnitude) {
        (Kind::Embedding, None) => {
            // `get_delta_weight(...).to(orig_dtype)`, then added in the weight's dtype.
            for (d, &w) in delta.iter_mut().zip(w) {
                *d = round_to(f.weight, w + round_to(f.weight, *d));
            }
            delta
        }
        (Kind::Linear { .. }, None) => {
            // `weight.data += delta`: added in f32, stored in the weight's dtype.
            for (d, &w) in delta.iter_mut().zip(w) {
                *d = round_to(f.weight, w + *d);
            }
            delta
        }
        // DoRA on a Linear, or on an embedding (one magnitude per embedding column, the delta not
        // rounded first).
        (_, Some(mag)) => {
            let sum_t = promote(f.weight, f.adapter);
            let mut sum = delta;
            for (d, &w) in sum.iter_mut().zip(w) {
                *d = round_to(sum_t, w + *d);
            }
            // The norm of each output row of `W + delta` (a column when transposed).
            let mut sq = vec![0f64; out];
            for (k, &v) in sum.iter().enumerate() {
                let o = if transposed { k % out } else { k / inn.max(1) };
                sq[o] += f64::from(v) * f64::from(v);
            }
            let mag_t = f.magnitude.unwrap_or(DType::F32);
            let factor_t = promote(mag_t, sum_t);
            let factor: Vec<f32> = sq
                .iter()
                .zip(mag)
                .map(|(&q, &m)| {
                    let norm = round_to(sum_t, q.sqrt() as f32);
                    round_to(factor_t, m / norm)
                })
                .collect();
            let prod_t = promote(factor_t, sum_t);
            for (k, v) in sum.iter_mut().enumerate() {
                let o = if transposed { k % out } else { k / inn.max(1) };
                *v = round_to(f.weight, round_to(prod_t, factor[o] * *v));
            }
            sum
        }
    }
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
}
