//! Copying from object storage input by input: the pieces of a checkpoint saved on many ranks
//! fetched in a few large GETs per object, several in flight across objects, each piece written
//! to its place in the outputs as its bytes arrive.
//!
//! The unit-major copy ([`super::run_unit`]) gathers each destination block from every piece
//! that meets it. From local files that costs nothing; from objects it costs GETs, and at 512
//! ranks a rank file of 2.5 MB was fetched in about 23 of them where a download takes one (a
//! consolidation from `moto_server` took 6x a parallel boto3 download). Here the GETs follow the
//! inputs (one per run of needed bytes, at most [`CHUNK_BYTES`]) and the writes follow the
//! pieces: a piece is one or a few contiguous runs of its region (FSDP shards rows), each written
//! with one `pwrite`. Memory is the GETs in flight, at most [`IN_FLIGHT`] x [`CHUNK_BYTES`].
//!
//! A region is copied here when it is written whole (no part's clip, not computed) and every fill
//! of it is a plain copy of an object's bytes whose runs are few or long; every other region is
//! left to the unit-major copy. A region a ZIP CRC covers (a torch.save record, a DCP item's
//! data) gets the CRC-32 of each run as it is written, and its CRC is those combined in order.

use std::borrow::Cow;
use std::collections::HashMap;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::cast;
use crate::error::{Error, ErrorKind, Result};
use crate::model::{contiguous_strides, numel, Encoding};
use crate::plan::{FilePlan, Fill, Plan, Region};

use super::write::{start_writeback, write_at};
use super::{checked_fills, fill_end, ExecOptions, Input, Span, Unit, WRITEBACK_BYTES};

/// Most bytes one GET asks for ([`crate::storage::gets_of`]): a rank file of up to this size
/// comes in one request, as a download fetches it.
const CHUNK_BYTES: u64 = crate::storage::GET_BYTES;
/// GETs in flight at once, over all inputs.
const IN_FLIGHT: usize = crate::storage::GETS_IN_FLIGHT;
/// Pieces planned at once: each is a few hundred bytes, and a checkpoint of millions of pieces
/// is copied a batch at a time.
const BATCH_PIECES: usize = 1 << 17;
/// A piece of more runs than this is taken only when its runs are at least [`LONG_RUN`] bytes:
/// a column shard written row by row would cost a system call per few bytes.
const MANY_RUNS: u64 = 64;
const LONG_RUN: u64 = 64 << 10;
/// Runs at least this long are written through [`write_at`]'s pipe; shorter ones with `pwrite`.
const PIPE_RUN: u64 = 64 << 10;

/// A fill of a region, or a band of its rows, with where its runs lie on both sides.
struct Band<'r> {
    /// Index of the destination in the window's files.
    file: usize,
    /// Index of the region in its file, and the region.
    ri: usize,
    region: &'r Region,
    fill: Fill,
    span: Span,
    /// The input's bytes the piece is read from: its own, or the whole DCP item it lies in.
    fetch: Range<u64>,
}

/// The window's destinations, as [`super::run_files`] holds them.
pub(super) struct Destinations<'a> {
    pub files: &'a [(usize, Cow<'a, FilePlan>)],
    pub sinks: &'a [super::FileSink<'a>],
    /// Bytes written to each output since its writeback was last started.
    pub unflushed: &'a [AtomicU64],
}

/// What [`copy_input_major`] wrote.
#[derive(Default)]
pub(super) struct Scattered {
    /// Per file of the window and region, whether it was written here.
    pub done: Vec<Vec<bool>>,
    /// The CRC-32 of each region written here that has CRC slots, by (file, region).
    pub crcs: HashMap<(usize, usize), u32>,
}

/// The CRC-32 of `len` bytes written at byte `at` of region `ri` of file `file` of the window.
struct RunCrc {
    file: usize,
    ri: usize,
    at: u64,
    len: u64,
    crc: u32,
}

/// Copy every region of the window this module can take (see the module docs), skipping the
/// files marked in `skip`.
pub(super) fn copy_input_major(
    plan: &Plan,
    to: &Destinations,
    skip: &[bool],
    sources: &[Input],
    opts: &ExecOptions,
) -> Result<Scattered> {
    let mut done: Vec<Vec<bool>> = to
        .files
        .iter()
        .map(|(_, f)| vec![false; f.regions.len()])
        .collect();
    if !sources.iter().any(Input::reads_by_request) {
        return Ok(Scattered {
            done,
            ..Scattered::default()
        });
    }
    let mut runs = Vec::new();
    let mut batch = Vec::new();
    for (fi, (_, f)) in to.files.iter().enumerate() {
        let writable = to.sinks.get(fi).and_then(super::FileSink::out).is_some();
        if skip.get(fi).copied().unwrap_or(true) || !writable {
            continue;
        }
        for (ri, r) in f.regions.iter().enumerate() {
            if plan.computed(r).is_some() {
                continue;
            }
            let fills = checked_fills(plan, r, None, sources)?;
            let Some(pieces) = pieces_of(fi, ri, r, &fills, sources) else {
                continue;
            };
            done[fi][ri] = true;
            batch.extend(pieces);
            if batch.len() >= BATCH_PIECES {
                copy_batch(&batch, to, sources, opts, &mut runs)?;
                batch.clear();
            }
        }
    }
    copy_batch(&batch, to, sources, opts, &mut runs)?;
    let crcs = combine_crcs(runs, to)?;
    Ok(Scattered { done, crcs })
}

/// Each region's CRC-32 from the CRCs of its runs, which tile it (its fills cover it once).
fn combine_crcs(mut runs: Vec<RunCrc>, to: &Destinations) -> Result<HashMap<(usize, usize), u32>> {
    runs.sort_unstable_by_key(|c| (c.file, c.ri, c.at));
    let mut crcs = HashMap::new();
    for region in runs.chunk_by(|a, b| (a.file, a.ri) == (b.file, b.ri)) {
        let (file, ri) = (region[0].file, region[0].ri);
        let nbytes = to
            .files
            .get(file)
            .and_then(|(_, f)| f.regions.get(ri))
            .map_or(0, Region::nbytes);
        let mut crc = crc32fast::Hasher::new();
        let mut at = 0;
        for c in region {
            if c.at != at {
                return Err(Error::bug("the runs copied into a region do not tile it"));
            }
            crc.combine(&crc32fast::Hasher::new_with_initial_len(c.crc, c.len));
            at += c.len;
        }
        if at != nbytes {
            return Err(Error::bug("the runs copied into a region do not cover it"));
        }
        crcs.insert((file, ri), crc.finalize());
    }
    Ok(crcs)
}

/// The pieces of region `r` (destination `file`), or `None` when a fill is not a plain copy of
/// an object's bytes in few or long runs, or the fills do not cover the region.
fn pieces_of<'r>(
    file: usize,
    ri: usize,
    r: &'r Region,
    fills: &[Fill],
    sources: &[Input],
) -> Option<Vec<Band<'r>>> {
    let rstrides = contiguous_strides(&r.shape);
    let whole = Unit {
        file,
        region: 0,
        start: vec![0; r.shape.len()],
        sizes: r.shape.clone(),
    };
    let mut pieces = Vec::new();
    let mut covered = 0u64;
    for fill in fills {
        let remote = sources.get(fill.input)?.object().is_some();
        // An unopened DCP item (a small item of an object, see `Encoding::Saved`) is fetched
        // whole and opened here; compressed items are left to the unit-major copy.
        let (bands, item) = match fill.encoding {
            Encoding::Raw => (bands(fill)?, None),
            Encoding::Saved {
                item_offset,
                item_length,
                ..
            } if item_length <= CHUNK_BYTES => (
                vec![fill.clone()],
                Some(item_offset..item_offset + item_length),
            ),
            _ => return None,
        };
        if !remote {
            return None;
        }
        for band in bands {
            let Some(span) = super::span(&band, &whole, &rstrides, r.dtype) else {
                continue;
            };
            let se = band.dtype.size() as u64;
            let runs: u64 = span.ext[..span.outer].iter().product();
            if runs > MANY_RUNS && span.run * se < LONG_RUN {
                return None;
            }
            let elements = numel(&band.sizes)?;
            let fetch = match &item {
                Some(item) => item.clone(),
                None => band.offset..fill_end(&band)?,
            };
            // A strided view read across (a column slice of a wide tensor) would fetch far more
            // than it uses.
            if item.is_none() && elements * se * 2 < fetch.end - fetch.start {
                return None;
            }
            covered += elements;
            pieces.push(Band {
                file,
                ri,
                region: r,
                fill: band,
                span,
                fetch,
            });
        }
    }
    (covered == numel(&r.shape)?).then_some(pieces)
}

/// `fill` cut into bands of its leading rows, each spanning at most [`CHUNK_BYTES`] of its
/// source (`None` when one row spans more).
fn bands(fill: &Fill) -> Option<Vec<Fill>> {
    let extent = fill_end(fill)? - fill.offset;
    if extent <= CHUNK_BYTES || fill.sizes.is_empty() {
        return Some(vec![fill.clone()]);
    }
    let mut row = fill.clone();
    row.sizes[0] = 1;
    let row_extent = fill_end(&row)? - row.offset;
    if row_extent > CHUNK_BYTES {
        return None;
    }
    let step = fill.strides[0] * fill.dtype.size() as u64;
    let rows = match step {
        0 => fill.sizes[0],
        _ => 1 + (CHUNK_BYTES - row_extent) / step,
    };
    let mut out = Vec::new();
    let mut at = 0;
    while at < fill.sizes[0] {
        let n = rows.min(fill.sizes[0] - at);
        let mut band = fill.clone();
        band.offset += at * step;
        band.start[0] += at;
        band.sizes[0] = n;
        out.push(band);
        at += n;
    }
    Some(out)
}

/// Fetch the source bytes of `pieces`, input by input in runs of at most [`CHUNK_BYTES`], and
/// write each piece as its run arrives.
fn copy_batch(
    pieces: &[Band],
    to: &Destinations,
    sources: &[Input],
    opts: &ExecOptions,
    runs: &mut Vec<RunCrc>,
) -> Result<()> {
    // (input, bytes fetched in one GET, the pieces inside them)
    let chunks = crate::storage::gets_of(
        &pieces
            .iter()
            .map(|p| (p.fill.input, p.fetch.clone()))
            .collect::<Vec<_>>(),
    );
    let ranges = chunks
        .iter()
        .map(|(input, run, _)| {
            let object = sources
                .get(*input)
                .and_then(Input::object)
                .ok_or_else(|| Error::bug("a piece of a local input was taken"))?;
            Ok((object, run.clone()))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut scratch = Vec::new();
    crate::storage::fetch_each(&ranges, IN_FLIGHT, |ci, bytes| {
        if opts.cancel.load(Ordering::Relaxed) {
            return Err(Error::new(ErrorKind::Io, "interrupted"));
        }
        let (input, run, ks) = &chunks[ci];
        // The last DCP item opened: the pieces of one item are next to each other.
        let mut opened: Option<(u64, Vec<u8>)> = None;
        for &k in ks {
            let p = &pieces[k];
            let Encoding::Saved { item_offset, .. } = p.fill.encoding else {
                write_piece(p, &bytes, run.start, to, opts, &mut scratch, runs)?;
                continue;
            };
            if opened.as_ref().is_none_or(|(at, _)| *at != item_offset) {
                let item = (p.fetch.start - run.start) as usize..(p.fetch.end - run.start) as usize;
                let item = bytes
                    .get(item)
                    .ok_or_else(|| Error::bug("an item lies outside its fetched bytes"))?;
                let decoded =
                    crate::formats::codec::decode(&p.fill.encoding, item, 0, p.fill.dtype)
                        .map_err(|e| {
                            let path = sources.get(*input).map(Input::path);
                            let e = e.within(item_offset).tensor(&p.region.name);
                            match path {
                                Some(path) => e.file(path),
                                None => e,
                            }
                        })?;
                opened = Some((item_offset, decoded));
            }
            let elements = opened.as_ref().map_or(&[][..], |(_, d)| &d[..]);
            write_piece(p, elements, 0, to, opts, &mut scratch, runs)?;
        }
        Ok(())
    })
}

/// Write `p`'s runs from `bytes`: the input's bytes from offset `base` on, or for an item the
/// item's elements (`base` 0). Each run's CRC-32 goes to `crcs` when a CRC covers the region.
fn write_piece(
    p: &Band,
    bytes: &[u8],
    base: u64,
    to: &Destinations,
    opts: &ExecOptions,
    scratch: &mut Vec<u8>,
    crcs: &mut Vec<RunCrc>,
) -> Result<()> {
    let (r, fill, sp) = (p.region, &p.fill, &p.span);
    let Some((out, path)) = to.sinks.get(p.file).and_then(super::FileSink::out) else {
        return Err(Error::bug("a piece has no output"));
    };
    let rstrides = contiguous_strides(&r.shape);
    let (se, de) = (fill.dtype.size() as u64, r.dtype.size() as u64);
    let mut idx = vec![0u64; sp.outer];
    let mut written = 0u64;
    'runs: loop {
        let s = sp.src0 + se * (0..sp.outer).map(|d| idx[d] * fill.strides[d]).sum::<u64>();
        let t = sp.dst0 + de * (0..sp.outer).map(|d| idx[d] * rstrides[d]).sum::<u64>();
        let src = s
            .checked_sub(base)
            .and_then(|a| bytes.get(a as usize..(a + sp.run * se) as usize))
            .ok_or_else(|| Error::bug("a piece lies outside its fetched bytes").tensor(&r.name))?;
        let run = if fill.dtype == r.dtype {
            src
        } else {
            scratch.resize((sp.run * de) as usize, 0);
            cast::convert(src, fill.dtype, scratch, r.dtype);
            &scratch[..]
        };
        let at = r.offset + t;
        if run.len() as u64 >= PIPE_RUN {
            write_at(out, path, run, at).map_err(|e| e.tensor(&r.name))?;
        } else {
            out.write_all_at(run, at)
                .map_err(|e| Error::io(path, e).at(at).tensor(&r.name))?;
        }
        written += run.len() as u64;
        if !r.crc_slots.is_empty() {
            crcs.push(RunCrc {
                file: p.file,
                ri: p.ri,
                at: t,
                len: run.len() as u64,
                crc: crc32fast::hash(run),
            });
        }
        // Odometer over the dims that are not part of the run.
        let mut d = sp.outer;
        loop {
            if d == 0 {
                break 'runs;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < sp.ext[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    if let (true, Some(dirty)) = (opts.durable, to.unflushed.get(p.file)) {
        let total = dirty.fetch_add(written, Ordering::Relaxed) + written;
        if total >= WRITEBACK_BYTES && dirty.swap(0, Ordering::Relaxed) > 0 {
            start_writeback(out);
        }
    }
    opts.progress.advance(written);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;

    fn fill(rows: u64, cols: u64, row_stride: u64) -> Fill {
        Fill {
            input: 0,
            encoding: Encoding::Raw,
            dtype: DType::F32,
            offset: 100,
            strides: vec![row_stride, 1],
            start: vec![8, 0],
            sizes: vec![rows, cols],
        }
    }

    #[test]
    fn a_fill_larger_than_a_get_is_cut_into_bands_of_whole_rows() {
        // 5000 rows of 1024 f32: 20 MB, over one GET of 16 MiB.
        let f = fill(5000, 1024, 1024);
        let cut = bands(&f).unwrap();
        assert_eq!(cut.len(), 2);
        let mut row = 8;
        let mut offset = 100;
        for b in &cut {
            assert_eq!((b.start[0], b.offset), (row, offset));
            assert!(fill_end(b).unwrap() - b.offset <= CHUNK_BYTES);
            row += b.sizes[0];
            offset += b.sizes[0] * 1024 * 4;
        }
        assert_eq!(row, 8 + 5000);
        // Small fills stay whole; a row wider than a GET is not taken.
        assert_eq!(
            bands(&fill(10, 1024, 1024)).unwrap(),
            vec![fill(10, 1024, 1024)]
        );
        assert!(bands(&fill(2, 5 << 20, 5 << 20)).is_none());
    }
}
