//! DCP's Hugging Face flavour: per-rank safetensors files whose `__metadata__` holds
//! `DCP_SHARDING_INFO` (`{fqn: {"saved_offsets": [..]}}`). No global shape is stored.
//!
//! `torch.distributed.checkpoint.save(..., storage_writer=HuggingFaceStorageWriter(path,
//! save_distributed=True, fqn_to_index_mapping=...))` makes each rank write its local pieces to
//! `shard-{rank+1:05}-model-{i:05}-of-{n:05}.safetensors` (a rank with nothing to write for file
//! `i` writes no such file). There is no `.metadata`: like torch's `HuggingFaceStorageReader`, the
//! reader infers each tensor's global shape as the largest `offset + size` over its pieces, so a
//! missing rank file would silently shrink a tensor; coverage is checked by the verifier, not here.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::formats::safetensors::{
    self, first_duplicate, python_json_string, Entries, DCP_SHARDING_INFO,
};
use crate::layout::{Found, Layout, Listing, ReadOptions};
use crate::model::{Checkpoint, Format, Piece, Pieces, Tensor, Unsupported};
use crate::storage;

/// `__metadata__` key torch writes with the value [`DCP_VERSION`].
const DCP_VERSION_KEY: &str = "DCP_VERSION";
/// `str(HF_DCP_VERSION)` in torch's `_hf_utils.py`.
const DCP_VERSION: &str = "1.0";

/// DCP's Hugging Face flavour: a directory with `shard-XXXXX-model-YYYYY-of-ZZZZZ.safetensors`
/// files and no `.metadata`.
pub struct DcpHf;

impl Layout for DcpHf {
    fn describe(&self) -> &'static str {
        "DCP safetensors shards (`shard-XXXXX-model-YYYYY-of-ZZZZZ.safetensors`)"
    }

    fn probe(&self, at: &Listing) -> Result<Option<Found>> {
        let Some(dir) = at.dir() else {
            return Ok(None);
        };
        let ours = at
            .files()
            .iter()
            .any(|e| parse_file_name(e.name()).is_some());
        Ok(ours.then(|| Found::at(dir)))
    }

    fn read(&self, found: &Found, _: &ReadOptions) -> Result<Checkpoint> {
        read(&found.path)
    }
}

/// The name torch gives the file of `rank` (0-based) for output file `index` (1-based) of
/// `count`: `shard-{rank+1:05}-model-{index:05}-of-{count:05}.safetensors`.
pub fn file_name(rank: usize, index: usize, count: usize) -> String {
    format!(
        "shard-{:05}-model-{index:05}-of-{count:05}.safetensors",
        rank.saturating_add(1)
    )
}

/// The `__metadata__` entries torch writes in each rank file, for the tensors of that file in
/// order, each with the offsets of its piece in the global tensor. `DCP_SHARDING_INFO` is
/// `json.dumps` output (Python spacing and escaping), as `FileSystemWriter` produces it.
pub fn sharding_metadata(pieces: &[(String, Vec<u64>)]) -> Vec<(String, String)> {
    let entries: Vec<String> = pieces
        .iter()
        .map(|(name, offsets)| {
            let offsets: Vec<String> = offsets.iter().map(|o| o.to_string()).collect();
            format!(
                "{}: {{\"saved_offsets\": [{}]}}",
                python_json_string(name),
                offsets.join(", ")
            )
        })
        .collect();
    vec![
        (
            DCP_SHARDING_INFO.to_string(),
            format!("{{{}}}", entries.join(", ")),
        ),
        (DCP_VERSION_KEY.to_string(), DCP_VERSION.to_string()),
        ("format".to_string(), "pt".to_string()),
    ]
}

/// A rank file's place in the checkpoint, parsed from its name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct ShardName {
    rank: usize,
    index: usize,
    count: usize,
}

/// Parse `shard-XXXXX-model-YYYYY-of-ZZZZZ.safetensors` strictly: each number exactly as torch's
/// `zfill(5)` writes it, a shard number of at least 1, and `1 <= index <= count`.
fn parse_file_name(name: &str) -> Option<ShardName> {
    let rest = name.strip_prefix("shard-")?.strip_suffix(".safetensors")?;
    let (shard, rest) = rest.split_once("-model-")?;
    let (index, count) = rest.split_once("-of-")?;
    let (shard, index, count) = (
        parse_number(shard)?,
        parse_number(index)?,
        parse_number(count)?,
    );
    if shard == 0 || index == 0 || index > count {
        return None;
    }
    Some(ShardName {
        rank: shard - 1,
        index,
        count,
    })
}

/// A zero-padded number, accepted only in its canonical `{:05}` spelling.
fn parse_number(s: &str) -> Option<usize> {
    if !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: usize = s.parse().ok()?;
    (format!("{n:05}") == s).then_some(n)
}

/// Offsets recorded in `DCP_SHARDING_INFO` for one tensor.
#[derive(serde::Deserialize)]
struct ShardingEntry {
    saved_offsets: Vec<u64>,
}

/// Read a directory of rank files as a sharded checkpoint.
pub fn read(dir: &Path) -> Result<Checkpoint> {
    if !storage::is_dir(dir) {
        return Err(Error::usage("not a directory").file(dir));
    }
    let files = list_files(dir)?;
    check_one_save(dir, &files)?;
    let mut gathered = Gathered::default();
    for (name, _) in &files {
        gathered.read_file(dir, name)?;
    }
    let Gathered {
        mut tensors,
        unsupported,
        ..
    } = gathered;
    set_global_shapes(dir, &mut tensors)?;

    let mut ranks: Vec<usize> = files.iter().map(|(_, s)| s.rank).collect();
    ranks.dedup();
    Ok(Checkpoint {
        root: dir.to_path_buf(),
        format: Format::DcpSafetensors,
        world_size: Some(ranks.len()),
        tensors,
        values: Vec::new(),
        unsupported,
        details: Vec::new(),
    })
}

/// An error unless `dir` holds rank files and they agree on the number of model files.
fn check_one_save(dir: &Path, files: &[(String, ShardName)]) -> Result<()> {
    let Some((first_name, first)) = files.first() else {
        return Err(Error::invalid(
            "directory has no `shard-XXXXX-model-YYYYY-of-ZZZZZ.safetensors` files",
        )
        .file(dir));
    };
    if let Some((name, _)) = files.iter().find(|(_, s)| s.count != first.count) {
        return Err(Error::invalid(format!(
            "`{name}` and `{first_name}` disagree on the number of model files"
        ))
        .file(dir)
        .hint("the directory mixes files from different saves"));
    }
    Ok(())
}

/// The tensors of the rank files read so far, each with every piece the files hold.
#[derive(Default)]
struct Gathered {
    tensors: Vec<Tensor>,
    /// Index of each tensor in `tensors`.
    by_name: HashMap<String, usize>,
    unsupported: Vec<Unsupported>,
}

impl Gathered {
    /// Add the pieces of rank file `name` in `dir`.
    fn read_file(&mut self, dir: &Path, name: &str) -> Result<()> {
        let path = dir.join(name);
        let header = safetensors::read_header(&path)?;
        let sharding = sharding_info(&header).map_err(|e| e.file(&path))?;
        let file: Arc<Path> = Path::new(name).into();
        // Every rank holds a piece of it: one entry per name is enough to refuse or drop it.
        for u in safetensors::unsupported(&header, &file) {
            if !self.unsupported.iter().any(|seen| seen.name == u.name) {
                self.unsupported.push(u);
            }
        }
        for t in &header.tensors {
            let at = header.data_start.saturating_add(t.begin);
            let offsets = saved_offsets(sharding.as_ref(), t, &path, at)?;
            let piece = safetensors::piece(t, offsets, &file, header.data_start);
            self.add(t, piece, &path, at)?;
        }
        Ok(())
    }

    /// Add `piece` of tensor `t` (at byte `at` of `path`): a new tensor, or one more piece of a
    /// tensor of the same dtype and rank.
    fn add(
        &mut self,
        t: &safetensors::HeaderTensor,
        piece: Piece,
        path: &Path,
        at: u64,
    ) -> Result<()> {
        let Some(tensor) = self
            .by_name
            .get(&t.name)
            .and_then(|&i| self.tensors.get_mut(i))
        else {
            self.by_name.insert(t.name.clone(), self.tensors.len());
            self.tensors.push(Tensor {
                name: t.name.clone(),
                key_path: Vec::new(),
                dtype: t.dtype,
                // Rank only, for now: `set_global_shapes` gives the extent, from all pieces.
                shape: vec![0; t.shape.len()],
                pieces: Pieces::from_vec(t.shape.len(), vec![piece])
                    .map_err(|e| e.tensor(&t.name))?,
            });
            return Ok(());
        };
        let other = tensor
            .pieces
            .iter()
            .next()
            .map(|p| p.file().display().to_string())
            .unwrap_or_default();
        if tensor.dtype != t.dtype {
            return Err(Error::invalid(format!(
                "piece is {} but the piece in `{other}` is {}",
                t.dtype, tensor.dtype
            ))
            .file(path)
            .tensor(&t.name)
            .at(at));
        }
        if tensor.shape.len() != t.shape.len() {
            return Err(Error::invalid(format!(
                "piece has {} dimensions but the piece in `{other}` has {}",
                t.shape.len(),
                tensor.shape.len()
            ))
            .file(path)
            .tensor(&t.name)
            .at(at));
        }
        tensor.pieces.push(piece).map_err(|e| e.tensor(&t.name))
    }
}

/// Where the piece of `t` (at byte `at` of `path`) lies in its global tensor, by the file's
/// `DCP_SHARDING_INFO` (`sharding`).
fn saved_offsets(
    sharding: Option<&HashMap<String, Vec<u64>>>,
    t: &safetensors::HeaderTensor,
    path: &Path,
    at: u64,
) -> Result<Vec<u64>> {
    let offsets = match sharding {
        // torch's reader takes offsets of zero only when a file has no sharding info at
        // all; a tensor left out of it is a KeyError there, and an error here.
        None => vec![0; t.shape.len()],
        Some(map) => match map.get(t.name.as_str()) {
            Some(offsets) => offsets.clone(),
            None => {
                return Err(Error::invalid(format!("tensor is missing from `{DCP_SHARDING_INFO}`"))
                    .file(path)
                    .tensor(&t.name)
                    .at(at)
                    .hint("its place in the global tensor is unknown; the file is corrupt or was not written by DCP"))
            }
        },
    };
    if offsets.len() != t.shape.len() {
        return Err(Error::invalid(format!(
            "`saved_offsets` {offsets:?} has {} dimensions, the tensor's shape {:?} has {}",
            offsets.len(),
            t.shape,
            t.shape.len()
        ))
        .file(path)
        .tensor(&t.name)
        .at(at));
    }
    Ok(offsets)
}

/// Each tensor's shape set to the largest `offset + size` over its pieces, as torch's
/// `HuggingFaceStorageReader` infers it.
fn set_global_shapes(dir: &Path, tensors: &mut [Tensor]) -> Result<()> {
    for tensor in tensors {
        for piece in tensor.pieces.iter() {
            for ((dim, &offset), &size) in tensor
                .shape
                .iter_mut()
                .zip(piece.offsets())
                .zip(piece.sizes())
            {
                let end = offset.checked_add(size).ok_or_else(|| {
                    Error::invalid(format!(
                        "`saved_offsets` {:?} overflow 64 bits",
                        piece.offsets()
                    ))
                    .file(dir.join(piece.file()))
                    .tensor(&tensor.name)
                })?;
                *dim = (*dim).max(end);
            }
        }
    }
    Ok(())
}

/// The rank files of `dir`, sorted by (rank, index). Any other `.safetensors` file is an error:
/// torch's reader would read it as part of the checkpoint, so leaving it out would change meaning.
fn list_files(dir: &Path) -> Result<Vec<(String, ShardName)>> {
    let mut files = Vec::new();
    for path in storage::list(dir)? {
        let Some(name) = path.file_name().map(|n| n.to_string_lossy().into_owned()) else {
            continue;
        };
        // Only names that could be ours are looked at: a stat per object costs a request.
        if !name.to_ascii_lowercase().ends_with(".safetensors") || !storage::is_file(&path) {
            continue;
        }
        match parse_file_name(&name) {
            Some(shard) => files.push((name, shard)),
            None if name.to_ascii_lowercase().ends_with(".safetensors") => {
                return Err(Error::invalid(
                    "file is not named `shard-XXXXX-model-YYYYY-of-ZZZZZ.safetensors` like the rest of this DCP checkpoint",
                )
                .file(path)
                .hint("move it out of the directory; torch would read it as part of the checkpoint"));
            }
            None => {}
        }
    }
    // Rank-major: file names sort the same way, so this is the order `ls` shows.
    files.sort_by_key(|(_, s)| (s.rank, s.index));
    Ok(files)
}

/// The file's `DCP_SHARDING_INFO` as tensor name → offsets, or `None` when it has none (torch then
/// places every tensor at offset zero).
fn sharding_info(header: &safetensors::Header) -> Result<Option<HashMap<String, Vec<u64>>>> {
    let Some(text) = header
        .metadata_value(DCP_SHARDING_INFO)
        .filter(|t| !t.is_empty())
    else {
        return Ok(None);
    };
    let entries: Entries<ShardingEntry> = serde_json::from_str(text).map_err(|e| {
        Error::invalid(format!(
            "`__metadata__` `{DCP_SHARDING_INFO}` is not a map of `saved_offsets`: {e}"
        ))
    })?;
    if let Some(dup) = first_duplicate(&entries.0) {
        return Err(
            Error::invalid(format!("`{DCP_SHARDING_INFO}` names this tensor twice")).tensor(dup),
        );
    }
    Ok(Some(
        entries
            .0
            .into_iter()
            .map(|(k, v)| (k, v.saved_offsets))
            .collect(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::error::ErrorKind;

    /// Write a rank file of zeroed tensors: (name, dtype, local shape, offsets).
    fn write_rank(dir: &Path, name: &str, tensors: &[(&str, DType, &[u64], &[u64])]) {
        let header: Vec<(String, DType, Vec<u64>)> = tensors
            .iter()
            .map(|(n, d, s, _)| (n.to_string(), *d, s.to_vec()))
            .collect();
        let offsets: Vec<(String, Vec<u64>)> = tensors
            .iter()
            .map(|(n, _, _, o)| (n.to_string(), o.to_vec()))
            .collect();
        write_with_metadata(dir, name, &header, &sharding_metadata(&offsets));
    }

    fn write_with_metadata(
        dir: &Path,
        name: &str,
        tensors: &[(String, DType, Vec<u64>)],
        meta: &[(String, String)],
    ) {
        let (mut bytes, ranges) = safetensors::header_bytes(tensors, meta);
        let len = bytes.len() + ranges.last().map_or(0, |r| r.1 as usize);
        bytes.resize(len, 0);
        std::fs::write(dir.join(name), bytes).unwrap();
    }

    /// The layout torch 2.15 wrote for 2 ranks (see the report): Shard(0) of a [5, 3] and a [1]
    /// tensor, Shard(1) of a [4, 5], over two model files.
    fn example() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        write_rank(
            d,
            &file_name(0, 1, 2),
            &[("a", DType::F32, &[3, 3], &[0, 0])],
        );
        write_rank(
            d,
            &file_name(0, 2, 2),
            &[
                ("d", DType::I64, &[1], &[0]),
                ("f", DType::F32, &[4, 3], &[0, 0]),
            ],
        );
        write_rank(
            d,
            &file_name(1, 1, 2),
            &[("a", DType::F32, &[2, 3], &[3, 0])],
        );
        // An empty piece, as torch writes for a rank past the end of a dimension.
        write_rank(
            d,
            &file_name(1, 2, 2),
            &[
                ("d", DType::I64, &[0], &[1]),
                ("f", DType::F32, &[4, 2], &[0, 3]),
            ],
        );
        std::fs::write(d.join("notes.txt"), "ignored").unwrap();
        dir
    }

    /// Whether the layout recognises the directory at `dir`.
    fn probes(dir: &Path) -> bool {
        DcpHf
            .probe(&crate::layout::Listing::of(dir).unwrap())
            .unwrap()
            .is_some()
    }

    #[test]
    fn names() {
        assert_eq!(
            file_name(0, 1, 2),
            "shard-00001-model-00001-of-00002.safetensors"
        );
        let parsed = parse_file_name("shard-00002-model-00003-of-00004.safetensors");
        assert_eq!(
            parsed,
            Some(ShardName {
                rank: 1,
                index: 3,
                count: 4
            })
        );
        assert_eq!(
            parse_file_name(&file_name(123455, 1, 1)).map(|s| s.rank),
            Some(123455)
        );
        for bad in [
            "shard-0001-model-00001-of-00001.safetensors",
            "shard-00000-model-00001-of-00001.safetensors",
            "shard-00001-model-00000-of-00001.safetensors",
            "shard-00001-model-00002-of-00001.safetensors",
            "shard-000001-model-00001-of-00001.safetensors",
            "shard-0000a-model-00001-of-00001.safetensors",
            "shard-+0001-model-00001-of-00001.safetensors",
            "shard-00001-model-00001-of-00001.safetensors.tmp",
            "model-00001-of-00001.safetensors",
        ] {
            assert_eq!(parse_file_name(bad), None, "{bad}");
        }
    }

    #[test]
    fn metadata_like_torch() {
        let meta = sharding_metadata(&[
            ("a.weight".to_string(), vec![3, 0]),
            ("c".to_string(), vec![]),
        ]);
        assert_eq!(
            meta,
            vec![
                (
                    "DCP_SHARDING_INFO".to_string(),
                    r#"{"a.weight": {"saved_offsets": [3, 0]}, "c": {"saved_offsets": []}}"#
                        .to_string()
                ),
                ("DCP_VERSION".to_string(), "1.0".to_string()),
                ("format".to_string(), "pt".to_string()),
            ]
        );
        assert_eq!(sharding_metadata(&[])[0].1, "{}");
    }

    #[test]
    fn reads_pieces_and_infers_shapes() {
        let dir = example();
        assert!(probes(dir.path()));
        let ckpt = read(dir.path()).unwrap();
        assert_eq!(ckpt.format, Format::DcpSafetensors);
        assert_eq!(ckpt.world_size, Some(2));
        let names: Vec<&str> = ckpt.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "d", "f"]);
        let a = &ckpt.tensors[0];
        assert_eq!(a.shape, vec![5, 3]);
        assert_eq!(a.pieces.len(), 2);
        let p = a.pieces.get(1);
        assert_eq!(p.offsets(), [3, 0]);
        assert_eq!(p.sizes(), [2, 3]);
        assert_eq!(&**p.file(), Path::new(&file_name(1, 1, 2)));
        assert_eq!(&*p.strides(), [3, 1]);
        let header = safetensors::read_header(&dir.path().join(file_name(1, 1, 2))).unwrap();
        assert_eq!(p.offset(), header.data_start);
        assert_eq!(ckpt.tensors[1].shape, vec![1]);
        assert_eq!(ckpt.tensors[1].pieces.get(1).sizes(), [0]);
        assert_eq!(ckpt.tensors[2].shape, vec![4, 5]);
    }

    #[test]
    fn no_sharding_info_means_zero_offsets() {
        let dir = tempfile::tempdir().unwrap();
        let t = vec![("w".to_string(), DType::F16, vec![2, 2])];
        write_with_metadata(
            dir.path(),
            &file_name(0, 1, 1),
            &t,
            &[("format".to_string(), "pt".to_string())],
        );
        let ckpt = read(dir.path()).unwrap();
        assert_eq!(ckpt.tensors[0].pieces.get(0).offsets(), [0, 0]);
        assert_eq!(ckpt.tensors[0].shape, vec![2, 2]);
        assert_eq!(ckpt.world_size, Some(1));
    }

    #[test]
    fn tensor_missing_from_sharding_info() {
        let dir = tempfile::tempdir().unwrap();
        let t = vec![
            ("w".to_string(), DType::F16, vec![2]),
            ("v".to_string(), DType::F16, vec![2]),
        ];
        let meta = sharding_metadata(&[("w".to_string(), vec![0])]);
        write_with_metadata(dir.path(), &file_name(0, 1, 1), &t, &meta);
        let err = read(dir.path()).unwrap_err();
        assert_eq!(err.tensor.as_deref(), Some("v"));
        assert!(
            err.message.contains("missing from `DCP_SHARDING_INFO`"),
            "{}",
            err.message
        );
    }

    #[test]
    fn inconsistent_pieces() {
        let dir = tempfile::tempdir().unwrap();
        write_rank(
            dir.path(),
            &file_name(0, 1, 1),
            &[("w", DType::F32, &[2], &[0])],
        );
        write_rank(
            dir.path(),
            &file_name(1, 1, 1),
            &[("w", DType::BF16, &[2], &[2])],
        );
        let err = read(dir.path()).unwrap_err();
        assert_eq!(err.tensor.as_deref(), Some("w"));
        assert!(
            err.message.contains("BF16") && err.message.contains("F32"),
            "{}",
            err.message
        );

        write_rank(
            dir.path(),
            &file_name(1, 1, 1),
            &[("w", DType::F32, &[2, 1], &[2, 0])],
        );
        assert!(read(dir.path()).unwrap_err().message.contains("dimensions"));

        write_rank(
            dir.path(),
            &file_name(1, 1, 1),
            &[("w", DType::F32, &[2], &[2, 0])],
        );
        assert!(read(dir.path())
            .unwrap_err()
            .message
            .contains("`saved_offsets`"));

        write_rank(
            dir.path(),
            &file_name(1, 1, 1),
            &[("w", DType::F32, &[2], &[u64::MAX])],
        );
        assert!(read(dir.path()).unwrap_err().message.contains("overflow"));
    }

    #[test]
    fn bad_sharding_info() {
        let dir = tempfile::tempdir().unwrap();
        let t = vec![("w".to_string(), DType::F16, vec![2])];
        for bad in [
            "[1]",
            "{\"w\": {}}",
            "{\"w\": {\"saved_offsets\": [-1]}}",
            "{\"w\": {\"saved_offsets\": [0]}, \"w\": {\"saved_offsets\": [0]}}",
        ] {
            let meta = vec![(DCP_SHARDING_INFO.to_string(), bad.to_string())];
            write_with_metadata(dir.path(), &file_name(0, 1, 1), &t, &meta);
            let err = read(dir.path()).unwrap_err();
            assert!(err.file.is_some(), "{bad}");
            assert!(
                err.message.contains(DCP_SHARDING_INFO),
                "{bad}: {}",
                err.message
            );
        }
    }

    #[test]
    fn directory_contents() {
        let dir = example();
        std::fs::write(dir.path().join("model.safetensors"), b"").unwrap();
        let err = read(dir.path()).unwrap_err();
        assert!(err.file.unwrap().ends_with("model.safetensors"));
        assert!(err.hint.is_some());

        let dir = example();
        write_rank(
            dir.path(),
            &file_name(2, 1, 3),
            &[("a", DType::F32, &[1], &[0])],
        );
        assert!(read(dir.path()).unwrap_err().message.contains("disagree"));

        let empty = tempfile::tempdir().unwrap();
        assert!(!probes(empty.path()));
        assert_eq!(read(empty.path()).unwrap_err().kind, ErrorKind::Invalid);
        assert_eq!(
            read(&empty.path().join("nope")).unwrap_err().kind,
            ErrorKind::Usage
        );
    }

    #[test]
    fn world_size_counts_ranks_with_files() {
        let dir = tempfile::tempdir().unwrap();
        write_rank(
            dir.path(),
            &file_name(0, 1, 1),
            &[("w", DType::F32, &[1], &[0])],
        );
        write_rank(
            dir.path(),
            &file_name(3, 1, 1),
            &[("w", DType::F32, &[1], &[1])],
        );
        assert_eq!(read(dir.path()).unwrap().world_size, Some(2));
    }
}
