//! The planner: a checkpoint and a target layout in, a [`Plan`] out, with no I/O.
//!
//! A plan lists every destination file with its length, its literal bytes (headers, pickles, ZIP
//! framing, written by the format modules; for DCP pieces, rendered from a few fields when written,
//! see [`FilePlan::for_each_literal`]) and its [`Region`]s: runs of tensor data, each filled from
//! boxes of source pieces ([`Fill`]). Because the planner only does arithmetic, property tests can
//! check that every destination byte is written exactly once.
//!
//! One file per kind of target: [`safetensors`] (one file, Hugging Face split files, DCP's
//! safetensors flavour) and [`torch_save`] are planned whole by a [`Planner`]; [`dcp`] is planned
//! rank file by rank file as it is written. [`mesh`] places tensors on a mesh for both sharded
//! targets, and [`sourcing`] finds where each box of a tensor comes from for all of them.

mod dcp;
pub(crate) mod deepspeed;
mod mesh;
mod safetensors;
mod sourcing;
#[cfg(test)]
mod tests;
mod torch_save;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::formats::dcp::metadata as dcp_metadata;
use crate::formats::{dcp as dcp_format, hf_index};
use crate::geometry::{NdBox, Placement};
use crate::model::{Checkpoint, Encoding, Tensor};
use crate::zip;

pub use dcp::DcpFiles;
use sourcing::Sourcing;

/// Everything needed to write one output: files, and where each byte comes from.
///
/// Most targets are planned whole, every file up front. A DCP target is planned one rank file at a
/// time as the executor asks for it ([`Plan::file`]), and its `.metadata` is streamed from mesh geometry ([`Plan::write_streamed`]):
/// a reshard to 1024 ranks has two million items, whose regions and metadata records never all
/// exist at once.
pub struct Plan<'a> {
    /// Absolute paths of the input files that fills read from; [`Fill::input`] indexes this.
    pub inputs: Vec<PathBuf>,
    /// Things the user should hear about (skipped entries, replicated tensors).
    pub notes: Vec<String>,
    files: PlannedFiles<'a>,
    /// The directory of the output the planned files go in (Megatron's `release/`), if not its
    /// root.
    dir: Option<PathBuf>,
    /// Files of known bytes beside the planned ones, relative to the output's root (an export's
    /// config.json, Megatron's `latest_checkpointed_iteration.txt`): after them in file order.
    beside: Vec<FilePlan>,
}

/// The destination files of a [`Plan`], by how they are planned.
enum PlannedFiles<'a> {
    /// Every file planned up front, with where the regions of its tensors find their fills.
    Whole {
        files: Vec<FilePlan>,
        src: Sourcing<'a>,
    },
    /// A DCP target: its rank files, planned when asked for, then its streamed `.metadata`.
    Dcp(Box<DcpFiles<'a>>),
    /// Files planned by a format of its own from its input's bytes, not from a checkpoint's
    /// tensors (DeepSpeed's rank files at another world size): every region's fills listed.
    Listed(Vec<FilePlan>),
}

#[derive(Clone, Debug, Default)]
pub struct FilePlan {
    /// Relative to the output root.
    pub path: PathBuf,
    pub len: u64,
    /// Bytes known at planning time, by offset.
    pub literals: Vec<(u64, Vec<u8>)>,
    /// DCP items of one tensor box each. Their framing (ZIP headers and a pickle, about 1.6 KiB)
    /// is the same for every box of one dtype and shape, so it is shared, not copied per item:
    /// see [`FilePlan::for_each_literal`].
    pub tensor_items: Vec<TensorItem>,
    pub regions: Vec<Region>,
    /// What the file is to the output; an output backend orders its writes by it.
    pub role: FileRole,
    /// Permission bits to give the file where the output has them, when it is a copy of an
    /// input file that has its own (DeepSpeed's recovery scripts, which it makes executable);
    /// `None` for the default.
    pub mode: Option<u32>,
}

/// What a destination file is to the output.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FileRole {
    /// Tensor data and its framing, written from literals and regions, in any order.
    #[default]
    Data,
    /// Its literals make the output a checkpoint (a split safetensors index): written once
    /// every data file is.
    CommitMarker,
    /// Written by [`Plan::write_streamed`] once every data file is, and makes the output a
    /// checkpoint (a DCP `.metadata`).
    StreamedCommitMarker,
}

impl FileRole {
    /// Whether the file is written by [`Plan::write_streamed`] rather than from regions.
    pub fn is_streamed(self) -> bool {
        self == FileRole::StreamedCommitMarker
    }

    /// Whether the file's presence makes the output a checkpoint, so it is written last.
    pub fn is_commit_marker(self) -> bool {
        self != FileRole::Data
    }
}

/// Names of the files that make an output a checkpoint, for every target the planner knows:
/// an output being replaced loses them before anything else.
pub const COMMIT_MARKERS: [&str; 2] = [dcp_format::METADATA, hf_index::INDEX_NAME];

impl FilePlan {
    /// Visit every literal byte run of the file in offset order: `literals`, and the framing of
    /// each of `tensor_items`.
    pub fn for_each_literal(&self, mut visit: impl FnMut(u64, &[u8]) -> Result<()>) -> Result<()> {
        let mut plain: Vec<&(u64, Vec<u8>)> = self.literals.iter().collect();
        plain.sort_by_key(|(offset, _)| *offset);
        let mut plain = plain.into_iter().peekable();
        let mut items: Vec<&TensorItem> = self.tensor_items.iter().collect();
        items.sort_by_key(|item| item.base);
        for item in items {
            for (offset, bytes) in &item.framing.layout.literals {
                let at = item.base + offset;
                while let Some((o, b)) = plain.next_if(|(o, _)| *o < at) {
                    visit(*o, b)?;
                }
                visit(at, bytes)?;
            }
        }
        for (o, b) in plain {
            visit(*o, b)?;
        }
        Ok(())
    }
}

/// A torch.save archive at `base` holding one contiguous tensor (its data is a [`Region`]): how
/// DCP stores each piece.
#[derive(Clone, Debug)]
pub struct TensorItem {
    pub base: u64,
    pub framing: Arc<ItemFraming>,
}

/// The records and layout of a torch.save archive of one contiguous tensor of a dtype and shape:
/// a pure function of those two, placed at any base.
#[derive(Debug)]
pub struct ItemFraming {
    pub records: Vec<zip::ZipRecord>,
    pub layout: zip::ZipLayout,
}

impl ItemFraming {
    pub fn new(dtype: DType, shape: &[u64]) -> ItemFraming {
        let leaf = crate::formats::torch_save::WriteLeaf::Tensor {
            dtype,
            shape: shape.to_vec(),
            storage_key: "0".into(),
        };
        let nbytes = crate::model::numel(shape).unwrap_or(0) * dtype.size() as u64;
        let records = crate::formats::torch_save::records(
            "archive",
            crate::formats::torch_save::data_pkl(&[(Vec::new(), leaf)]),
            &[("0".to_string(), nbytes)],
        );
        let layout = zip::layout(&records);
        ItemFraming { records, layout }
    }
}

/// A row-major, contiguous run of one tensor's data in a destination file.
#[derive(Clone, Debug)]
pub struct Region {
    /// Tensor name, for errors and progress.
    pub name: String,
    /// Byte offset in the destination file.
    pub offset: u64,
    /// Destination element type (differs from the fills' when casting).
    pub dtype: DType,
    /// Shape of the box this region holds.
    pub shape: Vec<u64>,
    pub source: RegionSource,
    /// Offsets in the destination file where the CRC-32 of this region's bytes goes (ZIP records).
    pub crc_slots: Vec<u64>,
}

/// Where a region's elements come from.
#[derive(Clone, Debug)]
pub enum RegionSource {
    /// Fills listed when planning (a value's carried bytes).
    Fills(Vec<Fill>),
    /// NdBox `b` of tensor `tensor` of the planned checkpoint. Its fills are found from the tensor's
    /// pieces when the region is copied ([`Plan::fills`]): consolidating a tensor saved on 1024
    /// ranks takes 1024 fills, and listing every tensor's up front took hundreds of bytes per
    /// piece of the checkpoint.
    Tensor { tensor: usize, b: NdBox },
}

/// Copy a box of source elements into a region.
#[derive(Clone, Debug, PartialEq)]
pub struct Fill {
    pub input: usize,
    pub encoding: Encoding,
    pub dtype: DType,
    /// Source byte offset of the box's first element.
    pub offset: u64,
    /// Source strides in elements.
    pub strides: Vec<u64>,
    /// Where the box starts inside the region, per dimension.
    pub start: Vec<u64>,
    pub sizes: Vec<u64>,
}

impl Region {
    /// Bytes this region occupies.
    pub fn nbytes(&self) -> u64 {
        crate::model::numel(&self.shape).unwrap_or(0) * self.dtype.size() as u64
    }
}

impl Plan<'_> {
    /// The files planned whole (none for a DCP target, whose rank files are planned when asked
    /// for with [`Plan::file`]).
    pub fn whole_files(&self) -> &[FilePlan] {
        match &self.files {
            PlannedFiles::Whole { files, .. } | PlannedFiles::Listed(files) => files,
            PlannedFiles::Dcp(_) => &[],
        }
    }

    /// A plan of files a format planned itself from `inputs`' bytes (every region's
    /// [`RegionSource::Fills`] listed), not from a checkpoint's tensors.
    pub fn listed(inputs: Vec<PathBuf>, files: Vec<FilePlan>) -> Result<Plan<'static>> {
        for f in &files {
            if let Some(r) = f
                .regions
                .iter()
                .find(|r| !matches!(r.source, RegionSource::Fills(_)))
            {
                return Err(Error::bug("a listed plan's region has no fills").tensor(&r.name));
            }
        }
        Ok(Plan {
            inputs,
            notes: Vec::new(),
            files: PlannedFiles::Listed(files),
            dir: None,
            beside: Vec::new(),
        })
    }

    /// Number of destination files.
    pub fn file_count(&self) -> usize {
        self.planned_count() + self.beside.len()
    }

    /// Number of files planned from the checkpoint (the files beside them come after).
    fn planned_count(&self) -> usize {
        match &self.files {
            PlannedFiles::Whole { files, .. } | PlannedFiles::Listed(files) => files.len(),
            PlannedFiles::Dcp(dcp) => dcp.file_count(),
        }
    }

    /// File `i` beside the planned ones, if it is one.
    fn beside(&self, i: usize) -> Option<&FilePlan> {
        i.checked_sub(self.planned_count())
            .and_then(|k| self.beside.get(k))
    }

    /// Path of destination file `i`, relative to the output root.
    pub fn path(&self, i: usize) -> PathBuf {
        if let Some(f) = self.beside(i) {
            return f.path.clone();
        }
        let path = match &self.files {
            PlannedFiles::Whole { files, .. } | PlannedFiles::Listed(files) => {
                files.get(i).map(|f| f.path.clone()).unwrap_or_default()
            }
            PlannedFiles::Dcp(dcp) => dcp.path(i),
        };
        match &self.dir {
            Some(dir) => dir.join(path),
            None => path,
        }
    }

    /// Paths of every destination file, in order.
    pub fn paths(&self) -> Vec<PathBuf> {
        (0..self.file_count()).map(|i| self.path(i)).collect()
    }

    /// Destination file `i`, planned now if it was not planned whole. A streamed file (see
    /// [`Plan::write_streamed`]) has no regions or literals here.
    pub fn file(&self, i: usize) -> Result<std::borrow::Cow<'_, FilePlan>> {
        use std::borrow::Cow;
        if let Some(f) = self.beside(i) {
            return Ok(Cow::Borrowed(f));
        }
        match &self.files {
            PlannedFiles::Whole { files, .. } | PlannedFiles::Listed(files) => files
                .get(i)
                .map(Cow::Borrowed)
                .ok_or_else(|| Error::bug(format!("no destination file {i} in the plan"))),
            PlannedFiles::Dcp(dcp) => dcp.file(i).map(Cow::Owned),
        }
    }

    /// Length of destination file `i` without planning its regions (0 for a streamed file, whose
    /// length is known only once it is written): what a partitioned run lays out its shares by.
    pub fn file_len(&self, i: usize) -> u64 {
        if let Some(f) = self.beside(i) {
            return f.len;
        }
        match &self.files {
            PlannedFiles::Whole { files, .. } | PlannedFiles::Listed(files) => {
                files.get(i).map_or(0, |f| f.len)
            }
            PlannedFiles::Dcp(dcp) => dcp.file_len(i),
        }
    }

    /// What destination file `i` is to the output.
    pub fn role(&self, i: usize) -> FileRole {
        if let Some(f) = self.beside(i) {
            return f.role;
        }
        match &self.files {
            PlannedFiles::Whole { files, .. } | PlannedFiles::Listed(files) => {
                files.get(i).map_or(FileRole::Data, |f| f.role)
            }
            PlannedFiles::Dcp(dcp) => dcp.role(i),
        }
    }

    /// True when file `i` is written by [`Plan::write_streamed`] rather than from regions.
    pub fn is_streamed(&self, i: usize) -> bool {
        self.role(i).is_streamed()
    }

    /// Write streamed file `i` (a DCP `.metadata`) to `sink`; returns its length. Setting `stop`
    /// ends it early with an error.
    pub fn write_streamed<W: std::io::Write + std::io::Seek>(
        &self,
        i: usize,
        sink: &mut W,
        stop: &std::sync::atomic::AtomicBool,
    ) -> std::io::Result<u64> {
        match &self.files {
            PlannedFiles::Dcp(dcp) if i < self.planned_count() && self.is_streamed(i) => {
                dcp_metadata::write_to(sink, &&**dcp, stop)
            }
            _ => Ok(0),
        }
    }

    /// The fills of region `r` that meet its sub-box at `start` of `sizes` (in region
    /// coordinates; all of them for `None`), in source piece order.
    pub fn fills<'r>(
        &self,
        r: &'r Region,
        within: Option<(&[u64], &[u64])>,
    ) -> Result<std::borrow::Cow<'r, [Fill]>> {
        use std::borrow::Cow;
        match &r.source {
            RegionSource::Fills(fills) => Ok(Cow::Borrowed(fills)),
            RegionSource::Tensor { tensor, b } => {
                let src = match &self.files {
                    PlannedFiles::Whole { src, .. } => src,
                    PlannedFiles::Dcp(dcp) => dcp.sourcing(),
                    PlannedFiles::Listed(_) => {
                        return Err(Error::bug("a listed plan's region names a tensor"))
                    }
                };
                src.fills(*tensor, b, within).map(Cow::Owned)
            }
        }
    }

    /// How region `r`'s elements are computed from its tensor's pieces, when they are not
    /// copied: the [`crate::model::Compute`], the tensor's dtype (what the pieces hold) and
    /// where the region's box starts in the tensor.
    pub fn computed<'r>(
        &self,
        r: &'r Region,
    ) -> Option<(&crate::model::Computed, DType, &'r [u64])> {
        let RegionSource::Tensor { tensor, b } = &r.source else {
            return None;
        };
        let src = match &self.files {
            PlannedFiles::Whole { src, .. } => src,
            PlannedFiles::Dcp(dcp) => dcp.sourcing(),
            PlannedFiles::Listed(_) => return None,
        };
        let t = src.ckpt.tensors.get(*tensor)?;
        t.pieces
            .computed()
            .map(|c| (c, t.dtype, b.offsets.as_slice()))
    }

    /// Put the planned files in directory `dir` of the output (Megatron's `release/`); the
    /// files beside them stay where they are.
    pub fn nest(&mut self, dir: PathBuf) {
        self.dir = Some(dir);
    }

    /// Add a file of known bytes beside the planned ones (`path` relative to the output's
    /// root): what an export writes beside the weights (config.json, the tokenizer's files),
    /// staged and committed with them. `role` says whether it makes the output a checkpoint
    /// (Megatron's `latest_checkpointed_iteration.txt`), and so is written last.
    pub fn add_literal_file(&mut self, path: PathBuf, bytes: Vec<u8>) -> Result<()> {
        self.add_file(path, bytes, FileRole::Data)
    }

    /// [`Plan::add_literal_file`] with the file's role.
    pub fn add_file(&mut self, path: PathBuf, bytes: Vec<u8>, role: FileRole) -> Result<()> {
        if (0..self.file_count()).any(|i| self.path(i) == path) {
            return Err(Error::usage(format!(
                "`{}` would be written twice in the output",
                path.display()
            )));
        }
        let len = bytes.len() as u64;
        let literals = if bytes.is_empty() {
            Vec::new()
        } else {
            vec![(0, bytes)]
        };
        self.beside.push(FilePlan {
            path,
            len,
            literals,
            role,
            ..FilePlan::default()
        });
        Ok(())
    }

    /// Bytes of tensor data the plan copies.
    pub fn data_bytes(&self) -> u64 {
        match &self.files {
            PlannedFiles::Whole { files, .. } | PlannedFiles::Listed(files) => files
                .iter()
                .flat_map(|f| &f.regions)
                .map(Region::nbytes)
                .sum(),
            PlannedFiles::Dcp(dcp) => dcp.data_bytes(),
        }
    }
}

/// The layout to produce.
#[derive(Clone, Debug)]
pub enum Target {
    /// One safetensors file called `file_name`.
    Safetensors { file_name: String },
    /// Hugging Face split files of at most `max_shard_bytes` each (a larger tensor gets a file of
    /// its own) plus `model.safetensors.index.json`; one file is written as `model.safetensors`.
    SafetensorsSplit { max_shard_bytes: u64 },
    /// One torch.save archive called `file_name`.
    TorchSave { file_name: String },
    /// A DCP directory sharded over a mesh.
    Dcp(MeshSpec),
    /// DCP's Hugging Face flavour sharded over a mesh.
    DcpSafetensors(MeshSpec),
}

/// A device mesh and how tensors are placed on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MeshSpec {
    pub shape: Vec<usize>,
    /// One per mesh dimension.
    pub placements: Vec<Placement>,
    /// Tensors stored whole, once (on rank 0), whatever the placements say.
    pub replicated: BTreeSet<String>,
}

impl MeshSpec {
    pub fn world_size(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Options that apply to every target.
#[derive(Clone, Debug, Default)]
pub struct PlanOptions {
    /// Cast floating-point tensors to this dtype; integer and bool tensors are left alone.
    pub cast: Option<DType>,
}

/// Plan writing `ckpt` as `target`. A file meant to be read needs [`check_dtypes`] first.
pub fn plan<'a>(ckpt: &'a Checkpoint, target: &Target, opts: &PlanOptions) -> Result<Plan<'a>> {
    let src = Sourcing::new(ckpt, opts)?;
    if let Target::Dcp(mesh) = target {
        let (dcp, notes) = DcpFiles::new(src, mesh)?;
        return Ok(Plan {
            inputs: dcp.sourcing().inputs.clone(),
            notes,
            files: PlannedFiles::Dcp(Box::new(dcp)),
            dir: None,
            beside: Vec::new(),
        });
    }
    let mut planner = Planner {
        src,
        files: Vec::new(),
        notes: Vec::new(),
    };
    match target {
        Target::Safetensors { file_name } => {
            let all: Vec<usize> = (0..ckpt.tensors.len()).collect();
            planner.safetensors_file(file_name, &all, &[("format", "pt")]);
            planner.skip_values("safetensors");
        }
        Target::SafetensorsSplit { max_shard_bytes } => {
            planner.split(*max_shard_bytes);
            planner.skip_values("safetensors");
        }
        Target::TorchSave { file_name } => planner.torch_save(file_name)?,
        Target::Dcp(_) => {}
        Target::DcpSafetensors(mesh) => {
            planner.dcp_safetensors(mesh)?;
            planner.skip_values("safetensors");
        }
    }
    let Planner { src, files, notes } = planner;
    Ok(Plan {
        inputs: src.inputs.clone(),
        notes,
        files: PlannedFiles::Whole { files, src },
        dir: None,
        beside: Vec::new(),
    })
}

/// and so DCP's safetensors flavour, has no complex128, complex32 or float4_e2m1fn_x2. Checked
/// before [`plan`], not in it: verify plans a safetensors file it never writes to digest any
/// checkpoint.
pub fn check_dtypes(ckpt: &Checkpoint, target: &Target, opts: &PlanOptions) -> Result<()> {
    let (format, hint) = match target {
        Target::TorchSave { .. } | Target::Dcp(_) => return Ok(()),
        Target::Safetensors { .. } | Target::SafetensorsSplit { .. } => (
            "safetensors",
            "write torch.save, which holds every torch dtype: --format torch",
        ),
        Target::DcpSafetensors(_) => (
            "dcp-safetensors",
            "write plain DCP, which holds every torch dtype: --format dcp",
        ),
    };
    let out_dtype = |t: &Tensor| sourcing::out_dtype(t, opts.cast);
    let refused: Vec<&Tensor> = ckpt
        .tensors
        .iter()
        .filter(|t| out_dtype(t).safetensors_code().is_none())
        .collect();
    let Some(first) = refused.first() else {
        return Ok(());
    };
    let dtype = out_dtype(first);
    let mut message = format!(
        "{format} cannot hold dtype `torch.{}` ({dtype})",
        dtype.torch_name()
    );
    if refused.len() > 1 {
        message += &format!(", nor {} other tensors of such dtypes", refused.len() - 1);
    }
    Err(Error::usage(message)
        .tensor(&first.name)
        .hint(format!("{hint}; or leave such tensors out with --exclude")))
}

/// Builds the files of a target planned whole; each target's methods are in its own file.
struct Planner<'a> {
    src: Sourcing<'a>,
    files: Vec<FilePlan>,
    notes: Vec<String>,
}

impl Planner<'_> {
    fn skip_values(&mut self, format: &str) {
        let values = &self.src.ckpt.values;
        if !values.is_empty() {
            let names: Vec<&str> = values.iter().map(|v| v.name.as_str()).collect();
            self.notes.push(format!(
                "skipped {} non-tensor entries ({format} holds tensors only): {}",
                names.len(),
                names.join(", ")
            ));
        }
    }
}
