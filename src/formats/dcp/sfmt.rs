//! DCP saved with `serialization_format=SAFETENSORS` (torch >= 2.8 `FileSystemWriter` option).
//!
//! Such a `.distcp` holds its byte items (torch.save archives, zstd-compressed or not) and then
//! one safetensors blob with every tensor chunk the file holds, keyed by fqn, its `__metadata__`
//! giving each chunk's `saved_offsets` under `DCP_SHARDING_INFO`. The `.metadata` storage record
//! of a tensor chunk does not point at its bytes: its offset is where the writer stood when the
//! chunk's turn came (the blob's start; with zstd, an empty zstd frame the writer's transform
//! left there, then the next one's, up to the blob) and its length is the chunk's byte count.
//! The blob itself is never compressed, so every chunk is plain bytes at a file offset. This is
//! recognised from the bytes at the recorded offset (a safetensors header, or an empty zstd
//! frame, where a torch.save item starts `PK` or with a non-empty frame), not from a flag.

use std::collections::HashMap;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::formats::safetensors::{self, Header, DCP_SHARDING_INFO};
use crate::storage::Input;

/// Bytes of the little-endian header length that opens a safetensors blob.
const LEN_PREFIX: u64 = 8;
/// First bytes of a zstd frame.
const ZSTD_MAGIC: [u8; 4] = [0x28, 0xb5, 0x2f, 0xfd];
/// Enough of a zstd frame to see that it is empty (an empty frame is 9 bytes as torch writes it).
const FRAME_PEEK: u64 = 32;

/// The safetensors blob at the end of one `.distcp` file.
#[derive(Debug)]
pub struct Blob {
    /// File offset of the blob's 8-byte header length.
    pub start: u64,
    header: Header,
    /// Tensor name -> index into `header.tensors`.
    by_name: HashMap<String, usize>,
    /// `DCP_SHARDING_INFO`: fqn -> offsets of the chunk in the global tensor.
    saved_offsets: HashMap<String, Vec<u64>>,
}

/// Where the safetensors blob of `input` starts, judged from a tensor item recorded at `offset`:
/// `None` when the item there is an ordinary torch.save item (plain or zstd).
pub fn find(input: &Input, offset: u64, zstd: bool) -> Result<Option<u64>> {
    let len = input.len();
    if zstd {
        // Skip the empty frames tensor items leave behind; a torch.save item is never empty.
        let mut pos = offset;
        while let Some(n) = empty_frame(input, pos)? {
            pos += n;
        }
        return Ok((pos > offset).then_some(pos));
    }
    if len.saturating_sub(offset) < LEN_PREFIX + 1 {
        return Ok(None);
    }
    let mut head = [0u8; LEN_PREFIX as usize + 1];
    input.read_at(offset, &mut head)?;
    // torch.save items are ZIP archives (`PK`); a safetensors header is a JSON object.
    Ok((head[LEN_PREFIX as usize] == b'{').then_some(offset))
}

/// The length of the empty zstd frame at `pos`, if there is one.
fn empty_frame(input: &Input, pos: u64) -> Result<Option<u64>> {
    let n = input.len().saturating_sub(pos).min(FRAME_PEEK);
    if n < ZSTD_MAGIC.len() as u64 {
        return Ok(None);
    }
    let mut buf = vec![0u8; n as usize];
    input.read_at(pos, &mut buf)?;
    if buf[..4] != ZSTD_MAGIC {
        return Ok(None);
    }
    let empty = matches!(zstd::zstd_safe::get_frame_content_size(&buf), Ok(Some(0)));
    Ok(match zstd::zstd_safe::find_frame_compressed_size(&buf) {
        Ok(size) if empty && size > 0 => Some(size as u64),
        _ => None,
    })
}

impl Blob {
    /// Parse the blob that starts at `start` and runs to the end of the file.
    pub fn read(input: &Input, start: u64) -> Result<Blob> {
        let len = input.len();
        let mut prefix = [0u8; LEN_PREFIX as usize];
        input.read_at(start, &mut prefix)?;
        let header_len = u64::from_le_bytes(prefix);
        if header_len > safetensors::MAX_HEADER_SIZE
            || header_len > len.saturating_sub(start + LEN_PREFIX)
        {
            return Err(Error::invalid(format!(
                "safetensors blob header length {header_len} does not fit in the file ({len} bytes)"
            ))
            .at(start)
            .hint("the file is truncated or corrupt: copy it again from where the checkpoint was saved"));
        }
        let mut json = vec![0u8; header_len as usize];
        input.read_at(start + LEN_PREFIX, &mut json)?;
        let header = safetensors::parse_header(&json, len - start).map_err(|e| e.within(start))?;
        let sharding = header.metadata_value(DCP_SHARDING_INFO).ok_or_else(|| {
            Error::invalid(format!(
                "safetensors blob has no `{DCP_SHARDING_INFO}` in its `__metadata__`"
            ))
            .at(start)
            .hint("this is not a blob torch's serialization_format=SAFETENSORS writer made")
        })?;
        let saved_offsets = parse_sharding(sharding).map_err(|e| e.at(start))?;
        let by_name = header
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(Blob {
            start,
            header,
            by_name,
            saved_offsets,
        })
    }

    /// The file offset of the chunk of `fqn` at `offsets` with `sizes`, checked against what the
    /// `.metadata` says (dtype, shape, byte length, offsets).
    pub fn locate(
        &self,
        fqn: &str,
        dtype: DType,
        offsets: &[u64],
        sizes: &[u64],
        length: u64,
    ) -> Result<u64> {
        let at = self.start;
        let t = self
            .by_name
            .get(fqn)
            .map(|&i| &self.header.tensors[i])
            .ok_or_else(|| {
                Error::invalid("the file's safetensors blob holds no tensor of this name")
                    .at(at)
                    .hint("the file does not belong to this .metadata, or it is truncated")
            })?;
        let data = at + self.header.data_start + t.begin;
        if t.dtype != dtype || t.shape != sizes {
            return Err(Error::invalid(format!(
                "safetensors blob holds {} {:?} but the metadata says {} {:?}",
                t.dtype, t.shape, dtype, sizes
            ))
            .at(data));
        }
        if t.end - t.begin != length {
            return Err(Error::invalid(format!(
                "safetensors blob holds {} bytes but the metadata records {length}",
                t.end - t.begin
            ))
            .at(data));
        }
        match self.saved_offsets.get(fqn) {
            Some(saved) if saved == offsets => Ok(data),
            saved => Err(Error::invalid(format!(
                "the metadata places this chunk at offsets {offsets:?} but the file's blob holds the chunk at {saved:?}"
            ))
            .at(data)
            .hint("torch writes one chunk per name in each file; two chunks of a tensor in one file cannot be told apart")),
        }
    }
}

/// `{"fqn": {"saved_offsets": [..]}, ...}`.
fn parse_sharding(text: &str) -> Result<HashMap<String, Vec<u64>>> {
    #[derive(serde::Deserialize)]
    struct Info {
        saved_offsets: Vec<u64>,
    }
    let map: HashMap<String, Info> = serde_json::from_str(text).map_err(|e| {
        Error::invalid(format!(
            "`{DCP_SHARDING_INFO}` is not valid sharding JSON: {e}"
        ))
    })?;
    Ok(map.into_iter().map(|(k, v)| (k, v.saved_offsets)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::Access;

    fn input(bytes: &[u8]) -> (tempfile::TempDir, Input) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("__0_0.distcp");
        std::fs::write(&path, bytes).unwrap();
        let input = Input::open(&path, Access::Read).unwrap();
        (dir, input)
    }

    /// A blob as safetensors.torch.save lays it out, for one F32 chunk `w` [2] at offsets [4].
    fn blob() -> Vec<u8> {
        let json = br#"{"__metadata__":{"DCP_SHARDING_INFO":"{\"w\": {\"saved_offsets\": [4]}}","format":"pt"},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
        let mut out = (json.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(json);
        out.extend_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
        out
    }

    #[test]
    fn empty_zstd_frames_lead_to_the_blob_and_a_chunk_is_found_by_name() {
        let empty = zstd::encode_all(&[][..], 3).unwrap();
        let full = zstd::encode_all(&b"PK\x03\x04 not empty"[..], 3).unwrap();
        let mut file = full.clone();
        let first = file.len() as u64;
        file.extend_from_slice(&empty);
        file.extend_from_slice(&empty);
        let start = file.len() as u64;
        file.extend_from_slice(&blob());
        let (_dir, input) = input(&file);
        // a torch.save item (a non-empty frame) is not the blob
        assert_eq!(find(&input, 0, true).unwrap(), None);
        assert_eq!(find(&input, first, true).unwrap(), Some(start));
        let b = Blob::read(&input, start).unwrap();
        let at = b.locate("w", DType::F32, &[4], &[2], 8).unwrap();
        assert_eq!(
            &file[at as usize..at as usize + 8],
            &[1, 2, 3, 4, 5, 6, 7, 8]
        );
        // what .metadata says must agree with the blob
        assert!(b.locate("w", DType::I32, &[4], &[2], 8).is_err());
        assert!(b.locate("w", DType::F32, &[0], &[2], 8).is_err());
        assert!(b.locate("w", DType::F32, &[4], &[2], 4).is_err());
        assert!(b.locate("v", DType::F32, &[4], &[2], 8).is_err());
    }

    #[test]
    fn a_plain_blob_is_found_at_the_record_and_a_zip_is_not() {
        let mut file = b"PK\x03\x04\x14\x00\x00\x00\x00\x00".to_vec();
        let start = file.len() as u64;
        file.extend_from_slice(&blob());
        let (_dir, input) = input(&file);
        assert_eq!(find(&input, 0, false).unwrap(), None);
        assert_eq!(find(&input, start, false).unwrap(), Some(start));
        assert!(Blob::read(&input, start).is_ok());
    }
}
