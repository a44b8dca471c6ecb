//! The planner: a checkpoint and a target layout in, a [`Plan`] out, with no I/O.
//!
//! A plan lists every destination file with its length, its literal bytes (headers, pickles, ZIP
//! framing, written by the format modules; for DCP pieces, rendered from a few fields when written,
//! see [`FilePlan::for_each_literal`]) and its [`Region`]s: runs of tensor data, each filled from
//! boxes of source pieces ([`Fill`]). Because the planner only does arithmetic, property tests can
//! check that every destination byte is written exactly once.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::formats::dcp::metadata::{
    self as dcp_metadata, Chunk, DcpEntry, DcpMetadata, MetadataIndex, StorageInfo,
};
use crate::formats::{dcp, hf_index, safetensors, torch_save, zip};
use crate::geometry::{self, local_box, Box, Placement};
use crate::model::{Checkpoint, Encoding, NonTensor, Tensor};

/// Everything needed to write one output: files, and where each byte comes from.
#[derive(Clone, Debug, Default)]
pub struct Plan {
    /// Absolute paths of the input files that fills read from; [`Fill::input`] indexes this.
    pub inputs: Vec<PathBuf>,
    pub files: Vec<FilePlan>,
    /// Things the user should hear about (skipped entries, replicated tensors).
    pub notes: Vec<String>,
}

/// One destination file.
#[derive(Clone, Debug, Default)]
pub struct FilePlan {
    /// Relative to the output root.
    pub path: PathBuf,
    pub len: u64,
    /// Bytes known at planning time, by offset.
    pub literals: Vec<(u64, Vec<u8>)>,
    /// DCP items of one tensor box each, whose framing (ZIP headers and a pickle, about 1.6 KiB)
    /// is rendered when the file is written instead of being held here: a reshard to many ranks
    /// has a million of them. See [`FilePlan::for_each_literal`].
    pub tensor_items: Vec<TensorItem>,
    pub regions: Vec<Region>,
}

impl FilePlan {
    /// Visit every literal byte run of the file in offset order: `literals`, and the framing of
    /// each of `tensor_items`, rendered one item at a time so that only one is in memory.
    pub fn for_each_literal(&self, mut visit: impl FnMut(u64, &[u8]) -> Result<()>) -> Result<()> {
        let mut plain: Vec<&(u64, Vec<u8>)> = self.literals.iter().collect();
        plain.sort_by_key(|(offset, _)| *offset);
        let mut plain = plain.into_iter().peekable();
        let mut items: Vec<&TensorItem> = self.tensor_items.iter().collect();
        items.sort_by_key(|item| item.base);
        for item in items {
            for (offset, bytes) in item.layout().literals {
                let at = item.base + offset;
                while let Some((o, b)) = plain.next_if(|(o, _)| *o < at) {
                    visit(*o, b)?;
                }
                visit(at, &bytes)?;
            }
        }
        for (o, b) in plain {
            visit(*o, b)?;
        }
        Ok(())
    }
}

/// A torch.save archive at `base` holding one contiguous tensor of `dtype` and `shape` (its data
/// is a [`Region`]): how DCP stores each piece. Its bytes are a pure function of these fields.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorItem {
    pub base: u64,
    pub dtype: DType,
    pub shape: Vec<u64>,
}

impl TensorItem {
    fn layout(&self) -> zip::ZipLayout {
        zip::layout(&self.records())
    }

    fn records(&self) -> Vec<zip::ZipRecord> {
        let leaf = torch_save::WriteLeaf::Tensor {
            dtype: self.dtype,
            shape: self.shape.clone(),
            storage_key: "0".into(),
        };
        let nbytes = crate::model::numel(&self.shape).unwrap_or(0) * self.dtype.size() as u64;
        torch_save::records(
            "archive",
            torch_save::data_pkl(&[(Vec::new(), leaf)]),
            &[("0".to_string(), nbytes)],
        )
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
    pub fills: Vec<Fill>,
    /// Offsets in the destination file where the CRC-32 of this region's bytes goes (ZIP records).
    pub crc_slots: Vec<u64>,
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

impl Plan {
    /// Bytes of tensor data the plan copies.
    pub fn data_bytes(&self) -> u64 {
        self.files
            .iter()
            .flat_map(|f| &f.regions)
            .map(Region::nbytes)
            .sum()
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

/// Plan writing `ckpt` as `target`.
pub fn plan(ckpt: &Checkpoint, target: &Target, opts: &PlanOptions) -> Result<Plan> {
    let mut planner = Planner::new(ckpt, opts)?;
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
        Target::Dcp(mesh) => planner.dcp(mesh)?,
        Target::DcpSafetensors(mesh) => {
            planner.dcp_safetensors(mesh)?;
            planner.skip_values("safetensors");
        }
    }
    Ok(planner.plan)
}

struct Planner<'a> {
    ckpt: &'a Checkpoint,
    opts: &'a PlanOptions,
    inputs: BTreeMap<PathBuf, usize>,
    /// One per tensor of `ckpt`.
    indexes: Vec<PieceIndex>,
    plan: Plan,
}

impl<'a> Planner<'a> {
    fn new(ckpt: &'a Checkpoint, opts: &'a PlanOptions) -> Result<Planner<'a>> {
        let indexes = ckpt
            .tensors
            .iter()
            .map(|t| {
                check_tensor(t)?;
                Ok(PieceIndex::new(t))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Planner {
            ckpt,
            opts,
            inputs: BTreeMap::new(),
            indexes,
            plan: Plan::default(),
        })
    }

    /// The dtype a tensor is written as.
    fn out_dtype(&self, t: &Tensor) -> DType {
        match self.opts.cast {
            Some(to) if t.dtype.is_float() => to,
            _ => t.dtype,
        }
    }

    fn input(&mut self, file: &Path) -> usize {
        let path = self.ckpt.path_of(file);
        let next = self.plan.inputs.len();
        *self.inputs.entry(path.clone()).or_insert_with(|| {
            self.plan.inputs.push(path);
            next
        })
    }

    /// A region at `offset` holding box `b` of tensor `ti`, filled from the pieces that meet it.
    fn region(&mut self, ti: usize, b: &Box, offset: u64) -> Region {
        let ckpt = self.ckpt;
        let t = &ckpt.tensors[ti];
        let mut fills = Vec::new();
        for k in self.indexes[ti].meeting(b) {
            let piece = &t.pieces[k];
            let pb = Box {
                offsets: piece.offsets.clone(),
                sizes: piece.sizes.clone(),
            };
            let Some(common) = pb.intersect(b) else {
                continue;
            };
            if common.is_empty() {
                continue;
            }
            let elem = t.dtype.size() as u64;
            let skip: u64 = (0..common.offsets.len())
                .map(|d| (common.offsets[d] - pb.offsets[d]) * piece.data.strides[d])
                .sum();
            fills.push(Fill {
                input: self.input(&piece.data.file),
                encoding: piece.data.encoding.clone(),
                dtype: t.dtype,
                offset: piece.data.offset + skip * elem,
                strides: piece.data.strides.clone(),
                start: (0..common.offsets.len())
                    .map(|d| common.offsets[d] - b.offsets[d])
                    .collect(),
                sizes: common.sizes,
            });
        }
        Region {
            name: t.name.clone(),
            offset,
            dtype: self.out_dtype(t),
            shape: b.sizes.clone(),
            fills,
            crc_slots: Vec::new(),
        }
    }

    fn skip_values(&mut self, format: &str) {
        if !self.ckpt.values.is_empty() {
            let names: Vec<&str> = self.ckpt.values.iter().map(|v| v.name.as_str()).collect();
            self.plan.notes.push(format!(
                "skipped {} non-tensor entries ({format} holds tensors only): {}",
                names.len(),
                names.join(", ")
            ));
        }
    }

    /// One safetensors file holding the whole of each tensor in `tensors` (indices), in order.
    fn safetensors_file(&mut self, name: &str, tensors: &[usize], metadata: &[(&str, &str)]) {
        let ckpt = self.ckpt;
        let entries: Vec<(String, DType, Vec<u64>)> = tensors
            .iter()
            .map(|&i| {
                let t = &ckpt.tensors[i];
                (t.name.clone(), self.out_dtype(t), t.shape.clone())
            })
            .collect();
        let boxes: Vec<(usize, Box)> = tensors
            .iter()
            .map(|&i| (i, Box::whole(&ckpt.tensors[i].shape)))
            .collect();
        self.safetensors_pieces(name, &entries, &boxes, metadata);
    }

    /// A safetensors file whose k-th entry is box `boxes[k].1` of tensor `boxes[k].0`.
    fn safetensors_pieces(
        &mut self,
        name: &str,
        entries: &[(String, DType, Vec<u64>)],
        boxes: &[(usize, Box)],
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
            file.regions.push(self.region(*i, b, data_start + begin));
        }
        self.plan.files.push(file);
    }

    fn split(&mut self, max_shard_bytes: u64) {
        let ckpt = self.ckpt;
        let mut groups: Vec<Vec<usize>> = Vec::new();
        let mut current = Vec::new();
        let mut current_bytes = 0u64;
        for (i, t) in ckpt.tensors.iter().enumerate() {
            let bytes = self.out_nbytes(t);
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
        let total: u64 = ckpt.tensors.iter().map(|t| self.out_nbytes(t)).sum();
        let index = hf_index::index_json(total, &weight_map);
        self.plan.files.push(FilePlan {
            path: PathBuf::from(hf_index::INDEX_NAME),
            len: index.len() as u64,
            literals: vec![(0, index)],
            ..FilePlan::default()
        });
    }

    fn out_nbytes(&self, t: &Tensor) -> u64 {
        crate::model::numel(&t.shape).unwrap_or(0) * self.out_dtype(t).size() as u64
    }

    fn torch_save(&mut self, file_name: &str) -> Result<()> {
        let ckpt = self.ckpt;
        let mut items = Vec::new();
        let mut storages = Vec::new();
        for (i, t) in ckpt.tensors.iter().enumerate() {
            let key = i.to_string();
            items.push((
                t.effective_key_path(),
                torch_save::WriteLeaf::Tensor {
                    dtype: self.out_dtype(t),
                    shape: t.shape.clone(),
                    storage_key: key.clone(),
                },
            ));
            storages.push((key, self.out_nbytes(t)));
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
        let regions = self.archive_into(&mut file, 0, &records, |planner, key| {
            let i = key.parse::<usize>().ok()?;
            let whole = Box::whole(&ckpt.tensors.get(i)?.shape);
            Some(planner.region(i, &whole, 0))
        })?;
        file.regions = regions;
        self.plan.files.push(file);
        Ok(())
    }

    /// Lay out a ZIP archive of `records` at `base` in `file`: literals go straight into the file, and
    /// each `{prefix}/data/{key}` record becomes the region `region_for(key)` returns, moved to its
    /// place. Returns those regions. The file grows to hold the archive.
    fn archive_into(
        &mut self,
        file: &mut FilePlan,
        base: u64,
        records: &[zip::ZipRecord],
        region_for: impl FnMut(&mut Self, &str) -> Option<Region>,
    ) -> Result<Vec<Region>> {
        let mut layout = zip::layout(records);
        for (offset, bytes) in std::mem::take(&mut layout.literals) {
            file.literals.push((base + offset, bytes));
        }
        self.place_archive(file, base, records, &layout, region_for)
    }

    /// Place the regions of an archive laid out as `layout` at `base` in `file` (see
    /// [`Planner::archive_into`]), without its literals.
    fn place_archive(
        &mut self,
        file: &mut FilePlan,
        base: u64,
        records: &[zip::ZipRecord],
        layout: &zip::ZipLayout,
        mut region_for: impl FnMut(&mut Self, &str) -> Option<Region>,
    ) -> Result<Vec<Region>> {
        let mut regions = Vec::new();
        for (k, record) in records.iter().enumerate() {
            if record.content.is_some() {
                continue;
            }
            let key = record.name.rsplit('/').next().unwrap_or_default();
            let Some(mut region) = region_for(self, key) else {
                return Err(Error::invalid(format!(
                    "internal: archive record `{}` has no tensor",
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

    /// The chunks of each tensor and the rank that stores each, under `mesh`.
    fn assign(&mut self, mesh: &MeshSpec) -> Result<Vec<Vec<(usize, Box)>>> {
        let world = mesh.world_size();
        if world == 0 || mesh.placements.len() != mesh.shape.len() {
            return Err(Error::usage(
                "the mesh needs one placement per dimension and no zero size",
            ));
        }
        let mut per_rank: Vec<Vec<(usize, Box)>> = vec![Vec::new(); world];
        let mut replicated_dims = Vec::new();
        for (i, t) in self.ckpt.tensors.iter().enumerate() {
            let whole = t.shape.is_empty() || mesh.replicated.contains(&t.name);
            if whole {
                per_rank[0].push((i, Box::whole(&t.shape)));
                continue;
            }
            if mesh
                .placements
                .iter()
                .any(|p| matches!(p, Placement::Shard(d) if *d >= t.shape.len()))
            {
                replicated_dims.push(t.name.as_str());
            }
            // DCP keys chunks by their offsets and stores each once: a replicated box is written
            // by the lowest rank holding it, and an empty box (a trailing rank of a short dim) only
            // when no box with data starts at the same offsets, as DTensor's saves show.
            let mut owner: BTreeMap<Vec<u64>, (usize, Box)> = BTreeMap::new();
            for rank in 0..world {
                let b = local_box(&t.shape, &mesh.shape, &mesh.placements, rank);
                let replaces = match owner.get(&b.offsets) {
                    None => true,
                    Some((_, kept)) => kept.is_empty() && !b.is_empty(),
                };
                if replaces {
                    owner.insert(b.offsets.clone(), (rank, b));
                }
            }
            let mut boxes: Vec<(usize, Box)> = owner.into_values().collect();
            boxes.sort_by_key(|(rank, _)| *rank);
            for (rank, b) in boxes {
                per_rank[rank].push((i, b));
            }
        }
        if !replicated_dims.is_empty() {
            self.plan.notes.push(format!(
                "replicated on mesh dimensions whose Shard(d) names a dim they lack: {}",
                replicated_dims.join(", ")
            ));
        }
        Ok(per_rank)
    }

    fn dcp(&mut self, mesh: &MeshSpec) -> Result<()> {
        let ckpt = self.ckpt;
        let per_rank = self.assign(mesh)?;
        let mut chunks: Vec<Vec<Chunk>> = vec![Vec::new(); ckpt.tensors.len()];
        let mut storage = Vec::new();
        for (rank, items) in per_rank.iter().enumerate() {
            let name = format!("__{rank}_0.distcp");
            let mut file = FilePlan {
                path: PathBuf::from(&name),
                ..FilePlan::default()
            };
            for (i, b) in items {
                let t = &ckpt.tensors[*i];
                let base = file.len;
                let item = TensorItem {
                    base,
                    dtype: self.out_dtype(t),
                    shape: b.sizes.clone(),
                };
                let records = item.records();
                let layout = zip::layout(&records);
                let regions = self.place_archive(&mut file, base, &records, &layout, |p, _| {
                    Some(p.region(*i, b, 0))
                })?;
                file.regions.extend(regions);
                file.tensor_items.push(item);
                storage.push((
                    MetadataIndex {
                        fqn: t.name.clone(),
                        offset: Some(b.offsets.clone()),
                        index: Some(chunks[*i].len() as i64),
                    },
                    StorageInfo {
                        relative_path: name.clone(),
                        offset: base,
                        length: file.len - base,
                        transforms: Vec::new(),
                    },
                ));
                chunks[*i].push(Chunk {
                    offsets: b.offsets.clone(),
                    sizes: b.sizes.clone(),
                });
            }
            if rank == 0 {
                for v in &ckpt.values {
                    let base = file.len;
                    let length = self.value_item(&mut file, v)?;
                    // Carried bytes keep their encoding, so a zstd item stays declared as one.
                    let transforms = match &v.raw {
                        Some(blob) if blob.zstd => vec![dcp::ZSTD.to_string()],
                        _ => Vec::new(),
                    };
                    storage.push((
                        MetadataIndex {
                            fqn: v.name.clone(),
                            offset: None,
                            index: None,
                        },
                        StorageInfo {
                            relative_path: name.clone(),
                            offset: base,
                            length,
                            transforms,
                        },
                    ));
                }
            }
            self.plan.files.push(file);
        }
        let mut entries = Vec::new();
        let mut planner_data = Vec::new();
        for (t, chunks) in ckpt.tensors.iter().zip(chunks) {
            entries.push(DcpEntry::Tensor {
                fqn: t.name.clone(),
                dtype: self.out_dtype(t),
                size: t.shape.clone(),
                chunks,
            });
            planner_data.push((t.name.clone(), t.effective_key_path()));
        }
        for v in &ckpt.values {
            entries.push(DcpEntry::Bytes {
                fqn: v.name.clone(),
            });
            planner_data.push((v.name.clone(), v.effective_key_path()));
        }
        let meta = DcpMetadata {
            entries,
            storage,
            planner_data,
            version: Some("1.0.0".into()),
        };
        let bytes = dcp_metadata::write(&meta);
        self.plan.files.push(FilePlan {
            path: PathBuf::from(".metadata"),
            len: bytes.len() as u64,
            literals: vec![(0, bytes)],
            ..FilePlan::default()
        });
        Ok(())
    }

    /// Append a non-tensor entry's torch.save bytes to `file`: the original bytes when the source
    /// had them (so DCP values survive byte for byte), else a fresh archive of the value.
    fn value_item(&mut self, file: &mut FilePlan, v: &NonTensor) -> Result<u64> {
        let base = file.len;
        if let Some(blob) = &v.raw {
            let input = self.input(&blob.file);
            file.regions.push(Region {
                name: v.name.clone(),
                offset: base,
                dtype: DType::U8,
                shape: vec![blob.length],
                fills: vec![Fill {
                    input,
                    encoding: Encoding::Raw,
                    dtype: DType::U8,
                    offset: blob.offset,
                    strides: vec![1],
                    start: vec![0],
                    sizes: vec![blob.length],
                }],
                crc_slots: Vec::new(),
            });
            file.len = base + blob.length;
            return Ok(blob.length);
        }
        let Some(value) = &v.value else {
            return Err(
                Error::invalid("non-tensor entry has neither bytes nor a value").tensor(&v.name),
            );
        };
        let pkl =
            torch_save::data_pkl(&[(Vec::new(), torch_save::WriteLeaf::Value(value.clone()))]);
        let records = torch_save::records("archive", pkl, &[]);
        self.archive_into(file, base, &records, |_, _| None)?;
        Ok(file.len - base)
    }

    fn dcp_safetensors(&mut self, mesh: &MeshSpec) -> Result<()> {
        let ckpt = self.ckpt;
        let per_rank = self.assign(mesh)?;
        for (rank, items) in per_rank.iter().enumerate() {
            let entries: Vec<(String, DType, Vec<u64>)> = items
                .iter()
                .map(|(i, b)| {
                    let t = &ckpt.tensors[*i];
                    (t.name.clone(), self.out_dtype(t), b.sizes.clone())
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
            self.safetensors_pieces(&name, &entries, items, &metadata);
        }
        Ok(())
    }
}

/// Pieces of `t`, with exact duplicates (replicas saved by several ranks) dropped.
fn unique_pieces(t: &Tensor) -> impl Iterator<Item = (usize, &crate::model::Piece)> {
    let mut seen = BTreeSet::new();
    t.pieces
        .iter()
        .enumerate()
        .filter(move |(_, p)| seen.insert((p.offsets.as_slice(), p.sizes.as_slice())))
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
                let starts: BTreeSet<u64> =
                    unique.iter().map(|&k| t.pieces[k].offsets[d]).collect();
                starts.len()
            })
            .unwrap_or(0);
        let at = |k: usize| t.pieces[k].offsets.get(dim).copied().unwrap_or(0);
        let mut order = unique;
        order.sort_by_key(|&k| (at(k), k));
        let starts = order.iter().map(|&k| at(k)).collect();
        let max_len = order
            .iter()
            .map(|&k| t.pieces[k].sizes.get(dim).copied().unwrap_or(0))
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
    fn meeting(&self, b: &Box) -> Vec<usize> {
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
    for p in &t.pieces {
        if p.offsets.len() != rank || p.sizes.len() != rank || p.data.strides.len() != rank {
            return Err(Error::invalid(format!(
                "a piece has {} dims but the tensor has {rank}",
                p.offsets.len()
            ))
            .tensor(&t.name)
            .file(&p.data.file));
        }
    }
    let boxes: Vec<Box> = unique_pieces(t)
        .map(|(_, p)| Box {
            offsets: p.offsets.clone(),
            sizes: p.sizes.clone(),
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
                    file: PathBuf::from("f"),
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
            pieces,
        }
    }

    #[test]
    fn the_piece_index_finds_every_piece_that_meets_a_box() {
        // A 2-D grid of uneven pieces (cut on both dims, 3 x 4) plus a replica of one of them,
        // queried with every box of a finer grid and some that straddle cuts.
        let rows = [(0, 3), (3, 4), (7, 1)];
        let cols = [(0, 2), (2, 2), (4, 5), (9, 1)];
        let mut boxes = Vec::new();
        for &(r0, rn) in &rows {
            for &(c0, cn) in &cols {
                boxes.push((vec![r0, c0], vec![rn, cn]));
            }
        }
        boxes.push(boxes[5].clone());
        let t = tensor_of_boxes(&[8, 10], &boxes);
        let index = PieceIndex::new(&t);
        assert_eq!(index.order.len(), 12, "the replica is dropped");
        for r0 in 0..8 {
            for c0 in 0..10 {
                for (rn, cn) in [(1, 1), (2, 3), (8 - r0, 10 - c0)] {
                    let b = Box {
                        offsets: vec![r0, c0],
                        sizes: vec![rn, cn],
                    };
                    let found = index.meeting(&b);
                    for (k, p) in t.pieces.iter().enumerate().take(12) {
                        let pb = Box {
                            offsets: p.offsets.clone(),
                            sizes: p.sizes.clone(),
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
    fn the_piece_index_looks_only_near_the_box() {
        // 1024 one-row pieces: a box of rows 10..12 is met by pieces 10 and 11 alone, so a
        // reshard asks O(log n) per box, not n.
        let boxes: Vec<_> = (0..1024).map(|r| (vec![r, 0], vec![1, 32])).collect();
        let index = PieceIndex::new(&tensor_of_boxes(&[1024, 32], &boxes));
        let b = Box {
            offsets: vec![10, 0],
            sizes: vec![2, 32],
        };
        assert_eq!(index.meeting(&b), vec![10, 11]);
    }

    #[test]
    fn literals_and_rendered_items_come_in_offset_order() {
        let item = TensorItem {
            base: 4,
            dtype: DType::F32,
            shape: vec![2, 3],
        };
        let layout = item.layout();
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
