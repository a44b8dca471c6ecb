//! The arithmetic of blockwise FP8 (`--quantize fp8-block`), as DeepSeek-V3 and Qwen3-FP8 ship
//! it: per 128×128 tile of a weight, `scale = amax / 448`, each value `x / scale` clamped to
//! ±448 and rounded to the nearest E4M3FN value (ties to even), all in f32 from the source
//! values. Edge tiles count as zero-padded (the padding changes no amax), and an all-zero
//! tile's scale is 1.0, so no tile divides by zero.

use crate::dtype::DType;

/// Rows and columns of a tile.
pub(crate) const TILE: u64 = 128;

/// The largest finite E4M3FN value.
pub(crate) const E4M3_MAX: f32 = 448.0;

/// The E4M3FN byte nearest to `x`, ties to even, as torch's `.to(torch.float8_e4m3fn)` gives it
/// (c10's `fp8e4m3fn_from_fp32_value`): NaN, and magnitudes from 480 up, are NaN (0x7f/0xff);
/// magnitudes in (464, 480) round up to the NaN code too, which callers avoid by clamping.
#[inline]
pub(crate) fn e4m3(x: f32) -> u8 {
    // Without branches, so that the loops over a row vectorise: both codes are computed and one
    // is picked.
    let bits = x.to_bits();
    let sign = (bits >> 24) & 0x80;
    let abs = bits & 0x7fff_ffff;
    // Below 2^-6 the values are subnormal, multiples of 2^-9: scaled by 2^9 (exact) to below 8,
    // and rounded to an integer, ties to even, by adding 2^23 (whose float has no fraction bits:
    // the sum is the rounded value's, in its low mantissa bits). That integer is the code (8,
    // the least normal value's, where it rounds up).
    let subnormal = (f32::from_bits(abs) * 512.0 + 8_388_608.0).to_bits() - 0x4b00_0000;
    // Normal: 3 of the f32's 23 mantissa bits kept, nearest even; the carry moves into the
    // exponent, rebiased from 127 to 7.
    let odd = (abs >> 20) & 1;
    let normal = abs
        .wrapping_add(0x7_ffff + odd)
        .wrapping_sub((127 - 7) << 23)
        >> 20;
    let code = if abs < 121 << 23 { subnormal } else { normal };
    // 480.0: the first magnitude torch does not round into range (NaN's bits are above it).
    let code = if abs >= 0x43f0_0000 { 0x7f } else { code };
    (sign | code) as u8
}

/// The value of an E4M3FN byte.
#[cfg(test)]
fn e4m3_value(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (i32::from((b >> 3) & 0xf), f32::from(b & 7));
    if b & 0x7f == 0x7f {
        return f32::NAN;
    }
    sign * match e {
        0 => m * 2f32.powi(-9),
        _ => (1.0 + m / 8.0) * 2f32.powi(e - 7),
    }
}

/// A tile's scale from its largest magnitude: `amax / 448`, or 1.0 for an all-zero tile (and
/// for one so small that the quotient underflows, whose values then quantize to zero).
pub(crate) fn scale(amax: f32) -> f32 {
    let s = amax / E4M3_MAX;
    if s == 0.0 {
        1.0
    } else {
        s
    }
}

/// `x` quantized with `scale`.
#[inline]
pub(crate) fn quantize(x: f32, scale: f32) -> u8 {
    e4m3((x / scale).clamp(-E4M3_MAX, E4M3_MAX))
}

/// Row `i` of `src` (`cols` values of `dtype`: f32, bf16 or f16, checked by the caller) as f32s
/// into `row`.
fn row_values(src: &[u8], dtype: DType, cols: usize, i: usize, row: &mut Vec<f32>) {
    let es = dtype.size();
    let bytes = &src[i * cols * es..(i + 1) * cols * es];
    row.clear();
    match dtype {
        DType::BF16 => row.extend(
            bytes
                .chunks_exact(2)
                .map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16)),
        ),
        DType::F16 => row.extend(
            bytes
                .chunks_exact(2)
                .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()),
        ),
        _ => row.extend(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        ),
    }
}

/// The scales of the tiles of one band of `rows` rows (at most [`TILE`]) of `cols` columns,
/// `src` row-major in `dtype`: one per 128-column tile.
pub(crate) fn band_scales(src: &[u8], dtype: DType, rows: usize, cols: usize) -> Vec<f32> {
    let tiles = cols.div_ceil(TILE as usize);
    let mut amax = vec![0f32; tiles];
    let mut row = Vec::with_capacity(cols);
    for i in 0..rows {
        row_values(src, dtype, cols, i, &mut row);
        for (t, chunk) in row.chunks(TILE as usize).enumerate() {
            let m = chunk.iter().fold(0f32, |m, v| m.max(v.abs()));
            amax[t] = amax[t].max(m);
        }
    }
    amax.into_iter().map(scale).collect()
}

/// Quantize `rows` rows of `cols` values (`src`, row-major in `dtype`) into `dst`, one byte each:
/// row `i` with the scales `scales_of(i)` (one per 128-column tile, from column `col0` of the
/// weight on).
pub(crate) fn quantize_rows<'s>(
    src: &[u8],
    dtype: DType,
    rows: usize,
    cols: usize,
    col0: usize,
    scales_of: impl Fn(usize) -> &'s [f32],
    dst: &mut [u8],
) {
    let mut row = Vec::with_capacity(cols);
    for i in 0..rows {
        row_values(src, dtype, cols, i, &mut row);
        let scales = scales_of(i);
        let out = &mut dst[i * cols..(i + 1) * cols];
        // A tile's run of the row at a time, with its one scale: a loop the compiler vectorises.
        let tile = TILE as usize;
        let mut j = 0;
        while j < cols {
            let t = (col0 + j) / tile;
            let end = ((t + 1) * tile - col0).min(cols);
            let s = scales.get(t).copied().unwrap_or(1.0);
            for (o, &x) in out[j..end].iter_mut().zip(&row[j..end]) {
                *o = quantize(x, s);
            }
            j = end;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The slow reference: the nearest of all 254 finite codes by exhaustive search, a tie going
    /// to the code with an even mantissa, as IEEE's round to nearest even.
    fn reference(x: f32) -> u8 {
        if x.is_nan() || x.abs() >= 480.0 {
            return if x.is_sign_negative() { 0xff } else { 0x7f };
        }
        let mut best: Option<(u8, f64)> = None;
        for b in 0..=255u8 {
            let v = e4m3_value(b);
            if v.is_nan() || (v.is_sign_negative() != x.is_sign_negative() && v != 0.0) {
                continue;
            }
            // The sign of zero follows x's.
            if v == 0.0 && (b & 0x80 != 0) != x.is_sign_negative() {
                continue;
            }
            let d = (f64::from(v) - f64::from(x)).abs();
            best = match best {
                None => Some((b, d)),
                Some((c, e)) if d < e || (d == e && b & 1 == 0 && c & 1 == 1) => Some((b, d)),
                keep => keep,
            };
        }
        // Between 448 and 480 the nearest even neighbour above 448 is the NaN code.
        let (b, _) = best.unwrap_or((0x7f, 0.0));
        if x.abs() > 464.0 {
            return (b & 0x80) | 0x7f;
        }
        b
    }

    #[test]
    fn every_code_round_trips() {
        for b in 0..=255u8 {
            let v = e4m3_value(b);
            if v.is_nan() {
                assert_eq!(b & 0x7f, 0x7f);
                continue;
            }
            assert_eq!(e4m3(v), b, "code {b:#04x} = {v}");
        }
    }

    #[test]
    fn rounds_as_the_reference() {
        let mut cases: Vec<f32> = vec![
            0.0,
            -0.0,
            448.0,
            -448.0,
            464.0,
            465.0,
            479.0,
            480.0,
            1e9,
            f32::NAN,
            f32::INFINITY,
            2f32.powi(-9),
            2f32.powi(-10),
            3.0 * 2f32.powi(-10),
            2f32.powi(-6),
            2f32.powi(-6) - 2f32.powi(-10),
            f32::MIN_POSITIVE,
        ];
        // Every midpoint between neighbouring codes (the ties), and a hair either side of it.
        for b in 0..0x7eu8 {
            let (lo, hi) = (e4m3_value(b), e4m3_value(b + 1));
            let mid = (lo + hi) / 2.0;
            for x in [
                mid,
                f32::from_bits(mid.to_bits() - 1),
                f32::from_bits(mid.to_bits() + 1),
            ] {
                cases.push(x);
                cases.push(-x);
            }
        }
        let mut s = 0x9e37_79b9u32;
        for _ in 0..200_000 {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            // Magnitudes from 2^-12 to 2^9, signs and mantissas at random.
            let e = 115 + (s >> 27) % 22;
            cases.push(f32::from_bits(
                (s & 0x8000_0000) | (e << 23) | (s & 0x7f_ffff),
            ));
        }
        for x in cases {
            let (got, want) = (e4m3(x), reference(x));
            assert_eq!(got, want, "{x:e}: {got:#04x} vs {want:#04x}");
        }
    }

    #[test]
    fn ties_go_to_even() {
        // 1.0625 is halfway between 1.0 (0x38) and 1.125 (0x39): even is 0x38.
        assert_eq!(e4m3(1.0625), 0x38);
        // 1.1875 is halfway between 1.125 (0x39) and 1.25 (0x3a): even is 0x3a.
        assert_eq!(e4m3(1.1875), 0x3a);
        // Subnormal ties: 0.5 × 2^-9 goes to 0, 1.5 × 2^-9 to 2 × 2^-9.
        assert_eq!(e4m3(2f32.powi(-10)), 0x00);
        assert_eq!(e4m3(3.0 * 2f32.powi(-10)), 0x02);
        // 7.5 × 2^-9 rounds up into the least normal, 2^-6.
        assert_eq!(e4m3(7.5 * 2f32.powi(-9)), 0x08);
        assert_eq!(e4m3(-2f32.powi(-9)), 0x81);
    }

    #[test]
    fn clamps_and_never_divides_by_zero() {
        assert_eq!(quantize(1e6, 1.0), 0x7e);
        assert_eq!(quantize(-1e6, 1.0), 0xfe);
        assert_eq!(scale(0.0), 1.0);
        assert_eq!(quantize(0.0, scale(0.0)), 0);
        // The tile's largest value is 448 × scale after the division, whatever its rounding.
        for amax in [1.0f32, 0.3, 3.7e-3, 1234.5, 1e-30] {
            let s = scale(amax);
            assert_eq!(quantize(amax, s), 0x7e, "{amax}");
            assert_eq!(quantize(-amax, s), 0xfe, "{amax}");
        }
    }

    /// The slow reference of a whole weight: zero-padded to whole tiles, each tile's scale and
    /// values from its own elements.
    fn reference_weight(w: &[f32], rows: usize, cols: usize) -> (Vec<u8>, Vec<f32>) {
        let (tr, tc) = (rows.div_ceil(128), cols.div_ceil(128));
        let mut scales = vec![0f32; tr * tc];
        let mut q = vec![0u8; rows * cols];
        for bi in 0..tr {
            for bj in 0..tc {
                let mut amax = 0f32;
                for i in bi * 128..bi * 128 + 128 {
                    for j in bj * 128..bj * 128 + 128 {
                        let v = if i < rows && j < cols {
                            w[i * cols + j]
                        } else {
                            0.0
                        };
                        amax = amax.max(v.abs());
                    }
                }
                let s = if amax == 0.0 { 1.0 } else { amax / 448.0 };
                scales[bi * tc + bj] = s;
                for i in bi * 128..(bi * 128 + 128).min(rows) {
                    for j in bj * 128..(bj * 128 + 128).min(cols) {
                        q[i * cols + j] = reference((w[i * cols + j] / s).clamp(-448.0, 448.0));
                    }
                }
            }
        }
        (q, scales)
    }

    #[test]
    fn edge_and_zero_tiles_match_the_reference() {
        // 320 × 200: a partial band of 64 rows and a partial column tile of 72; the second
        // column tile of the first band all zeros.
        let (rows, cols) = (320, 200);
        let mut w: Vec<f32> = (0..rows * cols)
            .map(|k| ((k as f32) * 0.7311).sin() * (1.0 + (k % 17) as f32))
            .collect();
        for i in 0..128 {
            for j in 128..200 {
                w[i * cols + j] = 0.0;
            }
        }
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let mut src = vec![0u8; rows * cols * dtype.size()];
            let wb: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
            crate::cast::convert(&wb, DType::F32, &mut src, dtype);
            let mut vals = vec![0u8; rows * cols * 4];
            crate::cast::convert(&src, dtype, &mut vals, DType::F32);
            let vals: Vec<f32> = vals
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            let (want_q, want_s) = reference_weight(&vals, rows, cols);
            let es = dtype.size();
            let mut scales = Vec::new();
            for band in 0..rows.div_ceil(128) {
                let n = 128.min(rows - band * 128);
                let bytes = &src[band * 128 * cols * es..(band * 128 + n) * cols * es];
                scales.push(band_scales(bytes, dtype, n, cols));
            }
            let flat: Vec<f32> = scales.concat();
            assert_eq!(flat, want_s, "{dtype:?}");
            assert_eq!(flat[1], 1.0);
            let mut q = vec![0u8; rows * cols];
            quantize_rows(&src, dtype, rows, cols, 0, |i| &scales[i / 128], &mut q);
            assert_eq!(q, want_q, "{dtype:?}");
        }
    }
}
