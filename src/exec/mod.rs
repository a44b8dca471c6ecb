//! The executor: runs a [`Plan`], copying bytes and nothing else (the blocks of a computed tensor,
//! a LoRA-merged weight, are gathered the same way and handed to its [`crate::model::Compute`]).
//!
//! Destination files are created at the paths the caller gives (temporary names: see
//! [`crate::output`]), sized up front and written positionally, so work units can run in parallel in
//! any order. A unit is one block of one region: a contiguous run of destination bytes, at most
//! [`BLOCK_BYTES`] unless one row is larger, gathered from the source boxes that meet it. Memory is
//! one block buffer per thread whatever the checkpoint size. The system calls that write the
//! outputs are in [`write`].

use std::cell::RefCell;
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::cast;
use crate::dtype::DType;
use crate::error::{Error, ErrorKind, Result};
use crate::model::{contiguous_strides, numel, Encoding};
use crate::part::Share;
use crate::plan::{FilePlan, Fill, Plan, Region};
use crate::storage::Access;

mod scatter;
mod write;
use write::{create_output, open_shared_output, start_writeback, write_at, write_literals};

/// Largest destination run one work unit gathers.
pub const BLOCK_BYTES: u64 = 8 << 20;

/// Largest file of many regions that is built in memory and written with one write.
const ASSEMBLE_BYTES: u64 = 16 << 20;

/// How much is written to an output between two starts of its writeback (durable runs).
const WRITEBACK_BYTES: u64 = 32 << 20;

/// How source bytes are read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum IoMode {
    /// Memory-map inputs: fewest copies on local disks.
    #[default]
    Mmap,
    /// Positional reads: better on network filesystems, where page faults are slow.
    Read,
}

/// Receives progress; the library never prints.
pub trait Progress: Sync {
    fn start(&self, _total_bytes: u64) {}
    fn advance(&self, _bytes: u64) {}
    fn finish(&self) {}
}

/// Progress that goes nowhere.
pub struct NoProgress;
impl Progress for NoProgress {}

pub struct ExecOptions<'a> {
    /// Worker threads; 0 means one per core.
    pub threads: usize,
    pub io: IoMode,
    pub progress: &'a dyn Progress,
    /// Set (by [`crate::interrupt`]'s handler, in the binary) to stop early with an error.
    pub cancel: &'a AtomicBool,
    /// Make outputs durable before returning: start each output's writeback every
    /// [`WRITEBACK_BYTES`] written (so the disk works while later blocks are copied) and fsync
    /// every output at the end.
    pub durable: bool,
}

/// An input, opened once: a mapped or read local file, or an object read with ranged GETs.
pub use crate::storage::Input;

/// A block of a region: a box of the region whose destination bytes are contiguous.
#[derive(Clone, Debug)]
struct Unit {
    file: usize,
    region: usize,
    start: Vec<u64>,
    sizes: Vec<u64>,
}

impl Unit {
    /// Where the unit's bytes start in its region (`rstrides`: the region's strides), and how
    /// many there are.
    fn bytes_in(&self, r: &Region, rstrides: &[u64]) -> (u64, u64) {
        let de = r.dtype.size() as u64;
        let first: u64 = self.start.iter().zip(rstrides).map(|(a, s)| a * s).sum();
        (
            first * de,
            crate::model::numel(&self.sizes).unwrap_or(0) * de,
        )
    }
}

/// What a region's bytes hashed to, and what its floats held.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegionDigest {
    /// xxh3-64 of the bytes when they fit one block, else of the blocks' xxh3-64s in order. Blocks
    /// depend only on shape and dtype, so the same tensor digests the same in any layout.
    pub xxh3: u64,
    /// Non-finite elements seen (only counted by [`digest`]).
    pub nan: u64,
    pub inf: u64,
}

/// Write every file of `plan` at `dest[i]` (one path per file, in [`Plan::paths`] order).
pub fn execute(plan: &Plan, dest: &[PathBuf], opts: &ExecOptions) -> Result<()> {
    run(plan, Sink::Files(dest), opts).map(|_| ())
}

/// Read everything `plan` would write without writing it: one digest per region, file by file.
pub fn digest(plan: &Plan, opts: &ExecOptions) -> Result<Vec<RegionDigest>> {
    run(plan, Sink::Digest, opts).map(|(digests, _)| digests)
}

/// The CRC-32 of a region's bytes within one part's share, for a ZIP record whose CRC slot the
/// part could not fill itself (the region or its slot lies partly in another part's share).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartialCrc {
    /// Destination file index, in [`Plan::paths`] order.
    pub file: usize,
    /// The region's byte offset in the file: what names it.
    pub region: u64,
    /// Where in the region this part's bytes start, and how many there are.
    pub at: u64,
    pub len: u64,
    pub crc: u32,
}

/// A CRC slot inside a part's share that the part left for the committer: the CRC-32 of the
/// region at `region` (of `region_len` bytes) goes at byte `slot` of file `file`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpenSlot {
    pub file: usize,
    pub slot: u64,
    pub region: u64,
    pub region_len: u64,
}

/// What a part of a partitioned run leaves for the part that commits.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShareOutcome {
    pub crcs: Vec<PartialCrc>,
    pub open_slots: Vec<OpenSlot>,
}

/// Write the bytes of `share` (one part of a partitioned run) into the files at `dest`, which
/// every part of the run shares: files are created at full length by whichever part gets there
/// first, and each part writes its byte ranges only. Streamed files are left to
/// [`write_streamed_files`]; CRC slots whose value depends on bytes of another part are left for
/// [`patch_crcs`] and reported.
pub fn execute_share(
    plan: &Plan,
    dest: &[PathBuf],
    share: &Share,
    opts: &ExecOptions,
) -> Result<ShareOutcome> {
    run(plan, Sink::Share(dest, share), opts).map(|(_, outcome)| outcome)
}

/// Write the streamed files of `plan` (a DCP `.metadata`) at `dest`; stopped early, with an
/// error, once `cancel` is set.
pub fn write_streamed_files(
    plan: &Plan,
    dest: &[PathBuf],
    durable: bool,
    cancel: &AtomicBool,
) -> Result<()> {
    for i in (0..plan.file_count()).filter(|&i| plan.is_streamed(i)) {
        if let Some(path) = dest.get(i) {
            // Left by a commit that failed after writing it.
            let _ = std::fs::remove_file(path);
            write_streamed(plan, i, path, durable, cancel)?;
        }
    }
    Ok(())
}

/// Fill the CRC slots the parts of a run left open, from the partial CRCs they reported: each
/// region's CRC is its parts' combined in byte order, which must cover the region exactly.
pub fn patch_crcs(
    dest: &[PathBuf],
    crcs: &[PartialCrc],
    slots: &[OpenSlot],
    durable: bool,
) -> Result<()> {
    use std::collections::BTreeMap;
    let mut by_region: BTreeMap<(usize, u64), Vec<&PartialCrc>> = BTreeMap::new();
    for c in crcs {
        by_region.entry((c.file, c.region)).or_default().push(c);
    }
    let mut by_file: BTreeMap<usize, Vec<(u64, [u8; 4])>> = BTreeMap::new();
    for s in slots {
        let mut parts = by_region.remove(&(s.file, s.region)).unwrap_or_default();
        parts.sort_by_key(|c| c.at);
        parts.dedup_by_key(|c| c.at);
        let mut crc = crc32fast::Hasher::new();
        let mut at = 0;
        for c in &parts {
            if c.at != at {
                break;
            }
            crc.combine(&crc32fast::Hasher::new_with_initial_len(c.crc, c.len));
            at += c.len;
        }
        if at != s.region_len {
            return Err(Error::invalid(format!(
                "the parts' checksums cover {at} of the {} bytes of the region at byte {}",
                s.region_len, s.region
            ))
            .file(
                dest.get(s.file)
                    .map(PathBuf::as_path)
                    .unwrap_or(Path::new("?")),
            )
            .hint("rerun every part"));
        }
        // Put the pieces back: several slots (local header, central directory) share a region.
        by_region.insert((s.file, s.region), parts);
        by_file
            .entry(s.file)
            .or_default()
            .push((s.slot, crc.finalize().to_le_bytes()));
    }
    for (file, patches) in by_file {
        let path = dest
            .get(file)
            .ok_or_else(|| Error::bug("a CRC slot of no file"))?;
        let out = std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .map_err(|e| Error::io(path, e))?;
        for (slot, crc) in patches {
            out.write_all_at(&crc, slot)
                .map_err(|e| Error::io(path, e).at(slot))?;
        }
        if durable {
            out.sync_all().map_err(|e| Error::io(path, e))?;
        }
    }
    Ok(())
}

/// Every input of `plan`, opened once (a run into an object store opens them once for all its
/// upload parts).
pub fn open_inputs(plan: &Plan, io: IoMode) -> Result<Vec<Input>> {
    let access = match io {
        IoMode::Mmap => Access::Map,
        IoMode::Read => Access::Read,
    };
    plan.inputs.iter().map(|p| Input::open(p, access)).collect()
}

/// [`execute_share`] on inputs opened by [`open_inputs`].
pub fn execute_share_on(
    plan: &Plan,
    inputs: &[Input],
    dest: &[PathBuf],
    share: &Share,
    opts: &ExecOptions,
) -> Result<ShareOutcome> {
    run_on(plan, inputs, Sink::Share(dest, share), opts).map(|(_, outcome)| outcome)
}

/// What a run writes to.
#[derive(Clone, Copy)]
enum Sink<'a> {
    /// Nothing: every region is read and digested.
    Digest,
    /// Every file, created whole at these paths (one per file, in [`Plan::paths`] order).
    Files(&'a [PathBuf]),
    /// One part's share of the files, which every part of the run writes, at these paths.
    Share(&'a [PathBuf], &'a Share),
}

impl<'a> Sink<'a> {
    /// Where file `i`'s bytes go, `f` being its plan: opened (or created) at its length.
    fn open(&self, i: usize, f: &FilePlan) -> Result<FileSink<'a>> {
        let (out, path, clip) = match *self {
            Sink::Digest => return Ok(FileSink::Digest),
            Sink::Files(dest) => {
                let path = dest
                    .get(i)
                    .ok_or_else(|| Error::bug("a file has no path"))?;
                (create_output(path, f.len)?, path, None)
            }
            Sink::Share(dest, share) => {
                let path = dest
                    .get(i)
                    .ok_or_else(|| Error::bug("a file has no path"))?;
                let clip = share
                    .range_of(i)
                    .ok_or_else(|| Error::bug("a file of no share"))?;
                (open_shared_output(path, f.len)?, path, Some(clip))
            }
        };
        if let Some(mode) = f.mode {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::Permissions::from_mode(mode);
            out.set_permissions(mode).map_err(|e| Error::io(path, e))?;
        }
        Ok(match clip {
            None => FileSink::Whole { out, path },
            Some(clip) => FileSink::Share { out, path, clip },
        })
    }
}

/// Where one destination file's bytes go.
enum FileSink<'a> {
    /// Nowhere: its regions are read and digested.
    Digest,
    /// Written whole at `path`.
    Whole { out: File, path: &'a Path },
    /// Only its bytes in `clip` (one part's share), into a file every part writes.
    Share {
        out: File,
        path: &'a Path,
        clip: Range<u64>,
    },
}

impl FileSink<'_> {
    /// The file written, if any, and its path.
    fn out(&self) -> Option<(&File, &Path)> {
        match self {
            FileSink::Digest => None,
            FileSink::Whole { out, path } | FileSink::Share { out, path, .. } => Some((out, path)),
        }
    }

    /// The byte range written, when it is not the whole file.
    fn clip(&self) -> Option<Range<u64>> {
        match self {
            FileSink::Share { clip, .. } => Some(clip.clone()),
            _ => None,
        }
    }
}

fn run(plan: &Plan, sink: Sink, opts: &ExecOptions) -> Result<(Vec<RegionDigest>, ShareOutcome)> {
    let sources = open_inputs(plan, opts.io)?;
    run_on(plan, &sources, sink, opts)
}

fn run_on(
    plan: &Plan,
    sources: &[Input],
    sink: Sink,
    opts: &ExecOptions,
) -> Result<(Vec<RegionDigest>, ShareOutcome)> {
    let share = match sink {
        Sink::Share(_, share) => Some(share),
        _ => None,
    };
    opts.progress
        .start(share.map_or_else(|| plan.data_bytes(), Share::len));
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(opts.threads)
        .build()
        .map_err(|e| Error::invalid(format!("cannot start worker threads: {e}")))?;
    // A streamed file (a DCP `.metadata`, hundreds of megabytes at millions of pieces) depends on
    // no data, so it is written on its own thread while the data files are copied.
    // A part writes no streamed file (the committer does) and only the files its share meets.
    let streamed: Vec<(usize, &PathBuf)> = match sink {
        Sink::Files(dest) => (0..plan.file_count())
            .filter(|&i| plan.is_streamed(i))
            .filter_map(|i| Some((i, dest.get(i)?)))
            .collect(),
        _ => Vec::new(),
    };
    let data_files: Vec<usize> = (0..plan.file_count())
        .filter(|&i| !plan.is_streamed(i) && share.is_none_or(|s| s.range_of(i).is_some()))
        .collect();
    // Files are planned and written a few at a time: enough for every thread to have work and
    // for one file's writeback to overlap the next one's copying, while a plan of thousands of
    // rank files never has all their regions in memory.
    let window = (2 * pool.current_num_threads()).max(4);
    let mut digests = Vec::new();
    let mut outcome = ShareOutcome::default();
    // The streamed writer stops when the run is cancelled or the copy fails: a `.metadata` of
    // millions of pieces should not be finished for an output that will not be committed.
    let stop_streamed = AtomicBool::new(false);
    std::thread::scope(|scope| -> Result<()> {
        let writer = scope.spawn(|| -> Result<()> {
            for &(i, path) in &streamed {
                write_streamed(plan, i, path, opts.durable, &stop_streamed)?;
            }
            Ok(())
        });
        let copied = (|| -> Result<()> {
            for group in data_files.chunks(window) {
                let mut files = Vec::with_capacity(group.len());
                for &i in group {
                    let f = plan.file(i)?;
                    if share.is_some() && f.len != plan.file_len(i) {
                        return Err(Error::invalid(format!(
                            "internal: `{}` is planned at {} bytes but laid out at {}",
                            f.path.display(),
                            f.len,
                            plan.file_len(i)
                        )));
                    }
                    files.push((i, f));
                }
                let sinks = files
                    .iter()
                    .map(|(i, f)| sink.open(*i, f))
                    .collect::<Result<Vec<_>>>()?;
                let window = Window {
                    plan,
                    files: &files,
                    sinks: &sinks,
                    sources,
                    opts,
                };
                let (batch, left) = pool.install(|| window.run())?;
                digests.extend(batch);
                outcome.crcs.extend(left.crcs);
                outcome.open_slots.extend(left.open_slots);
                if opts.durable {
                    for (out, path) in sinks.iter().filter_map(FileSink::out) {
                        out.sync_all().map_err(|e| Error::io(path, e))?;
                    }
                }
            }
            Ok(())
        })();
        loop {
            if copied.is_err() || opts.cancel.load(Ordering::Relaxed) {
                stop_streamed.store(true, Ordering::Relaxed);
            }
            if writer.is_finished() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let written = writer
            .join()
            .unwrap_or_else(|_| Err(Error::bug("the metadata writer stopped")));
        copied.and(written)
    })?;
    for s in sources {
        let now = s.current_len()?;
        if now != s.len() {
            return Err(Error::invalid(format!(
                "input changed size during the run ({} bytes, now {now})",
                s.len()
            ))
            .file(s.path())
            .hint("let the writer finish, then run ckpt again"));
        }
    }
    opts.progress.finish();
    Ok((digests, outcome))
}

/// The bytes of every tensor of `ckpt`, each whole and row-major in its own dtype, gathered from
/// its pieces as a copy gathers them: for a step that computes on tensor data (LoRA folding), one
/// small checkpoint of a few tensors at a time.
pub fn read_tensors(ckpt: &crate::model::Checkpoint, io: IoMode) -> Result<Vec<Vec<u8>>> {
    let target = crate::plan::Target::Safetensors {
        file_name: "tensors".into(),
    };
    let plan = crate::plan::plan(ckpt, &target, &crate::plan::PlanOptions::default())?;
    let sources = open_inputs(&plan, io)?;
    let file = plan.file(0)?;
    let bytes = assemble(&plan, &file, &sources)?;
    ckpt.tensors
        .iter()
        .map(|t| {
            let r = file
                .regions
                .iter()
                .find(|r| r.name == t.name)
                .ok_or_else(|| Error::bug("a tensor read has no region").tensor(&t.name))?;
            let start = r.offset as usize;
            bytes
                .get(start..start + r.nbytes() as usize)
                .map(<[u8]>::to_vec)
                .ok_or_else(|| Error::bug("a region outside its file").tensor(&t.name))
        })
        .collect()
}

/// The box at `start` of `sizes` of tensor `ti` of `ckpt`, row-major in the tensor's dtype (or
/// its computation's), gathered and computed as a copy gathers it: for a step that needs some of
/// a tensor's values besides the box it is computing (a band of rows for blockwise scales).
pub fn read_box(
    ckpt: &crate::model::Checkpoint,
    ti: usize,
    start: &[u64],
    sizes: &[u64],
    io: IoMode,
) -> Result<Vec<u8>> {
    let t = ckpt
        .tensors
        .get(ti)
        .ok_or_else(|| Error::bug(format!("tensor {ti} of {}", ckpt.tensors.len())))?;
    let one = crate::model::Checkpoint {
        tensors: vec![t.clone()],
        values: Vec::new(),
        unsupported: Vec::new(),
        root: ckpt.root.clone(),
        format: ckpt.format,
        world_size: None,
        details: Vec::new(),
    };
    let target = crate::plan::Target::Safetensors {
        file_name: "tensors".into(),
    };
    let plan = crate::plan::plan(&one, &target, &crate::plan::PlanOptions::default())?;
    let sources = open_inputs(&plan, io)?;
    let file = plan.file(0)?;
    let r = file
        .regions
        .first()
        .ok_or_else(|| Error::bug("a tensor read has no region").tensor(&t.name))?;
    let u = Unit {
        file: 0,
        region: 0,
        start: start.to_vec(),
        sizes: sizes.to_vec(),
    };
    let rstrides = contiguous_strides(&r.shape);
    let fills = checked_fills(&plan, r, Some((start, sizes)), &sources)?;
    let len = numel(sizes).unwrap_or(0) * r.dtype.size() as u64;
    let mut buf = vec![0u8; len as usize];
    let mut scratch = Vec::new();
    prefetch_objects(&fills, r, &u, &rstrides, &sources)?;
    fill_unit(
        &plan,
        r,
        &u,
        &rstrides,
        &fills,
        &sources,
        &mut buf,
        &mut scratch,
    )?;
    Ok(buf)
}

/// The whole of a small file, regions gathered and literals placed with their CRCs filled in.
fn assemble(plan: &Plan, f: &FilePlan, sources: &[Input]) -> Result<Vec<u8>> {
    let mut bytes = vec![0u8; f.len as usize];
    let mut scratch = Vec::new();
    for r in &f.regions {
        let fills = checked_fills(plan, r, None, sources)?;
        let rstrides = contiguous_strides(&r.shape);
        let start = r.offset as usize;
        let len = r.nbytes() as usize;
        let region = bytes
            .get_mut(start..start + len)
            .ok_or_else(|| Error::bug("region outside its file").tensor(&r.name))?;
        for (begin, sizes) in blocks(&r.shape, r.dtype.size() as u64, BLOCK_BYTES, align(plan, r)) {
            let u = Unit {
                file: 0,
                region: 0,
                start: begin,
                sizes,
            };
            let (at, unit_len) = u.bytes_in(r, &rstrides);
            let buf = &mut region[at as usize..(at + unit_len) as usize];
            prefetch_objects(&fills, r, &u, &rstrides, sources)?;
            fill_unit(plan, r, &u, &rstrides, &fills, sources, buf, &mut scratch)?;
        }
    }
    f.for_each_literal(|at, lit| {
        let at = at as usize;
        match bytes.get_mut(at..at + lit.len()) {
            Some(dst) => {
                dst.copy_from_slice(lit);
                Ok(())
            }
            None => Err(Error::bug("literal outside its file")),
        }
    })?;
    // After the literals: a CRC slot lies inside one (the ZIP framing of its record).
    for r in f.regions.iter().filter(|r| !r.crc_slots.is_empty()) {
        let start = r.offset as usize;
        let crc = crc32fast::hash(&bytes[start..start + r.nbytes() as usize]).to_le_bytes();
        for &slot in &r.crc_slots {
            if let Some(dst) = bytes.get_mut(slot as usize..slot as usize + 4) {
                dst.copy_from_slice(&crc);
            }
        }
    }
    Ok(bytes)
}

/// Write streamed file `i` of `plan` (a DCP `.metadata`) at `path`, synced when `durable`. A
/// `.metadata` of millions of pieces takes seconds, so `cancel` is polled as it is written.
fn write_streamed(
    plan: &Plan,
    i: usize,
    path: &Path,
    durable: bool,
    cancel: &AtomicBool,
) -> Result<()> {
    let file = create_output(path, 0)?;
    let mut sink = std::io::BufWriter::with_capacity(1 << 20, &file);
    plan.write_streamed(i, &mut sink, cancel)
        .and_then(|_| std::io::Write::flush(&mut sink))
        .map_err(|e| match cancel.load(Ordering::Relaxed) {
            true => Error::new(ErrorKind::Io, "interrupted"),
            false => Error::io(path, e),
        })?;
    drop(sink);
    if durable {
        file.sync_all().map_err(|e| Error::io(path, e))?;
    }
    Ok(())
}

/// A few destination files written together, each to its sink: what [`run_on`] hands the pool
/// at a time.
struct Window<'w, 'p> {
    plan: &'w Plan<'p>,
    /// (index in the plan, planned file)
    files: &'w [(usize, std::borrow::Cow<'w, FilePlan>)],
    sinks: &'w [FileSink<'w>],
    sources: &'w [Input],
    opts: &'w ExecOptions<'w>,
}

impl Window<'_, '_> {
    /// Copy every region of the window's files (in parallel, on the current pool) into their
    /// sinks, then write their literals with the CRCs the copies produced. Returns one digest
    /// per region, and what a part leaves for the part that commits (a share's CRCs).
    fn run(&self) -> Result<(Vec<RegionDigest>, ShareOutcome)> {
        let assembled = self.assemble_small_files()?;
        // Bytes written to each output since its writeback was last started.
        let unflushed: Vec<AtomicU64> = self.sinks.iter().map(|_| AtomicU64::new(0)).collect();
        // Regions read from objects are copied input by input where they can be (see
        // `scatter`); the rest, block by block.
        let to = scatter::Destinations {
            files: self.files,
            sinks: self.sinks,
            unflushed: &unflushed,
        };
        let skip: Vec<bool> = (0..self.files.len())
            .map(|fi| assembled[fi] || self.sinks[fi].clip().is_some())
            .collect();
        let scattered = scatter::copy_input_major(self.plan, &to, &skip, self.sources, self.opts)?;
        let units = self.units(&assembled, &scattered.done);
        let results = self.run_units(&units, &unflushed)?;
        self.finish(&assembled, &units, &results, &scattered)
    }

    /// Build each small file with an output in memory and write it with one write: a DCP rank
    /// file of a reshard to many ranks is thousands of items of a few hundred bytes, which would
    /// otherwise cost a copy and a framing write each. Returns which files were.
    fn assemble_small_files(&self) -> Result<Vec<bool>> {
        let assembled: Vec<bool> = self
            .files
            .iter()
            .zip(self.sinks)
            .map(|((_, f), sink)| {
                let whole = sink.clip().is_none_or(|c| c.start == 0 && c.end >= f.len);
                whole && sink.out().is_some() && f.len <= ASSEMBLE_BYTES && f.regions.len() > 1
            })
            .collect();
        let small: Vec<usize> = (0..self.files.len()).filter(|&fi| assembled[fi]).collect();
        small.par_iter().try_for_each(|&fi| {
            if self.opts.cancel.load(Ordering::Relaxed) {
                return Err(Error::new(ErrorKind::Io, "interrupted"));
            }
            let (_, f) = &self.files[fi];
            let Some((out, path)) = self.sinks[fi].out() else {
                return Ok(());
            };
            let bytes = assemble(self.plan, f, self.sources)?;
            out.write_all_at(&bytes, 0)
                .map_err(|e| Error::io(path, e))?;
            self.opts
                .progress
                .advance(f.regions.iter().map(Region::nbytes).sum());
            Ok(())
        })?;
        Ok(assembled)
    }

    /// The blocks left to copy, region by region in order: of every file not assembled, every
    /// region not scattered, within the file's clip.
    fn units(&self, assembled: &[bool], scattered: &[Vec<bool>]) -> Vec<Unit> {
        let mut units = Vec::new();
        for (fi, (_, f)) in self.files.iter().enumerate() {
            if assembled[fi] {
                continue;
            }
            let clip = self.sinks[fi].clip();
            let outside =
                |a: u64, b: u64| clip.as_ref().is_some_and(|c| a >= c.end || b <= c.start);
            for (ri, r) in f.regions.iter().enumerate() {
                if scattered[fi][ri] || outside(r.offset, r.offset + r.nbytes()) {
                    continue;
                }
                let rstrides = contiguous_strides(&r.shape);
                let elem = r.dtype.size() as u64;
                for (start, sizes) in blocks(&r.shape, elem, BLOCK_BYTES, align(self.plan, r)) {
                    let u = Unit {
                        file: fi,
                        region: ri,
                        start,
                        sizes,
                    };
                    let (at, len) = u.bytes_in(r, &rstrides);
                    if !outside(r.offset + at, r.offset + at + len) {
                        units.push(u);
                    }
                }
            }
        }
        units
    }

    /// Run every unit on the pool, starting each output's writeback as it fills.
    fn run_units(&self, units: &[Unit], unflushed: &[AtomicU64]) -> Result<Vec<UnitResult>> {
        let opts = self.opts;
        let run_one = |u: &Unit| {
            if opts.cancel.load(Ordering::Relaxed) {
                return Err(Error::new(ErrorKind::Io, "interrupted"));
            }
            let (_, f) = &self.files[u.file];
            let region = &f.regions[u.region];
            let sink = &self.sinks[u.file];
            let result = run_unit(self.plan, u, region, self.sources, sink)?;
            if let (true, Some((file, _)), Some(dirty)) =
                (opts.durable, sink.out(), unflushed.get(u.file))
            {
                // Once per WRITEBACK_BYTES written to a file, whichever thread crosses it.
                let total = dirty.fetch_add(result.len, Ordering::Relaxed) + result.len;
                if total >= WRITEBACK_BYTES && dirty.swap(0, Ordering::Relaxed) > 0 {
                    start_writeback(file);
                }
            }
            opts.progress.advance(result.len);
            Ok(result)
        };
        if self.sources.iter().any(Input::reads_by_request) {
            in_order(units, run_one)
        } else {
            units.par_iter().map(run_one).collect()
        }
    }

    /// Each region's digest and CRC from its units' results, and the files' literals written
    /// with the CRCs in their slots. Units were listed region by region in order, so a region's
    /// CRC is its units' combined (within a clip: the CRC of the region's bytes inside it, which
    /// are contiguous).
    fn finish(
        &self,
        assembled: &[bool],
        units: &[Unit],
        results: &[UnitResult],
        scattered: &scatter::Scattered,
    ) -> Result<(Vec<RegionDigest>, ShareOutcome)> {
        let mut digests = Vec::new();
        let mut outcome = ShareOutcome::default();
        let mut k = 0;
        for (fi, (i, f)) in self.files.iter().enumerate() {
            if assembled[fi] {
                // Only files being written are assembled, and their digests are not asked for.
                digests.extend(f.regions.iter().map(|_| RegionDigest::default()));
                continue;
            }
            let clip = self.sinks[fi].clip();
            let mut crc_patches = Vec::new();
            for (ri, r) in f.regions.iter().enumerate() {
                let mut crc = crc32fast::Hasher::new();
                let mut unit_hashes = Vec::new();
                let mut digest = RegionDigest::default();
                while k < units.len() && units[k].file == fi && units[k].region == ri {
                    let result = &results[k];
                    crc.combine(&crc32fast::Hasher::new_with_initial_len(
                        result.crc, result.len,
                    ));
                    unit_hashes.extend_from_slice(&result.xxh3.to_le_bytes());
                    digest.nan += result.nan;
                    digest.inf += result.inf;
                    k += 1;
                }
                digest.xxh3 = match unit_hashes.len() {
                    0 => xxhash_rust::xxh3::xxh3_64(&[]),
                    8 => u64::from_le_bytes(unit_hashes[..8].try_into().unwrap_or_default()),
                    _ => xxhash_rust::xxh3::xxh3_64(&unit_hashes),
                };
                digests.push(digest);
                let crc = match scattered.crcs.get(&(fi, ri)) {
                    Some(&copied) => copied,
                    None => crc.finalize(),
                };
                match &clip {
                    None => crc_patches
                        .extend(r.crc_slots.iter().map(|&slot| (slot, crc.to_le_bytes()))),
                    Some(c) => share_crc(*i, r, crc, c, &mut crc_patches, &mut outcome),
                }
            }
            if let Some((out, path)) = self.sinks[fi].out() {
                write_literals(out, path, f, &crc_patches, clip)?;
            }
        }
        Ok((digests, outcome))
    }
}

/// The CRC slots of region `r` (of file `file`) as one part writes the bytes `clip` of its file:
/// a region this part holds whole gets its CRC (`crc`) written into the slots in this share; the
/// committer fills every other slot from the parts' partial CRCs, reported in `outcome`.
fn share_crc(
    file: usize,
    r: &Region,
    crc: u32,
    clip: &Range<u64>,
    patches: &mut Vec<(u64, [u8; 4])>,
    outcome: &mut ShareOutcome,
) {
    if r.crc_slots.is_empty() {
        return;
    }
    let c = clip;
    let (lo, hi) = (r.offset, r.offset + r.nbytes());
    let whole = lo == hi || (c.start <= lo && hi <= c.end);
    let slot_in = |s: u64| c.start <= s && s + 4 <= c.end;
    for &slot in &r.crc_slots {
        if slot_in(slot) && whole {
            patches.push((slot, crc.to_le_bytes()));
        } else if slot < c.end && c.start < slot + 4 {
            outcome.open_slots.push(OpenSlot {
                file,
                slot,
                region: lo,
                region_len: hi - lo,
            });
        }
    }
    let all_slots_in = r.crc_slots.iter().all(|&s| slot_in(s));
    if lo.max(c.start) < hi.min(c.end) && !(whole && all_slots_in) {
        outcome.crcs.push(PartialCrc {
            file,
            region: lo,
            at: lo.max(c.start) - lo,
            len: hi.min(c.end) - lo.max(c.start),
            crc,
        });
    }
}

/// `f` of every unit on every worker, the units taken in their order: the workers then go through
/// each input together, front to back, so an object's blocks are fetched in a few large GETs
/// read ahead of them, as a download would, rather than by workers in distant places of it
/// (rayon's split hands each worker its own half) whose blocks crowd each other out of the cache.
fn in_order(
    units: &[Unit],
    f: impl Fn(&Unit) -> Result<UnitResult> + Sync,
) -> Result<Vec<UnitResult>> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let done: Vec<std::sync::OnceLock<UnitResult>> =
        units.iter().map(|_| std::sync::OnceLock::new()).collect();
    (0..rayon::current_num_threads())
        .into_par_iter()
        .try_for_each(|_| -> Result<()> {
            loop {
                let k = next.fetch_add(1, Ordering::Relaxed);
                let Some(u) = units.get(k) else {
                    return Ok(());
                };
                let r = f(u).inspect_err(|_| next.store(units.len(), Ordering::Relaxed))?;
                let _ = done[k].set(r);
            }
        })?;
    done.into_iter()
        .map(|r| {
            r.into_inner()
                .ok_or_else(|| Error::bug("a unit was not run"))
        })
        .collect()
}

/// The fills of region `r` that meet its sub-box `within` (all for `None`), each checked to lie
/// inside its source file.
fn checked_fills<'r>(
    plan: &Plan,
    r: &'r Region,
    within: Option<(&[u64], &[u64])>,
    sources: &[Input],
) -> Result<std::borrow::Cow<'r, [Fill]>> {
    let fills = plan.fills(r, within).map_err(|e| e.tensor(&r.name))?;
    for fill in fills.iter() {
        check_fill(fill, r, sources)?;
    }
    Ok(fills)
}

/// Check that every byte a fill reads lies inside its source file.
fn check_fill(fill: &Fill, region: &Region, sources: &[Input]) -> Result<()> {
    if fill.encoding == Encoding::Zeros {
        return Ok(());
    }
    let src = sources
        .get(fill.input)
        .ok_or_else(|| Error::bug("bad input index"))?;
    let limit = match fill.encoding {
        Encoding::Raw => src.len(),
        // The decoded length is checked when the item is decompressed or opened.
        Encoding::Zstd { .. }
        | Encoding::Deflate { .. }
        | Encoding::Saved { .. }
        | Encoding::Zeros => u64::MAX,
    };
    let end = fill_end(fill);
    match end {
        Some(end) if end <= limit => Ok(()),
        _ => Err(Error::invalid(format!(
            "data runs past the end of the file ({} bytes)",
            src.len()
        ))
        .file(src.path())
        .tensor(&region.name)
        .at(fill.offset)
        .hint("the file is truncated or the metadata is wrong: run `ckpt verify`")),
    }
}

/// One past the last source byte a fill reads, `None` on overflow.
fn fill_end(fill: &Fill) -> Option<u64> {
    if fill.sizes.contains(&0) {
        return Some(fill.offset);
    }
    let elem = fill.dtype.size() as u64;
    let last = fill
        .sizes
        .iter()
        .zip(&fill.strides)
        .try_fold(0u64, |acc, (&n, &s)| {
            acc.checked_add((n - 1).checked_mul(s)?)
        })?;
    last.checked_mul(elem)?
        .checked_add(fill.offset)?
        .checked_add(elem)
}

/// Split a region of `shape` into boxes whose bytes are contiguous and at most `max_bytes` (or one
/// row of the innermost dimension). Boxes fix the leading dims, take a range of dim `k` and all of
/// the dims after it, with `k` the outermost dim whose trailing rows fit. With `align` above 1
/// (a computed tensor's [`crate::model::Compute::block_rows`]) boxes take whole rows of dim 0, a
/// multiple of `align` of them, even where that is more than `max_bytes`.
fn blocks(shape: &[u64], elem: u64, max_bytes: u64, align: u64) -> Vec<(Vec<u64>, Vec<u64>)> {
    if shape.contains(&0) {
        return Vec::new();
    }
    if shape.is_empty() {
        return vec![(Vec::new(), Vec::new())];
    }
    let strides = contiguous_strides(shape);
    let k = match align {
        0 | 1 => (0..shape.len())
            .find(|&d| strides[d].saturating_mul(elem) <= max_bytes)
            .unwrap_or(shape.len() - 1),
        _ => 0,
    };
    let mut rows_per_block = (max_bytes / strides[k].saturating_mul(elem).max(1)).max(1);
    if align > 1 {
        rows_per_block = (rows_per_block / align).max(1).saturating_mul(align);
    }
    let mut out = Vec::new();
    let mut outer = vec![0u64; k];
    loop {
        let mut row = 0;
        while row < shape[k] {
            let n = rows_per_block.min(shape[k] - row);
            let mut start = outer.clone();
            start.push(row);
            start.extend(std::iter::repeat_n(0, shape.len() - k - 1));
            let mut sizes = vec![1u64; k];
            sizes.push(n);
            sizes.extend_from_slice(&shape[k + 1..]);
            out.push((start, sizes));
            row += n;
        }
        // Odometer over the fixed leading dims.
        let mut d = k;
        loop {
            if d == 0 {
                return out;
            }
            d -= 1;
            outer[d] += 1;
            if outer[d] < shape[d] {
                break;
            }
            outer[d] = 0;
        }
    }
}

/// The rows a box of region `r` must be a multiple of: its computation's, 1 for a copy.
fn align(plan: &Plan, r: &Region) -> u64 {
    plan.computed(r).map_or(1, |(c, _, _)| c.0.block_rows())
}

/// A decoded item (decompressed, or a piece's elements from an unopened item), keyed by (input
/// index, item offset).
type DecodedItem = Option<((usize, u64), Vec<u8>)>;

thread_local! {
    static BUFFERS: RefCell<(Vec<u8>, Vec<u8>)> = const { RefCell::new((Vec::new(), Vec::new())) };
    static DECODED: RefCell<DecodedItem> = const { RefCell::new(None) };
    /// A computed unit's source elements (see [`fill_unit`]).
    static COMPUTED_SRC: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
}

/// What one unit produced.
struct UnitResult {
    len: u64,
    crc: u32,
    xxh3: u64,
    nan: u64,
    inf: u64,
}

/// Gather one unit into a buffer, then write it to its file's sink or, for a digest, hash it and
/// count its non-finite floats.
///
/// Into a share (a byte range of the destination file: one part's), only the unit's bytes inside
/// it are written, and the result's length and CRC are those of these bytes.
fn run_unit(
    plan: &Plan,
    u: &Unit,
    r: &Region,
    sources: &[Input],
    sink: &FileSink,
) -> Result<UnitResult> {
    let (out, clip) = (sink.out(), sink.clip());
    let rstrides = contiguous_strides(&r.shape);
    let (at, len) = u.bytes_in(r, &rstrides);
    let dest_offset = r.offset + at;
    // The unit's bytes to write, relative to its start.
    let keep = match &clip {
        Some(c) => {
            c.start.saturating_sub(dest_offset).min(len)
                ..(c.end.saturating_sub(dest_offset)).min(len)
        }
        None => 0..len,
    };
    let fills = checked_fills(plan, r, Some((&u.start, &u.sizes)), sources)?;
    let direct = match plan.computed(r) {
        Some(_) => None,
        None => direct_runs(u, r, &fills, &rstrides, sources),
    };
    if let (Some((file, path)), Some(runs)) = (out, direct) {
        let want_crc = !r.crc_slots.is_empty();
        let mut crc = crc32fast::Hasher::new();
        let mut copied = 0;
        let mut covered = 0;
        for (src, src_offset, at, n) in runs {
            covered += n;
            let (a, b) = (at.max(keep.start), (at + n).min(keep.end));
            if a >= b {
                continue;
            }
            let n = b - a;
            let src_offset = src_offset + (a - at);
            let run_crc = copy_direct(src, src_offset, file, path, dest_offset + a, n, want_crc)
                .map_err(|e| e.tensor(&r.name))?;
            crc.combine(&crc32fast::Hasher::new_with_initial_len(run_crc, n));
            copied += n;
        }
        if covered != len || copied != keep.end - keep.start {
            return Err(Error::invalid(format!(
                "internal: {copied} of {len} bytes of a block were filled"
            ))
            .tensor(&r.name));
        }
        return Ok(UnitResult {
            len: copied,
            crc: crc.finalize(),
            xxh3: 0,
            nan: 0,
            inf: 0,
        });
    }
    BUFFERS.with(|bufs| {
        let (whole, scratch) = &mut *bufs.borrow_mut();
        // Grow, never re-zero: fills are disjoint (the planner checks coverage) and `written` is
        // checked against `len` below, so every byte of the slice is overwritten.
        if whole.len() < len as usize {
            whole.resize(len as usize, 0);
        }
        let buf = &mut whole[..len as usize];
        prefetch_objects(&fills, r, u, &rstrides, sources)?;
        fill_unit(plan, r, u, &rstrides, &fills, sources, buf, scratch)?;
        let mut result = UnitResult {
            len,
            crc: 0,
            xxh3: 0,
            nan: 0,
            inf: 0,
        };
        match out {
            Some((file, path)) => {
                let kept = &buf[keep.start as usize..keep.end as usize];
                let at = dest_offset + keep.start;
                write_at(file, path, kept, at).map_err(|e| e.tensor(&r.name))?;
                result.len = kept.len() as u64;
                if !r.crc_slots.is_empty() {
                    result.crc = crc32fast::hash(kept);
                }
            }
            None => {
                result.xxh3 = xxhash_rust::xxh3::xxh3_64(buf);
                (result.nan, result.inf) = cast::count_non_finite(buf, r.dtype);
            }
        }
        Ok(result)
    })
}

/// Where the slice of a fill that falls in a unit lies: `outer` leading dims iterated with an
/// odometer, each step one contiguous `run` of elements on both sides.
struct Span {
    /// Input byte offset of the first element.
    src0: u64,
    /// Byte offset of the first element within the unit.
    dst0: u64,
    ext: Vec<u64>,
    outer: usize,
    run: u64,
}

/// The slice of `fill` inside unit `u`, or `None` when they do not meet. `dst` is the dtype the
/// unit's buffer holds: the region's for a copy, the tensor's for a computed tensor's source
/// elements (an FP8 weight's region is one byte an element, its source box four).
fn span(fill: &Fill, u: &Unit, rstrides: &[u64], dst: DType) -> Option<Span> {
    let nd = u.start.len();
    let (se, de) = (fill.dtype.size() as u64, dst.size() as u64);
    // Intersect the fill's box with the unit's box, in region coordinates.
    let mut lo = vec![0u64; nd];
    let mut ext = vec![0u64; nd];
    for d in 0..nd {
        let a = fill.start[d].max(u.start[d]);
        let b = (fill.start[d] + fill.sizes[d]).min(u.start[d] + u.sizes[d]);
        if b <= a {
            return None;
        }
        lo[d] = a;
        ext[d] = b - a;
    }
    let src0 = fill.offset
        + se * (0..nd)
            .map(|d| (lo[d] - fill.start[d]) * fill.strides[d])
            .sum::<u64>();
    let dst0 = de
        * (0..nd)
            .map(|d| (lo[d] - u.start[d]) * rstrides[d])
            .sum::<u64>();
    // Merge trailing dims that are contiguous on both sides into one run.
    let mut run = 1u64;
    let mut outer = nd;
    while outer > 0 {
        let d = outer - 1;
        if fill.strides[d] == run && rstrides[d] == run {
            run *= ext[d];
            outer -= 1;
        } else if ext[d] == 1 {
            outer -= 1;
        } else {
            break;
        }
    }
    Some(Span {
        src0,
        dst0,
        ext,
        outer,
        run,
    })
}

/// Fetch the source bytes of unit `u` that lie in objects: for each plain fill, the byte range
/// covering its slice of the unit, coalesced and fetched concurrently into this thread's window,
/// from which [`gather`] then copies as it does from a map. A range much larger than the unit (a
/// strided view read across) is left to ranged reads as the copy asks for it.
fn prefetch_objects(
    fills: &[Fill],
    r: &Region,
    u: &Unit,
    rstrides: &[u64],
    sources: &[Input],
) -> Result<()> {
    let mut ranges = Vec::new();
    for fill in fills {
        let Some(object) = sources.get(fill.input).and_then(Input::object) else {
            continue;
        };
        if fill.encoding != Encoding::Raw {
            continue;
        }
        let Some(sp) = span(fill, u, rstrides, r.dtype) else {
            continue;
        };
        let se = fill.dtype.size() as u64;
        let last: u64 = (0..sp.outer)
            .map(|d| (sp.ext[d] - 1) * fill.strides[d])
            .sum();
        let end = sp.src0 + se * (last + sp.run);
        if end - sp.src0 <= 4 * BLOCK_BYTES && end <= object.len() {
            ranges.push((object, sp.src0..end));
        }
    }
    crate::storage::fetch_window(&ranges)
}

/// Unit `u` of region `r` into `buf` (its bytes, in the region's dtype): its fills' bytes
/// gathered, or for a computed tensor ([`crate::model::Compute`]) the same bytes gathered in the
/// tensor's dtype and computed on.
#[allow(clippy::too_many_arguments)]
fn fill_unit(
    plan: &Plan,
    r: &Region,
    u: &Unit,
    rstrides: &[u64],
    fills: &[Fill],
    sources: &[Input],
    buf: &mut [u8],
    scratch: &mut Vec<u8>,
) -> Result<()> {
    let Some((c, dtype, origin)) = plan.computed(r) else {
        return gather_all(fills, r, r.dtype, u, rstrides, sources, buf, scratch);
    };
    let want = (numel(&u.sizes).unwrap_or(0) * dtype.size() as u64) as usize;
    let mut src = COMPUTED_SRC.take();
    // Grown, never re-zeroed: `gather_all` checks that every byte is written.
    if src.len() < want {
        src.resize(want, 0);
    }
    gather_all(
        fills,
        r,
        dtype,
        u,
        rstrides,
        sources,
        &mut src[..want],
        scratch,
    )?;
    let start: Vec<u64> = origin.iter().zip(&u.start).map(|(o, s)| o + s).collect();
    let done =
        c.0.compute(&start, &u.sizes, &src[..want], buf, r.dtype)
            .map_err(|e| e.tensor(&r.name));
    COMPUTED_SRC.set(src);
    done
}

/// Every fill's slice of unit `u` into `buf` (the unit's bytes, as `dtype`), which they must
/// cover.
#[allow(clippy::too_many_arguments)]
fn gather_all(
    fills: &[Fill],
    r: &Region,
    dtype: DType,
    u: &Unit,
    rstrides: &[u64],
    sources: &[Input],
    buf: &mut [u8],
    scratch: &mut Vec<u8>,
) -> Result<()> {
    let mut written = 0u64;
    for fill in fills {
        written += gather(fill, r, dtype, u, rstrides, sources, buf, scratch)?;
    }
    if written != buf.len() as u64 {
        return Err(Error::invalid(format!(
            "internal: {written} of {} bytes of a block were filled",
            buf.len()
        ))
        .tensor(&r.name));
    }
    Ok(())
}

/// Copy the slice of `fill` that falls in unit `u` into `buf` (the unit's bytes, as `dtype`).
/// Returns the number of destination bytes written.
#[allow(clippy::too_many_arguments)]
fn gather(
    fill: &Fill,
    r: &Region,
    dtype: DType,
    u: &Unit,
    rstrides: &[u64],
    sources: &[Input],
    buf: &mut [u8],
    scratch: &mut Vec<u8>,
) -> Result<u64> {
    let Some(Span {
        src0,
        dst0,
        ext,
        outer,
        run,
    }) = span(fill, u, rstrides, dtype)
    else {
        return Ok(0);
    };
    let (se, de) = (fill.dtype.size() as u64, dtype.size() as u64);
    let src = source_of(fill, sources)?;
    let mut idx = vec![0u64; outer];
    let mut total = 0u64;
    loop {
        let s = src0 + se * (0..outer).map(|d| idx[d] * fill.strides[d]).sum::<u64>();
        let t = dst0 + de * (0..outer).map(|d| idx[d] * rstrides[d]).sum::<u64>();
        let dst = buf
            .get_mut(t as usize..(t + run * de) as usize)
            .ok_or_else(|| Error::bug("block overflow").tensor(&r.name))?;
        if fill.dtype == dtype {
            src.read(s, dst)?;
        } else {
            scratch.resize((run * se) as usize, 0);
            src.read(s, scratch)?;
            cast::convert(scratch, fill.dtype, dst, dtype);
        }
        total += run * de;
        // Odometer over the dims that are not part of the run.
        let mut d = outer;
        loop {
            if d == 0 {
                return Ok(total);
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < ext[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// The plain source byte ranges a unit is an exact copy of, as (source, source offset, offset in
/// the unit, bytes) in unit order, when every fill meeting the unit is one contiguous run of the
/// same dtype. Such units skip the buffer.
fn direct_runs<'a>(
    u: &Unit,
    r: &Region,
    fills: &[Fill],
    rstrides: &[u64],
    sources: &'a [Input],
) -> Option<Vec<(&'a Input, u64, u64, u64)>> {
    let de = r.dtype.size() as u64;
    let mut runs = Vec::new();
    for fill in fills {
        let Some(sp) = span(fill, u, rstrides, r.dtype) else {
            continue;
        };
        let src = sources.get(fill.input)?;
        let plain = sp.outer == 0 && fill.dtype == r.dtype && fill.encoding == Encoding::Raw;
        if !plain || src.reads_by_request() {
            return None;
        }
        runs.push((src, sp.src0, sp.dst0, sp.run * de));
    }
    runs.sort_by_key(|r| r.2);
    Some(runs)
}

/// Copy `len` bytes from `src` at `src_offset` to `out` at `dest_offset` without a user-space
/// buffer where possible, returning the CRC-32 of the bytes when `crc` is set.
///
/// The bytes move by `copy_file_range` (the kernel copies page-cache pages, or shares extents on
/// filesystems that can). A checksum needs the bytes in hand: mapped sources are hashed in place
/// before the kernel copies them, which measured about half the CPU time of `pwrite` from the map
/// (1 GB `--format torch`: the kernel's copy from user memory, `copy_folio_from_iter_atomic`, took
/// 70% of the run); unmapped sources (`--io read`) are read once and written from the buffer, so a
/// network filesystem is not read twice.
fn copy_direct(
    src: &Input,
    src_offset: u64,
    out: &File,
    out_path: &Path,
    dest_offset: u64,
    len: u64,
    crc: bool,
) -> Result<u32> {
    if !crc {
        src.copy_to(src_offset, out, out_path, dest_offset, len)?;
        return Ok(0);
    }
    let mapped = src.map().and_then(|map| {
        let start = usize::try_from(src_offset).ok()?;
        map.get(start..start.checked_add(usize::try_from(len).ok()?)?)
    });
    if let Some(bytes) = mapped {
        let crc = crc32fast::hash(bytes);
        src.copy_to(src_offset, out, out_path, dest_offset, len)?;
        return Ok(crc);
    }
    BUFFERS.with(|bufs| {
        let (whole, _) = &mut *bufs.borrow_mut();
        if whole.len() < len as usize {
            whole.resize(len as usize, 0);
        }
        let buf = &mut whole[..len as usize];
        src.read_at(src_offset, buf)?;
        out.write_all_at(buf, dest_offset)
            .map_err(|e| Error::io(out_path, e).at(dest_offset))?;
        Ok(crc32fast::hash(buf))
    })
}

/// Where a fill's bytes are read from: the file itself, a decompressed item, or nowhere (zeros).
enum FillSource<'a> {
    File(&'a Input),
    Decoded(&'a Input, u64),
    Zeros,
}

impl FillSource<'_> {
    fn read(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        match self {
            FillSource::Zeros => {
                dst.fill(0);
                Ok(())
            }
            FillSource::File(s) => s.read_at(offset, dst),
            FillSource::Decoded(s, item) => DECODED.with(|cell| {
                let cell = cell.borrow();
                let data = cell.as_ref().map(|c| &c.1);
                let src = usize::try_from(offset)
                    .ok()
                    .and_then(|o| data?.get(o..o.checked_add(dst.len())?));
                match src {
                    Some(src) => {
                        dst.copy_from_slice(src);
                        Ok(())
                    }
                    None => Err(
                        Error::invalid("tensor data lies outside its decompressed item")
                            .file(s.path())
                            .at(*item),
                    ),
                }
            }),
        }
    }
}

fn source_of<'a>(fill: &Fill, sources: &'a [Input]) -> Result<FillSource<'a>> {
    if fill.encoding == Encoding::Zeros {
        return Ok(FillSource::Zeros);
    }
    let src = sources
        .get(fill.input)
        .ok_or_else(|| Error::bug("bad input index"))?;
    let (item_offset, item_length) = match fill.encoding {
        Encoding::Raw => return Ok(FillSource::File(src)),
        Encoding::Zeros => return Ok(FillSource::Zeros),
        Encoding::Zstd {
            item_offset,
            item_length,
        }
        | Encoding::Deflate {
            item_offset,
            item_length,
        }
        | Encoding::Saved {
            item_offset,
            item_length,
            ..
        } => (item_offset, item_length),
    };
    // Only the prefix up to the fill's last byte is needed (the reader already checked the whole
    // item when it located the piece); a cached prefix serves every fill it is long enough for.
    // An unopened item is opened whole.
    let needed = match fill.encoding {
        Encoding::Saved { .. } => 0,
        _ => fill_end(fill).unwrap_or(u64::MAX),
    };
    DECODED.with(|cell| {
        let mut cell = cell.borrow_mut();
        let cached = cell.as_ref().is_some_and(|(key, data)| {
            *key == (fill.input, item_offset) && data.len() as u64 >= needed
        });
        if !cached {
            // A longer prefix of the same item is decoded from its start again, so it at least
            // doubles: a large record read block by block costs about twice one decoding.
            let had = match cell.as_ref() {
                Some((key, data)) if *key == (fill.input, item_offset) => data.len() as u64,
                _ => 0,
            };
            let needed = needed.max(had.saturating_mul(2));
            let mut item = vec![0u8; item_length as usize];
            src.read_at(item_offset, &mut item)?;
            let decoded = crate::formats::codec::decode(&fill.encoding, &item, needed, fill.dtype)
                .map_err(|e| match fill.encoding {
                    // The archive's own offsets, made file offsets as the reader makes them.
                    Encoding::Saved { .. } => e.file(src.path()).within(item_offset),
                    _ => e.file(src.path()).at(item_offset),
                })?;
            *cell = Some(((fill.input, item_offset), decoded));
        }
        Ok(FillSource::Decoded(src, item_offset))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_tile_the_region() {
        let shape = [3, 5, 4];
        let bs = blocks(&shape, 4, 40, 1);
        // Rows of 4 f32 are 16 bytes; two rows fit in 40 bytes, so k = 1 with 2 rows per block.
        assert_eq!(bs[0], (vec![0, 0, 0], vec![1, 2, 4]));
        assert_eq!(bs[2], (vec![0, 4, 0], vec![1, 1, 4]));
        let total: u64 = bs.iter().map(|(_, s)| s.iter().product::<u64>()).sum();
        assert_eq!(total, 60);
        assert_eq!(blocks(&[], 4, 40, 1), vec![(vec![], vec![])]);
        assert!(blocks(&[0, 3], 4, 40, 1).is_empty());
        assert_eq!(blocks(&[10], 1, 4, 1).len(), 3);
    }

    #[test]
    fn aligned_blocks_take_whole_bands_of_rows() {
        // 300 rows of 200 one-byte elements: 40 000 bytes a block would take 200 rows; aligned
        // to 128, it takes 128, and the last block the 44 left.
        let bs = blocks(&[300, 200], 1, 40_000, 128);
        let starts: Vec<u64> = bs.iter().map(|(s, _)| s[0]).collect();
        let rows: Vec<u64> = bs.iter().map(|(_, z)| z[0]).collect();
        assert_eq!((starts, rows), (vec![0, 128, 256], vec![128, 128, 44]));
        assert!(bs.iter().all(|(s, z)| s[1] == 0 && z[1] == 200));
        // Rows wider than a block still come a band at a time, whole.
        let bs = blocks(&[300, 200], 1, 100, 128);
        assert_eq!(bs[0], (vec![0, 0], vec![128, 200]));
        // Many bands fit: a multiple of 128 rows.
        assert_eq!(blocks(&[1000, 10], 1, 3000, 128)[0].1, vec![256, 10]);
    }

    /// A computed tensor (as a LoRA fold) written with `--dtype`: the executor gathers the
    /// source box in the tensor's dtype, whose elements are wider than the region's, from two
    /// pieces; each piece's elements land where they belong in that box.
    #[test]
    fn computed_boxes_gather_in_the_tensors_dtype_across_pieces() {
        use crate::model::{
            Checkpoint, Compute, Computed, DataRef, Encoding, Format, Piece, Pieces, Tensor,
        };
        struct Copy;
        impl Compute for Copy {
            fn compute(
                &self,
                _: &[u64],
                _: &[u64],
                src: &[u8],
                dst: &mut [u8],
                to: DType,
            ) -> Result<()> {
                cast::convert(src, DType::F32, dst, to);
                Ok(())
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let vals: Vec<f32> = (0..24).map(|k| k as f32 + 0.5).collect();
        let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(dir.path().join("src.bin"), &bytes).unwrap();
        // Rows 0..2 and 2..6 of a [6, 4] f32 tensor, each piece row-major in the file.
        let mut pieces = Pieces::new(2);
        for (r0, nr) in [(0u64, 2u64), (2, 4)] {
            pieces
                .push(Piece {
                    offsets: vec![r0, 0],
                    sizes: vec![nr, 4],
                    data: DataRef {
                        file: Path::new("src.bin").into(),
                        offset: r0 * 16,
                        strides: vec![4, 1],
                        encoding: Encoding::Raw,
                    },
                })
                .unwrap();
        }
        pieces.set_computed(Computed(std::sync::Arc::new(Copy)));
        let ckpt = Checkpoint {
            root: dir.path().to_path_buf(),
            format: Format::Dcp,
            world_size: None,
            tensors: vec![Tensor {
                name: "w".into(),
                key_path: Vec::new(),
                dtype: DType::F32,
                shape: vec![6, 4],
                pieces,
            }],
            values: Vec::new(),
            unsupported: Vec::new(),
            details: Vec::new(),
        };
        let target = crate::plan::Target::Safetensors {
            file_name: "out.safetensors".into(),
        };
        let opts = crate::plan::PlanOptions {
            cast: Some(DType::BF16),
        };
        let plan = crate::plan::plan(&ckpt, &target, &opts).unwrap();
        let out = dir.path().join("out.safetensors");
        let cancel = AtomicBool::new(false);
        let exec_opts = ExecOptions {
            threads: 1,
            io: IoMode::Read,
            progress: &NoProgress,
            cancel: &cancel,
            durable: false,
        };
        execute(&plan, std::slice::from_ref(&out), &exec_opts).unwrap();
        let file = std::fs::read(&out).unwrap();
        let st = safetensors::SafeTensors::deserialize(&file).unwrap();
        let mut want = vec![0u8; 48];
        cast::convert(&bytes, DType::F32, &mut want, DType::BF16);
        assert_eq!(st.tensor("w").unwrap().data(), &want[..]);
    }

    #[test]
    fn literals_are_merged_and_get_their_crcs() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out");
        let file = create_output(&path, 20).unwrap();
        // Two adjacent literals given out of order, and one apart.
        let plan = FilePlan {
            literals: vec![
                (4, b"efgh".to_vec()),
                (0, b"abcd".to_vec()),
                (10, b"xyz".to_vec()),
            ],
            ..FilePlan::default()
        };
        // A slot inside the merged run, one among data bytes, one running past the lone literal
        // (written on its own, after the literal, so the literal does not overwrite it).
        let patches = [(2, *b"1234"), (16, *b"5678"), (10, *b"9999")];
        write_literals(&file, &path, &plan, &patches, None).unwrap();
        let got = std::fs::read(&path).unwrap();
        assert_eq!(&got, b"ab1234gh\x00\x009999\x00\x005678");
    }
}
