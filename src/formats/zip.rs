//! The ZIP subset torch.save uses: stored (uncompressed) entries, data aligned to 64 bytes, zip64
//! when large. Reading also takes deflated entries (method 8), which torch.load reads through
//! miniz: their bytes are inflated where they are needed ([`inflate`]), never mapped in place. Reading locates entries inside a byte slice; writing lays out framing around data
//! the executor fills in later.
//!
//! torch.save writes its archives with PyTorch's patched miniz (`caffe2/serialize/inline_container.cc`),
//! and [`layout`] reproduces that byte for byte:
//! - every local header has flags `0x0808` (sizes and CRC in a data descriptor, UTF-8 names),
//!   versions 0, time and date 0, and CRC and sizes 0: they follow the data in a descriptor
//!   (an empty record has flags `0x0800` and no descriptor);
//! - the local extra field ends with an `FB` field of `Z` bytes that pads the data start to a
//!   multiple of 64, so tensors can be memory-mapped in place;
//! - a record of 0xFFFFFFFF bytes or more, or one whose local header starts at 0xFFFFFFFF or
//!   beyond, gets a zip64 extra field (sizes and/or offset) in both headers, and its descriptor
//!   carries 8-byte sizes;
//! - the central directory is always followed by a zip64 end record and locator, then the classic
//!   end record with saturated fields.
//!
//! Reading works on a slice because each DCP tensor item is a whole archive embedded in a
//! `.distcp` file; every offset here is relative to the start of that slice.

use crate::error::{Error, Result};

const LOCAL_SIG: u32 = 0x0403_4b50;
const CENTRAL_SIG: u32 = 0x0201_4b50;
const DESCRIPTOR_SIG: u32 = 0x0807_4b50;
const EOCD_SIG: u32 = 0x0605_4b50;
const ZIP64_EOCD_SIG: u32 = 0x0606_4b50;
const ZIP64_LOCATOR_SIG: u32 = 0x0706_4b50;

const LOCAL_HEADER_LEN: u64 = 30;
const CENTRAL_HEADER_LEN: u64 = 46;
const EOCD_LEN: u64 = 22;
const ZIP64_EOCD_LEN: u64 = 56;
const ZIP64_LOCATOR_LEN: u64 = 20;
/// Longest comment the classic end record can announce.
const MAX_COMMENT_LEN: u64 = 0xFFFF;

/// More entries than any checkpoint archive has (torch writes one per storage plus six); the cap
/// keeps a corrupt count from driving a huge allocation or loop.
pub const MAX_ENTRIES: u64 = 1 << 20;

/// Where torch aligns record data (`kFieldAlignment`, also written to `.storage_alignment`).
pub const ALIGNMENT: u64 = 64;

/// Bit 11: names are UTF-8. miniz sets it on every record.
const FLAG_UTF8: u16 = 0x0800;
const FLAG_ENCRYPTED: u16 = 0x0001;
const FLAG_DESCRIPTOR: u16 = 0x0008;
/// Bit 5 (compressed patch data) and bit 6 (strong encryption): miniz, and so torch.load, refuses
/// to read an entry with either, though it opens the archive.
pub const FLAGS_UNREADABLE: u16 = 0x0060;
/// Bit 13: local headers are masked. miniz refuses the whole archive.
const FLAG_MASKED_HEADERS: u16 = 0x2000;

/// A 32-bit size or offset at or above this moves to a zip64 field (miniz's `>= MZ_UINT32_MAX`).
const U32_LIMIT: u64 = 0xFFFF_FFFF;
const ZIP64_EXTRA_ID: u16 = 0x0001;
/// The id torch gives its alignment padding field.
const PADDING_EXTRA_ID: &[u8; 2] = b"FB";

/// Zip64 end record versions as miniz writes them: made by UNIX 3.0, needs 4.5 (zip64).
const ZIP64_VERSION_MADE_BY: u16 = 0x031e;
const ZIP64_VERSION_NEEDED: u16 = 0x002d;

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
    // (name, local header offset, length, crc, filled later) for the central directory.
    let mut placed = Vec::with_capacity(records.len());

    for record in records {
        let local_offset = out.pos;
        let len = record
            .content
            .as_ref()
            .map_or(record.len, |c| c.len() as u64);
        let zip64 = zip64_fields(len, local_offset, true);
        let name = record.name.as_bytes();

        // torch pads so that data starts on an alignment boundary, counting the zip64 field that
        // miniz puts before the padding and the padding field's own 4-byte header (`getPadding`
        // in inline_container.cc).
        let unpadded = local_offset + LOCAL_HEADER_LEN + name.len() as u64 + zip64.len() as u64 + 4;
        let padding = (ALIGNMENT - unpadded % ALIGNMENT) % ALIGNMENT;

        let flags = record_flags(len);
        let mut header = Vec::new();
        put32(&mut header, LOCAL_SIG);
        put16(&mut header, 0); // version needed
        put16(&mut header, flags);
        put16(&mut header, 0); // method: stored
        put16(&mut header, 0); // time
        put16(&mut header, 0); // date
        put32(&mut header, 0); // crc, in the descriptor
        put32(&mut header, 0); // compressed size, in the descriptor
        put32(&mut header, 0); // uncompressed size, in the descriptor
        put16(&mut header, len16(name.len()));
        put16(&mut header, len16(zip64.len() + 4 + padding as usize));
        header.extend_from_slice(name);
        header.extend_from_slice(&zip64);
        header.extend_from_slice(PADDING_EXTRA_ID);
        put16(&mut header, padding as u16);
        header.resize(header.len() + padding as usize, b'Z');
        out.emit(&header);

        let data_offset = out.pos;
        data_offsets.push(data_offset);
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
        let mut slots = Vec::new();
        if flags & FLAG_DESCRIPTOR == 0 {
            // miniz writes no descriptor for an empty record; its CRC is 0, already in place.
            crc_slots.push(slots);
            placed.push((name, local_offset, len, crc, false));
            continue;
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
        crc_slots.push(slots);
        out.emit(&descriptor);
        placed.push((name, local_offset, len, crc, record.content.is_none()));
    }

    let cd_offset = out.pos;
    for (index, &(name, local_offset, len, crc, filled_later)) in placed.iter().enumerate() {
        let zip64 = zip64_fields(len, local_offset, false);
        if filled_later {
            if let Some(slots) = crc_slots.get_mut(index) {
                slots.push(out.pos + 16);
            }
        }
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
        out.emit(&header);
    }
    let cd_size = out.pos - cd_offset;
    let count = records.len() as u64;

    let zip64_eocd_offset = out.pos;
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
    out.emit(&tail);

    ZipLayout {
        len: out.pos,
        data_offsets,
        literals: out.runs,
        crc_slots,
    }
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

/// True if `len` bytes at `at` end at or before `limit`.
fn fits(at: u64, len: u64, limit: u64) -> bool {
    at.checked_add(len).is_some_and(|end| end <= limit)
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

fn invalid(message: impl Into<String>) -> Error {
    Error::invalid(message)
}

/// The slice `bytes[at..at + len]`, or an error naming `what` if it runs past the end.
fn slice<'a>(bytes: &'a [u8], at: u64, len: u64, what: &str) -> Result<&'a [u8]> {
    usize::try_from(at)
        .ok()
        .zip(usize::try_from(len).ok())
        .and_then(|(start, len)| bytes.get(start..start.checked_add(len)?))
        .ok_or_else(|| invalid(format!("zip {what} runs past the end of the archive")).at(at))
}

/// Little-endian field reader over a header already known to be in bounds.
struct Fields<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Fields<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Fields { bytes, pos: 0 }
    }

    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let field = self.bytes.get(self.pos..self.pos.checked_add(N)?)?;
        self.pos += N;
        field.try_into().ok()
    }

    fn u16(&mut self) -> Option<u16> {
        self.take().map(u16::from_le_bytes)
    }

    fn u32(&mut self) -> Option<u32> {
        self.take().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Option<u64> {
        self.take().map(u64::from_le_bytes)
    }
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
    let lowest = (len - EOCD_LEN).saturating_sub(MAX_COMMENT_LEN);
    let mut eocd = None;
    for at in (lowest..=len - EOCD_LEN).rev() {
        let record = slice(bytes, at, EOCD_LEN, "end record")?;
        let mut f = Fields::new(record);
        if f.u32() != Some(EOCD_SIG) {
            continue;
        }
        f.pos = 20;
        let comment_len = u64::from(f.u16().unwrap_or(0));
        if at + EOCD_LEN + comment_len == len {
            eocd = Some(at);
            break;
        }
    }
    let Some(eocd_at) = eocd else {
        return Err(invalid(
            "not a zip archive: no end-of-central-directory record at the end of the data",
        ));
    };
    let mut f = Fields::new(slice(bytes, eocd_at + 4, EOCD_LEN - 4, "end record")?);
    let (disk, cd_disk) = (f.u16().unwrap_or(0), f.u16().unwrap_or(0));
    let disk_entries = u64::from(f.u16().unwrap_or(0));
    let entries = u64::from(f.u16().unwrap_or(0));
    let cd_size = u64::from(f.u32().unwrap_or(0));
    let cd_offset = u64::from(f.u32().unwrap_or(0));
    if (disk != 0 && disk != 0xFFFF)
        || (cd_disk != 0 && cd_disk != 0xFFFF)
        || disk_entries != entries
    {
        return Err(invalid("multi-disk zip archives are not supported").at(eocd_at));
    }

    let locator_at = eocd_at.checked_sub(ZIP64_LOCATOR_LEN);
    let locator = locator_at
        .map(|at| slice(bytes, at, ZIP64_LOCATOR_LEN, "zip64 locator"))
        .transpose()?
        .filter(|l| l.get(..4) == Some(&ZIP64_LOCATOR_SIG.to_le_bytes()[..]));
    let (end, records_start) = match (locator, locator_at) {
        (Some(locator), Some(locator_at)) => {
            let mut f = Fields::new(locator);
            f.u32();
            let eocd64_disk = f.u32().unwrap_or(0);
            let eocd64_at = f.u64().unwrap_or(0);
            let disks = f.u32().unwrap_or(1);
            if eocd64_disk != 0 || disks > 1 {
                return Err(invalid("multi-disk zip archives are not supported").at(locator_at));
            }
            if !fits(eocd64_at, ZIP64_EOCD_LEN, locator_at) {
                return Err(invalid(format!(
                    "zip64 end record offset {eocd64_at} does not fit before its locator"
                ))
                .at(locator_at));
            }
            let mut f = Fields::new(slice(bytes, eocd64_at, ZIP64_EOCD_LEN, "zip64 end record")?);
            if f.u32() != Some(ZIP64_EOCD_SIG) {
                return Err(invalid(
                    "zip64 end record signature not found where its locator points",
                )
                .at(eocd64_at));
            }
            f.u64(); // record size; extensible data after the fixed part is ignored
            f.u16(); // version made by
            f.u16(); // version needed
            let (disk, cd_disk) = (f.u32().unwrap_or(0), f.u32().unwrap_or(0));
            let disk_entries64 = f.u64().unwrap_or(0);
            let entries64 = f.u64().unwrap_or(0);
            let cd_size64 = f.u64().unwrap_or(0);
            let cd_offset64 = f.u64().unwrap_or(0);
            if disk != 0 || cd_disk != 0 || disk_entries64 != entries64 {
                return Err(invalid("multi-disk zip archives are not supported").at(eocd64_at));
            }
            // The classic record repeats each value unless it saturated; a mismatch is corruption.
            let agrees =
                |short: u64, saturated: u64, long: u64| short == saturated || short == long;
            if !agrees(entries, 0xFFFF, entries64)
                || !agrees(cd_size, U32_LIMIT, cd_size64)
                || !agrees(cd_offset, U32_LIMIT, cd_offset64)
            {
                return Err(invalid("zip end record and zip64 end record disagree").at(eocd_at));
            }
            let end = EndRecord {
                entries: entries64,
                cd_offset: cd_offset64,
                cd_size: cd_size64,
            };
            (end, eocd64_at)
        }
        _ => {
            if entries == 0xFFFF || cd_size == U32_LIMIT || cd_offset == U32_LIMIT {
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
    let mut f = Fields::new(slice(bytes, at, CENTRAL_HEADER_LEN, "central header")?);
    if f.u32() != Some(CENTRAL_SIG) {
        return Err(invalid("zip central directory header signature not found").at(at));
    }
    f.u16(); // version made by
    f.u16(); // version needed
    let flags = f.u16().unwrap_or(0);
    let method = f.u16().unwrap_or(0);
    f.u16(); // time
    f.u16(); // date
    let crc = f.u32().unwrap_or(0);
    let compressed32 = f.u32().unwrap_or(0);
    let len32 = f.u32().unwrap_or(0);
    let name_len = u64::from(f.u16().unwrap_or(0));
    let extra_len = u64::from(f.u16().unwrap_or(0));
    let comment_len = u64::from(f.u16().unwrap_or(0));
    let disk = f.u16().unwrap_or(0);
    f.u16(); // internal attributes
    f.u32(); // external attributes
    let local32 = f.u32().unwrap_or(0);

    let next = at + CENTRAL_HEADER_LEN + name_len + extra_len + comment_len;
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

    // Zip64 values appear in a fixed order, each only if its 32-bit field saturated.
    let zip64 = find_extra(extra, ZIP64_EXTRA_ID);
    let mut z = Fields::new(zip64.unwrap_or(&[]));
    let mut wide = |short: u32, what: &str| -> Result<u64> {
        if u64::from(short) != U32_LIMIT {
            return Ok(u64::from(short));
        }
        z.u64().ok_or_else(|| {
            invalid(format!(
                "zip entry `{name}` lacks the zip64 {what} its header points to"
            ))
            .at(at)
        })
    };
    let len = wide(len32, "size")?;
    let compressed = wide(compressed32, "compressed size")?;
    let local_offset = wide(local32, "offset")?;
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
    let header = slice(bytes, at, LOCAL_HEADER_LEN, "local header").map_err(|_| {
        invalid(format!(
            "zip entry `{name}` points past the end of the archive"
        ))
        .at(central.at)
    })?;
    let mut f = Fields::new(header);
    if f.u32() != Some(LOCAL_SIG) {
        return Err(invalid(format!(
            "zip local header of `{name}` not found where the central directory points"
        ))
        .at(at));
    }
    f.u16(); // version needed
    let flags = f.u16().unwrap_or(0);
    let method = f.u16().unwrap_or(0);
    f.u16(); // time
    f.u16(); // date
    let crc = f.u32().unwrap_or(0);
    let compressed32 = f.u32().unwrap_or(0);
    let len32 = f.u32().unwrap_or(0);
    let name_len = u64::from(f.u16().unwrap_or(0));
    let extra_len = u64::from(f.u16().unwrap_or(0));

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

    let data_offset = at + LOCAL_HEADER_LEN + name_len + extra_len;
    let data_end = data_offset
        .checked_add(stored_len)
        .filter(|&e| e <= cd_offset)
        .ok_or_else(|| {
            invalid(format!(
                "zip entry `{name}` ({stored_len} bytes at {data_offset}) runs into the central directory"
            ))
            .at(at)
        })?;
    let mut end = data_end;
    if descriptor {
        // torch's local headers hold zeros, so the descriptor is the only other witness of the
        // size: a central directory that claims more or less than was written is caught here.
        let extra = slice(
            bytes,
            at + LOCAL_HEADER_LEN + name_len,
            extra_len,
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
        end = data_end + f.pos as u64;
    }
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

fn entry_name(bytes: &[u8]) -> Result<String> {
    if bytes.contains(&0) {
        return Err(invalid("zip entry name contains a NUL byte"));
    }
    String::from_utf8(bytes.to_vec()).map_err(|_| invalid("zip entry name is not UTF-8"))
}

/// The data of the first extra field with id `id`, if the field list is well formed up to it.
fn find_extra(mut extra: &[u8], id: u16) -> Option<&[u8]> {
    while let [a, b, c, d, rest @ ..] = extra {
        let size = usize::from(u16::from_le_bytes([*c, *d]));
        let data = rest.get(..size)?;
        if u16::from_le_bytes([*a, *b]) == id {
            return Some(data);
        }
        extra = rest.get(size..)?;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const VIEWS: &[u8] = include_bytes!("testdata/views.pt");
    const DTYPES: &[u8] = include_bytes!("testdata/dtypes.pt");
    const BARE: &[u8] = include_bytes!("testdata/bare.pt");
    const NESTED: &[u8] = include_bytes!("testdata/nested.pt");
    /// A real > 4 GiB torch.save archive without the data of its big record (see `make.py`).
    const ZIP64_FRAMING: &[u8] = include_bytes!("testdata/zip64_framing.bin");

    fn literal(name: &str, content: &[u8]) -> ZipRecord {
        ZipRecord {
            name: name.into(),
            len: content.len() as u64,
            content: Some(content.to_vec()),
        }
    }

    fn data<'a>(bytes: &'a [u8], e: &ZipEntry) -> &'a [u8] {
        &bytes[e.data_offset as usize..(e.data_offset + e.len) as usize]
    }

    #[test]
    fn reads_real_archive() {
        // Offsets as Python's zipfile reports them for this file.
        let entries = read_entries(BARE).unwrap();
        let names: Vec<_> = entries.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "archive/data.pkl",
                "archive/.format_version",
                "archive/.storage_alignment",
                "archive/byteorder",
                "archive/data/0",
                "archive/version",
                "archive/.data/serialization_id",
            ]
        );
        for e in &entries {
            assert_eq!(e.data_offset % ALIGNMENT, 0, "{} is aligned", e.name);
        }
        assert_eq!(data(BARE, &entries[1]), b"1");
        assert_eq!(data(BARE, &entries[2]), b"64");
        assert_eq!(data(BARE, &entries[3]), b"little");
        assert_eq!(data(BARE, &entries[5]), b"3\n");
        // arange(6) in bf16: 0, 1, 2, 3, 4, 5.
        assert_eq!(entries[4].len, 12);
        assert_eq!(&data(BARE, &entries[4])[..4], &[0x00, 0x00, 0x80, 0x3f]);
        assert_eq!(entries[6].len, 40);
    }

    #[test]
    fn layout_reproduces_torch_byte_for_byte() {
        for real in [VIEWS, DTYPES, BARE, NESTED] {
            let records: Vec<_> = read_entries(real)
                .unwrap()
                .iter()
                .map(|e| literal(&e.name, data(real, e)))
                .collect();
            assert_eq!(build(&records, &[]).unwrap(), real);
        }
    }

    #[test]
    fn caller_filled_records_round_trip() {
        let big: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        let records = vec![
            literal("a/data.pkl", b"pickle"),
            ZipRecord {
                name: "a/data/0".into(),
                len: big.len() as u64,
                content: None,
            },
            ZipRecord {
                name: "a/data/1".into(),
                len: 0,
                content: None,
            },
            literal("a/version", b"3\n"),
        ];
        let plan = layout(&records);
        assert!(plan.crc_slots[0].is_empty() && plan.crc_slots[3].is_empty());
        assert_eq!(plan.crc_slots[1].len(), 2);
        // Literal runs never overlap the data the caller writes.
        for (at, run) in &plan.literals {
            let end = at + run.len() as u64;
            assert!(end <= plan.data_offsets[1] || *at >= plan.data_offsets[1] + big.len() as u64);
        }
        let bytes = build(&records, &[&big, &[]]).unwrap();
        assert_eq!(bytes.len() as u64, plan.len);
        let entries = read_entries(&bytes).unwrap();
        assert_eq!(entries.len(), 4);
        assert_eq!(data(&bytes, &entries[1]), &big[..]);
        assert_eq!(entries[1].data_offset, plan.data_offsets[1]);
        assert_eq!(entries[2].len, 0);
        // The CRC the central directory holds is the one patched in.
        let central = plan.crc_slots[1][1] as usize;
        assert_eq!(
            &bytes[central..central + 4],
            &crc32fast::hash(&big).to_le_bytes()
        );
        let descriptor = plan.crc_slots[1][0] as usize;
        assert_eq!(
            &bytes[descriptor - 4..descriptor],
            &DESCRIPTOR_SIG.to_le_bytes()
        );
        assert!(build(&records, &[&big]).is_err());
        assert!(build(&records, &[&big, &[1]]).is_err());
    }

    #[test]
    fn zip64_layout_matches_torch() {
        // The records of the real archive (`make.py --zip64`), its 4 GiB record left for the
        // caller; sizes, CRC and offsets as Python's zipfile reports them.
        let (big_index, big_len, big_crc) = (5, (1u64 << 32) + 100, 2_838_121_701u32);
        let head_len = 1024u64;
        // Framing positions past the big record sit `big_len` earlier in the fixture.
        let squeeze = |at: u64| {
            if at < head_len {
                at as usize
            } else {
                (at - big_len) as usize
            }
        };
        let pickle = &ZIP64_FRAMING[64..64 + 316];
        let id_at = squeeze(4_294_968_666 + 30 + 26 + 46);
        let serialization_id = &ZIP64_FRAMING[id_at..id_at + 40];
        let one = [0, 0, 0x80, 0x3f];
        let records = vec![
            literal("big/data.pkl", pickle),
            literal("big/.format_version", b"1"),
            literal("big/.storage_alignment", b"64"),
            literal("big/byteorder", b"little"),
            literal("big/data/0", &one.repeat(3)),
            ZipRecord {
                name: "big/data/1".into(),
                len: big_len,
                content: None,
            },
            literal("big/data/2", &one.repeat(2)),
            literal("big/version", b"3\n"),
            literal("big/.data/serialization_id", serialization_id),
        ];
        let plan = layout(&records);
        assert_eq!(plan.len, ZIP64_FRAMING.len() as u64 + big_len);
        assert_eq!(plan.data_offsets[big_index], head_len);
        let mut expected = vec![0u8; ZIP64_FRAMING.len()];
        let mut covered = vec![false; ZIP64_FRAMING.len()];
        for (at, run) in &plan.literals {
            let at = squeeze(*at);
            expected[at..at + run.len()].copy_from_slice(run);
            covered[at..at + run.len()]
                .iter_mut()
                .for_each(|c| *c = true);
        }
        for (at, crc) in plan.crc_patches(big_index, big_crc) {
            expected[squeeze(at)..squeeze(at) + 4].copy_from_slice(&crc);
        }
        assert!(
            covered.iter().all(|&c| c),
            "every framing byte is a literal"
        );
        assert_eq!(expected, ZIP64_FRAMING);
    }

    #[test]
    fn zip64_fields_in_headers() {
        let big = 0x1_0000_0005u64;
        let records = vec![
            ZipRecord {
                name: "a/data/0".into(),
                len: big,
                content: None,
            },
            literal("a/version", b"3\n"),
        ];
        let plan = layout(&records);
        let run = |at: u64| {
            plan.literals
                .iter()
                .find(|(s, r)| *s <= at && at < s + r.len() as u64)
                .unwrap()
        };
        let local = &plan.literals[0].1;
        // Local header: sizes zero, then a zip64 field (size, compressed size 0) before the padding.
        assert_eq!(&local[18..26], &[0; 8]);
        assert_eq!(&local[30 + 8..30 + 8 + 4], &[1, 0, 16, 0]);
        assert_eq!(&local[42..50], &big.to_le_bytes());
        assert_eq!(&local[50..58], &[0; 8]);
        assert_eq!(plan.data_offsets[0] % ALIGNMENT, 0);
        // The record after it starts beyond 4 GiB: its local header carries its offset.
        let second = plan.data_offsets[0] + big + 24;
        let (start, bytes) = run(second);
        let local2 = &bytes[(second - start) as usize..];
        assert_eq!(&local2[..4], &LOCAL_SIG.to_le_bytes());
        assert_eq!(
            &local2[30 + 9..30 + 9 + 12],
            &[&[1, 0, 8, 0][..], &second.to_le_bytes()].concat()[..]
        );
        // Descriptor of the big record: 8-byte sizes.
        let (start, bytes) = run(plan.data_offsets[0] + big);
        let descriptor = &bytes[(plan.data_offsets[0] + big - start) as usize..][..24];
        assert_eq!(
            &descriptor[8..],
            &[big.to_le_bytes(), big.to_le_bytes()].concat()[..]
        );
        // Central headers saturate what moved to zip64 fields.
        let cd = plan.crc_slots[0][1] - 16;
        let (start, bytes) = run(cd);
        let central = &bytes[(cd - start) as usize..];
        assert_eq!(&central[20..28], &[0xff; 8]);
        assert_eq!(&central[42..46], &[0, 0, 0, 0]);
        let central2 = &central[46 + 8 + 20..];
        assert_eq!(&central2[20..28], &[2, 0, 0, 0, 2, 0, 0, 0]);
        assert_eq!(&central2[42..46], &[0xff; 4]);
        // The classic end record saturates the directory offset.
        let tail = &plan.literals.last().unwrap().1;
        assert_eq!(&tail[tail.len() - 6..tail.len() - 2], &[0xff; 4]);
    }

    #[test]
    fn rejects_what_torch_never_writes() {
        let bytes = build(&[literal("a/data.pkl", b"x"), literal("a/b", b"yy")], &[]).unwrap();
        let err = |b: &[u8]| read_entries(b).unwrap_err().to_string();
        let cd = read_entries(&bytes).unwrap()[1].data_offset as usize + 2 + 16;

        let mut compressed = bytes.clone();
        compressed[cd + 10] = 12; // bzip2 in the first central header
        assert!(
            err(&compressed).contains("`a/data.pkl` is compressed with method 12"),
            "{}",
            err(&compressed)
        );

        // Deflate in the central header only: the local header says stored.
        let mut deflate = bytes.clone();
        deflate[cd + 10] = 8;
        assert!(
            err(&deflate).contains("method 0 disagrees"),
            "{}",
            err(&deflate)
        );

        let mut nul = bytes.clone();
        nul[cd + 46 + 1] = 0;
        assert!(err(&nul).contains("NUL"));

        let mut size = bytes.clone();
        size[cd + 20] = 2; // central sizes say 2 while the local header is at 64 - 2
        size[cd + 24] = 2;
        assert!(
            err(&size).contains("overlap") || err(&size).contains("disagree"),
            "{}",
            err(&size)
        );

        let mut local = bytes.clone();
        local[22] = 5; // local uncompressed size neither 0 nor the central one
        assert!(
            err(&local).contains("disagrees with central directory size 1"),
            "{}",
            err(&local)
        );

        let mut dup = build(&[literal("a/x", b"1"), literal("a/x", b"2")], &[]).unwrap();
        assert!(err(&dup).contains("duplicate zip entry `a/x`"));
        dup.push(0);
        assert!(err(&dup).contains("no end-of-central-directory record"));

        assert!(err(&bytes[..bytes.len() - 1]).contains("not a zip archive"));
        assert!(err(b"").contains("too short"));
        // A stray offset past the slice is an error, not a panic.
        let mut far = bytes.clone();
        far[cd + 42..cd + 46].copy_from_slice(&0xFFFF_FFF0u32.to_le_bytes());
        assert!(err(&far).contains("points past the end"), "{}", err(&far));
    }

    #[test]
    fn masked_local_headers_are_refused() {
        let bytes = build(&[literal("a/data.pkl", b"x"), literal("a/b", b"yy")], &[]).unwrap();
        let cd = read_entries(&bytes).unwrap()[1].data_offset as usize + 2 + 16;
        let mut masked = bytes.clone();
        masked[cd + 9] |= 0x20; // flag bit 13 of the first central header
        let e = read_entries(&masked).unwrap_err().to_string();
        assert!(
            e.contains("`a/data.pkl` has masked local headers (flag bit 13)"),
            "{e}"
        );
        // Bits 5 and 6 are kept for the reader of the record to judge.
        let mut patch = bytes.clone();
        patch[cd + 8] |= 0x60;
        assert_eq!(read_entries(&patch).unwrap()[0].flags, 0x0868);
    }

    #[test]
    fn errors_carry_offsets() {
        let bytes = build(&[literal("a/data.pkl", b"x")], &[]).unwrap();
        let mut bad = bytes.clone();
        bad[0] = b'Q';
        let e = read_entries(&bad).unwrap_err();
        assert_eq!(e.offset, Some(0));
        assert_eq!(
            e.message,
            "zip local header of `a/data.pkl` not found where the central directory points"
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn mutations_never_panic(
            edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
            cut in any::<prop::sample::Index>(),
            truncate in any::<bool>(),
        ) {
            let mut bytes = NESTED.to_vec();
            for (at, byte) in edits {
                let at = at.index(bytes.len());
                bytes[at] = byte;
            }
            if truncate {
                bytes.truncate(cut.index(bytes.len()));
            }
            if let Ok(entries) = read_entries(&bytes) {
                for e in entries {
                    prop_assert!(e.data_offset + e.len <= bytes.len() as u64);
                }
            }
        }

        #[test]
        fn layouts_read_back(
            lens in prop::collection::vec(0u64..300, 1..12),
            literal_mask in any::<u16>(),
        ) {
            let records: Vec<_> = lens.iter().enumerate().map(|(i, &len)| {
                let name = format!("p/data/{i}");
                if literal_mask >> (i % 16) & 1 == 1 {
                    ZipRecord { name, len, content: Some(vec![i as u8; len as usize]) }
                } else {
                    ZipRecord { name, len, content: None }
                }
            }).collect();
            let fills: Vec<Vec<u8>> = records.iter().enumerate()
                .filter(|(_, r)| r.content.is_none())
                .map(|(i, r)| vec![!(i as u8); r.len as usize])
                .collect();
            let fill_refs: Vec<&[u8]> = fills.iter().map(|f| f.as_slice()).collect();
            let bytes = build(&records, &fill_refs).unwrap();
            let entries = read_entries(&bytes).unwrap();
            prop_assert_eq!(entries.len(), records.len());
            let plan = layout(&records);
            for (i, e) in entries.iter().enumerate() {
                prop_assert_eq!(e.data_offset, plan.data_offsets[i]);
                prop_assert_eq!(e.data_offset % ALIGNMENT, 0);
                prop_assert_eq!(e.len, lens[i]);
            }
        }
    }
}
