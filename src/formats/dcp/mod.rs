//! PyTorch Distributed Checkpoint directories: `.metadata` + `__{rank}_{i}.distcp`.
//!
//! The `.metadata` pickle says which chunks each tensor has and where each item lives; every
//! tensor item is a whole torch.save archive (optionally zstd-compressed), which this reader opens
//! only far enough to find the byte range of the chunk's elements.

pub mod hf;
pub mod metadata;

use std::collections::HashMap;
use std::fs::File;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::formats::torch_save::{self, Leaf};
use crate::model::{
    Blob, Checkpoint, DataRef, Encoding, Format, KeyPart, NonTensor, Piece, Tensor, Unsupported,
};
use metadata::{DcpEntry, StorageInfo};

/// Name of the metadata file in a DCP directory.
pub const METADATA: &str = ".metadata";
/// `.metadata` files larger than this are refused: real ones are kilobytes to a few megabytes.
const MAX_METADATA_BYTES: u64 = 1 << 30;
/// Largest decompressed non-tensor item (train state, param groups: kilobytes in practice).
const MAX_VALUE_BYTES: u64 = 256 << 20;
/// zstd transform descriptor DCP writes.
pub const ZSTD: &str = "stream.zstd/1";

/// True when `dir` holds a `.metadata` file.
pub fn looks_like(dir: &Path) -> bool {
    dir.join(METADATA).is_file()
}

/// Read a DCP directory into the model.
pub fn read(dir: &Path) -> Result<Checkpoint> {
    let meta_path = dir.join(METADATA);
    let len = std::fs::metadata(&meta_path)
        .map_err(|e| Error::io(&meta_path, e))?
        .len();
    if len > MAX_METADATA_BYTES {
        return Err(Error::invalid(format!(
            "`.metadata` is {len} bytes, more than ckpt accepts"
        ))
        .file(&meta_path));
    }
    // Mapped, not read: at millions of pieces the file is hundreds of megabytes, and the graph
    // the pickle reader builds borrows its strings from these bytes.
    let file = File::open(&meta_path).map_err(|e| Error::io(&meta_path, e))?;
    let map = if len == 0 {
        None
    } else {
        // SAFETY: read-only map of an input ckpt never writes; see exec::Source for the
        // truncation caveat.
        Some(unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&meta_path, e))?)
    };
    let meta = metadata::parse(map.as_deref().unwrap_or(&[])).map_err(|e| e.file(&meta_path))?;
    drop(map);
    // Entries are consumed as they become tensors, so each one's chunks are freed as its pieces
    // are made rather than both being alive at the end.
    let metadata::DcpMetadata {
        entries,
        storage: storage_data,
        planner_data,
        ..
    } = meta;

    let storage = StorageIndex::new(&storage_data);
    let paths: HashMap<&str, &[KeyPart]> = planner_data
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_slice()))
        .collect();
    let files = Files::map_all(dir, &storage_data)?;
    let mut tensors = Vec::new();
    let mut values = Vec::new();
    let mut unsupported = Vec::new();
    for entry in entries {
        match entry {
            DcpEntry::Tensor {
                fqn,
                dtype,
                size,
                chunks,
            } => {
                // Each chunk's item is a small torch.save archive to open; at a million chunks
                // that is most of the read, and the items are independent.
                let pieces = chunks
                    .into_par_iter()
                    .map(|chunk| {
                        let info = storage
                            .get(&fqn, Some(chunk.offsets.as_slice()))
                            .ok_or_else(|| {
                                Error::invalid(format!(
                                    "no storage entry for the chunk at offsets {:?}",
                                    chunk.offsets
                                ))
                                .file(&meta_path)
                                .tensor(&fqn)
                            })?;
                        files
                            .tensor_piece(info, dtype, chunk)
                            .map_err(|e| e.tensor(&fqn))
                    })
                    .collect::<Result<Vec<Piece>>>()?;
                tensors.push(Tensor {
                    key_path: paths
                        .get(fqn.as_str())
                        .map(|p| p.to_vec())
                        .unwrap_or_default(),
                    name: fqn,
                    dtype,
                    shape: size,
                    pieces,
                });
            }
            DcpEntry::Bytes { fqn } => {
                let info = storage.get(&fqn, None).ok_or_else(|| {
                    Error::invalid("no storage entry for this value")
                        .file(&meta_path)
                        .tensor(&fqn)
                })?;
                let (blob, value) = files.value(info).map_err(|e| e.tensor(&fqn))?;
                values.push(NonTensor {
                    key_path: paths
                        .get(fqn.as_str())
                        .map(|p| p.to_vec())
                        .unwrap_or_default(),
                    name: fqn,
                    value,
                    raw: Some(blob),
                });
            }
            DcpEntry::Unsupported { fqn, dtype } => unsupported.push(Unsupported {
                name: fqn,
                dtype,
                file: PathBuf::from(METADATA),
            }),
        }
    }
    Ok(Checkpoint {
        root: dir.to_path_buf(),
        format: Format::Dcp,
        world_size: world_size(dir, &storage_data),
        tensors,
        values,
        unsupported,
    })
}

/// Where each item's bytes are, by fqn and chunk offsets: per fqn, its storage entries sorted by
/// offsets. Four bytes per entry, where a map keyed by (fqn, offsets) took about seventy, and a
/// reshard to 1024 ranks has two million entries.
struct StorageIndex<'m> {
    storage: &'m [(metadata::MetadataIndex, StorageInfo)],
    by_fqn: HashMap<&'m str, Vec<u32>>,
}

impl<'m> StorageIndex<'m> {
    fn new(storage: &'m [(metadata::MetadataIndex, StorageInfo)]) -> StorageIndex<'m> {
        let mut by_fqn: HashMap<&str, Vec<u32>> = HashMap::new();
        for (k, (index, _)) in storage.iter().enumerate() {
            by_fqn.entry(index.fqn.as_str()).or_default().push(k as u32);
        }
        for entries in by_fqn.values_mut() {
            // Stable, so of equal offsets the later entry stays later (it wins, as in a dict).
            entries.sort_by(|&a, &b| {
                storage[a as usize]
                    .0
                    .offset
                    .cmp(&storage[b as usize].0.offset)
            });
        }
        StorageIndex { storage, by_fqn }
    }

    /// The storage of the item of `fqn` at `offsets` (`None` for a non-tensor entry); the last
    /// one when the metadata repeats a key.
    fn get(&self, fqn: &str, offsets: Option<&[u64]>) -> Option<&'m StorageInfo> {
        let entries = self.by_fqn.get(fqn)?;
        let key = |k: &u32| self.storage[*k as usize].0.offset.as_deref();
        let end = entries.partition_point(|k| key(k) <= offsets);
        let last = *entries.get(end.checked_sub(1)?)?;
        let (index, info) = &self.storage[last as usize];
        (index.offset.as_deref() == offsets).then_some(info)
    }
}

/// Ranks that wrote files: one more than the highest `__{rank}_` prefix in the directory or the
/// metadata (a rank whose chunks were all deduplicated away still writes its file).
fn world_size(dir: &Path, storage: &[(metadata::MetadataIndex, StorageInfo)]) -> Option<usize> {
    let rank = |name: &str| -> Option<usize> {
        name.strip_prefix("__")?
            .strip_suffix(".distcp")?
            .split('_')
            .next()?
            .parse::<usize>()
            .ok()
    };
    // Items of one file are adjacent in storage order, so this looks at each name about once.
    let mut highest: Option<usize> = None;
    let mut last: Option<&str> = None;
    for (_, info) in storage {
        let name = info.relative_path.as_str();
        if last != Some(name) {
            highest = highest.max(rank(name));
            last = Some(name);
        }
    }
    if let Ok(list) = std::fs::read_dir(dir) {
        for entry in list.flatten() {
            if let Some(name) = entry.file_name().to_str() {
                highest = highest.max(rank(name));
            }
        }
    }
    highest.map(|r| r + 1)
}

/// The `.distcp` files of one checkpoint, each mapped once.
struct Files<'a> {
    dir: &'a Path,
    /// By `relative_path`: the file's name as pieces share it, and its bytes (`None` when empty).
    maps: HashMap<&'a str, (Arc<Path>, Option<Mmap>)>,
}

impl<'a> Files<'a> {
    /// Map every file the storage entries name, once each.
    fn map_all(
        dir: &'a Path,
        storage: &'a [(metadata::MetadataIndex, StorageInfo)],
    ) -> Result<Files<'a>> {
        let mut maps = HashMap::new();
        for (_, info) in storage {
            let name = info.relative_path.as_str();
            if !maps.contains_key(name) {
                maps.insert(name, (Arc::from(Path::new(name)), map_file(dir, name)?));
            }
        }
        Ok(Files { dir, maps })
    }

    /// The bytes of one item, checked against the file's length.
    fn item(&self, info: &StorageInfo) -> Result<&[u8]> {
        let path = self.dir.join(&info.relative_path);
        let map = match self.maps.get(info.relative_path.as_str()) {
            Some((_, map)) => map.as_deref().unwrap_or(&[]),
            None => {
                return Err(
                    Error::invalid("internal: item in a file that was not mapped").file(&path),
                )
            }
        };
        let end = info.offset.checked_add(info.length);
        match end {
            Some(end) if end <= map.len() as u64 => Ok(&map[info.offset as usize..end as usize]),
            _ => Err(Error::invalid(format!(
                "item of {} bytes at offset {} runs past the end of the file ({} bytes)",
                info.length,
                info.offset,
                map.len()
            ))
            .file(&path)
            .at(info.offset)
            .hint("the file is truncated: copy it again from where the checkpoint was saved")),
        }
    }

    /// The shared name of the file an item is in.
    fn name(&self, info: &StorageInfo) -> Arc<Path> {
        match self.maps.get(info.relative_path.as_str()) {
            Some((name, _)) => Arc::clone(name),
            None => Path::new(&info.relative_path).into(),
        }
    }

    /// Locate the elements of one tensor chunk.
    fn tensor_piece(
        &self,
        info: &StorageInfo,
        dtype: crate::dtype::DType,
        chunk: metadata::Chunk,
    ) -> Result<Piece> {
        let sizes = chunk.sizes.as_slice();
        let path = self.dir.join(&info.relative_path);
        let zstd = transforms_are_zstd(info).map_err(|e| e.file(&path))?;
        let item = self.item(info)?;
        let decoded;
        let archive_bytes: &[u8] = if zstd {
            // A chunk's archive holds its storage plus a little framing; a storage much larger
            // than the chunk is possible (a saved view) but not without bound.
            let chunk_bytes = crate::model::numel(sizes)
                .unwrap_or(u64::MAX)
                .saturating_mul(dtype.size() as u64);
            let limit = chunk_bytes.saturating_mul(4).saturating_add(64 << 20);
            decoded = decompress(item, limit).map_err(|e| e.file(&path).at(info.offset))?;
            &decoded
        } else {
            item
        };
        // Offsets inside a plain item are file offsets once shifted; inside a compressed one they
        // mean nothing on disk, so the item's own offset is the useful position.
        let archive = torch_save::read(archive_bytes).map_err(|e| {
            let e = e.file(&path);
            if zstd {
                Error {
                    offset: Some(info.offset),
                    ..e
                }
            } else {
                e.within(info.offset)
            }
        })?;
        let saved = match archive.leaves.as_slice() {
            [(key, Leaf::Tensor(t))] if key.is_empty() => t,
            _ => {
                return Err(Error::invalid("item is not a single saved tensor")
                    .file(&path)
                    .at(info.offset))
            }
        };
        if saved.dtype != dtype || saved.shape != sizes {
            return Err(Error::invalid(format!(
                "item holds {} {:?} but the metadata says {} {:?}",
                saved.dtype, saved.shape, dtype, sizes
            ))
            .file(&path)
            .at(info.offset));
        }
        let entry = archive.storage(&saved.storage_key).ok_or_else(|| {
            Error::invalid(format!(
                "item has no storage record `{}`",
                saved.storage_key
            ))
            .file(&path)
            .at(info.offset)
        })?;
        let within = entry.data_offset + saved.storage_offset * dtype.size() as u64;
        let (offset, encoding) = if zstd {
            (
                within,
                Encoding::Zstd {
                    item_offset: info.offset,
                    item_length: info.length,
                },
            )
        } else {
            (info.offset + within, Encoding::Raw)
        };
        Ok(Piece {
            offsets: chunk.offsets,
            sizes: chunk.sizes,
            data: DataRef {
                file: self.name(info),
                offset,
                strides: saved.strides.clone(),
                encoding,
            },
        })
    }

    /// A non-tensor item: its raw bytes, and its value when it is plain data.
    fn value(&self, info: &StorageInfo) -> Result<(Blob, Option<crate::pickle::Value>)> {
        let zstd = transforms_are_zstd(info)?;
        let item = self.item(info)?;
        let decoded;
        let bytes: &[u8] = if zstd {
            decoded = decompress(item, MAX_VALUE_BYTES)?;
            &decoded
        } else {
            item
        };
        // A value that is not plain data (a custom object) is still carried byte for byte.
        let value = torch_save::read(bytes)
            .ok()
            .and_then(|a| match a.leaves.as_slice() {
                [(key, Leaf::Value(v))] if key.is_empty() => Some(v.clone()),
                _ => None,
            });
        let blob = Blob {
            file: PathBuf::from(&info.relative_path),
            offset: info.offset,
            length: info.length,
            zstd,
        };
        Ok((blob, value))
    }
}

/// Map one file named by the metadata, checking first that it lies inside the checkpoint.
fn map_file(dir: &Path, name: &str) -> Result<Option<Mmap>> {
    let path = dir.join(safe_relative_path(name)?);
    let file = File::open(&path).map_err(|e| {
        Error::io(&path, e).hint("a rank's file is missing: was the checkpoint copied completely?")
    })?;
    let len = file.metadata().map_err(|e| Error::io(&path, e))?.len();
    if len == 0 {
        return Ok(None);
    }
    // SAFETY: read-only map of an input ckpt never writes; see exec::Source for the truncation
    // caveat.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
    Ok(Some(map))
}

fn transforms_are_zstd(info: &StorageInfo) -> Result<bool> {
    match info.transforms.as_slice() {
        [] => Ok(false),
        [t] if t == ZSTD => Ok(true),
        other => Err(
            Error::invalid(format!("unsupported item transform {other:?}"))
                .at(info.offset)
                .hint("ckpt reads items that are plain or `stream.zstd/1`"),
        ),
    }
}

/// The first `len` bytes of a zstd item (fewer if it is shorter).
pub fn decompress_prefix(item: &[u8], len: u64) -> Result<Vec<u8>> {
    use std::io::Read;
    let fail = |e: std::io::Error| Error::invalid(format!("cannot decompress zstd item: {e}"));
    let decoder = zstd::stream::read::Decoder::new(item).map_err(fail)?;
    let mut out = Vec::new();
    decoder.take(len).read_to_end(&mut out).map_err(fail)?;
    Ok(out)
}

/// A whole zstd item, refused when it decompresses to more than `limit` bytes.
pub fn decompress(item: &[u8], limit: u64) -> Result<Vec<u8>> {
    use std::io::Read;
    let fail = |e: std::io::Error| Error::invalid(format!("cannot decompress zstd item: {e}"));
    let decoder = zstd::stream::read::Decoder::new(item).map_err(fail)?;
    let mut out = Vec::new();
    decoder
        .take(limit.saturating_add(1))
        .read_to_end(&mut out)
        .map_err(fail)?;
    if out.len() as u64 > limit {
        return Err(Error::invalid(format!(
            "zstd item decompresses to more than {limit} bytes, larger than its metadata allows"
        ))
        .hint("the item may be a decompression bomb; ckpt stops before filling memory"));
    }
    Ok(out)
}

/// A `relative_path` from metadata must name a file inside the checkpoint directory.
pub fn safe_relative_path(name: &str) -> Result<PathBuf> {
    let path = Path::new(name);
    let plain = !name.is_empty()
        && !name.contains('\0')
        && path.components().all(|c| matches!(c, Component::Normal(_)));
    if plain {
        Ok(path.to_path_buf())
    } else {
        Err(Error::invalid(format!(
            "file name `{name}` points outside the checkpoint directory"
        ))
        .hint("the metadata may be hostile; ckpt reads only files inside the checkpoint"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use metadata::MetadataIndex;

    fn entry(fqn: &str, offset: Option<&[u64]>, at: u64) -> (MetadataIndex, StorageInfo) {
        (
            MetadataIndex {
                fqn: fqn.into(),
                offset: offset.map(<[u64]>::to_vec),
                index: None,
            },
            StorageInfo {
                relative_path: "__0_0.distcp".into(),
                offset: at,
                length: 1,
                transforms: Vec::new(),
            },
        )
    }

    #[test]
    fn the_storage_index_finds_each_item_and_the_last_of_a_repeated_key() {
        let storage = vec![
            entry("w", Some(&[4, 0]), 10),
            entry("w", Some(&[0, 0]), 20),
            entry("v", None, 30),
            entry("w", Some(&[2, 0]), 40),
            entry("w", Some(&[0, 0]), 50),
        ];
        let index = StorageIndex::new(&storage);
        let at = |fqn: &str, offsets: Option<&[u64]>| index.get(fqn, offsets).map(|i| i.offset);
        assert_eq!(at("w", Some(&[4, 0])), Some(10));
        assert_eq!(at("w", Some(&[2, 0])), Some(40));
        assert_eq!(
            at("w", Some(&[0, 0])),
            Some(50),
            "the later entry wins, as in a dict"
        );
        assert_eq!(at("v", None), Some(30));
        assert_eq!(at("w", Some(&[1, 0])), None);
        assert_eq!(at("w", None), None);
        assert_eq!(at("x", Some(&[0, 0])), None);
    }
}
