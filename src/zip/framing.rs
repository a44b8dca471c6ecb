//! Which bytes of a ZIP archive its reader needs, found without the rest: the end records, the
//! central directory, the local headers, the data descriptors and the small records (`data.pkl`,
//! `byteorder`, `version`), read in three rounds where each round's reads can go together.
//! What a store whose every read is a request (an object) fetches of a torch.save file or a DCP
//! item to open it, leaving the tensor bytes unread.

use std::ops::Range;

use super::{CentralHeader, EndRecord, LocalHeader, Zip64End, Zip64Locator};
use crate::error::Result;

/// Bytes read from the end of an archive to find its end records: the classic record and the
/// longest comment it can announce, and the zip64 locator before it.
const TAIL_BYTES: u64 = 22 + 0xFFFF + 20;
/// Records up to this size are fetched with the framing (`data.pkl`, `byteorder`, `version`);
/// larger ones are tensor data, which the reader does not look at.
const SMALL_RECORD: u64 = 1 << 20;
/// Longest local extra field fetched with a header in the second round (torch pads data to
/// 64 bytes and may add a zip64 field); a longer one costs a third-round read.
const LOCAL_EXTRA: u64 = 256;
/// Largest central directory fetched (a torch.save archive has one entry per storage).
const MAX_CD: u64 = 1 << 30;

/// The framing of the archive of `len` bytes that `read` gives ranges of (offsets within the
/// archive), as (offset, bytes) runs. Before each round, `ahead` is told the ranges the round
/// will read, to fetch them together. An archive whose framing does not parse gets what was
/// found, and the ZIP reader reports the problem.
pub(crate) fn framing(
    len: u64,
    read: &mut dyn FnMut(Range<u64>) -> Result<Vec<u8>>,
    ahead: &mut dyn FnMut(&[Range<u64>]) -> Result<()>,
) -> Result<Vec<(u64, Vec<u8>)>> {
    let mut found: Vec<(u64, Vec<u8>)> = Vec::new();
    let tail_len = len.min(TAIL_BYTES);
    let tail = read(len - tail_len..len)?;
    let end = EndRecord::find(&tail).map(|(at, end)| (len - tail_len + at, end));
    found.push((len - tail_len, tail));
    let Some((eocd_at, end)) = end else {
        return Ok(found);
    };
    let mut wide = None;
    if end.needs_zip64() {
        if let Some(loc) = eocd_at.checked_sub(Zip64Locator::LEN) {
            let l = read(loc..loc + Zip64Locator::LEN)?;
            let at = Zip64Locator::parse(&l)
                .map(|l| l.end_at)
                .filter(|at| at.saturating_add(Zip64End::LEN) <= loc);
            if let Some(at) = at {
                let r = read(at..at + Zip64End::LEN)?;
                wide = Zip64End::parse(&r).map(|z| (z.entries, z.cd_size, z.cd_offset));
                found.push((loc, l));
                found.push((at, r));
            }
        }
    }
    let (entries, cd_size, cd_offset) = wide.unwrap_or((end.entries, end.cd_size, end.cd_offset));
    if cd_offset.checked_add(cd_size).is_none_or(|e| e > len) || cd_size > MAX_CD {
        return Ok(found);
    }
    let cd = read(cd_offset..cd_offset + cd_size)?;
    let centrals = parse_central(&cd, entries);
    found.push((cd_offset, cd));
    // Round 2: local headers, with room for torch's alignment padding.
    let heads: Vec<Range<u64>> = centrals
        .iter()
        .map(|c| c.local..(c.local + LocalHeader::LEN + c.name_len + LOCAL_EXTRA).min(cd_offset))
        .filter(|r| r.start < r.end)
        .collect();
    ahead(&heads)?;
    let mut rest = Vec::new();
    for (c, r) in centrals.iter().zip(&heads) {
        let head = read(r.clone())?;
        let Some(local) = LocalHeader::parse(&head) else {
            continue;
        };
        let data = c.local + local.data_start();
        if local.data_start() > head.len() as u64 {
            rest.push(c.local + head.len() as u64..data.min(cd_offset));
        }
        found.push((r.start, head));
        let data_end = data.saturating_add(c.size);
        if c.size <= SMALL_RECORD {
            rest.push(data.min(cd_offset)..data_end.min(cd_offset));
        }
        // The data descriptor: at most 24 bytes (zip64 sizes).
        rest.push(data_end.min(cd_offset)..data_end.saturating_add(24).min(cd_offset));
    }
    // Round 3: what the headers lead to.
    rest.retain(|r| r.start < r.end);
    ahead(&rest)?;
    for r in rest {
        found.push((r.start, read(r)?));
    }
    Ok(found)
}

struct Central {
    local: u64,
    size: u64,
    name_len: u64,
}

/// Each central header's local header offset, compressed size and name length (zip64 fields
/// resolved), as far as `cd` parses: a header the strict reader would refuse still leads to what
/// it names, so that reader sees the archive as it is and reports the problem.
fn parse_central(cd: &[u8], entries: u64) -> Vec<Central> {
    let mut out = Vec::new();
    let mut pos = 0u64;
    for _ in 0..entries {
        let Some(h) = cd.get(pos as usize..).and_then(CentralHeader::parse) else {
            break;
        };
        let extra_at = pos + CentralHeader::LEN + h.entry.name_len;
        let extra = cd
            .get(extra_at as usize..(extra_at + h.entry.extra_len) as usize)
            .unwrap_or_default();
        let (size, local) = match h.wide(extra) {
            Ok((_, size, local)) => (size, local),
            Err(_) => (u64::from(h.entry.compressed32), u64::from(h.local32)),
        };
        out.push(Central {
            local,
            size,
            name_len: h.entry.name_len,
        });
        pos += h.total_len();
    }
    out
}
