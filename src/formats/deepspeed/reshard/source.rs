//! The source side of a reshard: each torch.save file of the DeepSpeed checkpoint read as data
//! (its pickled object and where each storage record's bytes are), and the few edits the new
//! files need (a flat tensor over a new storage, a value set at a key path).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::super::DeepSpeedGlobals;
use crate::error::{Error, Result};
use crate::formats::torch_save::TorchGlobals;
use crate::pickle::{self, Globals, Limits, Value};
use crate::storage::{self, Access};
use crate::zip;

/// The pickle policy of DeepSpeed's files: torch.save's data-only classes and DeepSpeed's own.
struct SaveGlobals;

impl Globals for SaveGlobals {
    fn allows(&self, module: &str, name: &str) -> bool {
        TorchGlobals.allows(module, name) || DeepSpeedGlobals.allows(module, name)
    }
}

/// One torch.save file of the source: its pickled object and where each storage record is.
pub(super) struct SavedFile {
    pub input: usize,
    pub path: PathBuf,
    pub root: Value,
    /// Storage key -> (byte offset, length) in the file.
    pub storages: HashMap<String, (u64, u64)>,
}

impl SavedFile {
    pub(super) fn open(path: &Path, input: usize) -> Result<SavedFile> {
        let file = storage::Input::open(path, Access::Map)?;
        let bytes = file.zip_view(0, file.len())?;
        let entries = zip::read_entries(&bytes).map_err(|e| e.file(path))?;
        let pkl = entries
            .iter()
            .find(|e| e.name.ends_with("/data.pkl") && e.name.matches('/').count() == 1)
            .ok_or_else(|| {
                Error::invalid("no `data.pkl` record: not a torch.save archive").file(path)
            })?;
        let prefix = pkl.name.trim_end_matches("data.pkl").to_string() + "data/";
        let mut storages = HashMap::new();
        for e in &entries {
            if let Some(key) = e.name.strip_prefix(&prefix) {
                if e.deflated.is_some() {
                    return Err(Error::invalid(format!(
                        "record `{}` is compressed: DeepSpeed stores records plain",
                        e.name
                    ))
                    .file(path));
                }
                storages.insert(key.to_string(), (e.data_offset, e.len));
            }
        }
        let data = usize::try_from(pkl.data_offset)
            .ok()
            .zip(usize::try_from(pkl.len).ok())
            .and_then(|(at, len)| bytes.get(at..at.checked_add(len)?))
            .filter(|_| pkl.deflated.is_none())
            .ok_or_else(|| Error::invalid("`data.pkl` is compressed or cut short").file(path))?;
        let root = pickle::read(data, &SaveGlobals, Limits::default()).map_err(|e| {
            Error::invalid(format!("cannot read `data.pkl` as data: {e}"))
                .file(path)
                .hint("ckpt rewrites DeepSpeed's own files; a class it does not know is refused")
        })?;
        Ok(SavedFile {
            input,
            path: path.to_path_buf(),
            root,
            storages,
        })
    }

    /// The value at a path of string keys.
    pub(super) fn at(&self, keys: &[&str]) -> Option<&Value> {
        keys.iter().try_fold(&self.root, |v, k| dict_get(v, k))
    }

    pub(super) fn missing(&self, what: &str) -> Error {
        Error::invalid(format!(
            "`{}` holds no {what}",
            self.path.file_name().unwrap_or_default().to_string_lossy()
        ))
        .file(&self.path)
        .hint("the file is not a DeepSpeed ZeRO save, or one of a DeepSpeed version ckpt does not know")
    }

    /// The byte offset and element count of a 1-D fp32 tensor's data, checked against its record.
    pub(super) fn flat(&self, tensor: &Value, what: &str) -> Result<(u64, u64)> {
        let (offset, numel, elem) = self.flat_any(tensor, what)?;
        if elem != 4 {
            return Err(self.missing(&format!("fp32 {what}")));
        }
        Ok((offset, numel))
    }

    /// The byte offset, element count and element size of a 1-D tensor's data (fp32 or 16-bit),
    /// checked against its record.
    pub(super) fn flat_any(&self, tensor: &Value, what: &str) -> Result<(u64, u64, u64)> {
        let t = TensorRef::of(tensor).ok_or_else(|| self.missing(what))?;
        let (offset, len) = self
            .storages
            .get(&t.key)
            .copied()
            .ok_or_else(|| self.missing(&format!("storage record `{}` for {what}", t.key)))?;
        let [numel] = t.sizes[..] else {
            return Err(self.missing(&format!("flat (1-D) {what}")));
        };
        let start = t.offset.checked_mul(t.elem);
        let end = t
            .offset
            .checked_add(numel)
            .and_then(|e| e.checked_mul(t.elem));
        match (start, end) {
            (Some(start), Some(end)) if t.stride_one && end <= len => {
                Ok((offset + start, numel, t.elem))
            }
            _ => Err(Error::invalid(format!(
                "{what} reaches past its storage record `{}` ({len} bytes)",
                t.key
            ))
            .file(&self.path)),
        }
    }
}

/// The parts of a pickled `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)`
/// this module reads or changes.
pub(super) struct TensorRef {
    pub key: String,
    pub offset: u64,
    pub sizes: Vec<u64>,
    pub stride_one: bool,
    /// Bytes per element.
    pub elem: u64,
}

impl TensorRef {
    pub(super) fn of(value: &Value) -> Option<TensorRef> {
        let args = rebuild_args(value)?;
        let Value::PersistentId(id) = args.first()? else {
            return None;
        };
        let Value::Tuple(id) = id.as_ref() else {
            return None;
        };
        // The storages of DeepSpeed's flat buffers: fp32 masters and moments, 16-bit parameters.
        let elem = match id.get(1)?.as_global()? {
            ("torch", "FloatStorage") => 4,
            ("torch", "BFloat16Storage" | "HalfStorage") => 2,
            _ => return None,
        };
        let ints = |v: &Value| -> Option<Vec<u64>> {
            v.as_seq()?
                .iter()
                .map(|i| u64::try_from(i.as_int()?).ok())
                .collect()
        };
        let sizes = ints(args.get(2)?)?;
        let strides = ints(args.get(3)?)?;
        Some(TensorRef {
            key: id.get(2)?.as_str()?.to_string(),
            elem,
            offset: u64::try_from(args.get(1)?.as_int()?).ok()?,
            stride_one: sizes.len() == 1 && strides == [1],
            sizes,
        })
    }
}

/// The arguments of `_rebuild_tensor_v2(storage, offset, size, stride, ...)` that make `value`:
/// its own, or those inside the `_rebuild_from_type_v2(func, Tensor, args, state)` that stage 3's
/// flat groups are pickled through (their `ds_id` attribute is the state).
fn rebuild_args(value: &Value) -> Option<&[Value]> {
    let Value::Object(o) = value else { return None };
    match o.callable.as_global()? {
        ("torch._utils", "_rebuild_tensor_v2") => Some(&o.args),
        ("torch._tensor", "_rebuild_from_type_v2") => match o.args.as_slice() {
            [func, _, Value::Tuple(args), _]
                if func.as_global() == Some(("torch._utils", "_rebuild_tensor_v2")) =>
            {
                Some(args)
            }
            _ => None,
        },
        _ => None,
    }
}

fn rebuild_args_mut(value: &mut Value) -> Option<&mut Vec<Value>> {
    let Value::Object(o) = value else { return None };
    match o.callable.as_global()? {
        ("torch._utils", "_rebuild_tensor_v2") => Some(&mut o.args),
        ("torch._tensor", "_rebuild_from_type_v2") => match o.args.get_mut(2)? {
            Value::Tuple(args) => Some(args),
            _ => None,
        },
        _ => None,
    }
}

/// `template` (a tensor) as a 1-D tensor of `numel` elements over storage `key` of
/// `storage_numel` elements.
pub(super) fn flat_tensor(template: &Value, key: &str, numel: u64, storage_numel: u64) -> Value {
    let mut value = template.clone();
    if let Some(args) = rebuild_args_mut(&mut value) {
        if let Some(Value::PersistentId(id)) = args.get_mut(0) {
            if let Value::Tuple(items) = id.as_mut() {
                if let Some(k) = items.get_mut(2) {
                    *k = Value::Str(key.to_string());
                }
                if let Some(n) = items.get_mut(4) {
                    *n = Value::Int(storage_numel as i64);
                }
            }
        }
        if let Some(v) = args.get_mut(1) {
            *v = Value::Int(0);
        }
        if let Some(v) = args.get_mut(2) {
            *v = Value::Tuple(vec![Value::Int(numel as i64)]);
        }
        if let Some(v) = args.get_mut(3) {
            *v = Value::Tuple(vec![Value::Int(1)]);
        }
    }
    value
}

/// A dict's (or `OrderedDict`'s) entries.
pub(super) fn entries(value: &Value) -> Option<&[(Value, Value)]> {
    super::super::dict_items(value)
}

pub(super) fn dict_get<'v>(value: &'v Value, key: &str) -> Option<&'v Value> {
    entries(value)?
        .iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
}

pub(super) fn dict_get_mut<'v>(value: &'v mut Value, key: &str) -> Option<&'v mut Value> {
    let items = match value {
        Value::Dict(items) => items,
        Value::Object(o) if o.callable.as_global() == Some(("collections", "OrderedDict")) => {
            &mut o.dict_items
        }
        _ => return None,
    };
    items
        .iter_mut()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
}

/// Set `keys` of `root` to `value`; the path must exist.
pub(super) fn set(root: &mut Value, keys: &[&str], value: Value) -> Result<()> {
    let mut at = root;
    for k in keys {
        at = dict_get_mut(at, k)
            .ok_or_else(|| Error::bug(format!("`{}` vanished", keys.join(".")).to_string()))?;
    }
    *at = value;
    Ok(())
}
