//! The torch.save target: one ZIP archive holding the pickled state dict and one record per
//! tensor. DCP's rank files are sequences of such archives, one per box ([`place_archive`]).

use std::path::{Path, PathBuf};

use super::{FilePlan, Planner, Region};
use crate::error::{Error, Result};
use crate::formats::torch_save;
use crate::geometry::NdBox;
use crate::zip;

impl Planner<'_> {
    pub(super) fn torch_save(&mut self, file_name: &str) -> Result<()> {
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
            self.notes.push(format!(
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
        self.files.push(file);
        Ok(())
    }
}

/// Lay out a ZIP archive of `records` at `base` in `file`: literals go straight into the file, and
/// each `{prefix}/data/{key}` record becomes the region `region_for(key)` returns, moved to its
/// place. Returns those regions. The file grows to hold the archive.
pub(super) fn archive_into(
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
pub(super) fn place_archive(
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
