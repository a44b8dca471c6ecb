//! Megatron-core `dist_checkpointing` directories saved with the `torch_dist` backend (the format
//! of Megatron-LM and NeMo): `metadata.json` (`{"sharded_backend": "torch_dist", ...}`), a DCP
//! `.metadata` + `__{rank}_{k}.distcp`, and `common.pt`, a torch.save of the state every rank
//! shares (`iteration`, `args`, ...).
//!
//! The sharded part is read as the DCP it is (`formats::dcp`), with Megatron's names and stored
//! shapes: a layer-stacked weight stays stacked on its leading layers axis. One thing is undone:
//! megatron-core 0.10 to 0.15 save a distributed optimizer's `flattened_range` pieces of a tensor
//! of shape `[X, Y, Z]` whose TP-local pieces are `[x, y, z]` as a tensor of shape
//! `[X/x, Y/y, Z/z, x*y*z]` (the grid of local blocks, then each block flattened), recording the
//! original shape in `mcore_data` (`nd_reformulated_orig_global_shape`). Each such piece (a run of
//! one block's flattened elements) is put back as the boxes of the original shape it covers, so
//! the tensor is read, consolidated and resharded in its original shape. That is a plain reshape
//! only when the first cut axis is the first axis of size above one (TP on dim 0); with TP on a
//! later dim the blocks interleave, which this mapping handles the same way.
//!
//! Megatron-LM's `save_checkpoint` writes each save into `iter_NNNNNNN/` (or `release/`) under
//! a save root whose `latest_checkpointed_iteration.txt` names the last one: pointed at the
//! root, ckpt reads the iteration that file names, or the one `--tag` names (`7` or
//! `iter_0000007`), as it follows DeepSpeed's `latest`.
//!
//! `common.pt`'s values become non-tensor entries under their own names (`iteration`,
//! `args.lr`). Its `argparse.Namespace` (`args`) is read as the dict of its fields: the data-only
//! reader allows that one class for this file and keeps only the field values, so the entries
//! are plain data that `torch.load(weights_only=True)` reads back (a dict, no longer a Namespace).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::formats::dcp;
use crate::formats::torch_save::{self, Extra, Leaf};
use crate::geometry::flat_range_boxes;
use crate::layout::{Found, Layout, Listing, ReadOptions};
use crate::model::{
    contiguous_strides, numel, Checkpoint, Format, KeyPart, NonTensor, Pieces, Tensor,
};
use crate::pickle::{Globals, Object, Value};
use crate::storage::{self, Stat};

/// The file that says a directory is a Megatron `dist_checkpointing` checkpoint.
pub(crate) const CONFIG: &str = "metadata.json";
/// The torch.save file of the state every rank shares.
pub(crate) const COMMON: &str = "common.pt";
/// The file at Megatron-LM's save root that names the last iteration saved.
pub(crate) const TRACKER: &str = "latest_checkpointed_iteration.txt";
/// `metadata.json` and `common.pt` are a few hundred bytes; anything this large is not one.
const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// A Megatron-core `torch_dist` directory: DCP plus `metadata.json` and `common.pt`.
pub(crate) struct Megatron;

impl Layout for Megatron {
    fn describe(&self) -> &'static str {
        "Megatron-core torch_dist directories (`metadata.json`, or a save root's `latest_checkpointed_iteration.txt`)"
    }

    fn probe(&self, at: &Listing) -> Result<Option<Found>> {
        if let (Listing::Dir { path, .. }, Some(_)) = (at, at.file_named(TRACKER)) {
            // Which iteration is read depends on `--tag`: `read` resolves it.
            return Ok(Some(Found::at(path.clone())));
        }
        let dir = match at {
            Listing::Dir { path, .. } if at.file_named(CONFIG).is_some() => path.clone(),
            // Any of its own files stands for the directory, when the directory is one.
            Listing::File(f) if [CONFIG, dcp::METADATA, COMMON].contains(&f.name()) => {
                match f.path.parent() {
                    Some(dir) if storage::is_file(&dir.join(CONFIG)) => dir.to_path_buf(),
                    _ => return Ok(None),
                }
            }
            _ => return Ok(None),
        };
        Ok((backend(&dir)?.as_deref() == Some("torch_dist")).then(|| Found::at(dir)))
    }

    fn read(&self, found: &Found, opts: &ReadOptions) -> Result<Checkpoint> {
        let tracker = found.path.join(TRACKER);
        if !storage::is_file(&tracker) {
            return read(&found.path, opts);
        }
        let dir = found.path.join(iteration_dir(&tracker, opts.tag)?);
        if backend(&dir)?.as_deref() != Some("torch_dist") {
            return Err(Error::invalid(format!(
                "`{}` is not a Megatron-core torch_dist checkpoint (no `{CONFIG}` naming torch_dist)",
                dir.display()
            ))
            .file(&dir)
            .hint("ckpt reads Megatron's torch_dist format, not its legacy `mp_rank_*/model_optim_rng.pt`"));
        }
        read(&dir, opts)
    }
}

/// The iteration directory of a Megatron-LM save root: `--tag` (`7` or `iter_0000007`), else
/// the one `latest_checkpointed_iteration.txt` names (an iteration, or `release`).
fn iteration_dir(tracker: &Path, tag: Option<&str>) -> Result<String> {
    let name = match tag {
        Some(tag) => tag.trim().to_string(),
        None => {
            if !matches!(storage::stat(tracker)?, Some(Stat::File(len)) if len <= MAX_CONFIG_BYTES)
            {
                return Err(Error::invalid(format!(
                    "`{TRACKER}` is too large to name an iteration"
                ))
                .file(tracker));
            }
            String::from_utf8_lossy(&storage::read(tracker)?)
                .trim()
                .to_string()
        }
    };
    let dir = match name.parse::<u64>() {
        Ok(n) => format!("iter_{n:07}"),
        Err(_) if name == "release" || name.starts_with("iter_") => name.clone(),
        Err(_) => {
            return Err(
                Error::invalid(format!("`{TRACKER}` names no iteration: {name:?}"))
                    .file(tracker)
                    .hint("pass --tag ITERATION, or point ckpt at an `iter_NNNNNNN` directory"),
            )
        }
    };
    if dir.contains('/') || dir.contains('\\') || dir == ".." {
        return Err(Error::usage(format!(
            "--tag {name:?} is not an iteration directory's name"
        )));
    }
    let parent = tracker.parent().unwrap_or(Path::new("."));
    if !storage::is_file(&parent.join(&dir).join(CONFIG)) {
        let (error, said) = match tag {
            Some(_) => (
                Error::usage as fn(String) -> Error,
                "--tag names".to_string(),
            ),
            None => (
                Error::invalid as fn(String) -> Error,
                format!("`{TRACKER}` names"),
            ),
        };
        return Err(error(format!(
            "{said} iteration `{dir}`, which is not in `{}`",
            parent.display()
        ))
        .file(parent)
        .hint("pass --tag with one of the `iter_NNNNNNN` directories there"));
    }
    Ok(dir)
}

/// The `sharded_backend` that `metadata.json` names, `None` when it names none or is not
/// Megatron's (another tool's JSON of that name).
fn backend(dir: &Path) -> Result<Option<String>> {
    let path = dir.join(CONFIG);
    match storage::stat(&path)? {
        Some(Stat::File(len)) if len <= MAX_CONFIG_BYTES => {}
        _ => return Ok(None),
    }
    let text = storage::read(&path)?;
    let json: serde_json::Value = match serde_json::from_slice(&text) {
        Ok(v) => v,
        Err(_) => return Ok(None),
    };
    Ok(json
        .get("sharded_backend")
        .and_then(|b| b.as_str())
        .map(str::to_string))
}

/// Read a Megatron `torch_dist` directory into the model.
pub(crate) fn read(dir: &Path, opts: &ReadOptions) -> Result<Checkpoint> {
    let (mut ckpt, fields) = dcp::read_extended(dir, opts, &McoreMetadata)?;
    ckpt.format = Format::MegatronTorchDist;
    let meta_path = dir.join(dcp::METADATA);
    let orig_shapes = match fields.iter().find(|(name, _)| name == MCORE_DATA) {
        Some((_, value)) => orig_shapes(value).map_err(|e| e.file(&meta_path))?,
        None => Vec::new(),
    };
    let orig: HashMap<&str, &[u64]> = orig_shapes
        .iter()
        .map(|(fqn, shape)| (fqn.as_str(), shape.as_slice()))
        .collect();
    for t in &mut ckpt.tensors {
        if let Some(shape) = orig.get(t.name.as_str()) {
            restore_shape(t, shape).map_err(|e| e.file(&meta_path).tensor(&t.name))?;
        }
    }
    let common = dir.join(COMMON);
    if storage::is_file(&common) {
        let (tensors, values) = common_values(&common)?;
        let taken: std::collections::HashSet<&str> = ckpt
            .tensors
            .iter()
            .map(|t| t.name.as_str())
            .chain(ckpt.values.iter().map(|v| v.name.as_str()))
            .collect();
        let names = tensors
            .iter()
            .map(|t| &t.name)
            .chain(values.iter().map(|v| &v.name));
        if let Some(name) = names.into_iter().find(|n| taken.contains(n.as_str())) {
            return Err(Error::invalid(
                "`common.pt` has an entry of the same name as one in `.metadata`",
            )
            .file(&common)
            .tensor(name));
        }
        ckpt.tensors.extend(tensors);
        ckpt.values.extend(values);
    }
    Ok(ckpt)
}

/// Where megatron-core 0.13 to 0.15 define their subclasses of DCP's `Metadata` and `SavePlan`
/// (which add an `mcore_data` dict).
const MCORE: &str = "megatron.core.dist_checkpointing.strategies.torch";
/// The `Metadata` field megatron-core records reformulated tensors' shapes in.
const MCORE_DATA: &str = "mcore_data";
/// The `mcore_data` key megatron-core (0.10 to 0.15) records a reformulated tensor's shape under.
const ORIG_SHAPE: &str = "nd_reformulated_orig_global_shape";

/// What megatron-core adds to DCP's `.metadata`: its two dataclasses, and `mcore_data`.
struct McoreMetadata;

impl dcp::Extension for McoreMetadata {
    fn allows(&self, module: &str, name: &str) -> bool {
        module == MCORE && matches!(name, "MCoreMetadata" | "MCoreSavePlan")
    }

    fn is_metadata(&self, module: &str, name: &str) -> bool {
        module == MCORE && name == "MCoreMetadata"
    }

    fn unhashable(&self, module: &str, name: &str) -> bool {
        self.is_metadata(module, name)
    }

    fn fields(&self) -> &[&str] {
        &[MCORE_DATA]
    }
}

/// `mcore_data`: `{fqn: {"nd_reformulated_orig_global_shape": (ints)}}`, the shape each tensor
/// megatron saved reformulated had before. Entries without that key (megatron stores `{}` for
/// tensors it did not reformulate) are skipped.
fn orig_shapes(value: &Value) -> Result<Vec<(String, Vec<u64>)>> {
    let Value::Dict(items) = value else {
        return Err(Error::invalid(format!(
            "`{MCORE_DATA}` is {}, not a dict",
            kind_of(value)
        )));
    };
    let mut out = Vec::new();
    for (k, v) in items {
        let Some(fqn) = k.as_str() else {
            return Err(Error::invalid(format!(
                "an `{MCORE_DATA}` key is {}, not a string",
                kind_of(k)
            )));
        };
        let Some(shape) = v.get(ORIG_SHAPE) else {
            continue;
        };
        let shape = shape.as_sizes().ok_or_else(|| {
            Error::invalid(format!(
                "`{MCORE_DATA}` gives `{ORIG_SHAPE}` as {}, not a tuple of sizes",
                kind_of(shape)
            ))
            .tensor(fqn)
        })?;
        out.push((fqn.to_string(), shape));
    }
    Ok(out)
}

/// A short description of a value for error messages.
fn kind_of(value: &Value) -> String {
    match value {
        Value::Object(o) => match o.callable.as_global() {
            Some((m, n)) => format!("`{m}.{n}`"),
            None => "an object".into(),
        },
        Value::Dict(_) => "a dict".into(),
        Value::List(_) => "a list".into(),
        Value::Tuple(_) => "a tuple".into(),
        Value::Str(_) => "a string".into(),
        Value::Int(_) | Value::BigInt(_) => "an int".into(),
        Value::None => "None".into(),
        _ => "a value of another kind".into(),
    }
}

/// Put a reformulated tensor (see the module docs) back into its original `shape`.
fn restore_shape(t: &mut Tensor, orig: &[u64]) -> Result<()> {
    let n = orig.len();
    let stored = t.shape.clone();
    let refuse = |why: String| {
        Error::invalid(format!(
            "`mcore_data` says this tensor had shape {orig:?}, but it is stored as {stored:?}: {why}"
        ))
        .hint("the checkpoint's `.metadata` and its data disagree; read it with the megatron-core version that wrote it")
    };
    if stored.len() != n + 1 {
        return Err(refuse(format!(
            "a reformulated tensor has one more dim than its original ({} dims)",
            n + 1
        )));
    }
    if numel(&stored) != numel(orig) {
        return Err(refuse(format!(
            "they hold {} and {} elements",
            numel(&stored).map_or("too many".into(), |v| v.to_string()),
            numel(orig).map_or("too many".into(), |v| v.to_string())
        )));
    }
    // The local block: the original shape over the grid of blocks.
    let mut block = Vec::with_capacity(n);
    for (d, (&o, &g)) in orig.iter().zip(&stored).enumerate() {
        if g == 0 || o % g != 0 {
            return Err(refuse(format!(
                "dim {d} ({o}) is not a whole number of {g} blocks"
            )));
        }
        block.push(o / g);
    }
    let block_len = numel(&block).unwrap_or(u64::MAX);
    if block_len != stored[n] {
        return Err(refuse(format!(
            "its blocks of {block:?} hold {block_len} elements, not {}",
            stored[n]
        )));
    }
    let size = t.dtype.size() as u64;
    let mut pieces = Pieces::new(n);
    for p in t.pieces.iter() {
        let (offsets, sizes) = (p.offsets(), p.sizes());
        let where_ = || format!("the piece at offsets {offsets:?}");
        if sizes[..n].iter().any(|&s| s != 1) {
            return Err(refuse(format!(
                "{} spans more than one block ({sizes:?})",
                where_()
            )));
        }
        if sizes[n] > 1 && p.strides()[n] != 1 {
            return Err(refuse(format!("{} is not stored contiguously", where_())));
        }
        let start = offsets[n];
        let end = start.saturating_add(sizes[n]);
        if end > block_len {
            return Err(refuse(format!(
                "{} runs past its block of {block_len} elements",
                where_()
            )));
        }
        let corner: Vec<u64> = offsets[..n]
            .iter()
            .zip(&block)
            .map(|(&b, &x)| b * x)
            .collect();
        for (local, box_sizes) in flat_range_boxes(&block, start, end) {
            let first = flat_index(&block, &local);
            let global: Vec<u64> = local.iter().zip(&corner).map(|(l, c)| l + c).collect();
            pieces.push_parts(
                &global,
                &box_sizes,
                Arc::clone(p.file()),
                p.offset() + (first - start) * size,
                &contiguous_strides(&box_sizes),
                p.encoding(),
            )?;
        }
    }
    t.shape = orig.to_vec();
    t.pieces = pieces;
    Ok(())
}

/// Row-major index of `at` in `shape`.
fn flat_index(shape: &[u64], at: &[u64]) -> u64 {
    at.iter().zip(shape).fold(0, |acc, (&i, &d)| acc * d + i)
}

/// `argparse.Namespace`, the one class `common.pt` may name beyond torch.save's own.
struct NamespaceGlobal;

impl Globals for NamespaceGlobal {
    fn allows(&self, module: &str, name: &str) -> bool {
        module == "argparse" && name == "Namespace"
    }
}

/// A `Namespace` as the dict of its fields: `Namespace(**kw)` pickles as NEWOBJ of the class
/// with no arguments, then BUILD with the fields' dict.
fn namespace_fields(object: &Object) -> Option<Value> {
    let (module, name) = object.callable.as_global()?;
    if module != "argparse" || name != "Namespace" {
        return None;
    }
    match &object.state {
        Some(state @ Value::Dict(_)) => Some(state.clone()),
        None => Some(Value::Dict(Vec::new())),
        // Any other state is not what argparse writes; left as an object, it is refused below.
        Some(_) => None,
    }
}

/// `common.pt`'s entries: plain values (and any tensor, as torch.save files have them).
fn common_values(path: &Path) -> Result<(Vec<Tensor>, Vec<NonTensor>)> {
    let len = match storage::stat(path)? {
        Some(Stat::File(len)) => len,
        _ => return Err(Error::invalid("`common.pt` is missing").file(path)),
    };
    if len > MAX_CONFIG_BYTES.saturating_mul(256) {
        return Err(Error::invalid(format!(
            "`common.pt` is {len} bytes, more than ckpt accepts"
        ))
        .file(path));
    }
    let bytes = storage::read(path)?;
    let extra = Extra {
        globals: &NamespaceGlobal,
        plain: &namespace_fields,
    };
    let mut archive = torch_save::read_with_extra(&bytes, &extra).map_err(|e| e.file(path))?;
    let mut out = Vec::new();
    let mut tensors = Vec::new();
    let leaves = std::mem::take(&mut archive.leaves);
    for (key_path, leaf) in leaves {
        // A `common.pt` of `{}` (nothing but sharded state saved) is one empty leaf: no entry.
        if key_path.is_empty() && matches!(&leaf, Leaf::Value(Value::Dict(d)) if d.is_empty()) {
            continue;
        }
        let name = KeyPart::flat_name(&key_path);
        match leaf {
            Leaf::Value(Value::Object(o)) => {
                let class = o
                    .callable
                    .as_global()
                    .map_or("an object".to_string(), |(m, n)| format!("`{m}.{n}`"));
                return Err(Error::invalid(format!(
                    "`common.pt` holds {class}, which ckpt does not read as data"
                ))
                .file(path)
                .tensor(&name));
            }
            Leaf::Value(v) => out.push(NonTensor {
                name,
                key_path,
                value: Some(v),
                raw: None,
            }),
            // Megatron keeps most tensors in the sharded part, but every non-distributed
            // optimizer puts its step here (`optimizer.state.common_step`): a tensor like any
            // other, one piece of `common.pt`.
            Leaf::Tensor(t) => tensors.push(
                torch_save::saved_tensor(&archive, &t, name, &key_path, Path::new(COMMON))
                    .map_err(|e| e.file(path))?,
            ),
            Leaf::Sharded(_) | Leaf::Unsupported { .. } => {
                return Err(Error::invalid(
                    "`common.pt` holds a sharded tensor or one of a dtype ckpt does not support",
                )
                .file(path)
                .tensor(&name)
                .hint("leave common.pt aside (move it out of the directory) to convert the sharded tensors"))
            }
        }
    }
    Ok((tensors, out))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every element of `shape` in row-major order, as the boxes give them.
    fn covered(shape: &[u64], start: u64, end: u64) -> Vec<u64> {
        let mut out = Vec::new();
        for (offsets, sizes) in flat_range_boxes(shape, start, end) {
            let count = numel(&sizes).unwrap();
            for i in 0..count {
                let mut rest = i;
                let mut at = vec![0; sizes.len()];
                for d in (0..sizes.len()).rev() {
                    at[d] = offsets[d] + rest % sizes[d];
                    rest /= sizes[d];
                }
                out.push(flat_index(shape, &at));
            }
        }
        out
    }

    /// The DCP under a Megatron directory, without Megatron's reading of it.
    fn stored_as_dcp(dir: &Path) -> Checkpoint {
        dcp::read_extended(dir, &ReadOptions::default(), &McoreMetadata)
            .unwrap()
            .0
    }

    fn fixture(name: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fixtures")
            .join(name)
    }

    #[test]
    fn megatron_0_15_metadata_gives_the_original_shapes() {
        let dir = fixture("megatron_torch_dist_flat");
        let (_, fields) =
            dcp::read_extended(&dir, &ReadOptions::default(), &McoreMetadata).unwrap();
        let (_, mcore_data) = fields.iter().find(|(n, _)| n == MCORE_DATA).unwrap();
        assert_eq!(
            orig_shapes(mcore_data).unwrap(),
            [
                (
                    "optimizer.state.exp_avg.decoder.linear_proj.weight".to_string(),
                    vec![6, 4]
                ),
                (
                    "optimizer.state.exp_avg.decoder.linear_qkv.weight".to_string(),
                    vec![4, 3]
                ),
            ]
        );
        let bad = Value::Dict(vec![(
            Value::Str("w".into()),
            Value::Dict(vec![(
                Value::Str(ORIG_SHAPE.into()),
                Value::Str("6x4".into()),
            )]),
        )]);
        let err = orig_shapes(&bad).unwrap_err();
        assert!(err.message.contains("not a tuple of sizes"), "{err}");
        assert_eq!(err.tensor.as_deref(), Some("w"));
    }

    #[test]
    fn real_files_are_detected_and_reformulated_tensors_get_their_shape_back() {
        let plain = read(&fixture("megatron_torch_dist"), &ReadOptions::default()).unwrap();
        assert_eq!(plain.format, Format::MegatronTorchDist);
        let stacked = plain
            .tensors
            .iter()
            .find(|t| t.name == "decoder.layers.mlp.linear_fc2.weight")
            .unwrap();
        assert_eq!(stacked.shape, [3, 5, 6]);
        let args: Vec<&str> = plain
            .values
            .iter()
            .filter(|v| v.name.starts_with("args."))
            .map(|v| v.name.as_str())
            .collect();
        assert_eq!(
            args,
            [
                "args.tensor_model_parallel_size",
                "args.num_layers",
                "args.lr",
                "args.model"
            ]
        );

        let flat = read(
            &fixture("megatron_torch_dist_flat"),
            &ReadOptions::default(),
        )
        .unwrap();
        let shapes: Vec<(&str, &[u64])> = flat
            .tensors
            .iter()
            .map(|t| (t.name.as_str(), t.shape.as_slice()))
            .collect();
        assert_eq!(
            shapes,
            [
                (
                    "optimizer.state.exp_avg.decoder.linear_proj.weight",
                    &[6u64, 4][..]
                ),
                (
                    "optimizer.state.exp_avg.decoder.linear_qkv.weight",
                    &[4, 3][..]
                ),
            ]
        );
        // Read as the DCP it is, the same directory keeps the stored, reformulated shapes.
        let dcp = stored_as_dcp(&fixture("megatron_torch_dist_flat"));
        assert_eq!(dcp.tensors[0].shape, [1, 2, 12]);
        let probes = |dir: &Path| {
            Megatron
                .probe(&crate::layout::Listing::of(dir).unwrap())
                .unwrap()
        };
        assert!(probes(&fixture("megatron_torch_dist")).is_some());
        assert!(probes(&fixture("fsdp2_adamw")).is_none());
        // Any of its files stands for the directory.
        let found = probes(&fixture("megatron_torch_dist").join("common.pt")).unwrap();
        assert_eq!(found.path, fixture("megatron_torch_dist"));
    }

    #[test]
    fn an_original_shape_that_does_not_fit_is_a_clear_error() {
        let stored = stored_as_dcp(&fixture("megatron_torch_dist_flat"));
        let t = &stored.tensors[0];
        for (orig, says) in [
            (&[6u64, 5][..], "elements"),
            (&[24][..], "one more dim"),
            (&[8, 3][..], "not a whole number of 2 blocks"),
        ] {
            let mut copy = t.clone();
            let err = restore_shape(&mut copy, orig).unwrap_err().to_string();
            assert!(err.contains(says), "{orig:?}: {err}");
            assert!(err.contains("[1, 2, 12]"), "{err}");
        }
    }

    #[test]
    fn flat_ranges_become_few_boxes_in_order() {
        let shape = [3, 4, 5];
        for start in 0..60 {
            for end in start..=60 {
                let boxes = flat_range_boxes(&shape, start, end);
                assert!(boxes.len() <= 5, "{start}..{end}: {boxes:?}");
                assert_eq!(
                    covered(&shape, start, end),
                    (start..end).collect::<Vec<_>>()
                );
            }
        }
        assert_eq!(
            flat_range_boxes(&[6, 2], 5, 12),
            vec![(vec![2, 1], vec![1, 1]), (vec![3, 0], vec![3, 2])]
        );
        assert_eq!(
            flat_range_boxes(&[6, 2], 0, 12),
            vec![(vec![0, 0], vec![6, 2])]
        );
    }
}
