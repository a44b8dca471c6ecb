//! Boxes of tensors: intersection, DTensor sharding geometry, and coverage checks.
//!
//! A box is an N-d hyper-rectangle given by per-dimension offsets and sizes, exactly DCP's
//! `ChunkStorageMetadata`. Everything here is pure arithmetic; callers decide what a result means.

/// Product of a shape, `None` on overflow. The empty shape (0-dim) has one element.
pub fn numel(shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d))
}

/// True when `strides` are the row-major contiguous strides of `sizes`.
pub fn is_contiguous(sizes: &[u64], strides: &[u64]) -> bool {
    let mut expected = 1u64;
    for (&size, &stride) in sizes.iter().zip(strides).rev() {
        if stride != expected {
            return false;
        }
        expected = expected.saturating_mul(size);
    }
    sizes.len() == strides.len()
}

/// Row-major contiguous strides, in elements.
pub fn contiguous_strides(shape: &[u64]) -> Vec<u64> {
    let mut strides = vec![1u64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1].saturating_mul(shape[i + 1]);
    }
    strides
}

/// The boxes (offsets, sizes) that elements `[lo, hi)` of a row-major tensor of `shape` make, in
/// order: at most `2 * (ndim - 1) + 1`, each a contiguous run of the flat elements. A flat
/// range of a 1-D buffer (an FSDP1 flat parameter, a ZeRO partition, a Megatron
/// `flattened_range`) is so expressed as ordinary pieces of the tensor it holds.
pub fn flat_range_boxes(shape: &[u64], lo: u64, hi: u64) -> Vec<(Vec<u64>, Vec<u64>)> {
    if lo >= hi {
        return Vec::new();
    }
    let Some((&rows, rest)) = shape.split_first() else {
        return vec![(Vec::new(), Vec::new())];
    };
    let inner = numel(rest).unwrap_or(0);
    if inner == 0 {
        return Vec::new();
    }
    let row = |r: u64, sub: Vec<(Vec<u64>, Vec<u64>)>| {
        sub.into_iter().map(move |(mut o, mut s)| {
            o.insert(0, r);
            s.insert(0, 1);
            (o, s)
        })
    };
    let (r0, c0) = (lo / inner, lo % inner);
    let (r1, c1) = (hi / inner, hi % inner);
    let mut out = Vec::new();
    if r0 == r1 {
        out.extend(row(r0, flat_range_boxes(rest, c0, c1)));
        return out;
    }
    let mut first_full = r0;
    if c0 != 0 {
        out.extend(row(r0, flat_range_boxes(rest, c0, inner)));
        first_full += 1;
    }
    if r1 > first_full {
        let mut o = vec![first_full];
        o.extend(std::iter::repeat_n(0, rest.len()));
        let mut s = vec![r1 - first_full];
        s.extend_from_slice(rest);
        out.push((o, s));
    }
    if c1 != 0 && r1 < rows {
        out.extend(row(r1, flat_range_boxes(rest, 0, c1)));
    }
    out
}

/// An N-d box: `offsets[d] .. offsets[d] + sizes[d]` in each dimension.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NdBox {
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
}

impl NdBox {
    /// The box covering a whole tensor of `shape`.
    pub fn whole(shape: &[u64]) -> NdBox {
        NdBox {
            offsets: vec![0; shape.len()],
            sizes: shape.to_vec(),
        }
    }

    /// Number of elements, `None` on overflow.
    pub fn numel(&self) -> Option<u64> {
        numel(&self.sizes)
    }

    pub fn is_empty(&self) -> bool {
        self.sizes.contains(&0)
    }

    /// The common part of two boxes of the same rank, or `None` when they do not meet.
    pub fn intersect(&self, other: &NdBox) -> Option<NdBox> {
        if self.offsets.len() != other.offsets.len() {
            return None;
        }
        let mut offsets = Vec::with_capacity(self.offsets.len());
        let mut sizes = Vec::with_capacity(self.offsets.len());
        for d in 0..self.offsets.len() {
            let lo = self.offsets[d].max(other.offsets[d]);
            let hi = self.end(d).min(other.end(d));
            if hi <= lo {
                return None;
            }
            offsets.push(lo);
            sizes.push(hi - lo);
        }
        if self.offsets.is_empty() && (self.is_empty() || other.is_empty()) {
            return None;
        }
        Some(NdBox { offsets, sizes })
    }

    /// Exclusive end in dimension `d` (saturating: boxes are validated before use).
    pub fn end(&self, d: usize) -> u64 {
        self.offsets[d].saturating_add(self.sizes[d])
    }

    /// True when this box lies inside a tensor of `shape`.
    pub fn fits_in(&self, shape: &[u64]) -> bool {
        self.offsets.len() == shape.len()
            && self.sizes.len() == shape.len()
            && (0..shape.len()).all(|d| {
                self.offsets[d]
                    .checked_add(self.sizes[d])
                    .is_some_and(|end| end <= shape[d])
            })
    }
}

/// `torch.chunk` geometry for one dimension: the part of `len` that chunk `index` of `count` gets,
/// as `(offset, size)`. Chunks are `ceil(len / count)` long; trailing ones may be short or empty.
pub fn chunk_1d(len: u64, count: u64, index: u64) -> (u64, u64) {
    if count == 0 {
        return (0, len);
    }
    let chunk = len.div_ceil(count);
    let start = chunk.saturating_mul(index).min(len);
    let end = start.saturating_add(chunk).min(len);
    (start, end - start)
}

/// How one mesh dimension places a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// `Shard(d)`: split tensor dim `d` across this mesh dimension.
    Shard(usize),
    /// `Replicate()`: every coordinate along this mesh dimension holds the same data.
    Replicate,
}

/// The box rank `rank` of a `mesh` holds under `placements`, following DTensor: mesh dimensions are
/// applied in order, each `Shard(d)` chunking what the previous ones left of dim `d`. A `Shard(d)` for
/// a dim the tensor lacks acts as `Replicate`.
pub fn local_box(shape: &[u64], mesh: &[usize], placements: &[Placement], rank: usize) -> NdBox {
    local_box_at(shape, mesh, placements, &mesh_coords(mesh, rank))
}

/// [`local_box`] of the rank at mesh coordinate `coords` (a DTensor saved per rank records its
/// coordinate, not its place in a row-major numbering).
pub fn local_box_at(
    shape: &[u64],
    mesh: &[usize],
    placements: &[Placement],
    coords: &[usize],
) -> NdBox {
    let mut b = NdBox::whole(shape);
    for (i, p) in placements.iter().enumerate() {
        if let (Placement::Shard(d), Some(&size), Some(&c)) = (p, mesh.get(i), coords.get(i)) {
            if *d < shape.len() {
                let (off, len) = chunk_1d(b.sizes[*d], size as u64, c as u64);
                b.offsets[*d] += off;
                b.sizes[*d] = len;
            }
        }
    }
    b
}

/// Row-major coordinates of `rank` in a mesh.
pub fn mesh_coords(mesh: &[usize], rank: usize) -> Vec<usize> {
    let mut coords = vec![0; mesh.len()];
    let mut r = rank;
    for i in (0..mesh.len()).rev() {
        let m = mesh[i].max(1);
        coords[i] = r % m;
        r /= m;
    }
    coords
}

/// What is wrong with how a set of boxes covers a tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CoverageProblem {
    /// NdBox `index` is not inside the tensor.
    OutOfBounds { index: usize },
    /// Boxes `a` and `b` share elements.
    Overlap { a: usize, b: usize },
    /// Some elements are in no box: `missing` of them.
    Gap { missing: u64 },
}

impl CoverageProblem {
    /// A sentence for the user, naming the boxes by their offsets.
    pub fn describe(&self, shape: &[u64], boxes: &[NdBox]) -> String {
        let offsets = |i: usize| {
            boxes
                .get(i)
                .map(|b| format!("{:?}", b.offsets))
                .unwrap_or_default()
        };
        match self {
            CoverageProblem::OutOfBounds { index } => format!(
                "piece at offsets {} with sizes {:?} lies outside the shape {shape:?}",
                offsets(*index),
                boxes
                    .get(*index)
                    .map(|b| b.sizes.clone())
                    .unwrap_or_default()
            ),
            CoverageProblem::Overlap { a, b } => {
                format!(
                    "pieces at offsets {} and {} overlap",
                    offsets(*a),
                    offsets(*b)
                )
            }
            CoverageProblem::Gap { missing } => {
                format!("{missing} elements of shape {shape:?} are in no piece (a rank's data is missing?)")
            }
        }
    }
}

/// Check that `boxes` cover a tensor of `shape` exactly once: every box inside, no two overlapping,
/// and the volumes adding up to the whole (which, with no overlap, means no gap).
pub fn check_coverage(shape: &[u64], boxes: &[NdBox]) -> Vec<CoverageProblem> {
    let mut problems = Vec::new();
    let mut inside = Vec::new();
    for (i, b) in boxes.iter().enumerate() {
        if b.fits_in(shape) {
            inside.push(i);
        } else {
            problems.push(CoverageProblem::OutOfBounds { index: i });
        }
    }
    // Sweep along the dim where boxes start at the most distinct offsets (the one they are cut
    // on), sorted by it: boxes starting at or after the end of box `a` there cannot meet it, so
    // a grid of n boxes costs about n log n, not n^2.
    let sweep = (0..shape.len())
        .max_by_key(|&d| {
            let starts: std::collections::BTreeSet<u64> =
                inside.iter().map(|&i| boxes[i].offsets[d]).collect();
            starts.len()
        })
        .unwrap_or(0);
    inside.sort_by_key(|&i| boxes[i].offsets.get(sweep).copied().unwrap_or(0));
    for (k, &a) in inside.iter().enumerate() {
        for &b in &inside[k + 1..] {
            let (ba, bb) = (&boxes[a], &boxes[b]);
            if !ba.offsets.is_empty() && bb.offsets[sweep] >= ba.end(sweep) {
                break;
            }
            let empty = ba.is_empty() || bb.is_empty();
            if !empty && ba.intersect(bb).is_some() {
                problems.push(CoverageProblem::Overlap {
                    a: a.min(b),
                    b: a.max(b),
                });
            }
        }
    }
    let total = numel(shape).unwrap_or(u64::MAX);
    let covered = inside
        .iter()
        .map(|&i| boxes[i].numel().unwrap_or(u64::MAX))
        .fold(0u64, |acc, n| acc.saturating_add(n));
    let overlapping = problems
        .iter()
        .any(|p| matches!(p, CoverageProblem::Overlap { .. }));
    if !overlapping && covered < total {
        problems.push(CoverageProblem::Gap {
            missing: total - covered,
        });
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn bx(offsets: &[u64], sizes: &[u64]) -> NdBox {
        NdBox {
            offsets: offsets.to_vec(),
            sizes: sizes.to_vec(),
        }
    }

    #[test]
    fn chunk_matches_torch_chunk() {
        // torch.arange(10).chunk(4) -> sizes 3,3,3,1
        let parts: Vec<_> = (0..4).map(|i| chunk_1d(10, 4, i)).collect();
        assert_eq!(parts, vec![(0, 3), (3, 3), (6, 3), (9, 1)]);
        // torch.arange(5).chunk(4) -> sizes 2,2,1 and nothing for the last rank
        let parts: Vec<_> = (0..4).map(|i| chunk_1d(5, 4, i)).collect();
        assert_eq!(parts, vec![(0, 2), (2, 2), (4, 1), (5, 0)]);
    }

    #[test]
    fn two_d_mesh_composes_placements() {
        let shape = [5, 7];
        let mesh = [2, 2];
        let pl = [Placement::Shard(0), Placement::Shard(1)];
        assert_eq!(local_box(&shape, &mesh, &pl, 0), bx(&[0, 0], &[3, 4]));
        assert_eq!(local_box(&shape, &mesh, &pl, 1), bx(&[0, 4], &[3, 3]));
        assert_eq!(local_box(&shape, &mesh, &pl, 3), bx(&[3, 4], &[2, 3]));
        // Shard(0) twice nests the chunking.
        let pl = [Placement::Shard(0), Placement::Shard(0)];
        assert_eq!(local_box(&[8], &mesh, &pl, 3), bx(&[6], &[2]));
        // A dim the tensor lacks replicates.
        let pl = [Placement::Shard(1), Placement::Replicate];
        assert_eq!(local_box(&[6], &mesh, &pl, 2), bx(&[0], &[6]));
    }

    #[test]
    fn coverage_finds_gap_and_overlap() {
        let shape = [4, 4];
        let good = [bx(&[0, 0], &[2, 4]), bx(&[2, 0], &[2, 4])];
        assert!(check_coverage(&shape, &good).is_empty());
        let gap = [bx(&[0, 0], &[2, 4])];
        assert_eq!(
            check_coverage(&shape, &gap),
            vec![CoverageProblem::Gap { missing: 8 }]
        );
        let overlap = [bx(&[0, 0], &[3, 4]), bx(&[2, 0], &[2, 4])];
        assert_eq!(
            check_coverage(&shape, &overlap),
            vec![CoverageProblem::Overlap { a: 0, b: 1 }]
        );
        let outside = [bx(&[0, 0], &[5, 4])];
        assert_eq!(
            check_coverage(&shape, &outside)[0],
            CoverageProblem::OutOfBounds { index: 0 }
        );
        // A 0-dim tensor is covered by one empty-offset box.
        assert!(check_coverage(&[], &[bx(&[], &[])]).is_empty());
        assert_eq!(
            check_coverage(&[], &[]),
            vec![CoverageProblem::Gap { missing: 1 }]
        );
    }

    proptest! {
        #[test]
        fn every_mesh_layout_covers_exactly_once(
            shape in prop::collection::vec(0u64..9, 0..4),
            mesh in prop::collection::vec(1usize..4, 1..3),
            dims in prop::collection::vec(0usize..4, 1..3),
        ) {
            let placements: Vec<Placement> = mesh.iter().zip(dims.iter().cycle())
                .map(|(_, &d)| if d == 3 { Placement::Replicate } else { Placement::Shard(d) })
                .collect();
            let world: usize = mesh.iter().product();
            let mut boxes: Vec<NdBox> = (0..world)
                .map(|r| local_box(&shape, &mesh, &placements, r))
                .filter(|b| !b.is_empty() || shape.is_empty())
                .collect();
            boxes.sort();
            boxes.dedup();
            if numel(&shape) != Some(0) {
                prop_assert!(check_coverage(&shape, &boxes).is_empty());
            }
        }
    }
}
