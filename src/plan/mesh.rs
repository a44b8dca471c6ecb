//! Where tensors go on a device mesh: which box of each tensor a rank stores, and which rank
//! stores a box that several hold. Shared by the DCP and DCP-safetensors targets.

use std::collections::BTreeMap;

use super::MeshSpec;
use crate::error::{Error, Result};
use crate::geometry::{local_box, NdBox, Placement};
use crate::model::{Checkpoint, Tensor};

/// True when tensor `ti` is stored whole, once, on rank 0 rather than placed on the mesh.
fn stored_whole(t: &Tensor, mesh: &MeshSpec) -> bool {
    t.shape.is_empty() || mesh.replicated.contains(&t.name)
}

/// The box of tensor `ti` that `rank` stores.
pub(super) fn box_of(ckpt: &Checkpoint, mesh: &MeshSpec, ti: usize, rank: usize) -> NdBox {
    let t = &ckpt.tensors[ti];
    if stored_whole(t, mesh) {
        NdBox::whole(&t.shape)
    } else {
        local_box(&t.shape, &mesh.shape, &mesh.placements, rank)
    }
}

/// The tensors each rank of `mesh` stores a box of, in tensor order (see [`box_of`] for the box),
/// and notes for the user.
pub(super) fn assign(ckpt: &Checkpoint, mesh: &MeshSpec) -> Result<(Vec<Vec<u32>>, Vec<String>)> {
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
