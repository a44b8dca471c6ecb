//! ZIP's fixed-layout records, parsed field by field with nothing checked but their signatures:
//! the one parser under both the strict reader ([`super::read_entries`], which then checks what
//! torch.load checks) and the sparse image of an archive on object storage
//! (`storage::remote`), which fetches only what these records point to.

use super::{
    find_extra, CENTRAL_HEADER_LEN, CENTRAL_SIG, EOCD_LEN, EOCD_SIG, LOCAL_HEADER_LEN, LOCAL_SIG,
    MAX_COMMENT_LEN, U32_LIMIT, ZIP64_EOCD_LEN, ZIP64_EOCD_SIG, ZIP64_EXTRA_ID, ZIP64_LOCATOR_LEN,
    ZIP64_LOCATOR_SIG,
};

/// Little-endian field reader over a record; a field past the end reads as `None`.
pub(super) struct Fields<'a> {
    pub(super) bytes: &'a [u8],
    pub(super) pos: usize,
}

impl<'a> Fields<'a> {
    pub(super) fn new(bytes: &'a [u8]) -> Self {
        Fields { bytes, pos: 0 }
    }

    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let field = self.bytes.get(self.pos..self.pos.checked_add(N)?)?;
        self.pos += N;
        field.try_into().ok()
    }

    pub(super) fn u16(&mut self) -> Option<u16> {
        self.take().map(u16::from_le_bytes)
    }

    pub(super) fn u32(&mut self) -> Option<u32> {
        self.take().map(u32::from_le_bytes)
    }

    pub(super) fn u64(&mut self) -> Option<u64> {
        self.take().map(u64::from_le_bytes)
    }
}

/// The classic end-of-central-directory record.
pub struct EndRecord {
    pub disk: u16,
    pub cd_disk: u16,
    pub disk_entries: u64,
    pub entries: u64,
    pub cd_size: u64,
    pub cd_offset: u64,
}

impl EndRecord {
    /// The last end record in `bytes` whose comment runs exactly to their end, and where it
    /// starts: so trailing bytes after an archive are not mistaken for its comment.
    pub fn find(bytes: &[u8]) -> Option<(u64, EndRecord)> {
        let len = bytes.len() as u64;
        let last = len.checked_sub(EOCD_LEN)?;
        let lowest = last.saturating_sub(MAX_COMMENT_LEN);
        (lowest..=last).rev().find_map(|at| {
            let mut f = Fields::new(&bytes[at as usize..]);
            if f.u32() != Some(EOCD_SIG) {
                return None;
            }
            let (disk, cd_disk) = (f.u16()?, f.u16()?);
            let disk_entries = u64::from(f.u16()?);
            let entries = u64::from(f.u16()?);
            let cd_size = u64::from(f.u32()?);
            let cd_offset = u64::from(f.u32()?);
            let comment_len = u64::from(f.u16()?);
            (at + EOCD_LEN + comment_len == len).then_some((
                at,
                EndRecord {
                    disk,
                    cd_disk,
                    disk_entries,
                    entries,
                    cd_size,
                    cd_offset,
                },
            ))
        })
    }

    /// True when a value saturated, so the zip64 end record holds the real ones.
    pub fn needs_zip64(&self) -> bool {
        self.entries == 0xFFFF || self.cd_size == U32_LIMIT || self.cd_offset == U32_LIMIT
    }
}

/// The zip64 end record locator, just before the classic end record.
pub struct Zip64Locator {
    /// The disk the zip64 end record is on.
    pub end_disk: u32,
    /// Where the zip64 end record starts.
    pub end_at: u64,
    pub disks: u32,
}

impl Zip64Locator {
    pub const LEN: u64 = ZIP64_LOCATOR_LEN;

    /// The locator at the start of `bytes`, if its signature is there.
    pub fn parse(bytes: &[u8]) -> Option<Zip64Locator> {
        let mut f = Fields::new(bytes);
        if f.u32()? != ZIP64_LOCATOR_SIG {
            return None;
        }
        Some(Zip64Locator {
            end_disk: f.u32()?,
            end_at: f.u64()?,
            disks: f.u32()?,
        })
    }
}

/// The fixed part of the zip64 end-of-central-directory record.
pub struct Zip64End {
    pub disk: u32,
    pub cd_disk: u32,
    pub disk_entries: u64,
    pub entries: u64,
    pub cd_size: u64,
    pub cd_offset: u64,
}

impl Zip64End {
    pub const LEN: u64 = ZIP64_EOCD_LEN;

    /// The record at the start of `bytes`, if its signature is there.
    pub fn parse(bytes: &[u8]) -> Option<Zip64End> {
        let mut f = Fields::new(bytes);
        if f.u32()? != ZIP64_EOCD_SIG {
            return None;
        }
        f.u64()?; // record size; extensible data after the fixed part is ignored
        f.u16()?; // version made by
        f.u16()?; // version needed
        Some(Zip64End {
            disk: f.u32()?,
            cd_disk: f.u32()?,
            disk_entries: f.u64()?,
            entries: f.u64()?,
            cd_size: f.u64()?,
            cd_offset: f.u64()?,
        })
    }
}

/// The fields a central directory header and a local header share, in the same order (after
/// the version fields).
pub struct EntryFields {
    pub flags: u16,
    pub method: u16,
    pub crc: u32,
    pub compressed32: u32,
    pub len32: u32,
    pub name_len: u64,
    pub extra_len: u64,
}

impl EntryFields {
    fn read(f: &mut Fields) -> Option<EntryFields> {
        let flags = f.u16()?;
        let method = f.u16()?;
        f.u16()?; // time
        f.u16()?; // date
        Some(EntryFields {
            flags,
            method,
            crc: f.u32()?,
            compressed32: f.u32()?,
            len32: f.u32()?,
            name_len: u64::from(f.u16()?),
            extra_len: u64::from(f.u16()?),
        })
    }
}

/// A central directory header; its name, extra field and comment follow it.
pub struct CentralHeader {
    pub entry: EntryFields,
    pub comment_len: u64,
    pub disk: u16,
    pub local32: u32,
}

impl CentralHeader {
    pub const LEN: u64 = CENTRAL_HEADER_LEN;

    /// The header at the start of `bytes`, if its signature is there.
    pub fn parse(bytes: &[u8]) -> Option<CentralHeader> {
        let mut f = Fields::new(bytes);
        if f.u32()? != CENTRAL_SIG {
            return None;
        }
        f.u16()?; // version made by
        f.u16()?; // version needed
        let entry = EntryFields::read(&mut f)?;
        let comment_len = u64::from(f.u16()?);
        let disk = f.u16()?;
        f.u16()?; // internal attributes
        f.u32()?; // external attributes
        Some(CentralHeader {
            entry,
            comment_len,
            disk,
            local32: f.u32()?,
        })
    }

    /// Bytes from this header to the next: the header, name, extra field and comment.
    pub fn total_len(&self) -> u64 {
        CENTRAL_HEADER_LEN + self.entry.name_len + self.entry.extra_len + self.comment_len
    }

    /// The entry's size, compressed size and local header offset. Zip64 values appear in that
    /// order in the `extra` field's zip64 record, each only if its 32-bit field saturated; the
    /// error names the first one that is missing.
    pub fn wide(&self, extra: &[u8]) -> Result<(u64, u64, u64), &'static str> {
        let mut z = Fields::new(find_extra(extra, ZIP64_EXTRA_ID).unwrap_or(&[]));
        let mut wide = |short: u32, what: &'static str| {
            if u64::from(short) != U32_LIMIT {
                return Ok(u64::from(short));
            }
            z.u64().ok_or(what)
        };
        let len = wide(self.entry.len32, "size")?;
        let compressed = wide(self.entry.compressed32, "compressed size")?;
        let local = wide(self.local32, "offset")?;
        Ok((len, compressed, local))
    }
}

/// A local header; its name and extra field follow it, then the entry's data.
pub struct LocalHeader {
    pub entry: EntryFields,
}

impl LocalHeader {
    pub const LEN: u64 = LOCAL_HEADER_LEN;

    /// The header at the start of `bytes`, if its signature is there.
    pub fn parse(bytes: &[u8]) -> Option<LocalHeader> {
        let mut f = Fields::new(bytes);
        if f.u32()? != LOCAL_SIG {
            return None;
        }
        f.u16()?; // version needed
        Some(LocalHeader {
            entry: EntryFields::read(&mut f)?,
        })
    }

    /// Bytes from the header to the entry's data: the header, name and extra field.
    pub fn data_start(&self) -> u64 {
        LOCAL_HEADER_LEN + self.entry.name_len + self.entry.extra_len
    }
}
