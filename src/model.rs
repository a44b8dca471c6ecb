//! The one format-free model of a checkpoint.
//!
//! Every reader produces a [`Checkpoint`]; the planner and every writer consume one. A tensor is a
//! name, a dtype, a global shape and the [`Piece`]s that hold its elements: each piece is a box of the
//! global tensor (offsets + sizes, DCP's `ChunkStorageMetadata`) plus where its bytes live
//! ([`DataRef`]). A FULL checkpoint is the special case of one piece per tensor covering all of it.
//! A tensor's pieces are kept as columns ([`Pieces`]): a checkpoint saved on 1024 ranks has
//! millions, and a struct of vectors per piece would cost hundreds of bytes each.
//! Non-tensor entries (train state, optimizer param groups) are kept as data, never executed.

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::dtype::DType;
use crate::error::{Error, Result};
pub use crate::geometry::{contiguous_strides, is_contiguous, numel};
use crate::pickle::Value;

/// On-disk layouts ckpt reads and writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// One `*.safetensors` file.
    Safetensors,
    /// Hugging Face split files with `model.safetensors.index.json`.
    SafetensorsIndex,
    /// A PyTorch Distributed Checkpoint directory: `.metadata` + `__{rank}_{i}.distcp`.
    Dcp,
    /// DCP's Hugging Face flavour: per-rank safetensors with `DCP_SHARDING_INFO`.
    DcpSafetensors,
    /// A `torch.save` ZIP archive (`pytorch_model.bin`, `*.pt`).
    TorchSave,
    /// One `torch.save` file per rank of DTensor, ShardedTensor and plain values
    /// (`model_world_size_4_rank_0.pt`, `rank0.pt`).
    PerRankTorchSave,
    /// Megatron-core `dist_checkpointing` with the `torch_dist` backend: a DCP directory plus
    /// `metadata.json` and `common.pt`.
    MegatronTorchDist,
    /// DeepSpeed's `save_checkpoint`: under ZeRO stages 1-3 (`partitioned`) model and optimizer
    /// states per data-parallel rank; under stage 0, one file of the whole model and optimizer,
    /// and a Universal Checkpoint (`ds_to_universal`), each parameter whole in files of its own.
    DeepSpeedZero { partitioned: bool },
}

impl Format {
    /// Stable name used in `--json` output and messages.
    pub fn name(self) -> &'static str {
        match self {
            Format::Safetensors => "safetensors",
            Format::SafetensorsIndex => "safetensors-index",
            Format::Dcp => "dcp",
            Format::DcpSafetensors => "dcp-safetensors",
            Format::TorchSave => "torch-save",
            Format::PerRankTorchSave => "per-rank-torch-save",
            Format::MegatronTorchDist => "megatron-torch-dist",
            Format::DeepSpeedZero { .. } => "deepspeed-zero",
        }
    }

    pub fn state_dict_type(self) -> StateDictType {
        match self {
            Format::Dcp
            | Format::DcpSafetensors
            | Format::PerRankTorchSave
            | Format::MegatronTorchDist
            | Format::DeepSpeedZero { partitioned: true } => StateDictType::Sharded,
            Format::Safetensors
            | Format::SafetensorsIndex
            | Format::TorchSave
            | Format::DeepSpeedZero { partitioned: false } => StateDictType::Full,
        }
    }
}

/// FSDP's `StateDictType` as far as the files show it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StateDictType {
    Full,
    Sharded,
    /// FSDP1's `LOCAL_STATE_DICT`: each rank's slice of every unit's flat parameter, with neither
    /// names nor shapes.
    Local,
}

impl StateDictType {
    pub fn name(self) -> &'static str {
        match self {
            StateDictType::Full => "FULL_STATE_DICT",
            StateDictType::Sharded => "SHARDED_STATE_DICT",
            StateDictType::Local => "LOCAL_STATE_DICT",
        }
    }
}

/// A whole checkpoint, as read from disk.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    /// The directory that every [`DataRef::file`] is relative to.
    pub root: PathBuf,
    pub format: Format,
    /// Number of ranks that wrote it, where the files show it.
    pub world_size: Option<usize>,
    pub tensors: Vec<Tensor>,
    pub values: Vec<NonTensor>,
    /// Tensors of a dtype ckpt cannot carry, by name: a selection may leave them out before
    /// [`Checkpoint::check_supported`] refuses the checkpoint for them.
    pub unsupported: Vec<Unsupported>,
    /// What the layout says of itself beyond the tensors, for `inspect` (DeepSpeed's ZeRO stage
    /// and tag): (what, value).
    pub details: Vec<(String, String)>,
}

/// A tensor whose dtype ckpt does not support (`torch.bits8`, safetensors `F4`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unsupported {
    pub name: String,
    /// The dtype as the file names it: `torch.bits8`, `F4`.
    pub dtype: String,
    /// The file that names it, relative to [`Checkpoint::root`].
    pub file: PathBuf,
}

/// One logical tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    /// Flattened key, e.g. `model.layers.0.attn.wq.weight` or `optim.state.x.exp_avg`.
    pub name: String,
    /// How the flattened key nests in the original state dict (DCP `planner_data`); empty when the
    /// source never said, in which case it is `[name]`.
    pub key_path: Vec<KeyPart>,
    pub dtype: DType,
    /// Global shape; empty for a 0-dim tensor.
    pub shape: Vec<u64>,
    pub pieces: Pieces,
}

/// A box of a tensor and where its bytes are: what a reader adds to [`Pieces`] and what
/// [`PieceRef::to_piece`] gives back.
#[derive(Clone, Debug, PartialEq)]
pub struct Piece {
    /// Start of the box in each dimension of the global tensor.
    pub offsets: Vec<u64>,
    /// Extent of the box in each dimension.
    pub sizes: Vec<u64>,
    pub data: DataRef,
}

/// Where a piece's elements live.
#[derive(Clone, Debug, PartialEq)]
pub struct DataRef {
    /// File relative to [`Checkpoint::root`]; shared by the pieces of one file (a DCP rank file
    /// holds thousands).
    pub file: Arc<Path>,
    /// Byte offset of the piece's first element, in the file (or in the decoded item, see `encoding`).
    pub offset: u64,
    /// Stride of each dimension in elements. Row-major contiguous for all but torch.save views.
    pub strides: Vec<u64>,
    pub encoding: Encoding,
}

/// How the bytes named by a [`DataRef`] are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Encoding {
    /// Plain bytes at `DataRef::offset` in the file.
    Raw,
    /// The DCP item at `item_offset..item_offset+item_length` of the file is a zstd stream
    /// (`stream.zstd/1`); `DataRef::offset` is relative to the decompressed item.
    Zstd { item_offset: u64, item_length: u64 },
    /// The ZIP record at `item_offset..item_offset+item_length` of the file is a raw deflate
    /// stream (a deflated torch.save record); `DataRef::offset` is relative to the inflated record.
    Deflate { item_offset: u64, item_length: u64 },
    /// The DCP item at `item_offset..item_offset+item_length` of the file is a torch.save archive
    /// of a chunk, not opened yet: `DataRef::offset` is relative to the chunk's elements in
    /// row-major order, which the executor finds (and checks against the chunk the metadata
    /// declares: `numel` elements of a shape whose [`shape_key`] is `shape`) when it reads the
    /// item. Small items in object storage are left this way, so that their bytes are fetched
    /// once, when copied, rather than their framing first. A piece may be a part of the chunk
    /// (an FSDP1 LOCAL parameter cut from a flat parameter), with strides of its own.
    Saved {
        item_offset: u64,
        item_length: u64,
        numel: u64,
        shape: u64,
    },
    /// No bytes stored: every element is zero. Not a reader's: what a writer adds as padding
    /// (DeepSpeed's partitions padded to equal sizes), planned as a fill like any other.
    Zeros,
}

/// The pieces of one tensor, as columns: per piece its box (offsets then sizes), its file and the
/// byte offset of its first element, about 56 bytes for a 2-D piece. Strides and encodings take
/// room only when some piece is not row-major contiguous or not raw, which in DCP and safetensors
/// none is.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Pieces {
    ndim: usize,
    /// `2 * ndim` values per piece: its offsets, then its sizes.
    boxes: Vec<u64>,
    files: Vec<Arc<Path>>,
    /// [`DataRef::offset`] of each piece.
    offsets: Vec<u64>,
    /// `ndim` values per piece, or `None` while every piece is row-major contiguous.
    strides: Option<Vec<u64>>,
    /// One per piece, or `None` while every piece is [`Encoding::Raw`].
    encodings: Option<Vec<Encoding>>,
    /// Set when the tensor's elements are computed from the pieces' rather than copied.
    computed: Option<Computed>,
}

/// How a tensor's elements are computed from the elements its pieces hold, box by box: a LoRA
/// fold ([`crate::transform::lora`]) computes a merged weight from its base weight's pieces.
///
/// The executor gathers a box of the pieces' elements as it would copy them (in the tensor's
/// dtype, from files, maps or objects alike) and hands them to [`Compute::compute`] instead of
/// writing them as they are. Computing where the bytes are copied writes each merged byte once
/// and keeps memory to one copy block per worker; the planner still does no I/O and plans the
/// tensor like any other.
pub trait Compute: Send + Sync {
    /// Fill `dst` (the box at `start` of `sizes` in the tensor, row-major in `dst_dtype`) from
    /// `src`, the same box of the pieces' elements (row-major in the tensor's dtype).
    fn compute(
        &self,
        start: &[u64],
        sizes: &[u64],
        src: &[u8],
        dst: &mut [u8],
        dst_dtype: DType,
    ) -> Result<()>;

    /// The dtype the tensor is written as whatever `--dtype` says, when the computation fixes
    /// it (an FP8 weight and its `F32` scales); `None` follows the cast like any tensor.
    fn out_dtype(&self) -> Option<DType> {
        None
    }

    /// Boxes handed to [`Compute::compute`] start and end on multiples of this many rows of
    /// the region (or at its end), even past the executor's block size: a blockwise quantizer
    /// computes each 128-row band's scales from the rows the box holds.
    fn block_rows(&self) -> u64 {
        1
    }
}

/// A shared [`Compute`]; equal only to itself.
#[derive(Clone)]
pub struct Computed(pub Arc<dyn Compute>);

impl PartialEq for Computed {
    fn eq(&self, other: &Computed) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl std::fmt::Debug for Computed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Computed")
    }
}

/// One piece of a [`Pieces`].
#[derive(Clone, Copy, Debug)]
pub struct PieceRef<'a> {
    pieces: &'a Pieces,
    k: usize,
}

impl Pieces {
    /// No pieces yet, of a tensor with `ndim` dimensions.
    pub fn new(ndim: usize) -> Pieces {
        Pieces {
            ndim,
            ..Pieces::default()
        }
    }

    /// Pieces of a tensor with `ndim` dimensions, each of which must have as many.
    pub fn from_vec(ndim: usize, pieces: Vec<Piece>) -> Result<Pieces> {
        let mut out = Pieces::new(ndim);
        out.reserve(pieces.len());
        for p in pieces {
            out.push(p)?;
        }
        Ok(out)
    }

    pub fn ndim(&self) -> usize {
        self.ndim
    }

    pub fn len(&self) -> usize {
        self.files.len()
    }

    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }

    pub fn reserve(&mut self, additional: usize) {
        self.boxes.reserve(additional * 2 * self.ndim);
        self.files.reserve(additional);
        self.offsets.reserve(additional);
    }

    /// The tensor's elements are computed by `c` from the pieces' elements.
    pub fn set_computed(&mut self, c: Computed) {
        self.computed = Some(c);
    }

    /// How the tensor's elements are computed from the pieces', if they are not copied.
    pub fn computed(&self) -> Option<&Computed> {
        self.computed.as_ref()
    }

    /// The one piece of a tensor stored whole (or of a view of it), with its dims.
    pub fn single(piece: Piece) -> Result<Pieces> {
        Pieces::from_vec(piece.sizes.len(), vec![piece])
    }

    /// Add a piece, which must have [`Pieces::ndim`] dims in its offsets, sizes and strides.
    pub fn push(&mut self, piece: Piece) -> Result<()> {
        let Piece {
            offsets,
            sizes,
            data,
        } = piece;
        self.push_parts(
            &offsets,
            &sizes,
            data.file,
            data.offset,
            &data.strides,
            data.encoding,
        )
    }

    /// [`Pieces::push`] of a piece given by its parts.
    pub fn push_parts(
        &mut self,
        offsets: &[u64],
        sizes: &[u64],
        file: Arc<Path>,
        offset: u64,
        strides: &[u64],
        encoding: Encoding,
    ) -> Result<()> {
        let n = self.ndim;
        if offsets.len() != n || sizes.len() != n || strides.len() != n {
            return Err(Error::invalid(format!(
                "a piece at offsets {offsets:?} with sizes {sizes:?} and strides {strides:?} \
                 does not have the tensor's {n} dims"
            ))
            .file(&file)
            .at(offset));
        }
        let k = self.len();
        if self.strides.is_none() && !is_contiguous(sizes, strides) {
            let before = (0..k).flat_map(|j| contiguous_strides(self.get(j).sizes()));
            self.strides = Some(before.collect());
        }
        if let Some(column) = &mut self.strides {
            column.extend_from_slice(strides);
        }
        if self.encodings.is_none() && encoding != Encoding::Raw {
            self.encodings = Some(vec![Encoding::Raw; k]);
        }
        if let Some(column) = &mut self.encodings {
            column.push(encoding);
        }
        self.boxes.extend_from_slice(offsets);
        self.boxes.extend_from_slice(sizes);
        self.files.push(file);
        self.offsets.push(offset);
        Ok(())
    }

    /// Piece `k`; panics past the end, like indexing a slice.
    pub fn get(&self, k: usize) -> PieceRef<'_> {
        assert!(k < self.len(), "piece {k} of {}", self.len());
        PieceRef { pieces: self, k }
    }

    pub fn iter(&self) -> impl ExactSizeIterator<Item = PieceRef<'_>> + '_ {
        (0..self.len()).map(move |k| PieceRef { pieces: self, k })
    }
}

impl<'a> PieceRef<'a> {
    /// Start of the box in each dimension of the global tensor.
    pub fn offsets(&self) -> &'a [u64] {
        let n = self.pieces.ndim;
        &self.pieces.boxes[2 * n * self.k..2 * n * self.k + n]
    }

    /// Extent of the box in each dimension.
    pub fn sizes(&self) -> &'a [u64] {
        let n = self.pieces.ndim;
        &self.pieces.boxes[2 * n * self.k + n..2 * n * (self.k + 1)]
    }

    /// [`DataRef::file`]
    pub fn file(&self) -> &'a Arc<Path> {
        &self.pieces.files[self.k]
    }

    /// [`DataRef::offset`]
    pub fn offset(&self) -> u64 {
        self.pieces.offsets[self.k]
    }

    /// [`DataRef::strides`]
    pub fn strides(&self) -> Cow<'a, [u64]> {
        let n = self.pieces.ndim;
        match &self.pieces.strides {
            Some(column) => Cow::Borrowed(&column[n * self.k..n * (self.k + 1)]),
            None => Cow::Owned(contiguous_strides(self.sizes())),
        }
    }

    /// [`DataRef::encoding`]
    pub fn encoding(&self) -> Encoding {
        match &self.pieces.encodings {
            Some(column) => column[self.k],
            None => Encoding::Raw,
        }
    }

    pub fn to_piece(&self) -> Piece {
        Piece {
            offsets: self.offsets().to_vec(),
            sizes: self.sizes().to_vec(),
            data: DataRef {
                file: Arc::clone(self.file()),
                offset: self.offset(),
                strides: self.strides().into_owned(),
                encoding: self.encoding(),
            },
        }
    }
}

/// One step of a nested state-dict key.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum KeyPart {
    /// A string dict key.
    Key(String),
    /// A list index (`optim.param_groups.0`). DCP's `planner_data` records every int step as
    /// one, and `dcp_to_torch_save` rebuilds lists from them.
    Index(i64),
    /// An int dict key, as torch.save'd optimizer state has (`state: {0: {...}}`).
    IntKey(i64),
}

impl KeyPart {
    /// The step as it appears in a flattened name.
    pub fn as_name(&self) -> String {
        match self {
            KeyPart::Key(k) => k.clone(),
            KeyPart::Index(i) | KeyPart::IntKey(i) => i.to_string(),
        }
    }

    /// DCP's flattening of a nested key: its steps joined with dots
    /// (`optim.param_groups.0.lr`).
    pub fn flat_name(path: &[KeyPart]) -> String {
        path.iter()
            .map(KeyPart::as_name)
            .collect::<Vec<_>>()
            .join(".")
    }
}

/// A non-tensor entry (`BytesStorageMetadata` in DCP, plain data in torch.save).
#[derive(Clone, Debug, PartialEq)]
pub struct NonTensor {
    pub name: String,
    pub key_path: Vec<KeyPart>,
    /// The value as a data-only pickle tree, when ckpt could read it.
    pub value: Option<Value>,
    /// The original serialized bytes (a torch.save archive in DCP), carried through byte for byte.
    pub raw: Option<Blob>,
}

/// A byte range of a file in the checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Blob {
    pub file: PathBuf,
    pub offset: u64,
    pub length: u64,
    /// The bytes are a zstd stream (DCP's `stream.zstd/1` transform).
    pub zstd: bool,
}

impl Tensor {
    /// Number of elements, or `None` on overflow.
    pub fn numel(&self) -> Option<u64> {
        numel(&self.shape)
    }

    /// Bytes of the whole logical tensor, or `None` on overflow.
    pub fn nbytes(&self) -> Option<u64> {
        self.numel()?.checked_mul(self.dtype.size() as u64)
    }

    /// The nesting to record for this tensor: its `key_path`, or just its name.
    pub fn effective_key_path(&self) -> Vec<KeyPart> {
        effective_key_path(&self.name, &self.key_path)
    }
}

impl NonTensor {
    pub fn effective_key_path(&self) -> Vec<KeyPart> {
        effective_key_path(&self.name, &self.key_path)
    }
}

fn effective_key_path(name: &str, path: &[KeyPart]) -> Vec<KeyPart> {
    if path.is_empty() {
        vec![KeyPart::Key(name.to_string())]
    } else {
        path.to_vec()
    }
}

/// A shape as [`Encoding::Saved`] keeps it: a hash (an encoding is a few words, copied by value).
pub fn shape_key(shape: &[u64]) -> u64 {
    let bytes: Vec<u8> = shape.iter().flat_map(|d| d.to_le_bytes()).collect();
    xxhash_rust::xxh3::xxh3_64(&bytes)
}

/// The name FSDP1 gives a unit's flattened parameters, after the unit's prefix: an FSDP1
/// `LOCAL_STATE_DICT` checkpoint holds these instead of the model's parameters (see
/// `crate::transform::fsdp_local`).
pub const FLAT_PARAM: &str = "_flat_param";

/// True for `_flat_param` and `prefix._flat_param`.
pub fn is_flat_param(name: &str) -> bool {
    name == FLAT_PARAM || name.ends_with("._flat_param")
}

/// The hint every message about an FSDP1 LOCAL checkpoint's missing names and shapes ends with.
pub const SHAPES_HINT: &str = "pass --shapes-from REF: a FULL torch.save of model.state_dict(), a JSON list [[name, shape], ...] in model.named_parameters() order, or a SHARDED checkpoint of the same model";

impl Checkpoint {
    /// Absolute path of a file named by a [`DataRef`] or [`Blob`].
    pub fn path_of(&self, file: &Path) -> PathBuf {
        self.root.join(file)
    }

    /// Refuse a checkpoint that still holds a tensor of an unsupported dtype, naming it (and the
    /// others, up to a few) with the flag that leaves them out, or FSDP1 LOCAL flat parameters
    /// whose names and shapes were not supplied.
    /// The FSDP1 LOCAL flat parameters not resolved to the model's parameters yet (none for any
    /// other checkpoint).
    pub fn flat_params(&self) -> Vec<&Tensor> {
        self.tensors
            .iter()
            .filter(|t| is_flat_param(&t.name) && t.shape.len() == 1)
            .collect()
    }

    /// What FSDP `StateDictType` the files show: an FSDP1 LOCAL checkpoint whose flat parameters
    /// are still there is [`StateDictType::Local`] whatever its container.
    pub fn state_dict_type(&self) -> StateDictType {
        if self.flat_params().is_empty() {
            self.format.state_dict_type()
        } else {
            StateDictType::Local
        }
    }

    /// Refuse a LOCAL checkpoint whose flat parameters were not resolved: consolidating them
    /// would write FSDP's internal buffers, not the model.
    fn check_resolved(&self) -> Result<()> {
        let flats = self.flat_params();
        let Some(first) = flats.first() else {
            return Ok(());
        };
        let names: Vec<String> = flats
            .iter()
            .take(4)
            .map(|t| format!("`{}`", t.name))
            .collect();
        let more = if flats.len() > 4 { ", ..." } else { "" };
        Err(Error::usage(format!(
            "this is an FSDP1 LOCAL_STATE_DICT checkpoint: {} flat parameter{} ({}{more}) hold the model's parameters flattened, and their names and shapes are not in the files",
            flats.len(),
            if flats.len() == 1 { "" } else { "s" },
            names.join(", ")
        ))
        .file(&self.root)
        .tensor(&first.name)
        .hint(SHAPES_HINT))
    }

    pub fn check_supported(&self) -> Result<()> {
        self.check_resolved()?;
        let Some(first) = self.unsupported.first() else {
            return Ok(());
        };
        let hint = match self.unsupported.len() {
            1 => format!(
                "consolidate and reshard leave it out with --exclude '{}'",
                first.name
            ),
            n => {
                let names: Vec<&str> = self
                    .unsupported
                    .iter()
                    .take(5)
                    .map(|u| u.name.as_str())
                    .collect();
                let more = if n > 5 { ", ..." } else { "" };
                format!(
                    "{n} tensors have dtypes ckpt does not support ({}{more}); consolidate and reshard leave them out with --exclude",
                    names.join(", ")
                )
            }
        };
        Err(
            Error::invalid(format!("dtype `{}` is not supported by ckpt", first.dtype))
                .file(self.path_of(&first.file))
                .tensor(&first.name)
                .hint(hint),
        )
    }

    /// Sum of the logical bytes of every tensor (saturating).
    pub fn total_bytes(&self) -> u64 {
        self.tensors
            .iter()
            .map(|t| t.nbytes().unwrap_or(u64::MAX))
            .fold(0u64, |a, b| a.saturating_add(b))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strides_are_row_major() {
        assert_eq!(contiguous_strides(&[2, 3, 4]), vec![12, 4, 1]);
        assert_eq!(contiguous_strides(&[]), Vec::<u64>::new());
        assert_eq!(numel(&[]), Some(1));
        assert_eq!(numel(&[3, 0]), Some(0));
        assert_eq!(numel(&[u64::MAX, 2]), None);
        for sizes in [&[2, 3, 4][..], &[], &[5], &[0, 3], &[u64::MAX, 2, 2]] {
            assert!(
                is_contiguous(sizes, &contiguous_strides(sizes)),
                "{sizes:?}"
            );
        }
        assert!(!is_contiguous(&[2, 3], &[1, 2]));
        assert!(!is_contiguous(&[2, 3], &[3]));
    }

    fn piece(offsets: &[u64], sizes: &[u64], strides: &[u64], encoding: Encoding) -> Piece {
        Piece {
            offsets: offsets.to_vec(),
            sizes: sizes.to_vec(),
            data: DataRef {
                file: Path::new("f").into(),
                offset: offsets[0] * 100,
                strides: strides.to_vec(),
                encoding,
            },
        }
    }

    #[test]
    fn pieces_give_back_what_was_pushed_and_refuse_other_dims() {
        let zstd = Encoding::Zstd {
            item_offset: 7,
            item_length: 9,
        };
        let all = vec![
            piece(&[0, 0], &[2, 3], &[3, 1], Encoding::Raw),
            // a view: strides not its own row-major ones, from here on stored per piece
            piece(&[2, 0], &[2, 3], &[1, 2], Encoding::Raw),
            piece(&[4, 0], &[1, 3], &[3, 1], zstd),
            piece(&[5, 0], &[1, 3], &[3, 1], Encoding::Raw),
        ];
        // Every order, so a view or a zstd piece comes first, last and in between.
        for first in 0..all.len() {
            let mut order = all.clone();
            order.rotate_left(first);
            let mut pieces = Pieces::new(2);
            for p in order.clone() {
                pieces.push(p).unwrap();
            }
            assert_eq!(pieces.len(), 4);
            let back: Vec<Piece> = pieces.iter().map(|p| p.to_piece()).collect();
            assert_eq!(back, order);
        }
        let mut pieces = Pieces::from_vec(2, all).unwrap();
        assert!(pieces.push(piece(&[0], &[1], &[1], Encoding::Raw)).is_err());
        assert_eq!(pieces.len(), 4);
        let scalar = Pieces::single(piece_0d()).unwrap();
        assert_eq!(scalar.len(), 1);
        assert_eq!(scalar.get(0).sizes(), &[] as &[u64]);
    }

    fn piece_0d() -> Piece {
        Piece {
            offsets: Vec::new(),
            sizes: Vec::new(),
            data: DataRef {
                file: Path::new("f").into(),
                offset: 3,
                strides: Vec::new(),
                encoding: Encoding::Raw,
            },
        }
    }
}
