//! The legacy (pre-1.6, non-zip) torch.save format: a magic number, a protocol version and
//! system info pickled in a row, then the object, the storage keys and each storage's bytes.

use super::*;

/// `torch.serialization.MAGIC_NUMBER`, little-endian as a pickle's `LONG1` carries it.
pub(super) const LEGACY_MAGIC: [u8; 10] =
    [0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19];
/// `torch.serialization.PROTOCOL_VERSION`.
pub(super) const LEGACY_PROTOCOL: i64 = 1001;

/// Read a legacy (pre-1.6, non-zip) torch.save file, as `torch.serialization._legacy_load`
/// reads it: five pickles back to back (the magic number, the protocol version, `sys_info`, the
/// object, the list of storage keys), then each listed storage as an 8-byte little-endian
/// element count and its bytes. Each storage becomes a record of the [`Archive`] (named as in
/// the zip format, `archive/data/{key}`) at its bytes' offset, so tensors are read in place
/// exactly as from a zip. Bytes after the last storage are ignored, as torch ignores them.
pub(super) fn read_legacy(bytes: &[u8]) -> Result<Archive> {
    const PREFIX: &str = "archive";
    // One pickle at `at` with the weights-only unpickler's rules; the value and where it ends.
    let pickle_at = |at: usize, what: &str| -> Result<(Value, usize)> {
        let rest = bytes.get(at..).unwrap_or_default();
        // The reader takes less than 4 GiB; a pickle ends long before the storages do.
        let rest = &rest[..rest.len().min(u32::MAX as usize - 1)];
        let graph = pickle::parse(rest, &TorchGlobals, Limits::default())
            .map_err(|e| pickle_error(e, what, at as u64))?;
        let end = graph.end();
        let value = graph.root().to_value();
        if let Some((opcode, op_at)) = opcode_torch_refuses(&rest[..end]) {
            return Err(Error::invalid(format!(
                "{what} uses pickle opcode 0x{opcode:02x}, which torch.load(weights_only=True) refuses"
            ))
            .at((at + op_at) as u64));
        }
        check_calls(&value).map_err(|e| e.at(at as u64))?;
        Ok((value, at + end))
    };
    let (magic, at) = pickle_at(0, "the magic number pickle")?;
    if !matches!(&magic, Value::BigInt(b) if b.as_slice() == LEGACY_MAGIC) {
        return Err(Error::invalid(
            "legacy torch.save file has the wrong magic number (torch: \"Invalid magic number; corrupt file?\")",
        )
        .at(0));
    }
    let (protocol, protocol_end) = pickle_at(at, "the protocol version pickle")?;
    if protocol.as_int() != Some(LEGACY_PROTOCOL) || matches!(protocol, Value::Bool(_)) {
        return Err(Error::invalid(format!(
            "legacy torch.save file has protocol version {}, not {LEGACY_PROTOCOL}",
            protocol.to_json()
        ))
        .at(at as u64));
    }
    // `sys_info` (byte order, type sizes) is read but not used, as torch does.
    let (_, data_at) = pickle_at(protocol_end, "the sys_info pickle")?;
    let (value, keys_at) = pickle_at(data_at, "the data pickle")?;
    let (keys, mut offset) = pickle_at(keys_at, "the storage key list")?;
    let Some(keys) = keys.as_seq().filter(|_| matches!(keys, Value::List(_))) else {
        return Err(
            bad("the storage key list of a legacy torch.save file is not a list")
                .at(keys_at as u64),
        );
    };

    // The storages the object names, by key: a listed key must be one of them.
    let mut named = HashMap::new();
    collect_storage_ids(&value, &mut named).map_err(|e| e.at(data_at as u64))?;
    let mut entries = Vec::with_capacity(keys.len());
    for key in keys {
        let key = key
            .as_str()
            .ok_or_else(|| bad("a storage key is not a string").at(keys_at as u64))?;
        let &(kind, numel) = named.get(key).ok_or_else(|| {
            Error::invalid(format!(
                "storage `{key}` is listed but the object never refers to it (torch: \"storage key not found\")"
            ))
            .at(keys_at as u64)
        })?;
        let size = match kind {
            StorageKind::Typed(dtype) => dtype.size() as u64,
            StorageKind::Untyped => 1,
        };
        let head = bytes.get(offset..offset + 8).ok_or_else(|| {
            Error::invalid(format!("file ends before storage `{key}`")).at(offset as u64)
        })?;
        let saved = u64::from_le_bytes(head.try_into().unwrap_or_default());
        let nbytes = numel
            .checked_mul(size)
            .ok_or_else(|| bad(format!("storage `{key}` size overflows")))?;
        if saved.checked_mul(size) != Some(nbytes) {
            return Err(Error::invalid(format!(
                "storage `{key}` holds {saved} elements in the file but {numel} in the object (torch: \"storage has wrong byte size\")"
            ))
            .at(offset as u64));
        }
        let data_offset = offset as u64 + 8;
        let end = data_offset
            .checked_add(nbytes)
            .filter(|&e| e <= bytes.len() as u64)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "file ends inside storage `{key}` ({nbytes} bytes at {data_offset})"
                ))
                .at(data_offset)
                .hint("the file is truncated: copy it again")
            })?;
        entries.push(ZipEntry {
            name: format!("{PREFIX}/data/{key}"),
            data_offset,
            len: nbytes,
            flags: 0,
            deflated: None,
        });
        offset = end as usize;
    }
    entries.sort_unstable_by(|a, b| a.name.cmp(&b.name));
    if let Some(pair) = entries.windows(2).find(|w| w[0].name == w[1].name) {
        return Err(
            Error::invalid(format!("storage `{}` is listed twice", pair[1].name))
                .at(keys_at as u64),
        );
    }
    let archive = Archive {
        prefix: PREFIX.to_string(),
        entries,
        leaves: Vec::new(),
    };
    let mut reader = Interpreter {
        archive: &archive,
        pkl_offset: data_at as u64,
        storages: HashMap::new(),
        leaves: Vec::new(),
        legacy: true,
    };
    reader.walk(&value, &mut Vec::new())?;
    let leaves = reader.leaves;
    Ok(Archive { leaves, ..archive })
}

/// Every storage id (persistent id) in `value`, by key; two ids of one key must agree.
pub(super) fn collect_storage_ids(
    value: &Value,
    out: &mut HashMap<String, (StorageKind, u64)>,
) -> Result<()> {
    match value {
        Value::PersistentId(pid) => {
            let (key, kind, numel) = storage_id(pid, true)?;
            if let Some(&seen) = out.get(&key) {
                if seen != (kind, numel) {
                    return Err(bad(format!(
                        "storage `{key}` is referenced as two different types or sizes"
                    )));
                }
            }
            out.insert(key, (kind, numel));
            Ok(())
        }
        Value::Tuple(items) | Value::List(items) | Value::Set(items) => {
            items.iter().try_for_each(|v| collect_storage_ids(v, out))
        }
        Value::Dict(items) => items.iter().try_for_each(|(k, v)| {
            collect_storage_ids(k, out)?;
            collect_storage_ids(v, out)
        }),
        Value::Object(o) => {
            collect_storage_ids(&o.callable, out)?;
            o.args
                .iter()
                .try_for_each(|v| collect_storage_ids(v, out))?;
            o.list_items
                .iter()
                .try_for_each(|v| collect_storage_ids(v, out))?;
            o.dict_items.iter().try_for_each(|(k, v)| {
                collect_storage_ids(k, out)?;
                collect_storage_ids(v, out)
            })?;
            o.state
                .as_ref()
                .map_or(Ok(()), |s| collect_storage_ids(s, out))
        }
        _ => Ok(()),
    }
}
