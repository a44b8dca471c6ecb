//! The interpreter: walks the data-only pickle tree, resolving persistent ids to storage records
//! and tensor rebuilds to views, and flattens nested dicts into key paths of leaves.

use super::*;

/// How a storage's persistent id names its type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum StorageKind {
    /// A legacy class (`torch.FloatStorage`): the dtype, `numel` in elements.
    Typed(DType),
    /// `torch.storage.UntypedStorage`: `numel` in bytes, the dtype comes from the tensor.
    Untyped,
}

impl StorageKind {
    pub(super) fn nbytes(self, numel: u64) -> Option<u64> {
        match self {
            StorageKind::Typed(dtype) => numel.checked_mul(dtype.size() as u64),
            StorageKind::Untyped => Some(numel),
        }
    }
}

/// Turns the unpickled tree into leaves, checking every tensor against its storage record.
pub(super) struct Interpreter<'a> {
    pub(super) archive: &'a Archive,
    /// Where `data.pkl`'s bytes start, for error offsets.
    pub(super) pkl_offset: u64,
    /// Each storage key seen, with how it was named, so every reference must agree.
    pub(super) storages: HashMap<String, (StorageKind, u64)>,
    pub(super) leaves: Vec<(Vec<KeyPart>, Leaf)>,
    /// A legacy file: storage ids carry a sixth item, `view_metadata`.
    pub(super) legacy: bool,
}

impl Interpreter<'_> {
    pub(super) fn walk(&mut self, value: &Value, path: &mut Vec<KeyPart>) -> Result<()> {
        if let Some(name) = unsupported_dtype(value) {
            let dtype = format!("torch.{name}");
            self.leaves
                .push((path.clone(), Leaf::Unsupported { dtype }));
            return Ok(());
        }
        let sharded = decode(value, &mut |t| match rebuild_function(t) {
            Some(kind) => self.tensor(t, kind),
            None => Err(bad("a tensor subclass's local tensor is not a tensor")),
        });
        if let Some(leaf) = sharded.map_err(|e| self.locate(e, path))? {
            self.leaves.push((path.clone(), Leaf::Sharded(leaf)));
            return Ok(());
        }
        if let Some(rebuild) = rebuild_function(value) {
            let tensor = self
                .tensor(value, rebuild)
                .map_err(|e| self.locate(e, path))?;
            self.leaves.push((path.clone(), Leaf::Tensor(tensor)));
            return Ok(());
        }
        if let Some(items) = dict_items(value) {
            let keys: Option<Vec<KeyPart>> = items.iter().map(|(k, _)| key_part(k)).collect();
            // An empty dict stays a value, so it survives the trip (optimizer state before step 1).
            if let Some(keys) = keys.filter(|k| !k.is_empty()) {
                for (key, (_, item)) in keys.into_iter().zip(items) {
                    path.push(key);
                    self.walk(item, path)?;
                    path.pop();
                }
                return Ok(());
            }
        }
        // A list or tuple holding tensors flattens as DCP flattens it: item `i` of `a` is `a.i`
        // (and is written back as a list).
        if let (Value::List(items) | Value::Tuple(items), true) = (value, holds_storage(value)) {
            for (i, item) in items.iter().enumerate() {
                path.push(KeyPart::Index(i as i64));
                self.walk(item, path)?;
                path.pop();
            }
            return Ok(());
        }
        if holds_storage(value) {
            return Err(self.locate(
                Error::invalid(
                    "tensors inside an object other than a dict, list or tuple are not supported",
                ),
                path,
            ));
        }
        self.leaves.push((path.clone(), Leaf::Value(value.clone())));
        Ok(())
    }

    /// Name the key path in an error about it, and point at `data.pkl`.
    pub(super) fn locate(&self, err: Error, path: &[KeyPart]) -> Error {
        let err = if path.is_empty() {
            err
        } else {
            err.tensor(KeyPart::flat_name(path))
        };
        err.at(self.pkl_offset)
    }

    pub(super) fn tensor(&mut self, call: &Value, rebuild: Rebuild) -> Result<SavedTensor> {
        let Value::Object(object) = call else {
            return Err(bad("tensor is not a call"));
        };
        let args = &object.args;
        match rebuild {
            Rebuild::Parameter => {
                let inner = args
                    .first()
                    .ok_or_else(|| bad("parameter without arguments"))?;
                match rebuild_function(inner) {
                    Some(kind @ (Rebuild::V2 | Rebuild::V3)) => self.tensor(inner, kind),
                    _ => Err(bad("parameter does not wrap a tensor")),
                }
            }
            Rebuild::V2 | Rebuild::V3 => self.view(args, rebuild == Rebuild::V3),
        }
    }

    /// `_rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks[, metadata])` or
    /// `_rebuild_tensor_v3(storage, offset, size, stride, requires_grad, hooks, dtype[, metadata])`.
    pub(super) fn view(&mut self, args: &[Value], v3: bool) -> Result<SavedTensor> {
        let fixed = if v3 { 7 } else { 6 };
        if args.len() != fixed && args.len() != fixed + 1 {
            return Err(bad(format!(
                "tensor rebuild takes {fixed} or {} arguments, not {}",
                fixed + 1,
                args.len()
            )));
        }
        // torch sets tensor metadata only for features ckpt cannot carry (e.g. conjugate views).
        match args.get(fixed) {
            None | Some(Value::None) => {}
            Some(Value::Dict(items)) if items.is_empty() => {}
            Some(other) => {
                return Err(Error::invalid(format!(
                    "tensor carries metadata {other:?}, which ckpt does not support"
                )))
            }
        }
        let (key, kind, numel_field) = storage_ref(args.first(), self.legacy)?;
        let storage_offset = nonneg(args.get(1), "storage offset")?;
        let shape = dims(args.get(2), "size")?;
        let strides = dims(args.get(3), "stride")?;
        if shape.len() != strides.len() {
            return Err(bad(format!(
                "tensor has {} sizes but {} strides",
                shape.len(),
                strides.len()
            )));
        }
        let dtype = match (kind, v3.then(|| args.get(6))) {
            (_, Some(Some(Value::Global(global)))) if global.module == "torch" => {
                let name = &global.name;
                let dtype = DType::from_torch_name(name).ok_or_else(|| {
                    Error::invalid(format!("tensor dtype `torch.{name}` is not supported"))
                })?;
                if matches!(kind, StorageKind::Typed(d) if d != dtype) {
                    return Err(bad(format!(
                        "tensor of dtype `torch.{name}` over a storage of another dtype"
                    )));
                }
                dtype
            }
            (_, Some(_)) => return Err(bad("tensor dtype is not a `torch` dtype")),
            (StorageKind::Typed(dtype), None) => dtype,
            // What torch's `_rebuild_tensor_v2` makes of an untyped storage: bytes.
            (StorageKind::Untyped, None) => DType::U8,
        };

        let (storage_numel, entry_offset) = self.storage(&key, kind, numel_field, dtype)?;
        check_view(storage_offset, &shape, &strides, storage_numel)
            .map_err(|e| e.at(entry_offset))?;
        Ok(SavedTensor {
            dtype,
            shape,
            strides,
            storage_offset,
            storage_key: key,
            storage_numel,
        })
    }

    /// Check storage `key` against its record and earlier references; returns its length in
    /// elements of `dtype` and where its record's data starts.
    pub(super) fn storage(
        &mut self,
        key: &str,
        kind: StorageKind,
        numel: u64,
        dtype: DType,
    ) -> Result<(u64, u64)> {
        match self.storages.get(key) {
            Some(&seen) if seen != (kind, numel) => {
                return Err(bad(format!(
                    "storage `{key}` is referenced as two different types or sizes"
                )))
            }
            Some(_) => {}
            None => {
                self.storages.insert(key.to_string(), (kind, numel));
            }
        }
        let entry = self.archive.storage(key).ok_or_else(|| {
            Error::invalid(format!(
                "storage `{key}` has no record `{}/data/{key}`",
                self.archive.prefix
            ))
        })?;
        readable(entry)?;
        let nbytes = kind
            .nbytes(numel)
            .ok_or_else(|| bad(format!("storage `{key}` size overflows")))?;
        if nbytes != entry.len {
            return Err(Error::invalid(format!(
                "storage `{key}` should be {nbytes} bytes but its record has {}",
                entry.len
            ))
            .at(entry.data_offset));
        }
        let size = dtype.size() as u64;
        if nbytes % size != 0 {
            return Err(Error::invalid(format!(
                "storage `{key}` of {nbytes} bytes is not a whole number of {dtype} elements"
            ))
            .at(entry.data_offset));
        }
        Ok((nbytes / size, entry.data_offset))
    }
}

/// Which rebuild function a value calls, if it is a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Rebuild {
    V2,
    V3,
    Parameter,
}

pub(super) fn rebuild_function(value: &Value) -> Option<Rebuild> {
    let Value::Object(object) = value else {
        return None;
    };
    match object.callable.as_global()? {
        ("torch._utils", "_rebuild_tensor_v2") => Some(Rebuild::V2),
        ("torch._utils", "_rebuild_tensor_v3") => Some(Rebuild::V3),
        ("torch._utils", "_rebuild_parameter" | "_rebuild_parameter_with_state") => {
            Some(Rebuild::Parameter)
        }
        _ => None,
    }
}

/// The dtype a `_rebuild_tensor_v3` call (or a parameter wrapping one) names, when it is a torch
/// dtype ckpt does not support.
pub(super) fn unsupported_dtype(value: &Value) -> Option<&str> {
    let Value::Object(object) = value else {
        return None;
    };
    match rebuild_function(value)? {
        Rebuild::Parameter => unsupported_dtype(object.args.first()?),
        Rebuild::V2 => None,
        Rebuild::V3 => match object.args.get(6)?.as_global()? {
            ("torch", name) if DType::from_torch_name(name).is_none() => Some(name),
            _ => None,
        },
    }
}

/// The items of a dict or of an `OrderedDict()` (whose items follow its creation, and whose
/// state, a module's `_metadata`, is dropped: safetensors and DCP cannot hold it either).
pub(super) fn dict_items(value: &Value) -> Option<&[(Value, Value)]> {
    match value {
        Value::Dict(items) => Some(items),
        Value::Object(object)
            if object.callable.as_global() == Some(("collections", "OrderedDict"))
                && object.args.is_empty()
                && object.list_items.is_empty() =>
        {
            Some(&object.dict_items)
        }
        _ => None,
    }
}

pub(super) fn key_part(key: &Value) -> Option<KeyPart> {
    match key {
        Value::Str(s) => Some(KeyPart::Key(s.clone())),
        Value::Int(i) => Some(KeyPart::IntKey(*i)),
        _ => None,
    }
}

/// True if a storage reference hides anywhere in `value`.
pub(super) fn holds_storage(value: &Value) -> bool {
    match value {
        Value::PersistentId(_) => true,
        Value::Tuple(items) | Value::List(items) | Value::Set(items) => {
            items.iter().any(holds_storage)
        }
        Value::Dict(items) => items
            .iter()
            .any(|(k, v)| holds_storage(k) || holds_storage(v)),
        Value::Object(object) => {
            holds_storage(&object.callable)
                || object.args.iter().any(holds_storage)
                || object
                    .dict_items
                    .iter()
                    .any(|(k, v)| holds_storage(k) || holds_storage(v))
                || object.list_items.iter().any(holds_storage)
                || object.state.as_ref().is_some_and(holds_storage)
        }
        _ => false,
    }
}

/// `('storage', storage_type, key, location, numel)`.
pub(super) fn storage_ref(
    value: Option<&Value>,
    legacy: bool,
) -> Result<(String, StorageKind, u64)> {
    let Some(Value::PersistentId(pid)) = value else {
        return Err(bad("tensor storage is not a persistent id"));
    };
    storage_id(pid, legacy)
}

/// `('storage', type, key, location, numel)`, or in a legacy file the same with a sixth item,
/// `view_metadata`, which torch < 1.0 set for storage views and ckpt supports only as `None`.
pub(super) fn storage_id(pid: &Value, legacy: bool) -> Result<(String, StorageKind, u64)> {
    let fields = match (pid.as_seq(), legacy) {
        (Some([tag, class, key, location, numel]), false) => [tag, class, key, location, numel],
        (Some([tag, class, key, location, numel, Value::None]), true) => {
            [tag, class, key, location, numel]
        }
        (Some([_, _, _, _, _, _]), true) => {
            return Err(Error::invalid(
                "legacy storage id carries a view of another storage (torch < 1.0), which ckpt does not support",
            ))
        }
        (_, false) => {
            return Err(bad(
                "storage persistent id is not `('storage', type, key, location, numel)`",
            ))
        }
        (_, true) => {
            return Err(bad(
                "storage persistent id is not `('storage', type, key, location, numel, view_metadata)`",
            ))
        }
    };
    let [tag, class, key, _location, numel] = fields;
    if tag.as_str() != Some("storage") {
        return Err(bad("storage persistent id does not start with `storage`"));
    }
    let kind = match class.as_global() {
        Some(("torch.storage", "UntypedStorage")) => StorageKind::Untyped,
        Some(("torch", name)) => match DType::from_storage_class(name) {
            Some(dtype) => StorageKind::Typed(dtype),
            None => {
                return Err(Error::invalid(format!(
                    "tensor storage `torch.{name}` holds a dtype ckpt does not support"
                )))
            }
        },
        _ => return Err(bad("storage type is not a torch storage class")),
    };
    let key = key
        .as_str()
        .ok_or_else(|| bad("storage key is not a string"))?
        .to_string();
    let numel = nonneg(Some(numel), "storage size")?;
    Ok((key, kind, numel))
}

/// A size or stride tuple (also accepted as `torch.Size(...)`).
pub(super) fn dims(value: Option<&Value>, what: &str) -> Result<Vec<u64>> {
    let items = match value {
        Some(Value::Object(object)) if object.callable.as_global() == Some(("torch", "Size")) => {
            object.args.first().and_then(Value::as_seq)
        }
        Some(v) => v.as_seq(),
        None => None,
    };
    let items = items.ok_or_else(|| bad(format!("tensor {what} is not a tuple")))?;
    items.iter().map(|v| nonneg(Some(v), what)).collect()
}

pub(super) fn nonneg(value: Option<&Value>, what: &str) -> Result<u64> {
    match value {
        Some(Value::Int(i)) => {
            u64::try_from(*i).map_err(|_| bad(format!("tensor {what} {i} is negative")))
        }
        _ => Err(bad(format!("tensor {what} is not an integer"))),
    }
}

/// Every element the view reaches must lie inside the storage.
pub(super) fn check_view(
    offset: u64,
    shape: &[u64],
    strides: &[u64],
    storage_numel: u64,
) -> Result<()> {
    let count = numel(shape).ok_or_else(|| bad("tensor element count overflows"))?;
    if count == 0 {
        return Ok(());
    }
    let last = shape
        .iter()
        .zip(strides)
        .try_fold(offset, |acc, (&size, &stride)| {
            acc.checked_add((size - 1).checked_mul(stride)?)
        });
    match last {
        Some(last) if last < storage_numel => Ok(()),
        _ => Err(Error::invalid(format!(
            "tensor view (offset {offset}, size {shape:?}, stride {strides:?}) reaches past its storage of {storage_numel} elements"
        ))),
    }
}
