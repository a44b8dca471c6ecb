//! Safetensors targets: one file, Hugging Face split files with their index, and DCP's
//! safetensors flavour (one file per rank, each box's offsets in the header's metadata).

use std::path::PathBuf;

use super::mesh::{assign, box_of};
use super::{FilePlan, FileRole, MeshSpec, Planner};
use crate::dtype::DType;
use crate::error::Result;
use crate::formats::{dcp, hf_index, safetensors};
use crate::geometry::NdBox;

impl Planner<'_> {
    /// One safetensors file holding the whole of each tensor in `tensors` (indices), in order.
    pub(super) fn safetensors_file(
        &mut self,
        name: &str,
        tensors: &[usize],
        metadata: &[(&str, &str)],
    ) {
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
        self.files.push(file);
    }

    pub(super) fn split(&mut self, max_shard_bytes: u64) {
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
        self.files.push(FilePlan {
            path: PathBuf::from(hf_index::INDEX_NAME),
            len: index.len() as u64,
            literals: vec![(0, index)],
            role: FileRole::CommitMarker,
            ..FilePlan::default()
        });
    }

    pub(super) fn dcp_safetensors(&mut self, mesh: &MeshSpec) -> Result<()> {
        let ckpt = self.src.ckpt;
        let (per_rank, notes) = assign(ckpt, mesh)?;
        self.notes.extend(notes);
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
