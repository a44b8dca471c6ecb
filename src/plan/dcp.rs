//! The DCP target: `__{rank}_0.distcp` rank files of torch.save items, planned one at a time,
//! and a `.metadata` streamed from the same assignment.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use super::mesh::{assign, box_of};
use super::sourcing::Sourcing;
use super::torch_save::place_archive;
use super::{FilePlan, FileRole, ItemFraming, MeshSpec, TensorItem};
use crate::dtype::DType;
use crate::error::Result;
use crate::formats::dcp;
use crate::formats::dcp::metadata::{Chunk, Describe, EntryRef, StorageRef};
use crate::model::KeyPart;

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
    pub(super) fn new(src: Sourcing<'a>, mesh: &MeshSpec) -> Result<(DcpFiles<'a>, Vec<String>)> {
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

    /// Where the regions of the rank files find their fills.
    pub(super) fn sourcing(&self) -> &Sourcing<'a> {
        &self.src
    }

    /// The rank files, then `.metadata`.
    pub(super) fn file_count(&self) -> usize {
        self.names.len() + 1
    }

    /// `__{i}_0.distcp` for a rank, `.metadata` after the last.
    pub(super) fn path(&self, i: usize) -> PathBuf {
        match self.names.get(i) {
            Some(name) => PathBuf::from(name),
            None => PathBuf::from(dcp::METADATA),
        }
    }

    /// Rank file `i` planned now; `.metadata` (streamed) as an empty plan of its path and role.
    pub(super) fn file(&self, i: usize) -> Result<FilePlan> {
        if i < self.names.len() {
            return self.rank_file(i);
        }
        Ok(FilePlan {
            path: self.path(i),
            role: self.role(i),
            ..FilePlan::default()
        })
    }

    /// Length of rank file `i`; 0 for `.metadata`, known once it is written.
    pub(super) fn file_len(&self, i: usize) -> u64 {
        if i < self.names.len() {
            self.rank_file_len(i)
        } else {
            0
        }
    }

    /// Rank files are data; `.metadata`, streamed last, makes the output a checkpoint.
    pub(super) fn role(&self, i: usize) -> FileRole {
        if i == self.names.len() {
            FileRole::StreamedCommitMarker
        } else {
            FileRole::Data
        }
    }

    /// Bytes of tensor data (and carried values) the rank files hold.
    pub(super) fn data_bytes(&self) -> u64 {
        self.data_bytes
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
