//! Reading: the entries of an archive that spans a byte slice, checked as miniz (and so
//! torch.load) checks them, and the bytes of deflated entries.

use super::records::{self, Fields};
use super::*;

/// One entry of an archive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ZipEntry {
    pub name: String,
    /// Where the entry's bytes start, relative to the start of the slice given to [`read_entries`].
    pub data_offset: u64,
    /// Length of the entry's bytes (once inflated, for a deflated entry).
    pub len: u64,
    /// The general-purpose flags of its central directory header.
    pub flags: u16,
    /// For a deflated entry, the length of its deflate stream at `data_offset`; `None` when the
    /// entry is stored.
    pub deflated: Option<u64>,
}

impl ZipEntry {
    /// Bytes the entry's data takes in the archive.
    pub fn stored_len(&self) -> u64 {
        self.deflated.unwrap_or(self.len)
    }
}

/// ZIP compression methods miniz, and so torch.load, reads.
const METHOD_STORED: u16 = 0;
const METHOD_DEFLATED: u16 = 8;

/// The first `len` bytes of the raw deflate stream `data` (fewer if it ends first).
pub fn inflate_prefix(data: &[u8], len: u64) -> Result<Vec<u8>> {
    use std::io::Read;
    let mut out = Vec::new();
    flate2::read::DeflateDecoder::new(data)
        .take(len)
        .read_to_end(&mut out)
        .map_err(|e| invalid(format!("cannot inflate a deflated zip entry: {e}")))?;
    Ok(out)
}

/// Check that a deflated `entry` inflates to exactly its length, without holding it. Its CRC is
/// not checked: torch.load does not check it either (a wrong one is read), and `verify --deep`
/// with a manifest is what catches changed bytes.
pub fn check_inflates(bytes: &[u8], entry: &ZipEntry) -> Result<()> {
    use std::io::Read;
    let Some(deflated) = entry.deflated else {
        return Ok(());
    };
    let data = slice(bytes, entry.data_offset, deflated, "entry data")?;
    let mut decoder = flate2::read::DeflateDecoder::new(data).take(entry.len.saturating_add(1));
    let mut total = 0u64;
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = decoder.read(&mut buf).map_err(|e| {
            invalid(format!("cannot inflate zip entry `{}`: {e}", entry.name)).at(entry.data_offset)
        })?;
        if n == 0 {
            break;
        }
        total += n as u64;
    }
    if total != entry.len {
        return Err(invalid(format!(
            "zip entry `{}` inflates to {}{} bytes, but its header says {}",
            entry.name,
            total.min(entry.len),
            if total > entry.len { " or more" } else { "" },
            entry.len
        ))
        .at(entry.data_offset));
    }
    Ok(())
}

/// The bytes of `entry` of the archive `bytes`: a slice of it when stored, inflated (and checked
/// to be exactly its declared length) when deflated. A deflate bomb stops at the
/// declared length plus one byte.
pub fn inflate<'a>(bytes: &'a [u8], entry: &ZipEntry) -> Result<std::borrow::Cow<'a, [u8]>> {
    let data = slice(bytes, entry.data_offset, entry.stored_len(), "entry data")?;
    if entry.deflated.is_none() {
        return Ok(std::borrow::Cow::Borrowed(data));
    }
    let out =
        inflate_prefix(data, entry.len.saturating_add(1)).map_err(|e| e.at(entry.data_offset))?;
    if out.len() as u64 != entry.len {
        return Err(invalid(format!(
            "zip entry `{}` inflates to {}{} bytes, but its header says {}",
            entry.name,
            out.len().min(entry.len as usize),
            if out.len() as u64 > entry.len {
                " or more"
            } else {
                ""
            },
            entry.len
        ))
        .at(entry.data_offset));
    }
    Ok(std::borrow::Cow::Owned(out))
}

/// Find every entry of the ZIP archive that spans exactly `bytes`.
///
/// Only what torch.save writes is accepted: stored entries, one disk, no encryption. The archive
/// must end at the end of the slice (an embedded DCP item located at the wrong offset or length
/// fails here rather than yielding wrong data). Entries come back in central-directory order.
pub fn read_entries(bytes: &[u8]) -> Result<Vec<ZipEntry>> {
    let end = find_end_record(bytes)?;
    let mut entries = Vec::new();
    // Where each entry's central header is, for the duplicate check.
    let mut central_at = Vec::new();
    // (local header offset, end of data and descriptor, index) for the overlap check.
    let mut spans = Vec::new();
    let mut pos = end.cd_offset;
    let cd_end = end.cd_offset + end.cd_size;
    for _ in 0..end.entries {
        let central = read_central(bytes, pos, cd_end)?;
        pos = central.next;
        let (entry, entry_end) = read_local(bytes, &central, end.cd_offset)?;
        spans.push((central.local_offset, entry_end, entries.len()));
        central_at.push(central.at);
        entries.push(entry);
    }
    // By sorting, not a set of copied names: DCP reads a million of these small archives.
    let mut by_name: Vec<usize> = (0..entries.len()).collect();
    by_name.sort_unstable_by(|&a, &b| entries[a].name.cmp(&entries[b].name).then(a.cmp(&b)));
    if let Some(pair) = by_name
        .windows(2)
        .find(|w| entries[w[0]].name == entries[w[1]].name)
    {
        let second = pair[1];
        return Err(
            invalid(format!("duplicate zip entry `{}`", entries[second].name))
                .at(central_at[second]),
        );
    }
    if pos != cd_end {
        return Err(invalid(format!(
            "zip central directory is {} bytes but its {} entries take {}",
            end.cd_size,
            end.entries,
            pos - end.cd_offset
        ))
        .at(end.cd_offset));
    }
    spans.sort_unstable();
    for pair in spans.windows(2) {
        if let [(_, first_end, first), (second_start, _, second)] = pair {
            if first_end > second_start {
                let (a, b) = (&entries[*first].name, &entries[*second].name);
                return Err(
                    invalid(format!("zip entries `{a}` and `{b}` overlap")).at(*second_start)
                );
            }
        }
    }
    Ok(entries)
}

/// Where the central directory is, from the (zip64) end records.
struct EndRecord {
    entries: u64,
    cd_offset: u64,
    cd_size: u64,
}

fn find_end_record(bytes: &[u8]) -> Result<EndRecord> {
    let len = bytes.len() as u64;
    if len < EOCD_LEN {
        return Err(invalid(format!(
            "not a zip archive: {len} bytes is too short for an end-of-central-directory record"
        )));
    }
    // The classic end record is the last 22 bytes plus a comment; accept only a comment that
    // reaches exactly the end of the slice, so trailing bytes are an error, not ignored.
    let Some((eocd_at, classic)) = records::EndRecord::find(bytes) else {
        return Err(invalid(
            "not a zip archive: no end-of-central-directory record at the end of the data",
        ));
    };
    let (disk, cd_disk) = (classic.disk, classic.cd_disk);
    if (disk != 0 && disk != 0xFFFF)
        || (cd_disk != 0 && cd_disk != 0xFFFF)
        || classic.disk_entries != classic.entries
    {
        return Err(invalid("multi-disk zip archives are not supported").at(eocd_at));
    }
    let (entries, cd_size, cd_offset) = (classic.entries, classic.cd_size, classic.cd_offset);

    let locator_at = eocd_at.checked_sub(ZIP64_LOCATOR_LEN);
    let locator = locator_at
        .map(|at| slice(bytes, at, ZIP64_LOCATOR_LEN, "zip64 locator"))
        .transpose()?
        .and_then(records::Zip64Locator::parse);
    let (end, records_start) = match (locator, locator_at) {
        (Some(locator), Some(locator_at)) => {
            let eocd64_at = locator.end_at;
            if locator.end_disk != 0 || locator.disks > 1 {
                return Err(invalid("multi-disk zip archives are not supported").at(locator_at));
            }
            if !fits(eocd64_at, ZIP64_EOCD_LEN, locator_at) {
                return Err(invalid(format!(
                    "zip64 end record offset {eocd64_at} does not fit before its locator"
                ))
                .at(locator_at));
            }
            let record = slice(bytes, eocd64_at, ZIP64_EOCD_LEN, "zip64 end record")?;
            let Some(wide) = records::Zip64End::parse(record) else {
                return Err(invalid(
                    "zip64 end record signature not found where its locator points",
                )
                .at(eocd64_at));
            };
            if wide.disk != 0 || wide.cd_disk != 0 || wide.disk_entries != wide.entries {
                return Err(invalid("multi-disk zip archives are not supported").at(eocd64_at));
            }
            // The classic record repeats each value unless it saturated; a mismatch is corruption.
            let agrees =
                |short: u64, saturated: u64, long: u64| short == saturated || short == long;
            if !agrees(entries, 0xFFFF, wide.entries)
                || !agrees(cd_size, U32_LIMIT, wide.cd_size)
                || !agrees(cd_offset, U32_LIMIT, wide.cd_offset)
            {
                return Err(invalid("zip end record and zip64 end record disagree").at(eocd_at));
            }
            let end = EndRecord {
                entries: wide.entries,
                cd_offset: wide.cd_offset,
                cd_size: wide.cd_size,
            };
            (end, eocd64_at)
        }
        _ => {
            if classic.needs_zip64() {
                return Err(
                    invalid("zip end record needs a zip64 end record, which is missing")
                        .at(eocd_at),
                );
            }
            (
                EndRecord {
                    entries,
                    cd_offset,
                    cd_size,
                },
                eocd_at,
            )
        }
    };
    if end.entries > MAX_ENTRIES {
        return Err(invalid(format!(
            "zip archive claims {} entries, more than the {MAX_ENTRIES} ckpt accepts",
            end.entries
        ))
        .at(eocd_at));
    }
    if !fits(end.cd_offset, end.cd_size, records_start) {
        return Err(invalid(format!(
            "zip central directory ({} bytes at {}) runs past the end records",
            end.cd_size, end.cd_offset
        ))
        .at(eocd_at));
    }
    if end.entries.saturating_mul(CENTRAL_HEADER_LEN) > end.cd_size {
        return Err(invalid(format!(
            "zip central directory of {} bytes cannot hold {} entries",
            end.cd_size, end.entries
        ))
        .at(end.cd_offset));
    }
    Ok(end)
}

/// What a central directory header says about one entry.
struct Central {
    /// Where the header is.
    at: u64,
    /// Where the next header starts.
    next: u64,
    name: String,
    name_bytes: Vec<u8>,
    flags: u16,
    len: u64,
    /// The deflate stream's length, for a deflated entry.
    deflated: Option<u64>,
    crc: u32,
    local_offset: u64,
}

fn read_central(bytes: &[u8], at: u64, cd_end: u64) -> Result<Central> {
    if !fits(at, CENTRAL_HEADER_LEN, cd_end) {
        return Err(invalid("zip central directory ends inside an entry header").at(at));
    }
    let header = slice(bytes, at, CENTRAL_HEADER_LEN, "central header")?;
    let Some(header) = records::CentralHeader::parse(header) else {
        return Err(invalid("zip central directory header signature not found").at(at));
    };
    let records::EntryFields {
        flags,
        method,
        crc,
        name_len,
        extra_len,
        ..
    } = header.entry;
    let disk = header.disk;

    let next = at + header.total_len();
    if next > cd_end {
        return Err(invalid("zip central directory ends inside an entry header").at(at));
    }
    let name_bytes = slice(bytes, at + CENTRAL_HEADER_LEN, name_len, "entry name")?.to_vec();
    let name = entry_name(&name_bytes).map_err(|e| e.at(at + CENTRAL_HEADER_LEN))?;
    let extra = slice(
        bytes,
        at + CENTRAL_HEADER_LEN + name_len,
        extra_len,
        "extra field",
    )?;

    if flags & FLAG_ENCRYPTED != 0 {
        return Err(invalid(format!("zip entry `{name}` is encrypted")).at(at));
    }
    if flags & FLAG_MASKED_HEADERS != 0 {
        return Err(invalid(format!(
            "zip entry `{name}` has masked local headers (flag bit 13), which torch.load refuses"
        ))
        .at(at));
    }
    if method != METHOD_STORED && method != METHOD_DEFLATED {
        return Err(invalid(format!(
            "zip entry `{name}` is compressed with method {method}; torch.load reads only stored and deflated (8) entries"
        ))
        .at(at));
    }
    if disk != 0 && disk != 0xFFFF {
        return Err(invalid("multi-disk zip archives are not supported").at(at));
    }

    let (len, compressed, local_offset) = header.wide(extra).map_err(|what| {
        invalid(format!(
            "zip entry `{name}` lacks the zip64 {what} its header points to"
        ))
        .at(at)
    })?;
    if method == METHOD_STORED && compressed != len {
        return Err(invalid(format!(
            "zip entry `{name}` is stored but its compressed size {compressed} differs from its size {len}"
        ))
        .at(at));
    }
    Ok(Central {
        at,
        next,
        flags,
        name,
        name_bytes,
        len,
        deflated: (method == METHOD_DEFLATED).then_some(compressed),
        crc,
        local_offset,
    })
}

/// Check the local header (and data descriptor) against the central one; returns the entry and
/// where its descriptor ends.
fn read_local(bytes: &[u8], central: &Central, cd_offset: u64) -> Result<(ZipEntry, u64)> {
    let at = central.local_offset;
    let name = &central.name;
    let local = check_local_header(bytes, central)?;
    let stored_len = central.deflated.unwrap_or(central.len);
    let data_offset = at + LOCAL_HEADER_LEN + local.name_len + local.extra_len;
    let data_end = data_offset
        .checked_add(stored_len)
        .filter(|&e| e <= cd_offset)
        .ok_or_else(|| {
            invalid(format!(
                "zip entry `{name}` ({stored_len} bytes at {data_offset}) runs into the central directory"
            ))
            .at(at)
        })?;
    let end = if local.flags & FLAG_DESCRIPTOR != 0 {
        check_descriptor(bytes, central, &local, data_end, cd_offset)?
    } else {
        data_end
    };
    Ok((
        ZipEntry {
            name: name.clone(),
            data_offset,
            len: central.len,
            flags: central.flags,
            deflated: central.deflated,
        },
        end,
    ))
}

/// The fields of `central`'s local header, once its name, method, sizes and CRC agree with
/// the central directory's.
fn check_local_header(bytes: &[u8], central: &Central) -> Result<records::EntryFields> {
    let at = central.local_offset;
    let name = &central.name;
    let header = slice(bytes, at, LOCAL_HEADER_LEN, "local header").map_err(|_| {
        invalid(format!(
            "zip entry `{name}` points past the end of the archive"
        ))
        .at(central.at)
    })?;
    let Some(local) = records::LocalHeader::parse(header) else {
        return Err(invalid(format!(
            "zip local header of `{name}` not found where the central directory points"
        ))
        .at(at));
    };
    let records::EntryFields {
        flags,
        method,
        crc,
        compressed32,
        len32,
        name_len,
        ..
    } = local.entry;

    if slice(bytes, at + LOCAL_HEADER_LEN, name_len, "entry name")? != central.name_bytes.as_slice()
    {
        return Err(invalid(format!(
            "zip local header of `{name}` names a different entry"
        ))
        .at(at));
    }
    let central_method = if central.deflated.is_some() {
        METHOD_DEFLATED
    } else {
        METHOD_STORED
    };
    if method != central_method {
        return Err(invalid(format!(
            "zip entry `{name}`: local header method {method} disagrees with central directory method {central_method}"
        ))
        .at(at));
    }
    let stored_len = central.deflated.unwrap_or(central.len);
    // With a data descriptor the local fields may be zero (miniz writes zeros); a zip64 entry
    // saturates them; otherwise they must repeat the central directory.
    let descriptor = flags & FLAG_DESCRIPTOR != 0;
    let agrees = |local: u32, central: u64| {
        (descriptor && local == 0) || u64::from(local) == U32_LIMIT || u64::from(local) == central
    };
    if !agrees(len32, central.len) || !agrees(compressed32, stored_len) {
        return Err(invalid(format!(
            "zip entry `{name}`: local header size {len32} disagrees with central directory size {}",
            central.len
        ))
        .at(at));
    }
    if !(descriptor && crc == 0) && crc != central.crc {
        return Err(invalid(format!(
            "zip entry `{name}`: local header CRC {crc:08x} disagrees with central directory CRC {:08x}",
            central.crc
        ))
        .at(at));
    }
    Ok(local.entry)
}

/// Where the data descriptor after `central`'s data (ending at `data_end`) ends, once it agrees
/// with the central directory.
fn check_descriptor(
    bytes: &[u8],
    central: &Central,
    local: &records::EntryFields,
    data_end: u64,
    cd_offset: u64,
) -> Result<u64> {
    let name = &central.name;
    let stored_len = central.deflated.unwrap_or(central.len);
    // torch's local headers hold zeros, so the descriptor is the only other witness of the
    // size: a central directory that claims more or less than was written is caught here.
    let extra = slice(
        bytes,
        central.local_offset + LOCAL_HEADER_LEN + local.name_len,
        local.extra_len,
        "extra field",
    )?;
    let wide = find_extra(extra, ZIP64_EXTRA_ID).is_some();
    let descriptor_len = if wide { 24 } else { 16 };
    let bad = || {
        invalid(format!(
            "zip entry `{name}`: data descriptor disagrees with the central directory (size {}, CRC {:08x})",
            central.len, central.crc
        ))
        .at(data_end)
    };
    let window = (data_end + descriptor_len).min(cd_offset) - data_end;
    let mut f = Fields::new(slice(bytes, data_end, window, "data descriptor")?);
    // The signature is optional in the spec; miniz always writes it.
    let has_sig = f.bytes.get(..4) == Some(&DESCRIPTOR_SIG.to_le_bytes()[..]);
    if has_sig {
        f.pos = 4;
    }
    let crc = f.u32().ok_or_else(bad)?;
    let (len, compressed) = if wide {
        (f.u64(), f.u64())
    } else {
        (f.u32().map(u64::from), f.u32().map(u64::from))
    };
    if crc != central.crc || len != Some(central.len) || compressed != Some(stored_len) {
        return Err(bad());
    }
    Ok(data_end + f.pos as u64)
}

fn entry_name(bytes: &[u8]) -> Result<String> {
    if bytes.contains(&0) {
        return Err(invalid("zip entry name contains a NUL byte"));
    }
    String::from_utf8(bytes.to_vec()).map_err(|_| invalid("zip entry name is not UTF-8"))
}
