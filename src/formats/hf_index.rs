//! Hugging Face split checkpoints: `model.safetensors.index.json` + `model-0000i-of-0000n.safetensors`.
//!
//! The index maps every tensor name to the file that holds it (`weight_map`); each file is a plain
//! safetensors file of whole tensors. Reading cross-checks the two in both directions, because a
//! stale index next to re-saved files is a common way to lose or duplicate a tensor silently.
//! Writing produces the index bytes exactly as `transformers`' `save_pretrained` does.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Component, Path, PathBuf};

use crate::error::{Error, Result};
use crate::formats::safetensors::{
    self, first_duplicate, json_error, python_json_string, Entries, MAX_HEADER_SIZE,
};
use crate::layout::{Found, Layout, Listing, ReadOptions};
use crate::model::{Checkpoint, Format, Tensor, Unsupported};
use crate::storage::{self, Stat};

/// The index file name `transformers` and `huggingface_hub` write.
pub(crate) const INDEX_NAME: &str = "model.safetensors.index.json";

/// Names of Hugging Face split safetensors files (`model-00001-of-00003.safetensors`) in `dir`.
fn split_files_in(dir: &Path) -> Vec<String> {
    let Ok(entries) = storage::list(dir) else {
        return Vec::new();
    };
    // `<prefix>-<index>-of-<count>.safetensors`, index and count of at least 5 digits.
    let is_split = |name: &str| {
        let digits = |s: &str| s.len() >= 5 && s.bytes().all(|b| b.is_ascii_digit());
        let Some(rest) = name.strip_suffix(".safetensors") else {
            return false;
        };
        let mut parts = rest.rsplit('-');
        let (count, of, index) = (parts.next(), parts.next(), parts.next());
        matches!((count, of, index), (Some(c), Some("of"), Some(i)) if digits(c) && digits(i))
    };
    let mut names: Vec<String> = entries
        .iter()
        .filter_map(|e| e.file_name()?.to_str().map(str::to_string))
        .filter(|n| is_split(n))
        .collect();
    names.sort();
    names
}

/// Hugging Face split files: `model.safetensors.index.json` and the files it names.
pub(crate) struct HfIndex;

impl Layout for HfIndex {
    fn describe(&self) -> &'static str {
        "Hugging Face split files (`model.safetensors.index.json`)"
    }

    fn probe(&self, at: &Listing) -> Result<Option<Found>> {
        if let Some(index) = at.file_named(INDEX_NAME) {
            return Ok(Some(Found::at(&index.path)));
        }
        // An index of another name (`diffusion_pytorch_model.safetensors.index.json`) is read
        // when given itself.
        Ok(at
            .file()
            .filter(|f| f.name().ends_with(".safetensors.index.json"))
            .map(|f| Found::at(&f.path)))
    }

    fn read(&self, found: &Found, opts: &ReadOptions) -> Result<Checkpoint> {
        read(&found.path, opts)
    }
}

/// The index `transformers` writes next to `pytorch_model-*.bin` files.
const BIN_INDEX_NAME: &str = "pytorch_model.bin.index.json";

/// Read a split checkpoint. `path` is the directory holding [`INDEX_NAME`], or an index file
/// itself (any name, e.g. `diffusion_pytorch_model.safetensors.index.json`).
pub(crate) fn read(path: &Path, opts: &ReadOptions) -> Result<Checkpoint> {
    let index_path = find_index(path)?;
    let (root, _) = safetensors::split_path(&index_path)?;
    let weight_map = read_weight_map(&index_path)?;
    let by_file = group_by_file(&weight_map, &index_path, &root)?;
    let mapped: HashMap<&str, &str> = weight_map
        .iter()
        .map(|(t, f)| (t.as_str(), f.as_str()))
        .collect();

    let mut tensors = Vec::with_capacity(weight_map.len());
    let mut unsupported = Vec::new();
    for (file, names) in &by_file {
        let split = SplitFile {
            root: &root,
            index_path: &index_path,
            file,
            names,
        };
        // One broken file is a problem of its own; `verify` goes on to the next one.
        if let Err(e) = split.read(&mapped, &mut tensors, &mut unsupported) {
            opts.step_past(e)?;
        }
    }

    Ok(Checkpoint {
        root,
        format: Format::SafetensorsIndex,
        world_size: None,
        tensors,
        values: Vec::new(),
        unsupported,
        details: Vec::new(),
    })
}

/// The index file `path` names: `path` itself, or the [`INDEX_NAME`] in the directory `path`.
fn find_index(path: &Path) -> Result<PathBuf> {
    let stat = storage::stat(path)?;
    if stat == Some(Stat::Dir) {
        let index = path.join(INDEX_NAME);
        if !storage::is_file(&index) {
            let err = Error::usage(format!("directory has no `{INDEX_NAME}`")).file(path);
            return Err(if storage::is_file(&path.join(BIN_INDEX_NAME)) {
                err.hint(format!(
                    "`{BIN_INDEX_NAME}` indexes torch.save files; only safetensors indexes are read, \
                     so pass each `.bin` file on its own"
                ))
            } else {
                err
            });
        }
        Ok(index)
    } else if matches!(stat, Some(Stat::File(_))) {
        Ok(path.to_path_buf())
    } else {
        Err(Error::usage("no such file or directory").file(path))
    }
}

/// The index's tensor names by the file it maps them to, once every split file in `root` is
/// among those files.
fn group_by_file<'a>(
    weight_map: &'a [(String, String)],
    index_path: &Path,
    root: &Path,
) -> Result<BTreeMap<&'a str, Vec<&'a str>>> {
    // BTreeMap keeps files in name order, which is numeric order for `model-0000i-of-0000n`
    // names.
    let mut by_file: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (tensor, file) in weight_map {
        check_file_name(file).map_err(|e| e.file(index_path).tensor(tensor))?;
        by_file
            .entry(file.as_str())
            .or_default()
            .push(tensor.as_str());
    }
    // A split file the index forgets would silently drop its tensors: every
    // `model-0000i-of-0000n.safetensors` of the set in the directory must be indexed.
    if let Some(unlisted) = split_files_in(root)
        .into_iter()
        .find(|name| !by_file.contains_key(name.as_str()))
    {
        return Err(Error::invalid(format!(
            "`{unlisted}` is in the directory but `{}` names none of its tensors",
            index_name(index_path)
        ))
        .file(index_path)
        .hint("the index and the files come from different saves, or the index was edited"));
    }
    Ok(by_file)
}

/// One file the index names, with the tensor names it maps to it.
struct SplitFile<'a> {
    root: &'a Path,
    index_path: &'a Path,
    file: &'a str,
    names: &'a [&'a str],
}

impl SplitFile<'_> {
    /// Add the file's tensors to `tensors` and `unsupported`, once the file and the index
    /// (`mapped`: tensor name to file) agree on what it holds.
    fn read(
        &self,
        mapped: &HashMap<&str, &str>,
        tensors: &mut Vec<Tensor>,
        unsupported: &mut Vec<Unsupported>,
    ) -> Result<()> {
        let (file, names) = (self.file, self.names);
        let file_path = self.root.join(file);
        if !storage::is_file(&file_path) {
            return Err(
                Error::invalid(format!("the index names `{file}`, which does not exist"))
                    .file(&file_path)
                    .tensor(names.first().copied().unwrap_or_default())
                    .hint("the checkpoint is incomplete: copy or download the missing file"),
            );
        }
        let header = safetensors::read_header(&file_path)?;
        let all_names = header.tensors.iter().map(|t| t.name.as_str());
        let all_names = all_names.chain(header.unsupported.iter().map(|u| u.name.as_str()));
        for t_name in all_names.clone() {
            self.check_mapped_here(t_name, mapped)
                .map_err(|e| e.file(&file_path).tensor(t_name))?;
        }
        let present: HashSet<&str> = all_names.collect();
        if let Some(missing) = names.iter().find(|n| !present.contains(*n)) {
            return Err(Error::invalid(format!(
                "`{}` maps this tensor to `{file}`, which does not hold it",
                index_name(self.index_path)
            ))
            .file(&file_path)
            .tensor(*missing)
            .hint("the index and the files come from different saves"));
        }
        let file_name: std::sync::Arc<Path> = Path::new(file).into();
        unsupported.extend(safetensors::unsupported(&header, &file_name));
        for t in &header.tensors {
            tensors.push(safetensors::full_tensor(t, &file_name, header.data_start)?);
        }
        Ok(())
    }

    /// An error unless the index maps `t_name`, a tensor this file holds, to this file.
    fn check_mapped_here(&self, t_name: &str, mapped: &HashMap<&str, &str>) -> Result<()> {
        let file = self.file;
        let why = match mapped.get(t_name) {
            Some(&f) if f == file => return Ok(()),
            Some(f) => format!(
                "tensor is in `{file}` but `{}` maps it to `{f}`",
                index_name(self.index_path)
            ),
            None => format!(
                "tensor is in `{file}` but missing from `{}`",
                index_name(self.index_path)
            ),
        };
        Err(Error::invalid(why).hint("the index and the files come from different saves"))
    }
}

/// The file name part of the index path, for messages.
fn index_name(index_path: &Path) -> String {
    index_path.file_name().map_or_else(
        || INDEX_NAME.to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
}

/// Parse the index JSON into `(tensor, file)` pairs in file order.
fn read_weight_map(index_path: &Path) -> Result<Vec<(String, String)>> {
    let len = match storage::stat(index_path)? {
        Some(Stat::File(len)) => len,
        _ => {
            return Err(Error::io(
                index_path,
                std::io::Error::from(std::io::ErrorKind::NotFound),
            ))
        }
    };
    // An index is a few MB even for the largest models; a bigger one is not an index.
    if len > MAX_HEADER_SIZE {
        return Err(Error::invalid(format!(
            "index is {len} bytes, more than the {MAX_HEADER_SIZE}-byte limit"
        ))
        .file(index_path));
    }
    let bytes = storage::read(index_path)?;
    // `Entries` keeps duplicate tensor names, which a plain map would silently merge.
    #[derive(serde::Deserialize)]
    struct Index {
        weight_map: Option<Entries<serde_json::Value>>,
    }
    let index: Index =
        serde_json::from_slice(&bytes).map_err(|e| json_error(&e, &bytes, 0).file(index_path))?;
    let weight_map = index.weight_map.ok_or_else(|| {
        Error::invalid("index has no `weight_map`")
            .file(index_path)
            .hint("a Hugging Face index looks like {\"metadata\": {...}, \"weight_map\": {name: file}}")
    })?;
    let mut out = Vec::with_capacity(weight_map.0.len());
    for (tensor, file) in weight_map.0 {
        let Some(file) = file.as_str() else {
            return Err(
                Error::invalid("`weight_map` value is not a file name string")
                    .file(index_path)
                    .tensor(tensor),
            );
        };
        out.push((tensor, file.to_string()));
    }
    if let Some(dup) = first_duplicate(&out) {
        return Err(Error::invalid("`weight_map` names this tensor twice")
            .file(index_path)
            .tensor(dup));
    }
    Ok(out)
}

/// A `weight_map` file must be a plain file name in the index's directory: anything else could
/// read outside the checkpoint.
fn check_file_name(name: &str) -> Result<()> {
    let plain = !name.is_empty()
        && !name.contains(['/', '\\', '\0'])
        && matches!(
            Path::new(name).components().collect::<Vec<_>>().as_slice(),
            [Component::Normal(_)]
        );
    if !plain {
        return Err(Error::invalid(format!(
            "`weight_map` names `{name}`, which is not a plain file name in the index's directory"
        ))
        .hint("an index may only name files next to it; fix or regenerate the index"));
    }
    let lower = name.to_ascii_lowercase();
    if [".bin", ".pt", ".pth"]
        .iter()
        .any(|ext| lower.ends_with(ext))
    {
        return Err(Error::invalid(format!(
            "`weight_map` names `{name}`, a torch.save file; only safetensors indexes are read"
        ))
        .hint("pass each torch.save file on its own"));
    }
    Ok(())
}

/// The name of split file `i` (1-based) of `n`: `model-00001-of-00003.safetensors`, as
/// `huggingface_hub` and torch's `_gen_file_name` write it (at least 5 digits).
pub(crate) fn split_file_name(i: usize, n: usize) -> String {
    format!("model-{i:05}-of-{n:05}.safetensors")
}

/// The bytes of `model.safetensors.index.json` exactly as `transformers`' `save_pretrained`
/// writes them: `json.dumps(index, indent=2, sort_keys=True) + "\n"`, so keys are sorted
/// (by code point, which is UTF-8 byte order) and non-ASCII is `\u`-escaped.
/// (`huggingface_hub.save_torch_state_dict` keeps insertion order and omits the newline; the
/// sorted form is what most published checkpoints carry.)
pub(crate) fn index_json(total_size: u64, weight_map: &[(String, String)]) -> Vec<u8> {
    let mut sorted: Vec<&(String, String)> = weight_map.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    let mut out = String::new();
    out.push_str("{\n  \"metadata\": {\n    \"total_size\": ");
    out.push_str(&total_size.to_string());
    out.push_str("\n  },\n  \"weight_map\": {");
    for (i, (tensor, file)) in sorted.iter().enumerate() {
        out.push_str(if i == 0 { "\n    " } else { ",\n    " });
        out.push_str(&python_json_string(tensor));
        out.push_str(": ");
        out.push_str(&python_json_string(file));
    }
    // Python writes an empty dict as `{}` on one line.
    out.push_str(if sorted.is_empty() {
        "}\n}\n"
    } else {
        "\n  }\n}\n"
    });
    out.into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::error::ErrorKind;

    /// Write a safetensors file of zeroed tensors into `dir`.
    fn write_st(dir: &Path, name: &str, tensors: &[(&str, DType, &[u64])]) {
        let tensors: Vec<(String, DType, Vec<u64>)> = tensors
            .iter()
            .map(|(n, d, s)| (n.to_string(), *d, s.to_vec()))
            .collect();
        let (mut bytes, ranges) = safetensors::header_bytes(&tensors, &[]);
        let len = bytes.len() + ranges.last().map_or(0, |r| r.1 as usize);
        bytes.resize(len, 0);
        std::fs::write(dir.join(name), bytes).unwrap();
    }

    fn write_index(dir: &Path, map: &[(&str, &str)]) {
        let map: Vec<(String, String)> = map
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect();
        std::fs::write(dir.join(INDEX_NAME), index_json(0, &map)).unwrap();
    }

    fn two_files() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        write_st(
            dir.path(),
            &split_file_name(1, 2),
            &[("b", DType::F32, &[2]), ("a", DType::F32, &[3])],
        );
        write_st(
            dir.path(),
            &split_file_name(2, 2),
            &[("c", DType::BF16, &[2, 2])],
        );
        write_index(
            dir.path(),
            &[
                ("c", "model-00002-of-00002.safetensors"),
                ("a", "model-00001-of-00002.safetensors"),
                ("b", "model-00001-of-00002.safetensors"),
            ],
        );
        dir
    }

    #[test]
    fn names() {
        assert_eq!(split_file_name(1, 3), "model-00001-of-00003.safetensors");
        assert_eq!(
            split_file_name(123456, 123456),
            "model-123456-of-123456.safetensors"
        );
    }

    #[test]
    fn reads_in_file_order() {
        let dir = two_files();
        for path in [dir.path().to_path_buf(), dir.path().join(INDEX_NAME)] {
            let ckpt = read(&path, &ReadOptions::default()).unwrap();
            assert_eq!(ckpt.format, Format::SafetensorsIndex);
            assert_eq!(ckpt.root, dir.path());
            let names: Vec<&str> = ckpt.tensors.iter().map(|t| t.name.as_str()).collect();
            assert_eq!(names, ["b", "a", "c"]);
            let c = &ckpt.tensors[2];
            assert_eq!(
                &**c.pieces.get(0).file(),
                Path::new("model-00002-of-00002.safetensors")
            );
            assert_eq!(c.shape, vec![2, 2]);
            assert_eq!(c.dtype, DType::BF16);
        }
    }

    #[test]
    fn index_json_like_transformers() {
        let map = vec![
            (
                "b.w".to_string(),
                "model-00002-of-00002.safetensors".to_string(),
            ),
            (
                "a.é".to_string(),
                "model-00001-of-00002.safetensors".to_string(),
            ),
        ];
        let text = String::from_utf8(index_json(42, &map)).unwrap();
        assert_eq!(
            text,
            "{\n  \"metadata\": {\n    \"total_size\": 42\n  },\n  \"weight_map\": {\n    \
             \"a.\\u00e9\": \"model-00001-of-00002.safetensors\",\n    \
             \"b.w\": \"model-00002-of-00002.safetensors\"\n  }\n}\n"
        );
        let empty = String::from_utf8(index_json(0, &[])).unwrap();
        assert_eq!(
            empty,
            "{\n  \"metadata\": {\n    \"total_size\": 0\n  },\n  \"weight_map\": {}\n}\n"
        );
    }

    #[test]
    fn path_escapes_are_rejected() {
        for bad in [
            "../x.safetensors",
            "/etc/x.safetensors",
            "sub/x.safetensors",
            "a\\b.safetensors",
            "..",
            ".",
            "",
            "a\0b",
        ] {
            let dir = tempfile::tempdir().unwrap();
            write_index(dir.path(), &[("w", bad)]);
            let err = read(dir.path(), &ReadOptions::default()).unwrap_err();
            assert!(
                err.message.contains("not a plain file name"),
                "{bad}: {}",
                err.message
            );
            assert_eq!(err.tensor.as_deref(), Some("w"));
        }
    }

    #[test]
    fn missing_file() {
        let dir = two_files();
        std::fs::remove_file(dir.path().join(split_file_name(2, 2))).unwrap();
        let err = read(dir.path(), &ReadOptions::default()).unwrap_err();
        assert!(err.message.contains("does not exist"), "{}", err.message);
        assert_eq!(err.tensor.as_deref(), Some("c"));
        assert!(err.hint.is_some());
    }

    #[test]
    fn tensor_missing_from_file_or_index() {
        let dir = two_files();
        write_index(
            dir.path(),
            &[
                ("c", "model-00002-of-00002.safetensors"),
                ("a", "model-00001-of-00002.safetensors"),
                ("b", "model-00001-of-00002.safetensors"),
                ("z", "model-00002-of-00002.safetensors"),
            ],
        );
        let err = read(dir.path(), &ReadOptions::default()).unwrap_err();
        assert_eq!(err.tensor.as_deref(), Some("z"));
        assert!(err.message.contains("does not hold it"), "{}", err.message);

        write_index(
            dir.path(),
            &[
                ("c", "model-00002-of-00002.safetensors"),
                ("a", "model-00001-of-00002.safetensors"),
            ],
        );
        let err = read(dir.path(), &ReadOptions::default()).unwrap_err();
        assert_eq!(err.tensor.as_deref(), Some("b"));
        assert!(err.message.contains("missing from"), "{}", err.message);

        write_index(
            dir.path(),
            &[
                ("c", "model-00002-of-00002.safetensors"),
                ("a", "model-00001-of-00002.safetensors"),
                ("b", "model-00002-of-00002.safetensors"),
            ],
        );
        let err = read(dir.path(), &ReadOptions::default()).unwrap_err();
        assert_eq!(err.tensor.as_deref(), Some("b"));
        assert!(err.message.contains("maps it to"), "{}", err.message);
    }

    #[test]
    fn duplicate_and_malformed_indexes() {
        let dir = two_files();
        let index = dir.path().join(INDEX_NAME);
        std::fs::write(
            &index,
            r#"{"weight_map": {"a": "x.safetensors", "a": "y.safetensors"}}"#,
        )
        .unwrap();
        let err = read(dir.path(), &ReadOptions::default()).unwrap_err();
        assert!(err.message.contains("twice"), "{}", err.message);

        std::fs::write(&index, r#"{"metadata": {}}"#).unwrap();
        assert!(read(dir.path(), &ReadOptions::default())
            .unwrap_err()
            .message
            .contains("no `weight_map`"));

        std::fs::write(&index, r#"{"weight_map": {"a": 1}}"#).unwrap();
        assert_eq!(
            read(dir.path(), &ReadOptions::default())
                .unwrap_err()
                .tensor
                .as_deref(),
            Some("a")
        );

        std::fs::write(&index, r#"{"weight_map": {"a": "#).unwrap();
        assert!(read(dir.path(), &ReadOptions::default())
            .unwrap_err()
            .message
            .starts_with("invalid JSON"));
    }

    #[test]
    fn bin_indexes_are_refused_clearly() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(BIN_INDEX_NAME), "{}").unwrap();
        let err = read(dir.path(), &ReadOptions::default()).unwrap_err();
        assert_eq!(err.kind, ErrorKind::Usage);
        assert!(err.hint.unwrap().contains("only safetensors indexes"));

        write_index(dir.path(), &[("w", "pytorch_model-00001-of-00002.bin")]);
        let err = read(dir.path(), &ReadOptions::default()).unwrap_err();
        assert!(
            err.message.contains("only safetensors indexes are read"),
            "{}",
            err.message
        );
    }

    #[test]
    fn missing_path_is_a_usage_error() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            read(&dir.path().join("nope"), &ReadOptions::default())
                .unwrap_err()
                .kind,
            ErrorKind::Usage
        );
        assert_eq!(
            read(dir.path(), &ReadOptions::default()).unwrap_err().kind,
            ErrorKind::Usage
        );
    }
}
