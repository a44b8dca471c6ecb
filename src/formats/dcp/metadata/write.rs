//! Writing `.metadata`: the pickle torch's `FileSystemWriter` writes, item by item from a
//! [`Describe`], so millions of chunks are never all in memory.

use super::*;
use crate::model::contiguous_strides;
use crate::pickle;
use crate::pickle::{Protocol, Stream};

/// What the `.metadata` writer needs, item by item: an owned [`DcpMetadata`], or a plan that
/// derives millions of chunks from mesh geometry as they are written, so they are never all in
/// memory. The writer walks each sequence twice (to find repeated strings, then to write), so each
/// call must give the same items.
pub trait Describe<'m> {
    /// `state_dict_metadata`, in pickled order.
    fn entries(&self) -> Box<dyn Iterator<Item = EntryRef<'m, '_>> + '_>;
    /// `planner_data`: fqn and nesting path.
    fn planner_data(&self) -> Box<dyn Iterator<Item = (&'m str, &'m [KeyPart])> + '_>;
    /// `storage_data`, in pickled order.
    fn storage(&self) -> Box<dyn Iterator<Item = StorageRef<'m>> + '_>;
    /// `version`, e.g. "1.0.0".
    fn version(&self) -> Option<&'m str>;
}

/// One entry of `state_dict_metadata`, as [`Describe`] gives it.
pub enum EntryRef<'m, 'i> {
    Tensor {
        fqn: &'m str,
        dtype: DType,
        size: &'m [u64],
        chunks: Box<dyn Iterator<Item = Chunk> + 'i>,
    },
    Bytes {
        fqn: &'m str,
    },
}

/// One `MetadataIndex -> _StorageInfo` pair of `storage_data`, as [`Describe`] gives it.
pub struct StorageRef<'m> {
    pub fqn: &'m str,
    /// The chunk's offsets for a tensor, `None` for bytes.
    pub chunk_offsets: Option<Vec<u64>>,
    pub index: Option<i64>,
    pub relative_path: &'m str,
    pub offset: u64,
    pub length: u64,
    pub transforms: &'m [String],
}

impl<'m> Describe<'m> for &'m DcpMetadata {
    fn entries(&self) -> Box<dyn Iterator<Item = EntryRef<'m, '_>> + '_> {
        // Entries of an unsupported dtype are not written: ckpt cannot name them back.
        Box::new(self.entries.iter().filter_map(|e| match e {
            DcpEntry::Tensor {
                fqn,
                dtype,
                size,
                chunks,
            } => Some(EntryRef::Tensor {
                fqn,
                dtype: *dtype,
                size,
                chunks: Box::new(chunks.iter().cloned()),
            }),
            DcpEntry::Bytes { fqn } => Some(EntryRef::Bytes { fqn }),
            DcpEntry::Unsupported { .. } => None,
        }))
    }

    fn planner_data(&self) -> Box<dyn Iterator<Item = (&'m str, &'m [KeyPart])> + '_> {
        Box::new(
            self.planner_data
                .iter()
                .map(|(fqn, path)| (fqn.as_str(), path.as_slice())),
        )
    }

    fn storage(&self) -> Box<dyn Iterator<Item = StorageRef<'m>> + '_> {
        Box::new(self.storage.iter().map(|(index, info)| StorageRef {
            fqn: &index.fqn,
            chunk_offsets: index.offset.clone(),
            index: index.index,
            relative_path: &info.relative_path,
            offset: info.offset,
            length: info.length,
            transforms: &info.transforms,
        }))
    }

    fn version(&self) -> Option<&'m str> {
        self.version.as_deref()
    }
}

/// Serialize metadata as PyTorch writes it (pickle protocol 4 of the real classes).
///
/// Mirrors torch 2.15's `FileSystemWriter`: the same classes, field order and state shapes. Fields
/// ckpt does not model are written as torch would for a fresh contiguous tensor: `strides` are the
/// row-major strides of the first chunk (torch records the saving rank's local shard), and
/// `storage_meta` is a `StorageMeta` with no ids or path. Sizes above `i64::MAX`, which no torch
/// tensor can have, are written as `i64::MAX`.
pub fn write(meta: &DcpMetadata) -> Vec<u8> {
    pickle::write_with(Protocol::V4, |w| metadata(w, &meta))
}

/// [`write`] of what `meta` describes, streamed to `sink`; returns the length written. Setting
/// `stop` ends it early with an error (see [`pickle::write_to`]).
pub fn write_to<'m, W: std::io::Write + std::io::Seek>(
    sink: &mut W,
    meta: &impl Describe<'m>,
    stop: &std::sync::atomic::AtomicBool,
) -> std::io::Result<u64> {
    pickle::write_to(sink, Protocol::V4, stop, |w| metadata(w, meta))
}

/// `Metadata(state_dict_metadata, planner_data, storage_data, storage_meta, version)`.
pub(super) fn metadata<'m, 's>(w: &mut Stream<'m, 's>, meta: &impl Describe<'m>) {
    dataclass(w, META, "Metadata", |w| {
        w.fields(|w| {
            w.str("state_dict_metadata");
            w.dict(meta.entries(), |w, entry| match entry {
                EntryRef::Tensor {
                    fqn,
                    dtype,
                    size,
                    chunks,
                } => {
                    w.str(fqn);
                    tensor_storage_metadata(w, dtype, size, chunks);
                }
                EntryRef::Bytes { fqn } => {
                    w.str(fqn);
                    new_obj(w, META, "BytesStorageMetadata");
                }
            });
            w.str("planner_data");
            w.dict(meta.planner_data(), |w, (fqn, path)| {
                w.str(fqn);
                w.tuple(path.len(), |w| {
                    for part in path {
                        match part {
                            KeyPart::Key(k) => w.str(k),
                            KeyPart::Index(i) | KeyPart::IntKey(i) => w.int(*i),
                        }
                    }
                });
            });
            w.str("storage_data");
            w.dict(meta.storage(), |w, entry| {
                write_metadata_index(w, &entry);
                write_storage_info(w, &entry);
            });
            w.str("storage_meta");
            dataclass(w, META, "StorageMeta", |w| {
                w.fields(|w| {
                    for name in ["checkpoint_id", "save_id", "load_id"] {
                        w.str(name);
                        w.none();
                    }
                    w.str("modules");
                    w.list(std::iter::empty::<()>(), |_, _| {});
                });
            });
            w.str("version");
            match meta.version() {
                Some(v) => w.str(v),
                None => w.none(),
            }
        });
    });
}

pub(super) fn int(w: &mut Stream<'_, '_>, v: u64) {
    w.int(i64::try_from(v).unwrap_or(i64::MAX));
}

/// A dataclass with no state as pickle writes it: `cls.__new__(cls)`.
pub(super) fn new_obj<'m, 's>(w: &mut Stream<'m, 's>, module: &'m str, name: &'m str) {
    w.global(module, name);
    w.tuple(0, |_| {});
    w.call(true);
}

/// A dataclass as pickle writes it: `cls.__new__(cls)`, then `BUILD` with the state `state` writes.
pub(super) fn dataclass<'m, 's>(
    w: &mut Stream<'m, 's>,
    module: &'m str,
    name: &'m str,
    state: impl FnOnce(&mut Stream<'m, 's>),
) {
    new_obj(w, module, name);
    w.build(state);
}

pub(super) fn torch_size(w: &mut Stream<'_, '_>, dims: &[u64]) {
    w.global("torch", "Size");
    w.tuple(1, |w| {
        w.tuple(dims.len(), |w| dims.iter().for_each(|&d| int(w, d)))
    });
    w.call(false);
}

pub(super) fn tensor_storage_metadata(
    w: &mut Stream<'_, '_>,
    dtype: DType,
    size: &[u64],
    chunks: impl Iterator<Item = Chunk>,
) {
    let mut chunks = chunks.peekable();
    let strides = contiguous_strides(chunks.peek().map_or(size, |c| &c.sizes));
    dataclass(w, META, "TensorStorageMetadata", |w| {
        w.fields(|w| {
            w.str("properties");
            dataclass(w, META, "TensorProperties", |w| {
                w.tuple(6, |w| {
                    w.global("torch", dtype.torch_name());
                    w.global("torch.serialization", "_get_layout");
                    w.tuple(1, |w| w.str("torch.strided"));
                    w.call(false);
                    w.bool(false);
                    // `_MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT`
                    w.global(META, "_MEM_FORMAT_ENCODING");
                    w.tuple(1, |w| w.int(0));
                    w.call(false);
                    w.bool(false);
                    w.tuple(strides.len(), |w| strides.iter().for_each(|&s| int(w, s)));
                });
            });
            w.str("size");
            torch_size(w, size);
            w.str("chunks");
            w.list(chunks, |w, c| {
                dataclass(w, META, "ChunkStorageMetadata", |w| {
                    w.fields(|w| {
                        w.str("offsets");
                        torch_size(w, &c.offsets);
                        w.str("sizes");
                        torch_size(w, &c.sizes);
                    });
                });
            });
        });
    });
}

/// `MetadataIndex`'s state: `fqn`, `index`, and `offset` for tensors.
pub(super) fn write_metadata_index<'m, 's>(w: &mut Stream<'m, 's>, entry: &StorageRef<'m>) {
    dataclass(w, META, "MetadataIndex", |w| {
        w.fields(|w| {
            w.str("fqn");
            w.str(entry.fqn);
            w.str("index");
            match entry.index {
                Some(i) => w.int(i),
                None => w.none(),
            }
            if let Some(offset) = &entry.chunk_offsets {
                w.str("offset");
                torch_size(w, offset);
            }
        });
    });
}

pub(super) fn write_storage_info<'m, 's>(w: &mut Stream<'m, 's>, entry: &StorageRef<'m>) {
    dataclass(w, FS, "_StorageInfo", |w| {
        // torch leaves `transform_descriptors` out when there are none.
        let transforms = entry.transforms;
        w.fields(|w| {
            w.str("relative_path");
            w.str(entry.relative_path);
            w.str("offset");
            int(w, entry.offset);
            w.str("length");
            int(w, entry.length);
            if !transforms.is_empty() {
                w.str("transform_descriptors");
                w.list(transforms, |w, t| w.str(t));
            }
        });
    });
}
