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

mod framing;
mod read;
mod records;
mod write;

pub(crate) use framing::framing;
pub use read::{check_inflates, inflate, inflate_prefix, read_entries, ZipEntry};
pub use records::{CentralHeader, EndRecord, LocalHeader, Zip64End, Zip64Locator};
pub use write::{build, layout, ZipLayout, ZipRecord};

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

/// True if `len` bytes at `at` end at or before `limit`.
fn fits(at: u64, len: u64, limit: u64) -> bool {
    at.checked_add(len).is_some_and(|end| end <= limit)
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
mod tests;
