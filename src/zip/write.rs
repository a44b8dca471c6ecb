//! Writing: the framing of an archive laid out exactly as torch.save's miniz writes it, for the
//! executor to fill with record data.

use super::*;

/// One record to place in an archive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ZipRecord {
    pub name: String,
    /// Data length; for a record with `content` it must equal `content.len()` (the content wins).
    pub len: u64,
    /// The bytes, for small records written with the framing; `None` for data the caller writes
    /// at [`ZipLayout::data_offsets`] later.
    pub content: Option<Vec<u8>>,
}

/// Every byte of an archive except the data of records without content, by position.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ZipLayout {
    /// Total archive length.
    pub len: u64,
    /// Per record, where its data starts.
    pub data_offsets: Vec<u64>,
    /// Framing bytes and the contents of literal records, as non-overlapping runs in offset order.
    /// CRC slots of caller-filled records hold zeros until patched.
    pub literals: Vec<(u64, Vec<u8>)>,
    /// Per record, the offsets where its CRC-32 (4 bytes little-endian) must be written: the data
    /// descriptor and the central header. Empty for literal records, whose CRCs are in place.
    pub crc_slots: Vec<Vec<u64>>,
}

impl ZipLayout {
    /// The writes that record `record`'s CRC-32 `crc` into the archive.
    pub fn crc_patches(&self, record: usize, crc: u32) -> Vec<(u64, [u8; 4])> {
        self.crc_slots
            .get(record)
            .map(|slots| slots.iter().map(|&at| (at, crc.to_le_bytes())).collect())
            .unwrap_or_default()
    }
}

/// Lay out an archive of `records`, in order, exactly as torch.save would write them.
///
/// Names must be shorter than 64 KiB (ZIP stores their length in 16 bits); torch's are short paths.
pub fn layout(records: &[ZipRecord]) -> ZipLayout {
    let mut out = Literals::default();
    let mut data_offsets = Vec::with_capacity(records.len());
    let mut crc_slots = Vec::with_capacity(records.len());
    let mut placed = Vec::with_capacity(records.len());
    for record in records {
        let (local, data_offset, slots) = place_local(&mut out, record);
        data_offsets.push(data_offset);
        crc_slots.push(slots);
        placed.push(local);
    }

    let cd_offset = out.pos;
    for (index, local) in placed.iter().enumerate() {
        if local.filled_later {
            if let Some(slots) = crc_slots.get_mut(index) {
                slots.push(out.pos + 16);
            }
        }
        out.emit(&central_header(local));
    }
    let cd_size = out.pos - cd_offset;
    let zip64_eocd_offset = out.pos;
    out.emit(&end_records(
        records.len() as u64,
        cd_size,
        cd_offset,
        zip64_eocd_offset,
    ));

    ZipLayout {
        len: out.pos,
        data_offsets,
        literals: out.runs,
        crc_slots,
    }
}

/// What the central directory repeats of a record laid out before it.
struct Placed<'a> {
    name: &'a [u8],
    local_offset: u64,
    len: u64,
    crc: u32,
    /// The caller writes the data, and the CRC once it is known.
    filled_later: bool,
}

/// Lay out `record` at `out`'s end: its local header, its data (or room for it) and its data
/// descriptor. Gives what the central directory needs, where the data starts and where the
/// record's CRC is to be written so far.
fn place_local<'a>(out: &mut Literals, record: &'a ZipRecord) -> (Placed<'a>, u64, Vec<u64>) {
    let local_offset = out.pos;
    let len = record
        .content
        .as_ref()
        .map_or(record.len, |c| c.len() as u64);
    let zip64 = zip64_fields(len, local_offset, true);
    let name = record.name.as_bytes();
    out.emit(&local_header(name, len, local_offset, &zip64));

    let data_offset = out.pos;
    let crc = match &record.content {
        Some(content) => {
            out.emit(content);
            crc32fast::hash(content)
        }
        None => {
            out.skip(len);
            0
        }
    };
    let mut placed = Placed {
        name,
        local_offset,
        len,
        crc,
        filled_later: false,
    };
    let mut slots = Vec::new();
    if record_flags(len) & FLAG_DESCRIPTOR == 0 {
        // miniz writes no descriptor for an empty record; its CRC is 0, already in place.
        return (placed, data_offset, slots);
    }

    let mut descriptor = Vec::with_capacity(24);
    put32(&mut descriptor, DESCRIPTOR_SIG);
    put32(&mut descriptor, crc);
    // miniz widens the descriptor's sizes whenever the local header has a zip64 field.
    if zip64.is_empty() {
        put32(&mut descriptor, len as u32);
        put32(&mut descriptor, len as u32);
    } else {
        put64(&mut descriptor, len);
        put64(&mut descriptor, len);
    }
    if record.content.is_none() {
        slots.push(out.pos + 4);
    }
    out.emit(&descriptor);
    placed.filled_later = record.content.is_none();
    (placed, data_offset, slots)
}

/// The local header of a record named `name`, of `len` bytes, at `local_offset`, padded so
/// that its data starts on an alignment boundary.
fn local_header(name: &[u8], len: u64, local_offset: u64, zip64: &[u8]) -> Vec<u8> {
    // torch pads so that data starts on an alignment boundary, counting the zip64 field that
    // miniz puts before the padding and the padding field's own 4-byte header (`getPadding`
    // in inline_container.cc).
    let unpadded = local_offset + LOCAL_HEADER_LEN + name.len() as u64 + zip64.len() as u64 + 4;
    let padding = (ALIGNMENT - unpadded % ALIGNMENT) % ALIGNMENT;

    let mut header = Vec::new();
    put32(&mut header, LOCAL_SIG);
    put16(&mut header, 0); // version needed
    put16(&mut header, record_flags(len));
    put16(&mut header, 0); // method: stored
    put16(&mut header, 0); // time
    put16(&mut header, 0); // date
    put32(&mut header, 0); // crc, in the descriptor
    put32(&mut header, 0); // compressed size, in the descriptor
    put32(&mut header, 0); // uncompressed size, in the descriptor
    put16(&mut header, len16(name.len()));
    put16(&mut header, len16(zip64.len() + 4 + padding as usize));
    header.extend_from_slice(name);
    header.extend_from_slice(zip64);
    header.extend_from_slice(PADDING_EXTRA_ID);
    put16(&mut header, padding as u16);
    header.resize(header.len() + padding as usize, b'Z');
    header
}

/// The central directory header of a record laid out as `local` says.
fn central_header(local: &Placed) -> Vec<u8> {
    let Placed {
        name,
        local_offset,
        len,
        crc,
        ..
    } = *local;
    let zip64 = zip64_fields(len, local_offset, false);
    let mut header = Vec::with_capacity(CENTRAL_HEADER_LEN as usize + name.len() + zip64.len());
    put32(&mut header, CENTRAL_SIG);
    put16(&mut header, 0); // version made by
    put16(&mut header, 0); // version needed
    put16(&mut header, record_flags(len));
    put16(&mut header, 0); // method: stored
    put16(&mut header, 0); // time
    put16(&mut header, 0); // date
    put32(&mut header, crc);
    put32(&mut header, len.min(U32_LIMIT) as u32);
    put32(&mut header, len.min(U32_LIMIT) as u32);
    put16(&mut header, len16(name.len()));
    put16(&mut header, len16(zip64.len()));
    put16(&mut header, 0); // comment length
    put16(&mut header, 0); // disk
    put16(&mut header, 0); // internal attributes
    put32(&mut header, 0); // external attributes
    put32(&mut header, local_offset.min(U32_LIMIT) as u32);
    header.extend_from_slice(name);
    header.extend_from_slice(&zip64);
    header
}

/// The zip64 end of central directory record, its locator and the classic end record, for a
/// central directory of `count` records and `cd_size` bytes at `cd_offset`, followed by the
/// zip64 record at `zip64_eocd_offset`.
fn end_records(count: u64, cd_size: u64, cd_offset: u64, zip64_eocd_offset: u64) -> Vec<u8> {
    let mut tail = Vec::with_capacity((ZIP64_EOCD_LEN + ZIP64_LOCATOR_LEN + EOCD_LEN) as usize);
    put32(&mut tail, ZIP64_EOCD_SIG);
    put64(&mut tail, ZIP64_EOCD_LEN - 12); // size of the rest of the record
    put16(&mut tail, ZIP64_VERSION_MADE_BY);
    put16(&mut tail, ZIP64_VERSION_NEEDED);
    put32(&mut tail, 0); // this disk
    put32(&mut tail, 0); // disk of the central directory
    put64(&mut tail, count);
    put64(&mut tail, count);
    put64(&mut tail, cd_size);
    put64(&mut tail, cd_offset);
    put32(&mut tail, ZIP64_LOCATOR_SIG);
    put32(&mut tail, 0); // disk of the zip64 end record
    put64(&mut tail, zip64_eocd_offset);
    put32(&mut tail, 1); // total disks
    put32(&mut tail, EOCD_SIG);
    put16(&mut tail, 0); // this disk
    put16(&mut tail, 0); // disk of the central directory
    put16(&mut tail, count.min(0xFFFF) as u16);
    put16(&mut tail, count.min(0xFFFF) as u16);
    put32(&mut tail, cd_size.min(U32_LIMIT) as u32);
    put32(&mut tail, cd_offset.min(U32_LIMIT) as u32);
    put16(&mut tail, 0); // comment length
    tail
}

/// Write a whole archive to memory. `fill` supplies, in order, the data of each record whose
/// `content` is `None` (each exactly `len` bytes); meant for small archives such as a DCP
/// non-tensor item.
pub fn build(records: &[ZipRecord], fill: &[&[u8]]) -> Result<Vec<u8>> {
    let plan = layout(records);
    let len = usize::try_from(plan.len).map_err(|_| {
        invalid(format!(
            "zip archive of {} bytes does not fit in memory",
            plan.len
        ))
    })?;
    let mut bytes = vec![0u8; len];
    for (at, run) in &plan.literals {
        write_at(&mut bytes, *at, run);
    }
    let mut fill = fill.iter();
    for (index, record) in records.iter().enumerate() {
        if record.content.is_some() {
            continue;
        }
        let Some(data) = fill.next() else {
            return Err(invalid(format!(
                "no data given for zip record `{}`",
                record.name
            )));
        };
        if data.len() as u64 != record.len {
            return Err(invalid(format!(
                "zip record `{}` is {} bytes but {} were given",
                record.name,
                record.len,
                data.len()
            )));
        }
        if let Some(&at) = plan.data_offsets.get(index) {
            write_at(&mut bytes, at, data);
        }
        for (at, crc) in plan.crc_patches(index, crc32fast::hash(data)) {
            write_at(&mut bytes, at, &crc);
        }
    }
    if fill.next().is_some() {
        return Err(invalid("more data given than zip records to hold it"));
    }
    Ok(bytes)
}

/// The zip64 extra field miniz writes for a record: sizes when the record is large, the local
/// header offset when it lies beyond 4 GiB, nothing otherwise. In the local header the compressed
/// size is 0, because miniz writes that header before it has compressed anything.
fn zip64_fields(len: u64, local_offset: u64, local: bool) -> Vec<u8> {
    let big_len = len >= U32_LIMIT;
    let big_offset = local_offset >= U32_LIMIT;
    if !big_len && !big_offset {
        return Vec::new();
    }
    let mut field = Vec::with_capacity(28);
    put16(&mut field, ZIP64_EXTRA_ID);
    put16(&mut field, 8 * (2 * big_len as u16 + big_offset as u16));
    if big_len {
        put64(&mut field, len); // uncompressed
        put64(&mut field, if local { 0 } else { len }); // compressed
    }
    if big_offset {
        put64(&mut field, local_offset);
    }
    field
}

/// Framing runs being built; adjacent pieces merge so the executor issues few writes.
#[derive(Default)]
struct Literals {
    pos: u64,
    runs: Vec<(u64, Vec<u8>)>,
}

impl Literals {
    fn emit(&mut self, bytes: &[u8]) {
        match self.runs.last_mut() {
            Some((at, run)) if *at + run.len() as u64 == self.pos => run.extend_from_slice(bytes),
            _ => self.runs.push((self.pos, bytes.to_vec())),
        }
        self.pos += bytes.len() as u64;
    }

    fn skip(&mut self, len: u64) {
        self.pos = self.pos.saturating_add(len);
    }
}

/// Bit 11 (UTF-8 names) always, and bit 3 (CRC and sizes in a data descriptor) unless the record
/// is empty: miniz writes no descriptor for an empty record.
fn record_flags(len: u64) -> u16 {
    if len == 0 {
        FLAG_UTF8
    } else {
        FLAG_UTF8 | FLAG_DESCRIPTOR
    }
}

fn len16(len: usize) -> u16 {
    u16::try_from(len).unwrap_or(u16::MAX)
}

fn put16(out: &mut Vec<u8>, v: u16) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn write_at(bytes: &mut [u8], at: u64, data: &[u8]) {
    let start = usize::try_from(at).unwrap_or(usize::MAX);
    if let Some(dst) = start
        .checked_add(data.len())
        .and_then(|end| bytes.get_mut(start..end))
    {
        dst.copy_from_slice(data);
    }
}
