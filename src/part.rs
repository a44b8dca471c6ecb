//! Partitioned runs: which bytes of an output part `I` of `N` writes.
//!
//! A run split over machines needs no coordinator when every part can work out its share alone:
//! the share is a pure function of the output's byte layout (the lengths of its files, in plan
//! order) and `(I, N)`. The files are laid end to end as one stream of bytes, and the stream is
//! cut in `N` runs of nearly equal length, so a single large file splits as well as many small
//! ones. Cuts fall on [`ALIGN`] boundaries of the file they land in, so no two parts ever write
//! the same page of a shared file (filesystems that lock or cache by page or block then never see
//! two writers of one). Files whose bytes are not known before the end (a DCP `.metadata`) are
//! not in the layout: the part that commits writes them.

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

/// Cut positions are multiples of this inside the file they fall in.
pub const ALIGN: u64 = 4096;

/// `--part I/N`: part `index` (0-based) of `count`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PartSpec {
    pub index: usize,
    pub count: usize,
}

impl FromStr for PartSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<PartSpec, String> {
        let bad = || format!("`{s}` is not a part like 0/4 (0-based index / number of parts)");
        let (i, n) = s.split_once('/').ok_or_else(bad)?;
        let index: usize = i.trim().parse().map_err(|_| bad())?;
        let count: usize = n.trim().parse().map_err(|_| bad())?;
        if count == 0 {
            return Err(format!("`{s}`: the number of parts must be at least 1"));
        }
        if index >= count {
            return Err(format!(
                "`{s}`: parts are numbered from 0 to {} (0-based, as a Slurm array or a Kubernetes \
                 Indexed Job gives them)",
                count - 1
            ));
        }
        Ok(PartSpec { index, count })
    }
}

impl fmt::Display for PartSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

/// A byte range of one output file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileRange {
    /// Index of the file in the layout (plan order).
    pub file: usize,
    pub bytes: Range<u64>,
}

/// What one part writes: at most one range per file, in file order. An empty file belongs to the
/// part whose stream range holds its position, so that some part creates it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Share {
    pub part: PartSpec,
    pub ranges: Vec<FileRange>,
}

impl Share {
    /// Bytes this part writes.
    pub fn len(&self) -> u64 {
        self.ranges
            .iter()
            .map(|r| r.bytes.end - r.bytes.start)
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// This part's range of file `file`, if it has one.
    pub fn range_of(&self, file: usize) -> Option<Range<u64>> {
        self.ranges
            .binary_search_by_key(&file, |r| r.file)
            .ok()
            .map(|k| self.ranges[k].bytes.clone())
    }
}

/// The `N + 1` stream positions where parts start and end: `0`, then each ideal cut `k·T/N` moved
/// down to an [`ALIGN`] boundary of the file it falls in, then `T`. Each part is within `ALIGN` of
/// the mean `T/N`.
pub fn cuts(file_lens: &[u64], count: usize) -> Vec<u64> {
    cuts_aligned(file_lens, count, ALIGN)
}

/// [`cuts`] on boundaries of `align` bytes instead of [`ALIGN`] (tests cut anywhere with 1).
pub fn cuts_aligned(file_lens: &[u64], count: usize, align: u64) -> Vec<u64> {
    let align = align.max(1);
    let total: u64 = file_lens.iter().sum();
    let mut starts = Vec::with_capacity(file_lens.len());
    let mut at = 0u64;
    for &len in file_lens {
        starts.push(at);
        at += len;
    }
    let mut out = Vec::with_capacity(count + 1);
    out.push(0);
    for k in 1..count {
        let ideal = (total as u128 * k as u128 / count as u128) as u64;
        // The last file starting at or before `ideal` holds it (a run of empty files shares one
        // start, and any of them gives the same boundary).
        let f = starts.partition_point(|&s| s <= ideal).saturating_sub(1);
        let file_start = starts.get(f).copied().unwrap_or(0);
        let aligned = file_start + (ideal - file_start) / align * align;
        out.push(aligned.max(*out.last().unwrap_or(&0)));
    }
    out.push(total);
    out
}

/// The share of part `part` of an output whose files have `file_lens` bytes, in plan order.
pub fn share(file_lens: &[u64], part: PartSpec) -> Share {
    share_aligned(file_lens, part, ALIGN)
}

/// [`share`] with cuts on boundaries of `align` bytes.
pub fn share_aligned(file_lens: &[u64], part: PartSpec, align: u64) -> Share {
    let cuts = cuts_aligned(file_lens, part.count, align);
    let (lo, hi) = (cuts[part.index], cuts[part.index + 1]);
    let last = part.index + 1 == part.count;
    let mut ranges = Vec::new();
    let mut start = 0u64;
    for (file, &len) in file_lens.iter().enumerate() {
        let end = start + len;
        if len == 0 {
            // Position `start` belongs to the part whose [lo, hi) holds it; the end of the
            // stream to the last part.
            if (lo <= start && start < hi) || (last && start == hi) {
                ranges.push(FileRange { file, bytes: 0..0 });
            }
        } else if start < hi && lo < end {
            ranges.push(FileRange {
                file,
                bytes: lo.max(start) - start..hi.min(end) - start,
            });
        }
        start = end;
    }
    Share { part, ranges }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn spec(index: usize, count: usize) -> PartSpec {
        PartSpec { index, count }
    }

    #[test]
    fn part_specs_parse_and_refuse() {
        assert_eq!("0/4".parse(), Ok(spec(0, 4)));
        assert_eq!("3/4".parse(), Ok(spec(3, 4)));
        assert_eq!(" 1 / 2 ".parse(), Ok(spec(1, 2)));
        assert!("4/4".parse::<PartSpec>().is_err());
        assert!("0/0".parse::<PartSpec>().is_err());
        assert!("-1/4".parse::<PartSpec>().is_err());
        assert!("1".parse::<PartSpec>().is_err());
        assert!("a/b".parse::<PartSpec>().is_err());
        assert_eq!(spec(2, 8).to_string(), "2/8");
    }

    #[test]
    fn one_large_file_splits_in_page_aligned_runs() {
        let lens = [10 * ALIGN + 17];
        let shares: Vec<Share> = (0..3).map(|i| share(&lens, spec(i, 3))).collect();
        let ranges: Vec<Range<u64>> = shares.iter().map(|s| s.ranges[0].bytes.clone()).collect();
        assert_eq!(
            ranges,
            vec![
                0..3 * ALIGN,
                3 * ALIGN..6 * ALIGN,
                6 * ALIGN..10 * ALIGN + 17
            ]
        );
    }

    #[test]
    fn empty_files_and_an_empty_output_still_have_an_owner() {
        for lens in [
            vec![],
            vec![0],
            vec![0, 0, 5, 0],
            vec![ALIGN * 8, 0, ALIGN * 8, 0],
        ] {
            for count in 1..5 {
                let mut owners = vec![0; lens.len()];
                for i in 0..count {
                    for r in share(&lens, spec(i, count)).ranges {
                        owners[r.file] += 1;
                    }
                }
                for (f, &len) in lens.iter().enumerate() {
                    if len == 0 {
                        assert_eq!(owners[f], 1, "{lens:?} in {count}: file {f}");
                    }
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Shares are disjoint, cover every byte of every file, hold at most one range per file,
        /// start on page boundaries of their file and are each within ALIGN of the mean.
        #[test]
        fn shares_tile_the_output(
            lens in prop::collection::vec(
                prop_oneof![Just(0u64), 1u64..100, 1u64..5_000_000],
                0..12,
            ),
            count in 1usize..17,
        ) {
            let total: u64 = lens.iter().sum();
            let mut owner: Vec<Vec<(u64, u64, usize)>> = vec![Vec::new(); lens.len()];
            let mut sizes = Vec::new();
            for i in 0..count {
                let s = share(&lens, spec(i, count));
                prop_assert_eq!(&s, &share(&lens, spec(i, count)), "deterministic");
                prop_assert!(s.ranges.windows(2).all(|w| w[0].file < w[1].file));
                for r in &s.ranges {
                    prop_assert!(r.bytes.start <= r.bytes.end && r.bytes.end <= lens[r.file]);
                    if r.bytes.start > 0 {
                        prop_assert_eq!(r.bytes.start % ALIGN, 0, "cut inside a page");
                    }
                    prop_assert_eq!(s.range_of(r.file), Some(r.bytes.clone()));
                    owner[r.file].push((r.bytes.start, r.bytes.end, i));
                }
                sizes.push(s.len());
            }
            for (f, ranges) in owner.iter_mut().enumerate() {
                ranges.retain(|r| r.0 < r.1 || lens[f] == 0);
                ranges.sort();
                let mut at = 0;
                for &(a, b, _) in ranges.iter() {
                    prop_assert_eq!(a, at, "file {} has a gap or an overlap", f);
                    at = b;
                }
                prop_assert_eq!(at, lens[f], "file {} is not covered", f);
            }
            prop_assert_eq!(sizes.iter().sum::<u64>(), total);
            let mean = total as f64 / count as f64;
            for &size in &sizes {
                prop_assert!((size as f64 - mean).abs() <= ALIGN as f64, "{} vs mean {}", size, mean);
            }
            // "Enough bytes": with 4 pages per part, the largest share is at most 1.25x the mean.
            if total >= 4 * ALIGN * count as u64 {
                let largest = *sizes.iter().max().unwrap_or(&0) as f64;
                prop_assert!(largest <= 1.25 * mean, "largest {} vs mean {}", largest, mean);
            }
        }
    }
}
