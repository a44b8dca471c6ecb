//! The planner: a checkpoint and a target layout in, a [`Plan`] out, with no I/O.
//!
//! A plan lists every destination file with its length, its literal bytes (headers, pickles, ZIP
//! framing, written by the format modules; for DCP pieces, rendered from a few fields when written,
//! see [`FilePlan::for_each_literal`]) and its [`Region`]s: runs of tensor data, each filled from
//! boxes of source pieces ([`Fill`]). Because the planner only does arithmetic, property tests can
//! check that every destination byte is written exactly once.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::formats::dcp::metadata::{self as dcp_metadata, Chunk, Describe, EntryRef, StorageRef};
use crate::formats::{dcp, hf_index, safetensors, torch_save, zip};
use crate::geometry::{self, local_box, NdBox, Placement};
use crate::model::{Checkpoint, Encoding, KeyPart, NonTensor, PieceRef, Tensor};

/// Everything needed to write one output: files, and where each byte comes from.
///
/// Most targets are planned whole, into [`Plan::files`]. A DCP target ([`Plan::dcp`]) is planned
/// one rank file at a time as the executor asks for it ([`Plan::file`]), and its `.metadata` is
/// streamed from mesh geometry ([`Plan::write_streamed`]): a reshard to 1024 ranks has two million
/// items, whose regions and metadata records never all exist at once.
#[derive(Default)]
pub struct Plan<'a> {
    /// Absolute paths of the input files that fills read from; [`Fill::input`] indexes this.
    pub inputs: Vec<PathBuf>,
    /// Files planned whole, written first.
    pub files: Vec<FilePlan>,
    /// Things the user should hear about (skipped entries, replicated tensors).
    pub notes: Vec<String>,
    /// A DCP target's rank files and `.metadata`, after `files`.
    pub dcp: Option<DcpFiles<'a>>,
    /// Where the regions of `files` find their fills (a DCP target's are in `dcp`).
    src: Option<Sourcing<'a>>,
}

/// One destination file.
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
pub const COMMIT_MARKERS: [&str; 2] = [dcp::METADATA, hf_index::INDEX_NAME];

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
        let leaf = torch_save::WriteLeaf::Tensor {
            dtype,
            shape: shape.to_vec(),
            storage_key: "0".into(),
        };
        let nbytes = crate::model::numel(shape).unwrap_or(0) * dtype.size() as u64;
        let records = torch_save::records(
            "archive",
            torch_save::data_pkl(&[(Vec::new(), leaf)]),
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
    /// Number of destination files.
    pub fn file_count(&self) -> usize {
        self.files.len() + self.dcp.as_ref().map_or(0, |d| d.names.len() + 1)
    }

    /// Path of destination file `i`, relative to the output root.
    pub fn path(&self, i: usize) -> PathBuf {
        match (self.files.get(i), &self.dcp) {
            (Some(f), _) => f.path.clone(),
            (None, Some(dcp)) => match dcp.names.get(i - self.files.len()) {
                Some(name) => PathBuf::from(name),
                None => PathBuf::from(dcp::METADATA),
            },
            (None, None) => PathBuf::new(),
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
        if let Some(f) = self.files.get(i) {
            return Ok(Cow::Borrowed(f));
        }
        let k = i - self.files.len();
        match &self.dcp {
            Some(dcp) if k < dcp.names.len() => Ok(Cow::Owned(dcp.rank_file(k)?)),
            _ => Ok(Cow::Owned(FilePlan {
                path: self.path(i),
                role: self.role(i),
                ..FilePlan::default()
            })),
        }
    }

    /// Length of destination file `i` without planning its regions (0 for a streamed file, whose
    /// length is known only once it is written): what a partitioned run lays out its shares by.
    pub fn file_len(&self, i: usize) -> u64 {
        if let Some(f) = self.files.get(i) {
            return f.len;
        }
        match &self.dcp {
            Some(dcp) if i - self.files.len() < dcp.names.len() => {
                dcp.rank_file_len(i - self.files.len())
            }
            _ => 0,
        }
    }

    /// What destination file `i` is to the output.
    pub fn role(&self, i: usize) -> FileRole {
        match (self.files.get(i), &self.dcp) {
            (Some(f), _) => f.role,
            (None, Some(d)) if i == self.files.len() + d.names.len() => {
                FileRole::StreamedCommitMarker
            }
            _ => FileRole::Data,
        }
    }

    /// True when file `i` is written by [`Plan::write_streamed`] rather than from regions.
    pub fn is_streamed(&self, i: usize) -> bool {
        self.role(i).is_streamed()
    }

    /// Write streamed file `i` (a DCP `.metadata`) to `sink`; returns its length.
    pub fn write_streamed<W: std::io::Write + std::io::Seek>(
        &self,
        i: usize,
        sink: &mut W,
    ) -> std::io::Result<u64> {
        match &self.dcp {
            Some(dcp) if self.is_streamed(i) => dcp_metadata::write_to(sink, &dcp),
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
                let src = self
                    .src
                    .as_ref()
                    .or(self.dcp.as_ref().map(|d| &d.src))
                    .ok_or_else(|| Error::bug("a region of a tensor in a plan without one"))?;
                Ok(Cow::Owned(src.fills(*tensor, b, within)))
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
        let src = self.src.as_ref().or(self.dcp.as_ref().map(|d| &d.src))?;
        let t = src.ckpt.tensors.get(*tensor)?;
        t.pieces
            .computed()
            .map(|c| (c, t.dtype, b.offsets.as_slice()))
    }

    /// Bytes of tensor data the plan copies.
    pub fn data_bytes(&self) -> u64 {
        let whole: u64 = self
            .files
            .iter()
            .flat_map(|f| &f.regions)
            .map(Region::nbytes)
            .sum();
        whole + self.dcp.as_ref().map_or(0, |d| d.data_bytes)
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
            inputs: dcp.src.inputs.clone(),
            notes,
            dcp: Some(dcp),
            ..Plan::default()
        });
    }
    let mut planner = Planner {
        plan: Plan {
            inputs: src.inputs.clone(),
            ..Plan::default()
        },
        src,
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
    let Planner { mut plan, src } = planner;
    plan.src = Some(src);
    Ok(plan)
}

/// Refuse `target` when its format cannot hold a tensor's dtype (after any cast): safetensors,
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
    let out_dtype = |t: &Tensor| match opts.cast {
        Some(to) if t.dtype.is_float() => to,
        _ => t.dtype,
    };
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

/// Where each tensor's bytes come from: the checkpoint, its input files numbered once, and an
/// index of each tensor's pieces. All a [`Region`] needs, and read-only, so rank files can be
/// planned one at a time long after planning started.
struct Sourcing<'a> {
    ckpt: &'a Checkpoint,
    cast: Option<DType>,
    /// Absolute paths, in the order the checkpoint first names them.
    inputs: Vec<PathBuf>,
    /// Index into `inputs` of each file, as the checkpoint names it (relative).
    input_of: HashMap<&'a Path, usize>,
    /// One per tensor of `ckpt`.
    indexes: Vec<PieceIndex>,
}

impl<'a> Sourcing<'a> {
    fn new(ckpt: &'a Checkpoint, opts: &PlanOptions) -> Result<Sourcing<'a>> {
        let indexes = ckpt
            .tensors
            .iter()
            .map(|t| {
                check_tensor(t)?;
                Ok(PieceIndex::new(t))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut inputs = Vec::new();
        let mut input_of = HashMap::new();
        let pieces = ckpt.tensors.iter().flat_map(|t| t.pieces.iter());
        let files = pieces.map(|p| &**p.file()).chain(
            ckpt.values
                .iter()
                .filter_map(|v| Some(v.raw.as_ref()?.file.as_path())),
        );
        for file in files {
            input_of.entry(file).or_insert_with(|| {
                inputs.push(ckpt.path_of(file));
                inputs.len() - 1
            });
        }
        Ok(Sourcing {
            ckpt,
            cast: opts.cast,
            inputs,
            input_of,
            indexes,
        })
    }

    /// The dtype a tensor is written as.
    fn out_dtype(&self, t: &Tensor) -> DType {
        match self.cast {
            Some(to) if t.dtype.is_float() => to,
            _ => t.dtype,
        }
    }

    fn out_nbytes(&self, t: &Tensor) -> u64 {
        crate::model::numel(&t.shape).unwrap_or(0) * self.out_dtype(t).size() as u64
    }

    fn input(&self, file: &Path) -> usize {
        // Every file of the checkpoint was numbered in `new`.
        self.input_of.get(file).copied().unwrap_or(usize::MAX)
    }

    /// A region at `offset` holding box `b` of tensor `ti`, filled from the pieces that meet it.
    fn region(&self, ti: usize, b: &NdBox, offset: u64) -> Region {
        let t = &self.ckpt.tensors[ti];
        Region {
            name: t.name.clone(),
            offset,
            dtype: self.out_dtype(t),
            shape: b.sizes.clone(),
            source: RegionSource::Tensor {
                tensor: ti,
                b: b.clone(),
            },
            crc_slots: Vec::new(),
        }
    }

    /// The fills of box `b` of tensor `ti` from the pieces that meet its sub-box at `start` of
    /// `sizes` (relative to `b`), or all of it.
    fn fills(&self, ti: usize, b: &NdBox, within: Option<(&[u64], &[u64])>) -> Vec<Fill> {
        let t = &self.ckpt.tensors[ti];
        let query = match within {
            Some((start, sizes)) => NdBox {
                offsets: b.offsets.iter().zip(start).map(|(o, s)| o + s).collect(),
                sizes: sizes.to_vec(),
            },
            None => b.clone(),
        };
        let mut fills = Vec::new();
        for k in self.indexes[ti].meeting(&query) {
            let piece = t.pieces.get(k);
            let pb = NdBox {
                offsets: piece.offsets().to_vec(),
                sizes: piece.sizes().to_vec(),
            };
            if within.is_some() && pb.intersect(&query).is_none_or(|c| c.is_empty()) {
                continue;
            }
            let Some(common) = pb.intersect(b) else {
                continue;
            };
            if common.is_empty() {
                continue;
            }
            let elem = t.dtype.size() as u64;
            let strides = piece.strides().into_owned();
            let skip: u64 = (0..common.offsets.len())
                .map(|d| (common.offsets[d] - pb.offsets[d]) * strides[d])
                .sum();
            fills.push(Fill {
                input: self.input(piece.file()),
                encoding: piece.encoding(),
                dtype: t.dtype,
                offset: piece.offset() + skip * elem,
                strides,
                start: (0..common.offsets.len())
                    .map(|d| common.offsets[d] - b.offsets[d])
                    .collect(),
                sizes: common.sizes,
            });
        }
        fills
    }

    /// Append a non-tensor entry's torch.save bytes to `file`: the original bytes when the source
    /// had them (so DCP values survive byte for byte), else a fresh archive of the value.
    fn value_item(&self, file: &mut FilePlan, v: &NonTensor) -> Result<u64> {
        let base = file.len;
        if let Some(blob) = &v.raw {
            file.regions.push(Region {
                name: v.name.clone(),
                offset: base,
                dtype: DType::U8,
                shape: vec![blob.length],
                source: RegionSource::Fills(vec![Fill {
                    input: self.input(&blob.file),
                    encoding: Encoding::Raw,
                    dtype: DType::U8,
                    offset: blob.offset,
                    strides: vec![1],
                    start: vec![0],
                    sizes: vec![blob.length],
                }]),
                crc_slots: Vec::new(),
            });
            file.len = base + blob.length;
            return Ok(blob.length);
        }
        let Some(value) = &v.value else {
            // Every reader keeps a value's original bytes, its decoded value, or both.
            return Err(
                Error::bug("non-tensor entry has neither bytes nor a value").tensor(&v.name)
            );
        };
        let pkl =
            torch_save::data_pkl(&[(Vec::new(), torch_save::WriteLeaf::Value(value.clone()))]);
        let records = torch_save::records("archive", pkl, &[]);
        archive_into(file, base, &records, |_| None)?;
        Ok(file.len - base)
    }
}

/// Builds the plan of a target planned whole.
struct Planner<'a> {
    src: Sourcing<'a>,
    plan: Plan<'a>,
}

impl Planner<'_> {
    fn skip_values(&mut self, format: &str) {
        let values = &self.src.ckpt.values;
        if !values.is_empty() {
            let names: Vec<&str> = values.iter().map(|v| v.name.as_str()).collect();
            self.plan.notes.push(format!(
                "skipped {} non-tensor entries ({format} holds tensors only): {}",
                names.len(),
                names.join(", ")
            ));
        }
    }

    /// One safetensors file holding the whole of each tensor in `tensors` (indices), in order.
    fn safetensors_file(&mut self, name: &str, tensors: &[usize], metadata: &[(&str, &str)]) {
        let ckpt = self.src.ckpt;
        let entries: Vec<(String, DType, Vec<u64>)> = tensors
            .iter()
            .map(|&i| {
                let t = &ckpt.tensors[i];
                (t.name.clone(), self.src.out_dtype(t), t.shape.clone())
            })
            .collect();
        let boxes: Vec<(usize, NdBox)> = tensors
            .iter()
            .map(|&i| (i, NdBox::whole(&ckpt.tensors[i].shape)))
            .collect();
        self.safetensors_pieces(name, &entries, &boxes, metadata);
    }

    /// A safetensors file whose k-th entry is box `boxes[k].1` of tensor `boxes[k].0`.
    fn safetensors_pieces(
        &mut self,
        name: &str,
        entries: &[(String, DType, Vec<u64>)],
        boxes: &[(usize, NdBox)],
        metadata: &[(&str, &str)],
    ) {
        let metadata: Vec<(String, String)> = metadata
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let (header, ranges) = safetensors::header_bytes(entries, &metadata);
        let data_start = header.len() as u64;
        let mut file = FilePlan {
            path: PathBuf::from(name),
            len: data_start + ranges.last().map_or(0, |r| r.1),
            literals: vec![(0, header)],
            ..FilePlan::default()
        };
        for ((i, b), (begin, _)) in boxes.iter().zip(&ranges) {
            file.regions
                .push(self.src.region(*i, b, data_start + begin));
        }
        self.plan.files.push(file);
    }

    fn split(&mut self, max_shard_bytes: u64) {
        let ckpt = self.src.ckpt;
        let mut groups: Vec<Vec<usize>> = Vec::new();
        let mut current = Vec::new();
        let mut current_bytes = 0u64;
        for (i, t) in ckpt.tensors.iter().enumerate() {
            let bytes = self.src.out_nbytes(t);
            if !current.is_empty() && current_bytes.saturating_add(bytes) > max_shard_bytes {
                groups.push(std::mem::take(&mut current));
                current_bytes = 0;
            }
            current.push(i);
            current_bytes = current_bytes.saturating_add(bytes);
        }
        if !current.is_empty() || groups.is_empty() {
            groups.push(current);
        }
        if groups.len() == 1 {
            self.safetensors_file("model.safetensors", &groups[0], &[("format", "pt")]);
            return;
        }
        let n = groups.len();
        let mut weight_map = Vec::new();
        for (k, group) in groups.iter().enumerate() {
            let name = hf_index::split_file_name(k + 1, n);
            for &i in group {
                weight_map.push((ckpt.tensors[i].name.clone(), name.clone()));
            }
            self.safetensors_file(&name, group, &[("format", "pt")]);
        }
        let total: u64 = ckpt.tensors.iter().map(|t| self.src.out_nbytes(t)).sum();
        let index = hf_index::index_json(total, &weight_map);
        self.plan.files.push(FilePlan {
            path: PathBuf::from(hf_index::INDEX_NAME),
            len: index.len() as u64,
            literals: vec![(0, index)],
            role: FileRole::CommitMarker,
            ..FilePlan::default()
        });
    }

    fn torch_save(&mut self, file_name: &str) -> Result<()> {
        let ckpt = self.src.ckpt;
        let mut items = Vec::new();
        let mut storages = Vec::new();
        for (i, t) in ckpt.tensors.iter().enumerate() {
            let key = i.to_string();
            items.push((
                t.effective_key_path(),
                torch_save::WriteLeaf::Tensor {
                    dtype: self.src.out_dtype(t),
                    shape: t.shape.clone(),
                    storage_key: key.clone(),
                },
            ));
            storages.push((key, self.src.out_nbytes(t)));
        }
        let mut unreadable = Vec::new();
        for v in &ckpt.values {
            match &v.value {
                Some(value) => items.push((
                    v.effective_key_path(),
                    torch_save::WriteLeaf::Value(value.clone()),
                )),
                None => unreadable.push(v.name.as_str()),
            }
        }
        if !unreadable.is_empty() {
            self.plan.notes.push(format!(
                "skipped {} non-tensor entries ckpt cannot read as plain data: {}",
                unreadable.len(),
                unreadable.join(", ")
            ));
        }
        let prefix = Path::new(file_name)
            .file_stem()
            .and_then(|s| s.to_str())
            .filter(|s| !s.is_empty())
            .unwrap_or("archive")
            .to_string();
        // Key paths must nest into one dict tree (`a` cannot be both a tensor and a dict).
        torch_save::check_key_paths(&items)?;
        let records = torch_save::records(&prefix, torch_save::data_pkl(&items), &storages);
        let mut file = FilePlan {
            path: PathBuf::from(file_name),
            ..FilePlan::default()
        };
        let src = &self.src;
        let regions = archive_into(&mut file, 0, &records, |key| {
            let i = key.parse::<usize>().ok()?;
            let whole = NdBox::whole(&ckpt.tensors.get(i)?.shape);
            Some(src.region(i, &whole, 0))
        })?;
        file.regions = regions;
        self.plan.files.push(file);
        Ok(())
    }

    fn dcp_safetensors(&mut self, mesh: &MeshSpec) -> Result<()> {
        let ckpt = self.src.ckpt;
        let (per_rank, notes) = assign(ckpt, mesh)?;
        self.plan.notes.extend(notes);
        for (rank, tensors) in per_rank.iter().enumerate() {
            let items: Vec<(usize, NdBox)> = tensors
                .iter()
                .map(|&i| (i as usize, box_of(ckpt, mesh, i as usize, rank)))
                .collect();
            let entries: Vec<(String, DType, Vec<u64>)> = items
                .iter()
                .map(|(i, b)| {
                    let t = &ckpt.tensors[*i];
                    (t.name.clone(), self.src.out_dtype(t), b.sizes.clone())
                })
                .collect();
            let offsets: Vec<(String, Vec<u64>)> = items
                .iter()
                .map(|(i, b)| (ckpt.tensors[*i].name.clone(), b.offsets.clone()))
                .collect();
            let metadata = dcp::hf::sharding_metadata(&offsets);
            let metadata: Vec<(&str, &str)> = metadata
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            let name = dcp::hf::file_name(rank, 1, 1);
            self.safetensors_pieces(&name, &entries, &items, &metadata);
        }
        Ok(())
    }
}

/// Lay out a ZIP archive of `records` at `base` in `file`: literals go straight into the file, and
/// each `{prefix}/data/{key}` record becomes the region `region_for(key)` returns, moved to its
/// place. Returns those regions. The file grows to hold the archive.
fn archive_into(
    file: &mut FilePlan,
    base: u64,
    records: &[zip::ZipRecord],
    region_for: impl FnMut(&str) -> Option<Region>,
) -> Result<Vec<Region>> {
    let mut layout = zip::layout(records);
    for (offset, bytes) in std::mem::take(&mut layout.literals) {
        file.literals.push((base + offset, bytes));
    }
    place_archive(file, base, records, &layout, region_for)
}

/// Place the regions of an archive laid out as `layout` at `base` in `file` (see
/// [`archive_into`]), without its literals.
fn place_archive(
    file: &mut FilePlan,
    base: u64,
    records: &[zip::ZipRecord],
    layout: &zip::ZipLayout,
    mut region_for: impl FnMut(&str) -> Option<Region>,
) -> Result<Vec<Region>> {
    let mut regions = Vec::new();
    for (k, record) in records.iter().enumerate() {
        if record.content.is_some() {
            continue;
        }
        let key = record.name.rsplit('/').next().unwrap_or_default();
        let Some(mut region) = region_for(key) else {
            return Err(Error::bug(format!(
                "archive record `{}` has no tensor",
                record.name
            )));
        };
        region.offset = base + layout.data_offsets[k];
        region.crc_slots = layout.crc_slots[k].iter().map(|o| base + o).collect();
        regions.push(region);
    }
    file.len = file.len.max(base + layout.len);
    Ok(regions)
}

/// True when tensor `ti` is stored whole, once, on rank 0 rather than placed on the mesh.
fn stored_whole(t: &Tensor, mesh: &MeshSpec) -> bool {
    t.shape.is_empty() || mesh.replicated.contains(&t.name)
}

/// The box of tensor `ti` that `rank` stores.
fn box_of(ckpt: &Checkpoint, mesh: &MeshSpec, ti: usize, rank: usize) -> NdBox {
    let t = &ckpt.tensors[ti];
    if stored_whole(t, mesh) {
        NdBox::whole(&t.shape)
    } else {
        local_box(&t.shape, &mesh.shape, &mesh.placements, rank)
    }
}

/// The tensors each rank of `mesh` stores a box of, in tensor order (see [`box_of`] for the box),
/// and notes for the user.
fn assign(ckpt: &Checkpoint, mesh: &MeshSpec) -> Result<(Vec<Vec<u32>>, Vec<String>)> {
    let world = mesh.world_size();
    if world == 0 || mesh.placements.len() != mesh.shape.len() {
        return Err(Error::usage(
            "the mesh needs one placement per dimension and no zero size",
        ));
    }
    if u32::try_from(ckpt.tensors.len()).is_err() {
        return Err(Error::invalid("more than 4 billion tensors"));
    }
    let mut per_rank: Vec<Vec<u32>> = vec![Vec::new(); world];
    let mut replicated_dims = Vec::new();
    for (i, t) in ckpt.tensors.iter().enumerate() {
        if stored_whole(t, mesh) {
            per_rank[0].push(i as u32);
            continue;
        }
        if mesh
            .placements
            .iter()
            .any(|p| matches!(p, Placement::Shard(d) if *d >= t.shape.len()))
        {
            replicated_dims.push(t.name.as_str());
        }
        // DCP keys chunks by their offsets and stores each once: a replicated box is written by
        // the lowest rank holding it, and an empty box (a trailing rank of a short dim) only when
        // no box with data starts at the same offsets, as DTensor's saves show.
        let mut owner: BTreeMap<Vec<u64>, (usize, bool)> = BTreeMap::new();
        for rank in 0..world {
            let b = local_box(&t.shape, &mesh.shape, &mesh.placements, rank);
            let empty = b.is_empty();
            let replaces = match owner.get(&b.offsets) {
                None => true,
                Some(&(_, kept_empty)) => kept_empty && !empty,
            };
            if replaces {
                owner.insert(b.offsets, (rank, empty));
            }
        }
        let mut ranks: Vec<usize> = owner.into_values().map(|(rank, _)| rank).collect();
        ranks.sort_unstable();
        for rank in ranks {
            per_rank[rank].push(i as u32);
        }
    }
    let mut notes = Vec::new();
    if !replicated_dims.is_empty() {
        notes.push(format!(
            "replicated on mesh dimensions whose Shard(d) names a dim they lack: {}",
            replicated_dims.join(", ")
        ));
    }
    Ok((per_rank, notes))
}

/// A DCP target, planned one rank file at a time ([`DcpFiles::rank_file`]) with its `.metadata`
/// derived from the same assignment as it is written ([`Describe`]): memory follows tensors and
/// ranks (a few bytes per item for the assignment), not the items' regions and records.
pub struct DcpFiles<'a> {
    src: Sourcing<'a>,
    mesh: MeshSpec,
    /// `__{rank}_0.distcp`, per rank.
    names: Vec<String>,
    /// The tensors each rank stores, in tensor order.
    per_rank: Vec<Vec<u32>>,
    /// The ranks storing each tensor, in rank order: the tensor's chunks, in `.metadata` order.
    owners: Vec<Vec<u32>>,
    /// The torch.save framing of a box, by written dtype and box sizes (a mesh gives few
    /// distinct sizes, so this is small).
    framings: HashMap<(DType, Vec<u64>), Arc<ItemFraming>>,
    /// Length of each non-tensor entry's item (on rank 0, after its tensors).
    value_lens: Vec<u64>,
    planner_data: Vec<(String, Vec<KeyPart>)>,
    /// `["stream.zstd/1"]`, for values carried compressed.
    zstd: Vec<String>,
    data_bytes: u64,
}

impl<'a> DcpFiles<'a> {
    fn new(src: Sourcing<'a>, mesh: &MeshSpec) -> Result<(DcpFiles<'a>, Vec<String>)> {
        let ckpt = src.ckpt;
        let (per_rank, notes) = assign(ckpt, mesh)?;
        let mut owners: Vec<Vec<u32>> = vec![Vec::new(); ckpt.tensors.len()];
        let mut framings = HashMap::new();
        let mut data_bytes = 0u64;
        for (rank, tensors) in per_rank.iter().enumerate() {
            for &ti in tensors {
                let t = &ckpt.tensors[ti as usize];
                owners[ti as usize].push(rank as u32);
                let b = box_of(ckpt, mesh, ti as usize, rank);
                let dtype = src.out_dtype(t);
                data_bytes += b.numel().unwrap_or(0) * dtype.size() as u64;
                framings
                    .entry((dtype, b.sizes.clone()))
                    .or_insert_with(|| Arc::new(ItemFraming::new(dtype, &b.sizes)));
            }
        }
        let mut value_lens = Vec::new();
        for v in &ckpt.values {
            let mut scratch = FilePlan::default();
            value_lens.push(src.value_item(&mut scratch, v)?);
            data_bytes += v.raw.as_ref().map_or(0, |b| b.length);
        }
        let planner_data = ckpt
            .tensors
            .iter()
            .map(|t| (t.name.clone(), t.effective_key_path()))
            .chain(
                ckpt.values
                    .iter()
                    .map(|v| (v.name.clone(), v.effective_key_path())),
            )
            .collect();
        let dcp = DcpFiles {
            names: (0..mesh.world_size())
                .map(|rank| format!("__{rank}_0.distcp"))
                .collect(),
            src,
            mesh: mesh.clone(),
            per_rank,
            owners,
            framings,
            value_lens,
            planner_data,
            zstd: vec![dcp::ZSTD.to_string()],
            data_bytes,
        };
        Ok((dcp, notes))
    }

    fn framing(&self, dtype: DType, sizes: &[u64]) -> Arc<ItemFraming> {
        // Every box was framed in `new`.
        match self.framings.get(&(dtype, sizes.to_vec())) {
            Some(f) => Arc::clone(f),
            None => Arc::new(ItemFraming::new(dtype, sizes)),
        }
    }

    /// The length [`DcpFiles::rank_file`] gives `__{rank}_0.distcp`, from the item framings alone.
    fn rank_file_len(&self, rank: usize) -> u64 {
        let ckpt = self.src.ckpt;
        let items: u64 = self.per_rank[rank]
            .iter()
            .map(|&ti| {
                let ti = ti as usize;
                let b = box_of(ckpt, &self.mesh, ti, rank);
                let dtype = self.src.out_dtype(&ckpt.tensors[ti]);
                self.framing(dtype, &b.sizes).layout.len
            })
            .sum();
        let values: u64 = if rank == 0 {
            self.value_lens.iter().sum()
        } else {
            0
        };
        items + values
    }

    /// `__{rank}_0.distcp`: one torch.save item per box the rank stores, then (on rank 0) the
    /// non-tensor entries.
    fn rank_file(&self, rank: usize) -> Result<FilePlan> {
        let ckpt = self.src.ckpt;
        let mut file = FilePlan {
            path: PathBuf::from(&self.names[rank]),
            ..FilePlan::default()
        };
        for &ti in &self.per_rank[rank] {
            let ti = ti as usize;
            let b = box_of(ckpt, &self.mesh, ti, rank);
            let base = file.len;
            let framing = self.framing(self.src.out_dtype(&ckpt.tensors[ti]), &b.sizes);
            let regions =
                place_archive(&mut file, base, &framing.records, &framing.layout, |_| {
                    Some(self.src.region(ti, &b, 0))
                })?;
            file.regions.extend(regions);
            file.tensor_items.push(TensorItem { base, framing });
        }
        if rank == 0 {
            for v in &ckpt.values {
                self.src.value_item(&mut file, v)?;
            }
        }
        Ok(file)
    }
}

impl<'m> Describe<'m> for &'m DcpFiles<'_> {
    fn entries(&self) -> Box<dyn Iterator<Item = EntryRef<'m, '_>> + '_> {
        let dcp: &'m DcpFiles<'_> = self;
        let ckpt = dcp.src.ckpt;
        let tensors = ckpt.tensors.iter().enumerate().map(move |(ti, t)| {
            let chunks = dcp.owners[ti].iter().map(move |&rank| {
                let b = box_of(ckpt, &dcp.mesh, ti, rank as usize);
                Chunk {
                    offsets: b.offsets,
                    sizes: b.sizes,
                }
            });
            EntryRef::Tensor {
                fqn: &t.name,
                dtype: dcp.src.out_dtype(t),
                size: &t.shape,
                chunks: Box::new(chunks),
            }
        });
        let values = ckpt.values.iter().map(|v| EntryRef::Bytes { fqn: &v.name });
        Box::new(tensors.chain(values))
    }

    fn planner_data(&self) -> Box<dyn Iterator<Item = (&'m str, &'m [KeyPart])> + '_> {
        Box::new(
            self.planner_data
                .iter()
                .map(|(fqn, path)| (fqn.as_str(), path.as_slice())),
        )
    }

    fn storage(&self) -> Box<dyn Iterator<Item = StorageRef<'m>> + '_> {
        let ckpt = self.src.ckpt;
        let dcp: &'m DcpFiles<'_> = self;
        let ranks = dcp
            .per_rank
            .iter()
            .enumerate()
            .flat_map(move |(rank, tensors)| {
                let name = dcp.names[rank].as_str();
                let mut base = 0u64;
                let items: Vec<StorageRef<'m>> = tensors
                    .iter()
                    .map(|&ti| {
                        let ti = ti as usize;
                        let t = &ckpt.tensors[ti];
                        let b = box_of(ckpt, &dcp.mesh, ti, rank);
                        let length = dcp.framing(dcp.src.out_dtype(t), &b.sizes).layout.len;
                        let at = base;
                        base += length;
                        // This rank's place among the tensor's owners is its chunk's index.
                        let index = dcp.owners[ti].partition_point(|&r| (r as usize) < rank);
                        StorageRef {
                            fqn: &t.name,
                            chunk_offsets: Some(b.offsets),
                            index: Some(index as i64),
                            relative_path: name,
                            offset: at,
                            length,
                            transforms: &[],
                        }
                    })
                    .collect();
                let values = (rank == 0).then(|| {
                    ckpt.values
                        .iter()
                        .zip(&dcp.value_lens)
                        .map(|(v, &length)| {
                            let at = base;
                            base += length;
                            // Carried bytes keep their encoding, so a zstd item stays declared as one.
                            let zstd = v.raw.as_ref().is_some_and(|b| b.zstd);
                            StorageRef {
                                fqn: &v.name,
                                chunk_offsets: None,
                                index: None,
                                relative_path: name,
                                offset: at,
                                length,
                                transforms: if zstd { &dcp.zstd } else { &[] },
                            }
                        })
                        .collect::<Vec<_>>()
                });
                items.into_iter().chain(values.into_iter().flatten())
            });
        Box::new(ranks)
    }

    fn version(&self) -> Option<&'m str> {
        Some("1.0.0")
    }
}

/// Pieces of `t`, with exact duplicates (replicas saved by several ranks) dropped.
fn unique_pieces(t: &Tensor) -> impl Iterator<Item = (usize, PieceRef<'_>)> {
    let mut seen = BTreeSet::new();
    t.pieces
        .iter()
        .enumerate()
        .filter(move |(_, p)| seen.insert((p.offsets(), p.sizes())))
}

/// A tensor's distinct pieces, sorted by where they start on the dim they are cut on, so that the
/// pieces meeting a box are found by binary search: a reshard from 1024 ranks to 1024 asks for
/// 1024 boxes of each tensor, and testing every piece for each would cost a million per tensor.
struct PieceIndex {
    /// The dim with the most distinct piece starts; 0 for a 0-dim tensor (never read then).
    dim: usize,
    /// Piece indices, sorted by their start on `dim`.
    order: Vec<usize>,
    /// `starts[k]` is where piece `order[k]` starts on `dim`.
    starts: Vec<u64>,
    /// The longest extent of any piece on `dim`.
    max_len: u64,
}

impl PieceIndex {
    fn new(t: &Tensor) -> PieceIndex {
        let unique: Vec<usize> = unique_pieces(t).map(|(k, _)| k).collect();
        let dim = (0..t.shape.len())
            .max_by_key(|&d| {
                let starts: BTreeSet<u64> = unique
                    .iter()
                    .map(|&k| t.pieces.get(k).offsets()[d])
                    .collect();
                starts.len()
            })
            .unwrap_or(0);
        let at = |k: usize| t.pieces.get(k).offsets().get(dim).copied().unwrap_or(0);
        let mut order = unique;
        order.sort_by_key(|&k| (at(k), k));
        let starts = order.iter().map(|&k| at(k)).collect();
        let max_len = order
            .iter()
            .map(|&k| t.pieces.get(k).sizes().get(dim).copied().unwrap_or(0))
            .max()
            .unwrap_or(0);
        PieceIndex {
            dim,
            order,
            starts,
            max_len,
        }
    }

    /// Indices of the pieces that may meet `b` (those whose span on `dim` overlaps `b`'s), in
    /// piece order.
    fn meeting(&self, b: &NdBox) -> Vec<usize> {
        let (Some(&lo), Some(&len)) = (b.offsets.get(self.dim), b.sizes.get(self.dim)) else {
            return self.order.clone();
        };
        let hi = lo.saturating_add(len);
        // A piece meets [lo, hi) only if it starts before `hi` and after `lo - max_len`.
        let first = self
            .starts
            .partition_point(|&s| s.saturating_add(self.max_len) <= lo);
        let last = self.starts.partition_point(|&s| s < hi);
        let mut found = self.order[first..last.max(first)].to_vec();
        found.sort_unstable();
        found
    }
}

/// A tensor can be planned when its pieces are well-formed and cover it exactly once.
fn check_tensor(t: &Tensor) -> Result<()> {
    let rank = t.shape.len();
    if t.pieces.ndim() != rank {
        return Err(Error::invalid(format!(
            "its pieces have {} dims but the tensor has {rank}",
            t.pieces.ndim()
        ))
        .tensor(&t.name));
    }
    let boxes: Vec<NdBox> = unique_pieces(t)
        .map(|(_, p)| NdBox {
            offsets: p.offsets().to_vec(),
            sizes: p.sizes().to_vec(),
        })
        .collect();
    if let Some(problem) = geometry::check_coverage(&t.shape, &boxes).first() {
        return Err(Error::invalid(problem.describe(&t.shape, &boxes))
            .tensor(&t.name)
            .hint("run `ckpt verify` on the input for details"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor_of_boxes(shape: &[u64], boxes: &[(Vec<u64>, Vec<u64>)]) -> Tensor {
        let pieces = boxes
            .iter()
            .map(|(offsets, sizes)| crate::model::Piece {
                offsets: offsets.clone(),
                sizes: sizes.clone(),
                data: crate::model::DataRef {
                    file: Path::new("f").into(),
                    offset: 0,
                    strides: crate::model::contiguous_strides(sizes),
                    encoding: Encoding::Raw,
                },
            })
            .collect();
        Tensor {
            name: "t".into(),
            key_path: Vec::new(),
            dtype: DType::F32,
            shape: shape.to_vec(),
            pieces: crate::model::Pieces::from_vec(shape.len(), pieces).unwrap(),
        }
    }

    /// The boxes of an [8, 10] tensor cut unevenly on both dims, 3 x 4.
    fn uneven_grid() -> Vec<(Vec<u64>, Vec<u64>)> {
        let rows = [(0, 3), (3, 4), (7, 1)];
        let cols = [(0, 2), (2, 2), (4, 5), (9, 1)];
        let mut boxes = Vec::new();
        for &(r0, rn) in &rows {
            for &(c0, cn) in &cols {
                boxes.push((vec![r0, c0], vec![rn, cn]));
            }
        }
        boxes
    }

    #[test]
    fn the_piece_index_finds_every_piece_that_meets_a_box() {
        // The uneven grid plus a replica of one of its pieces, queried with every box of a finer
        // grid and some that straddle cuts.
        let mut boxes = uneven_grid();
        boxes.push(boxes[5].clone());
        let t = tensor_of_boxes(&[8, 10], &boxes);
        let index = PieceIndex::new(&t);
        assert_eq!(index.order.len(), 12, "the replica is dropped");
        for r0 in 0..8 {
            for c0 in 0..10 {
                for (rn, cn) in [(1, 1), (2, 3), (8 - r0, 10 - c0)] {
                    let b = NdBox {
                        offsets: vec![r0, c0],
                        sizes: vec![rn, cn],
                    };
                    let found = index.meeting(&b);
                    for (k, p) in t.pieces.iter().enumerate().take(12) {
                        let pb = NdBox {
                            offsets: p.offsets().to_vec(),
                            sizes: p.sizes().to_vec(),
                        };
                        assert_eq!(
                            pb.intersect(&b).is_some(),
                            found.contains(&k) && pb.intersect(&b).is_some(),
                            "piece {k} and box {b:?}"
                        );
                    }
                    assert!(found.windows(2).all(|w| w[0] < w[1]), "in piece order");
                }
            }
        }
    }

    #[test]
    fn the_fills_of_a_sub_box_are_the_fills_of_the_whole_that_meet_it() {
        let boxes = uneven_grid();
        let ckpt = Checkpoint {
            root: PathBuf::from("/nonexistent"),
            format: crate::model::Format::Dcp,
            world_size: None,
            tensors: vec![tensor_of_boxes(&[8, 10], &boxes)],
            values: Vec::new(),
            unsupported: Vec::new(),
            details: Vec::new(),
        };
        let src = Sourcing::new(&ckpt, &PlanOptions::default()).unwrap();
        let b = NdBox {
            offsets: vec![1, 1],
            sizes: vec![6, 8],
        };
        let whole = src.fills(0, &b, None);
        assert_eq!(
            whole.len(),
            6,
            "rows 0..3 and 3..7, cols 0..2, 2..4 and 4..9"
        );
        for (start, sizes) in [
            (vec![0, 0], vec![6, 8]),
            (vec![0, 0], vec![1, 8]),
            (vec![2, 0], vec![3, 8]),
            (vec![5, 3], vec![1, 1]),
            (vec![1, 2], vec![4, 3]),
        ] {
            let meets = |f: &Fill| {
                (0..2)
                    .all(|d| f.start[d] < start[d] + sizes[d] && start[d] < f.start[d] + f.sizes[d])
            };
            let want: Vec<Fill> = whole.iter().filter(|f| meets(f)).cloned().collect();
            assert_eq!(
                src.fills(0, &b, Some((&start, &sizes))),
                want,
                "{start:?} {sizes:?}"
            );
        }
    }

    /// The planner's consistency checks blame ckpt, not the checkpoint: a non-tensor entry no
    /// reader makes (neither its bytes nor a value), and the fills of a tensor region asked of a
    /// plan that has no tensors to take them from.
    #[test]
    fn broken_invariants_are_reported_as_bugs() {
        let ckpt = Checkpoint {
            root: PathBuf::from("/nonexistent"),
            format: crate::model::Format::Dcp,
            world_size: None,
            tensors: vec![tensor_of_boxes(&[4], &[(vec![0], vec![4])])],
            values: vec![NonTensor {
                name: "step".into(),
                key_path: Vec::new(),
                value: None,
                raw: None,
            }],
            unsupported: Vec::new(),
            details: Vec::new(),
        };
        let mesh = MeshSpec {
            shape: vec![2],
            placements: vec![Placement::Shard(0)],
            replicated: BTreeSet::new(),
        };
        let Err(err) = plan(&ckpt, &Target::Dcp(mesh), &PlanOptions::default()) else {
            panic!("planned a value with nothing to write");
        };
        assert_eq!(err.kind, crate::ErrorKind::Bug);
        assert_eq!(err.tensor.as_deref(), Some("step"));
        let text = err.to_string();
        assert!(text.contains("a bug in ckpt"), "{text}");
        assert!(text.contains("please report"), "{text}");

        let region = Region {
            name: "t".into(),
            offset: 0,
            dtype: DType::F32,
            shape: vec![4],
            source: RegionSource::Tensor {
                tensor: 0,
                b: NdBox::whole(&[4]),
            },
            crc_slots: Vec::new(),
        };
        let err = Plan::default().fills(&region, None).unwrap_err();
        assert_eq!(err.kind, crate::ErrorKind::Bug);
        assert!(err.to_string().contains("a bug in ckpt"));
    }

    #[test]
    fn the_piece_index_looks_only_near_the_box() {
        // 1024 one-row pieces: a box of rows 10..12 is met by pieces 10 and 11 alone, so a
        // reshard asks O(log n) per box, not n.
        let boxes: Vec<_> = (0..1024).map(|r| (vec![r, 0], vec![1, 32])).collect();
        let index = PieceIndex::new(&tensor_of_boxes(&[1024, 32], &boxes));
        let b = NdBox {
            offsets: vec![10, 0],
            sizes: vec![2, 32],
        };
        assert_eq!(index.meeting(&b), vec![10, 11]);
    }

    #[test]
    fn literals_and_item_framing_come_in_offset_order() {
        let item = TensorItem {
            base: 4,
            framing: Arc::new(ItemFraming::new(DType::F32, &[2, 3])),
        };
        let layout = item.framing.layout.clone();
        let after = 4 + layout.len;
        let file = FilePlan {
            literals: vec![(after, b"zz".to_vec()), (0, b"head".to_vec())],
            tensor_items: vec![item],
            ..FilePlan::default()
        };
        let mut seen = Vec::new();
        file.for_each_literal(|at, bytes| {
            seen.push((at, bytes.to_vec()));
            Ok(())
        })
        .unwrap();
        // The plain literals first and last, the item's framing in between, shifted to its base
        // and byte for byte what the ZIP layout gives.
        assert_eq!(seen.first(), Some(&(0, b"head".to_vec())));
        assert_eq!(seen.last(), Some(&(after, b"zz".to_vec())));
        let middle: Vec<(u64, Vec<u8>)> = layout
            .literals
            .iter()
            .map(|(o, b)| (4 + o, b.clone()))
            .collect();
        assert_eq!(&seen[1..seen.len() - 1], &middle[..]);
        assert!(seen
            .windows(2)
            .all(|w| w[0].0 + w[0].1.len() as u64 <= w[1].0));
    }
}
