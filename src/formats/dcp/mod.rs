//! PyTorch Distributed Checkpoint directories: `.metadata` + `__{rank}_{i}.distcp`.
//!
//! The `.metadata` pickle says which chunks each tensor has and where each item lives; every
//! tensor item is a whole torch.save archive (optionally zstd-compressed), which this reader opens
//! only far enough to find the byte range of the chunk's elements. Files saved with
//! `serialization_format=SAFETENSORS` hold their tensor chunks in one safetensors blob instead
//! ([`sfmt`]).

pub mod hf;
pub mod metadata;
pub mod sfmt;

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use bytes::Bytes;

use rayon::prelude::*;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::formats::torch_save::{self, Leaf};
use crate::layout::{Found, Layout, Listing, ReadOptions};
use crate::model::{
    Blob, Checkpoint, Encoding, Format, KeyPart, NonTensor, Pieces, Tensor, Unsupported,
};
use crate::pickle::{opcodes, Value};
use crate::storage::{self, Access, Input, Stat, View};
use metadata::DcpEntry;
pub use metadata::{Extension, NoExtension};

/// Name of the metadata file in a DCP directory.
pub const METADATA: &str = ".metadata";
/// `.metadata` files larger than this are refused: real ones are kilobytes to a few megabytes.
const MAX_METADATA_BYTES: u64 = 1 << 30;
/// Largest decompressed non-tensor item (train state, param groups: kilobytes in practice).
const MAX_VALUE_BYTES: u64 = 256 << 20;
/// zstd transform descriptor DCP writes.
pub const ZSTD: &str = "stream.zstd/1";

/// A PyTorch Distributed Checkpoint directory: `.metadata` and the rank files it names.
pub struct Dcp;

impl Layout for Dcp {
    fn describe(&self) -> &'static str {
        "DCP directories (`.metadata`)"
    }

    fn probe(&self, at: &Listing) -> Result<Option<Found>> {
        Ok(match at {
            Listing::Dir { path, .. } if at.file_named(METADATA).is_some() => Some(Found::at(path)),
            // `.metadata` itself stands for its directory.
            Listing::File(f) if f.name() == METADATA => f.path.parent().map(Found::at),
            _ => None,
        })
    }

    fn read(&self, found: &Found, opts: &ReadOptions) -> Result<Checkpoint> {
        read(&found.path, opts)
    }
}

/// Largest item left unopened: one block of the object cache. A larger item is opened while
/// reading (its framing is a small part of it), so that copying it in several units does not
/// fetch all of it for each.
const UNOPENED_ITEM_BYTES: u64 = storage::BLOCK_BYTES;

/// Read a DCP directory into the model.
pub fn read(dir: &Path, opts: &ReadOptions) -> Result<Checkpoint> {
    read_extended(dir, opts, &NoExtension).map(|(ckpt, _)| ckpt)
}

/// [`read`] for a format built on DCP: `.metadata` may also name the classes `extension` allows,
/// and the `Metadata` fields it asks for come back beside the checkpoint, as data.
pub fn read_extended(
    dir: &Path,
    opts: &ReadOptions,
    extension: &dyn Extension,
) -> Result<(Checkpoint, Vec<(String, Value)>)> {
    let meta_path = dir.join(METADATA);
    let meta = Input::open(&meta_path, Access::Map)?;
    let len = meta.len();
    if len > MAX_METADATA_BYTES {
        return Err(Error::invalid(format!(
            "`.metadata` is {len} bytes, more than ckpt accepts"
        ))
        .file(&meta_path));
    }
    // Mapped, not read (a remote one is fetched whole): at millions of pieces the file is
    // hundreds of megabytes, and the graph the pickle reader builds borrows its strings from
    // these bytes.
    let bytes = meta.bytes(0, len)?;
    let mut built = Builder::default();
    let rest =
        metadata::parse_into(&bytes, &mut built, extension).map_err(|e| e.file(&meta_path))?;
    drop(bytes);
    drop(meta);
    built.apply_pending();
    let paths: HashMap<&str, &[KeyPart]> = rest
        .planner_data
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_slice()))
        .collect();
    let key_path = |fqn: &str| paths.get(fqn).map(|p| p.to_vec()).unwrap_or_default();
    let slots = std::mem::take(&mut built.slots);
    let files = Files::map_all(dir, &built, opts.open_items_when_copied)?;
    let world_size = world_size(dir, &built.file_names);
    let mut tensors = Vec::new();
    let mut values = Vec::new();
    let mut unsupported = Vec::new();
    files.open_ahead(&slots);
    // Each entry's columns are freed as its pieces are made, so the two are never both whole.
    for (at, slot) in slots.into_iter().enumerate() {
        match slot {
            Slot::Tensor(t) => {
                // Every broken item of the tensor is a problem of its own (see `verify`).
                let pieces = match files.pieces(&t, at) {
                    Ok(pieces) => pieces,
                    Err(errors) => {
                        for e in errors {
                            opts.step_past(e.file(&meta_path).tensor(&t.fqn))?;
                        }
                        continue;
                    }
                };
                tensors.push(Tensor {
                    key_path: key_path(&t.fqn),
                    name: t.fqn,
                    dtype: t.dtype,
                    shape: t.size,
                    pieces,
                });
            }
            Slot::Bytes { fqn, item } => {
                let item = item.ok_or_else(|| {
                    Error::invalid("no storage entry for this value")
                        .file(&meta_path)
                        .tensor(&fqn)
                })?;
                let (blob, value) = match files.value(&item) {
                    Ok(found) => found,
                    Err(e) => {
                        opts.step_past(e.tensor(&fqn))?;
                        continue;
                    }
                };
                values.push(NonTensor {
                    key_path: key_path(&fqn),
                    name: fqn,
                    value,
                    raw: Some(blob),
                });
            }
            Slot::Unsupported { fqn, dtype } => unsupported.push(Unsupported {
                name: fqn,
                dtype,
                file: PathBuf::from(METADATA),
            }),
        }
    }
    let ckpt = Checkpoint {
        root: dir.to_path_buf(),
        format: Format::Dcp,
        world_size,
        tensors,
        values,
        unsupported,
        details: Vec::new(),
    };
    Ok((ckpt, rest.fields))
}

/// Where a chunk's elements are ([`Files::locate`]): its item, their byte offset (in the file, or
/// in the decompressed item), strides and encoding.
type Located = (Item, u64, Vec<u64>, Encoding);

/// Where an item's bytes are: `_StorageInfo`, with its file numbered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Item {
    /// Index into [`Builder::file_names`].
    file: u32,
    /// Index into [`Builder::transforms`].
    transform: u32,
    offset: u64,
    length: u64,
}

/// One `state_dict_metadata` entry as it is read, with the items its storage records give.
enum Slot {
    Tensor(TensorSlot),
    Bytes {
        fqn: String,
        item: Option<Item>,
    },
    /// A tensor of a dtype ckpt does not support, kept by name (see [`Unsupported`]).
    Unsupported {
        fqn: String,
        dtype: String,
    },
}

/// A tensor entry's chunks as columns, about 60 bytes each, where the parsed records of a chunk
/// and its storage took over 300: a `.metadata` of 2M pieces is read in about 120 MB.
struct TensorSlot {
    fqn: String,
    dtype: DType,
    size: Vec<u64>,
    /// Per chunk, its offsets then its sizes.
    boxes: Vec<u64>,
    /// Chunk indices sorted by offsets, to find a storage record's chunks by binary search;
    /// made when a record's index hint does not name its chunk.
    order: Vec<u32>,
    /// Two chunks have the same offsets (a replica listed twice), so a record is put on every
    /// chunk at its offsets, never on the one its hint names alone.
    repeated: bool,
    /// Per chunk, its item once a storage record named it.
    items: Vec<Option<Item>>,
}

impl TensorSlot {
    fn offsets(&self, k: usize) -> &[u64] {
        let n = self.size.len();
        &self.boxes[2 * n * k..2 * n * k + n]
    }

    fn sizes(&self, k: usize) -> &[u64] {
        let n = self.size.len();
        &self.boxes[2 * n * k + n..2 * n * (k + 1)]
    }

    fn sort(&mut self) {
        let mut order: Vec<u32> = (0..self.items.len() as u32).collect();
        // Stable and nearly sorted already (chunks come in rank order), so this is cheap.
        order.sort_by(|&a, &b| self.offsets(a as usize).cmp(self.offsets(b as usize)));
        self.order = order;
    }
}

/// The [`metadata::Sink`] of [`read`]: entries in pickled order (a repeated fqn keeps its first
/// place and last value), each storage record put on the chunks it names as it comes.
#[derive(Default)]
struct Builder {
    slots: Vec<Slot>,
    by_fqn: HashMap<String, usize>,
    /// Every `relative_path` the records name, once.
    file_names: Vec<String>,
    /// Records naming each file, by file id.
    file_items: Vec<u64>,
    file_ids: HashMap<String, u32>,
    /// Every list of `transform_descriptors`, once.
    transforms: Vec<Vec<String>>,
    transform_ids: HashMap<Vec<String>, u32>,
    /// Records read before their entry (a pickle with `storage_data` first); applied at the end.
    pending: Vec<(metadata::MetadataIndex, Item)>,
}

impl Builder {
    fn file_id(&mut self, name: String) -> u32 {
        if let Some(&id) = self.file_ids.get(&name) {
            return id;
        }
        let id = self.file_names.len() as u32;
        self.file_names.push(name.clone());
        self.file_items.push(0);
        self.file_ids.insert(name, id);
        id
    }

    /// Put `item` where `index` says; false when no entry of its fqn has been read yet.
    fn place(&mut self, index: &metadata::MetadataIndex, item: Item) -> bool {
        let Some(&at) = self.by_fqn.get(index.fqn.as_str()) else {
            return false;
        };
        match (&mut self.slots[at], &index.offset) {
            (Slot::Bytes { item: slot, .. }, None) => *slot = Some(item),
            (Slot::Tensor(t), Some(offsets)) => {
                // The hint torch and ckpt write: the chunk's place in the entry. Trusted only
                // when it names a chunk at these offsets and no other chunk has them.
                let hinted = index.index.and_then(|i| usize::try_from(i).ok());
                if let Some(k) = hinted.filter(|&k| k < t.items.len() && !t.repeated) {
                    if t.offsets(k) == offsets.as_slice() {
                        t.items[k] = Some(item);
                        return true;
                    }
                }
                if t.order.is_empty() {
                    t.sort();
                }
                // Python's dict keys records by (fqn, offsets): every chunk at those offsets (a
                // replica listed twice) reads this item, and a later record replaces it.
                let first = t
                    .order
                    .partition_point(|&k| t.offsets(k as usize) < offsets.as_slice());
                let mut k = first;
                while let Some(&chunk) = t.order.get(k) {
                    if t.offsets(chunk as usize) != offsets.as_slice() {
                        break;
                    }
                    t.items[chunk as usize] = Some(item);
                    k += 1;
                }
            }
            // A record no entry reads: torch ignores it too.
            _ => {}
        }
        true
    }

    fn apply_pending(&mut self) {
        for (index, item) in std::mem::take(&mut self.pending) {
            self.place(&index, item);
        }
    }
}

impl metadata::Sink for Builder {
    fn entry(&mut self, entry: DcpEntry) -> Result<()> {
        let slot = match entry {
            DcpEntry::Bytes { fqn } => Slot::Bytes { fqn, item: None },
            DcpEntry::Unsupported { fqn, dtype } => Slot::Unsupported { fqn, dtype },
            DcpEntry::Tensor {
                fqn,
                dtype,
                size,
                chunks,
            } => {
                let mut boxes = Vec::with_capacity(chunks.len() * 2 * size.len());
                for c in &chunks {
                    boxes.extend_from_slice(&c.offsets);
                    boxes.extend_from_slice(&c.sizes);
                }
                let count = u32::try_from(chunks.len())
                    .map_err(|_| Error::invalid("more than 4 billion chunks").tensor(&fqn))?;
                drop(chunks);
                let mut t = TensorSlot {
                    fqn,
                    dtype,
                    size,
                    boxes,
                    order: Vec::new(),
                    repeated: false,
                    items: vec![None; count as usize],
                };
                t.sort();
                t.repeated = t
                    .order
                    .windows(2)
                    .any(|w| t.offsets(w[0] as usize) == t.offsets(w[1] as usize));
                if !t.repeated {
                    // Records name their chunks by hint; the order is made again if one does not.
                    t.order = Vec::new();
                }
                Slot::Tensor(t)
            }
        };
        let fqn = match &slot {
            Slot::Tensor(t) => &t.fqn,
            Slot::Bytes { fqn, .. } | Slot::Unsupported { fqn, .. } => fqn,
        };
        match self.by_fqn.get(fqn) {
            Some(&at) => self.slots[at] = slot,
            None => {
                self.by_fqn.insert(fqn.clone(), self.slots.len());
                self.slots.push(slot);
            }
        }
        Ok(())
    }

    fn storage(
        &mut self,
        index: metadata::MetadataIndex,
        info: metadata::StorageInfo,
    ) -> Result<()> {
        let transform = match self.transform_ids.get(&info.transforms) {
            Some(&id) => id,
            None => {
                let id = self.transforms.len() as u32;
                self.transforms.push(info.transforms.clone());
                self.transform_ids.insert(info.transforms, id);
                id
            }
        };
        let file = self.file_id(info.relative_path);
        if let Some(n) = self.file_items.get_mut(file as usize) {
            *n += 1;
        }
        let item = Item {
            file,
            transform,
            offset: info.offset,
            length: info.length,
        };
        if !self.place(&index, item) {
            self.pending.push((index, item));
        }
        Ok(())
    }
}

/// Ranks that wrote files: one more than the highest `__{rank}_` prefix in the directory or the
/// metadata (a rank whose chunks were all deduplicated away still writes its file).
fn world_size(dir: &Path, names: &[String]) -> Option<usize> {
    let rank = |name: &str| -> Option<usize> {
        name.strip_prefix("__")?
            .strip_suffix(".distcp")?
            .split('_')
            .next()?
            .parse::<usize>()
            .ok()
    };
    let mut highest: Option<usize> = names.iter().filter_map(|n| rank(n)).max();
    if let Ok(list) = storage::list(dir) {
        for entry in list {
            if let Some(name) = entry.file_name().and_then(|n| n.to_str()) {
                highest = highest.max(rank(name));
            }
        }
    }
    highest.map(|r| r + 1)
}

/// The `.distcp` files of one checkpoint, each opened (mapped, when local) once, and what their
/// items are.
struct Files<'a> {
    dir: &'a Path,
    /// By [`Item::file`]: the file's name as pieces share it, and the file.
    maps: Vec<(Arc<Path>, Input)>,
    /// By [`Item::transform`].
    transforms: &'a [Vec<String>],
    /// By [`Item::file`]: the file's safetensors blob, once a tensor item led to it.
    blobs: Vec<OnceLock<Arc<sfmt::Blob>>>,
    /// Leave small remote items unopened ([`OpenItemsWhenCopied`]).
    unopened: bool,
    /// By [`Item::file`]: set once an item of the file opened as a torch.save archive, which
    /// tells its items from a `serialization_format=SAFETENSORS` file's. One writer wrote every
    /// file of a checkpoint in one format, so once any file's item has opened so, the other
    /// items are left unopened: a checkpoint of 512 rank files is not probed with a GET per file
    /// before its copy starts (an item that is not an archive after all is an error when copied).
    saved: Vec<OnceLock<()>>,
    /// The items of the GET being opened by [`Files::open_ahead`].
    fetched: RwLock<HashMap<Item, Bytes>>,
    /// What [`Files::open_ahead`] found of each chunk it opened, by (entry, chunk), taken as the
    /// entry's pieces are made.
    opened: Mutex<HashMap<(usize, usize), Result<Located>>>,
}

impl<'a> Files<'a> {
    /// Map every file the storage records name, once each.
    fn map_all(dir: &'a Path, built: &'a Builder, unopened: bool) -> Result<Files<'a>> {
        let maps = built
            .file_names
            .iter()
            .zip(&built.file_items)
            .map(|(name, &items)| Ok((Arc::from(Path::new(name)), map_file(dir, name, items)?)))
            .collect::<Result<Vec<_>>>()?;
        Ok(Files {
            dir,
            blobs: (0..maps.len()).map(|_| OnceLock::new()).collect(),
            unopened,
            saved: (0..maps.len()).map(|_| OnceLock::new()).collect(),
            fetched: RwLock::default(),
            opened: Mutex::default(),
            maps,
            transforms: &built.transforms,
        })
    }

    /// Open the small items of the tensors' chunks in remote files before the entries are
    /// read, file by file: each file's items come in a few GETs (whole, when it is at most
    /// [`storage::GET_BYTES`]), several files in flight, and are opened as they arrive. Opened
    /// entry by entry, each item cost a GET of its own, and a DCP of 128 rank files has tens of
    /// thousands. Nothing is done when items are left unopened for the copy, or none is remote;
    /// whatever this leaves unopened (a failed GET, a large item) is opened as before, when its
    /// entry is read. Memory: the GETs in flight, and what was found of each chunk until its
    /// entry takes it (about what the entry's pieces then hold).
    fn open_ahead(&self, slots: &[Slot]) {
        if self.unopened || !self.maps.iter().any(|(_, input)| input.reads_by_request()) {
            return;
        }
        // (item, entry, chunk) of every small item in a remote file, by file and offset.
        let mut chunks: Vec<(Item, usize, usize)> = Vec::new();
        for (at, slot) in slots.iter().enumerate() {
            let Slot::Tensor(t) = slot else { continue };
            for (k, item) in t.items.iter().enumerate() {
                let Some(item) = item.filter(|item| self.fits_a_get(item)) else {
                    continue;
                };
                chunks.push((item, at, k));
            }
        }
        chunks.sort_by_key(|(item, ..)| (item.file, item.offset));
        let ranges: Vec<(usize, Range<u64>)> = chunks
            .iter()
            .map(|(item, ..)| (item.file as usize, item.offset..item.offset + item.length))
            .collect();
        let gets = storage::gets_of(&ranges);
        let Some(objects) = gets
            .iter()
            .map(|(file, get, _)| Some((self.maps.get(*file)?.1.object()?, get.clone())))
            .collect::<Option<Vec<_>>>()
        else {
            return;
        };
        // A failed GET leaves its items to be opened when their entries are read, where what
        // failed is reported against them (`verify` lists each broken item).
        let _ = storage::fetch_each(&objects, storage::GETS_IN_FLIGHT, |g, got| {
            let (_, get, ks) = &gets[g];
            {
                let mut fetched = self.fetched.write().unwrap_or_else(|p| p.into_inner());
                fetched.clear();
                for &k in ks {
                    let r = &ranges[k].1;
                    let within = (r.start - get.start) as usize..(r.end - get.start) as usize;
                    fetched.insert(chunks[k].0, got.slice(within));
                }
            }
            // At a million pieces opening items is most of the read: in parallel.
            let found: Vec<_> = ks
                .par_iter()
                .filter_map(|&k| {
                    let (item, at, c) = chunks[k];
                    let Some(Slot::Tensor(t)) = slots.get(at) else {
                        return None;
                    };
                    Some(((at, c), self.locate(&item, t, c)))
                })
                .collect();
            self.opened
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .extend(found);
            Ok(())
        });
        self.fetched
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }

    /// True for an item [`Files::open_ahead`] fetches: in a remote file, inside it, and small
    /// (a large one is opened from its framing alone).
    fn fits_a_get(&self, item: &Item) -> bool {
        let end = item.offset.checked_add(item.length);
        item.length <= UNOPENED_ITEM_BYTES
            && self.maps.get(item.file as usize).is_some_and(|(_, input)| {
                input.reads_by_request() && end.is_some_and(|end| end <= input.len())
            })
    }

    /// An item of the GET [`Files::open_ahead`] is opening.
    fn fetched_item(&self, item: &Item) -> Option<Bytes> {
        let fetched = self.fetched.read().unwrap_or_else(|p| p.into_inner());
        fetched.get(item).cloned()
    }

    fn path(&self, item: &Item) -> PathBuf {
        match self.maps.get(item.file as usize) {
            Some((name, _)) => self.dir.join(name),
            None => self.dir.to_path_buf(),
        }
    }

    /// An error found inside an item's archive, placed in the file: offsets inside a plain item
    /// are file offsets once shifted; inside a compressed one they mean nothing on disk, so the
    /// item's own offset is the useful position.
    fn placed(&self, e: Error, item: &Item, zstd: bool) -> Error {
        let e = e.file(self.path(item));
        if zstd {
            Error {
                offset: Some(item.offset),
                ..e
            }
        } else {
            e.within(item.offset)
        }
    }

    /// True when the item is zstd-compressed; an error for transforms ckpt does not know.
    fn is_zstd(&self, item: &Item) -> Result<bool> {
        let transforms = self
            .transforms
            .get(item.transform as usize)
            .map_or(&[][..], Vec::as_slice);
        match transforms {
            [] => Ok(false),
            [t] if t == ZSTD => Ok(true),
            other => Err(
                Error::invalid(format!("unsupported item transform {other:?}"))
                    .file(self.path(item))
                    .at(item.offset)
                    .hint("ckpt reads items that are plain or `stream.zstd/1`"),
            ),
        }
    }

    /// The bytes of one item, checked against the file's length: the whole item, or (`zip`) a
    /// view of it for the ZIP reader, which for a remote file holds only the archive's framing.
    fn bytes(&self, item: &Item, zip: bool) -> Result<View<'_>> {
        let input = match self.maps.get(item.file as usize) {
            Some((_, input)) => input,
            None => {
                return Err(Error::bug("item in a file that was not mapped").file(self.path(item)))
            }
        };
        if input.reads_by_request() {
            if let Some(fetched) = self.fetched_item(item) {
                return Ok(View::Fetched(fetched));
            }
        }
        let end = item.offset.checked_add(item.length);
        match end {
            Some(end) if end <= input.len() && zip => input.zip_view(item.offset, item.length),
            Some(end) if end <= input.len() => input.bytes(item.offset, item.length),
            _ => Err(Error::invalid(format!(
                "item of {} bytes at offset {} runs past the end of the file ({} bytes)",
                item.length,
                item.offset,
                input.len()
            ))
            .file(self.path(item))
            .at(item.offset)
            .hint("the file is truncated: copy it again from where the checkpoint was saved")),
        }
    }

    /// The pieces of a tensor: each chunk's item opened to find its elements. At a million
    /// chunks that is most of the read, and the items are independent, so it runs in parallel.
    /// On failure, the error of every item that failed, in chunk order.
    fn pieces(&self, t: &TensorSlot, at: usize) -> std::result::Result<Pieces, Vec<Error>> {
        let chunk = |k: usize, ahead: Option<Result<Located>>| {
            let item = t.items[k].ok_or_else(|| {
                Error::invalid(format!(
                    "no storage entry for the chunk at offsets {:?}",
                    t.offsets(k)
                ))
            })?;
            ahead.unwrap_or_else(|| self.locate(&item, t, k))
        };
        // What `open_ahead` found of this entry's chunks, if it ran.
        let ahead: Vec<Option<Result<Located>>> = {
            let mut opened = self.opened.lock().unwrap_or_else(|p| p.into_inner());
            if opened.is_empty() {
                Vec::new()
            } else {
                (0..t.items.len())
                    .map(|k| opened.remove(&(at, k)))
                    .collect()
            }
        };
        let located: Vec<Result<Located>> = if ahead.is_empty() {
            (0..t.items.len())
                .into_par_iter()
                .map(|k| chunk(k, None))
                .collect()
        } else {
            ahead
                .into_par_iter()
                .enumerate()
                .map(|(k, ahead)| chunk(k, ahead))
                .collect()
        };
        if located.iter().any(|r| r.is_err()) {
            return Err(located.into_iter().filter_map(|r| r.err()).collect());
        }
        let mut pieces = Pieces::new(t.size.len());
        pieces.reserve(located.len());
        for (k, (item, offset, strides, encoding)) in located.into_iter().flatten().enumerate() {
            let file = Arc::clone(&self.maps[item.file as usize].0);
            pieces
                .push_parts(t.offsets(k), t.sizes(k), file, offset, &strides, encoding)
                .map_err(|e| vec![e])?;
        }
        Ok(pieces)
    }

    /// Where the elements of a chunk of `sizes` are in its item: their byte offset (in the file,
    /// or in the decompressed item), strides and encoding.
    fn locate(&self, item: &Item, t: &TensorSlot, k: usize) -> Result<Located> {
        let zstd = self.is_zstd(item)?;
        if let Some(unopened) = self.unopened(item, t.sizes(k), zstd) {
            return Ok(unopened);
        }
        // A file saved with serialization_format=SAFETENSORS is told apart only where its first
        // record fails as a torch.save item, so ordinary checkpoints (remote ones included) read
        // nothing more than before.
        let blob = match self.blobs.get(item.file as usize).and_then(OnceLock::get) {
            Some(blob) if item.offset <= blob.start => Arc::clone(blob),
            _ => match self.locate_saved(item, t.dtype, t.sizes(k), zstd) {
                Ok(found) => {
                    if let Some(saved) = self.saved.get(item.file as usize) {
                        let _ = saved.set(());
                    }
                    return Ok(found);
                }
                Err(e) => match self.blob(item, zstd) {
                    Ok(Some(blob)) => blob,
                    Ok(None) => return Err(e),
                    Err(blob_err) => return Err(blob_err),
                },
            },
        };
        let sizes = t.sizes(k);
        let offset = blob
            .locate(&t.fqn, t.dtype, t.offsets(k), sizes, item.length)
            .map_err(|e| e.file(self.path(item)))?;
        Ok((
            *item,
            offset,
            crate::model::contiguous_strides(sizes),
            Encoding::Raw,
        ))
    }

    /// The piece of a small plain item in object storage, left unopened ([`Encoding::Saved`])
    /// when this read allows it and an item of the checkpoint has opened as a torch.save archive.
    fn unopened(&self, item: &Item, sizes: &[u64], zstd: bool) -> Option<Located> {
        let file = item.file as usize;
        if !self.unopened
            || zstd
            || item.length > UNOPENED_ITEM_BYTES
            || !self.saved.iter().any(|s| s.get().is_some())
            || !self.maps.get(file)?.1.reads_by_request()
        {
            return None;
        }
        let numel = crate::model::numel(sizes).filter(|&n| n > 0)?;
        let encoding = Encoding::Saved {
            item_offset: item.offset,
            item_length: item.length,
            numel,
            shape: crate::model::shape_key(sizes),
        };
        Some((*item, 0, crate::model::contiguous_strides(sizes), encoding))
    }

    /// [`Files::locate`] for a torch.save item (plain or zstd).
    fn locate_saved(
        &self,
        item: &Item,
        dtype: DType,
        sizes: &[u64],
        zstd: bool,
    ) -> Result<Located> {
        // Named only in errors: building the path for each of a million items costs time.
        let path = || self.path(item);
        let view = self.bytes(item, !zstd)?;
        let bytes: &[u8] = &view;
        let decoded;
        let archive_bytes: &[u8] = if zstd {
            // A chunk's archive holds its storage plus a little framing; a storage much larger
            // than the chunk is possible (a saved view) but not without bound.
            let chunk_bytes = crate::model::numel(sizes)
                .unwrap_or(u64::MAX)
                .saturating_mul(dtype.size() as u64);
            let limit = chunk_bytes.saturating_mul(4).saturating_add(64 << 20);
            decoded = zstd_decompress(bytes, limit).map_err(|e| e.file(path()).at(item.offset))?;
            &decoded
        } else {
            bytes
        };
        let archive =
            torch_save::read_cached(archive_bytes).map_err(|e| self.placed(e, item, zstd))?;
        let (saved, entry) =
            saved_chunk(&archive, dtype, sizes).map_err(|e| e.file(path()).at(item.offset))?;
        let within = entry.data_offset + saved.storage_offset * dtype.size() as u64;
        let (offset, encoding) = if zstd {
            (
                within,
                Encoding::Zstd {
                    item_offset: item.offset,
                    item_length: item.length,
                },
            )
        } else {
            (item.offset + within, Encoding::Raw)
        };
        Ok((*item, offset, saved.strides.clone(), encoding))
    }

    /// The safetensors blob of the item's file when the file was saved with
    /// `serialization_format=SAFETENSORS` ([`sfmt`]); `None` for an ordinary torch.save item.
    fn blob(&self, item: &Item, zstd: bool) -> Result<Option<Arc<sfmt::Blob>>> {
        let (Some(cell), Some((_, input))) = (
            self.blobs.get(item.file as usize),
            self.maps.get(item.file as usize),
        ) else {
            return Err(Error::bug("item in a file that was not mapped").file(self.path(item)));
        };
        let Some(start) =
            sfmt::find(input, item.offset, zstd).map_err(|e| e.file(self.path(item)))?
        else {
            return Ok(None);
        };
        let blob = Arc::new(sfmt::Blob::read(input, start).map_err(|e| e.file(self.path(item)))?);
        // Items of one file race here; any of them parses the same blob.
        Ok(Some(Arc::clone(cell.get_or_init(|| blob))))
    }

    /// A non-tensor item: its raw bytes, and its value when it is plain data.
    fn value(&self, item: &Item) -> Result<(Blob, Option<crate::pickle::Value>)> {
        let zstd = self.is_zstd(item)?;
        let view = self.bytes(item, false)?;
        let bytes: &[u8] = &view;
        let decoded;
        let bytes: &[u8] = if zstd {
            decoded = zstd_decompress(bytes, MAX_VALUE_BYTES)?;
            &decoded
        } else {
            bytes
        };
        // The item must be an archive torch.load can open: a broken frame fails the load whatever
        // the value is (a legacy pickle, first byte PROTO, has no frame to check).
        if bytes.first() != Some(&opcodes::PROTO) {
            crate::zip::read_entries(bytes).map_err(|e| self.placed(e, item, zstd))?;
        }
        // A value that is not plain data (a custom object) is still carried byte for byte.
        let value = torch_save::read(bytes)
            .ok()
            .and_then(|a| match a.leaves.as_slice() {
                [(key, Leaf::Value(v))] if key.is_empty() => Some(v.clone()),
                _ => None,
            });
        let blob = Blob {
            file: self.maps[item.file as usize].0.to_path_buf(),
            offset: item.offset,
            length: item.length,
            zstd,
        };
        Ok((blob, value))
    }
}

/// Average item size up to which a file's pages are all mapped at once ([`map_file`]).
const POPULATE_ITEM_BYTES: u64 = 64 << 10;

/// Map one file named by the metadata, checking first that it lies inside the checkpoint.
///
/// A file of `items` small items (a rank file of a checkpoint saved on many ranks: thousands of
/// items of a few kilobytes) has framing on every page, all of which is read; its pages are
/// mapped in one go rather than faulted in one by one (about a tenth less CPU time for a
/// consolidation of a million pieces, measured on a busy machine). Files of large items are left to fault: only their framing is read
/// here, and reading all of them now would read the data twice.
fn map_file(dir: &Path, name: &str, items: u64) -> Result<Input> {
    let path = dir.join(safe_relative_path(name)?);
    let missing =
        |e: Error| e.hint("a rank's file is missing: was the checkpoint copied completely?");
    let len = match storage::stat(&path).map_err(missing)? {
        Some(Stat::File(len)) => len,
        _ => {
            return Err(missing(Error::io(
                &path,
                std::io::Error::from(std::io::ErrorKind::NotFound),
            )))
        }
    };
    let access = if len <= items.saturating_mul(POPULATE_ITEM_BYTES) {
        Access::MapPopulated
    } else {
        Access::Map
    };
    Input::open(&path, access).map_err(missing)
}

/// The one tensor a DCP item's archive holds and its storage record, checked against the chunk
/// the metadata declares (`dtype`, `sizes`). The caller places errors (file, offset).
fn saved_chunk<'a>(
    archive: &'a torch_save::Archive,
    dtype: DType,
    sizes: &[u64],
) -> Result<(&'a torch_save::SavedTensor, &'a crate::zip::ZipEntry)> {
    let saved = match archive.leaves.as_slice() {
        [(key, Leaf::Tensor(t))] if key.is_empty() => t,
        _ => return Err(Error::invalid("item is not a single saved tensor")),
    };
    if saved.dtype != dtype || saved.shape != sizes {
        return Err(Error::invalid(format!(
            "item holds {} {:?} but the metadata says {} {:?}",
            saved.dtype, saved.shape, dtype, sizes
        )));
    }
    let entry = archive.storage(&saved.storage_key).ok_or_else(|| {
        Error::invalid(format!(
            "item has no storage record `{}`",
            saved.storage_key
        ))
    })?;
    if entry.deflated.is_some() {
        return Err(Error::invalid(format!(
            "item's storage record `{}` is deflated, which ckpt reads in torch.save files but not inside DCP items (torch's writer never deflates them)",
            saved.storage_key
        )));
    }
    Ok((saved, entry))
}

/// The elements of a chunk left unopened ([`Encoding::Saved`]), in row-major order, from the
/// whole bytes of its item: the item is read and checked as [`read`] checks an item it opens,
/// against the chunk the metadata declares (`dtype`, `numel` elements of a shape whose
/// [`crate::model::shape_key`] is `shape`).
pub fn saved_elements(item: &[u8], dtype: DType, numel: u64, shape: u64) -> Result<Vec<u8>> {
    let archive = torch_save::read_cached(item)?;
    let sizes = match archive.leaves.as_slice() {
        [(key, Leaf::Tensor(t))] if key.is_empty() => t.shape.clone(),
        _ => return Err(Error::invalid("item is not a single saved tensor")),
    };
    if crate::model::shape_key(&sizes) != shape || crate::model::numel(&sizes) != Some(numel) {
        return Err(Error::invalid(format!(
            "item holds {} {sizes:?} but the metadata says a chunk of another shape ({numel} elements)",
            dtype
        )));
    }
    let (saved, entry) = saved_chunk(&archive, dtype, &sizes)?;
    let strides = crate::model::contiguous_strides(&sizes);
    let elem = dtype.size() as u64;
    let base = entry.data_offset + saved.storage_offset * elem;
    let element = |i: u64| -> Option<&[u8]> {
        let at = usize::try_from(base.checked_add(i.checked_mul(elem)?)?).ok()?;
        item.get(at..at.checked_add(elem as usize)?)
    };
    let outside = || Error::invalid("the item's tensor lies outside its storage record");
    let len = numel
        .checked_mul(elem)
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(outside)?;
    if saved.strides == strides {
        let start = usize::try_from(base).map_err(|_| outside())?;
        return item
            .get(start..start.checked_add(len).ok_or_else(outside)?)
            .map(<[u8]>::to_vec)
            .ok_or_else(outside);
    }
    // A view saved with its own strides (a transposed weight): gathered element by element,
    // which for an item of at most a block is quick.
    let mut out = Vec::with_capacity(len);
    let mut idx = vec![0u64; saved.shape.len()];
    for _ in 0..numel {
        let at: u64 = idx.iter().zip(&saved.strides).map(|(i, s)| i * s).sum();
        out.extend_from_slice(element(at).ok_or_else(outside)?);
        for d in (0..idx.len()).rev() {
            idx[d] += 1;
            if idx[d] < saved.shape[d] {
                break;
            }
            idx[d] = 0;
        }
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

/// The first `len` bytes of a zstd item (fewer if it is shorter).
pub fn zstd_prefix(item: &[u8], len: u64) -> Result<Vec<u8>> {
    use std::io::Read;
    let fail = |e: std::io::Error| Error::invalid(format!("cannot decompress zstd item: {e}"));
    let decoder = zstd::stream::read::Decoder::new(item).map_err(fail)?;
    let mut out = Vec::new();
    decoder.take(len).read_to_end(&mut out).map_err(fail)?;
    Ok(out)
}

/// A whole zstd item, refused when it decompresses to more than `limit` bytes.
pub fn zstd_decompress(item: &[u8], limit: u64) -> Result<Vec<u8>> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use metadata::{Chunk, MetadataIndex, Sink, StorageInfo};

    fn record(fqn: &str, offset: Option<&[u64]>, at: u64) -> (MetadataIndex, StorageInfo) {
        (
            MetadataIndex {
                fqn: fqn.into(),
                offset: offset.map(<[u64]>::to_vec),
                index: None,
            },
            StorageInfo {
                relative_path: format!("__{}_0.distcp", at % 2),
                offset: at,
                length: 1,
                transforms: Vec::new(),
            },
        )
    }

    fn tensor(fqn: &str, rows: &[u64]) -> DcpEntry {
        DcpEntry::Tensor {
            fqn: fqn.into(),
            dtype: DType::F32,
            size: vec![6, 2],
            chunks: rows
                .iter()
                .map(|&r| Chunk {
                    offsets: vec![r, 0],
                    sizes: vec![2, 2],
                })
                .collect(),
        }
    }

    /// Where the builder put the item of each chunk of `fqn` (its offsets), or of the value.
    fn placed(b: &Builder, fqn: &str) -> Vec<Option<u64>> {
        match &b.slots[b.by_fqn[fqn]] {
            Slot::Tensor(t) => t.items.iter().map(|i| i.map(|i| i.offset)).collect(),
            Slot::Bytes { item, .. } => vec![item.map(|i| i.offset)],
            Slot::Unsupported { .. } => Vec::new(),
        }
    }

    #[test]
    fn the_builder_puts_each_record_on_its_chunks_and_the_last_of_a_repeated_key_wins() {
        let mut b = Builder::default();
        // Chunks out of order, one listed twice (a replica): both read the one record.
        b.entry(tensor("w", &[4, 0, 2, 0])).unwrap();
        b.entry(DcpEntry::Bytes { fqn: "v".into() }).unwrap();
        for (index, info) in [
            record("w", Some(&[4, 0]), 10),
            record("w", Some(&[0, 0]), 21),
            record("v", None, 30),
            record("w", Some(&[0, 0]), 51),
            // Records no entry reads are ignored, as torch ignores them.
            record("w", Some(&[1, 0]), 60),
            record("w", None, 70),
            record("x", Some(&[0, 0]), 80),
        ] {
            b.storage(index, info).unwrap();
        }
        b.apply_pending();
        assert_eq!(
            placed(&b, "w"),
            vec![Some(10), Some(51), None, Some(51)],
            "the later record wins, as in a dict"
        );
        assert_eq!(placed(&b, "v"), vec![Some(30)]);
        assert_eq!(b.file_names, ["__0_0.distcp", "__1_0.distcp"]);
    }

    #[test]
    fn index_hints_are_used_only_when_they_name_a_chunk_at_the_records_offsets() {
        let mut b = Builder::default();
        b.entry(tensor("w", &[0, 2, 4])).unwrap();
        b.entry(tensor("r", &[0, 2, 0])).unwrap();
        let hinted = |fqn: &str, row: u64, hint: i64, at: u64| {
            let (mut index, info) = record(fqn, Some(&[row, 0]), at);
            index.index = Some(hint);
            (index, info)
        };
        for (index, info) in [
            hinted("w", 0, 0, 10),
            // A wrong hint, and one past the end: found by offsets all the same.
            hinted("w", 2, 0, 20),
            hinted("w", 4, 9, 30),
            // With a replica, a hint naming one chunk still reaches both.
            hinted("r", 0, 0, 40),
            hinted("r", 2, 1, 50),
        ] {
            b.storage(index, info).unwrap();
        }
        assert_eq!(placed(&b, "w"), vec![Some(10), Some(20), Some(30)]);
        assert_eq!(placed(&b, "r"), vec![Some(40), Some(50), Some(40)]);
    }

    #[test]
    fn records_before_their_entry_are_placed_at_the_end_and_a_repeated_entry_replaces() {
        let mut b = Builder::default();
        let (index, info) = record("w", Some(&[2, 0]), 40);
        b.storage(index, info).unwrap();
        b.entry(tensor("w", &[0])).unwrap();
        b.entry(DcpEntry::Bytes { fqn: "v".into() }).unwrap();
        // The same fqn again: first place, last value.
        b.entry(tensor("w", &[0, 2, 4])).unwrap();
        b.apply_pending();
        assert_eq!(b.slots.len(), 2);
        assert_eq!(placed(&b, "w"), vec![None, Some(40), None]);
    }
}
