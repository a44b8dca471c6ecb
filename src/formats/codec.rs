//! Decoding of piece data that is not plain bytes in its file: a zstd DCP item, a deflated
//! torch.save record, a DCP item left unopened. Readers describe such data with an
//! [`Encoding`]; the executor asks this module for the bytes, so it never names a format.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::model::Encoding;

/// The decoded bytes of an encoded item (`item`, the item's bytes as stored), at least its first
/// `needed` bytes where the encoding can stop early: the decompressed zstd item or inflated
/// record, or the elements of an unopened DCP item in row-major order (checked against the
/// chunk its [`Encoding::Saved`] records). Plain bytes are not encoded and are refused here.
pub fn decode(encoding: &Encoding, item: &[u8], needed: u64, dtype: DType) -> Result<Vec<u8>> {
    match *encoding {
        Encoding::Raw => Err(Error::bug("plain bytes handed to the decoder")),
        Encoding::Zstd { .. } => zstd_prefix(item, needed),
        Encoding::Deflate { .. } => super::zip::inflate_prefix(item, needed),
        Encoding::Saved { numel, shape, .. } => {
            super::dcp::saved_elements(item, dtype, numel, shape)
        }
    }
}

/// The first `len` bytes of a zstd item (fewer if it is shorter).
pub fn zstd_prefix(item: &[u8], len: u64) -> Result<Vec<u8>> {
    use std::io::Read;
    let fail = |e: std::io::Error| Error::invalid(format!("cannot decompress zstd item: {e}"));
    let decoder = zstd::stream::read::Decoder::new(item).map_err(fail)?;
    let mut out = Vec::new();
    decoder.take(len).read_to_end(&mut out).map_err(fail)?;
    Ok(out)
}

/// A whole zstd item, refused when it decompresses to more than `limit` bytes.
pub fn zstd_decompress(item: &[u8], limit: u64) -> Result<Vec<u8>> {
    use std::io::Read;
    let fail = |e: std::io::Error| Error::invalid(format!("cannot decompress zstd item: {e}"));
    let decoder = zstd::stream::read::Decoder::new(item).map_err(fail)?;
    let mut out = Vec::new();
    decoder
        .take(limit.saturating_add(1))
        .read_to_end(&mut out)
        .map_err(fail)?;
    if out.len() as u64 > limit {
        return Err(Error::invalid(format!(
            "zstd item decompresses to more than {limit} bytes, larger than its metadata allows"
        ))
        .hint("the item may be a decompression bomb; ckpt stops before filling memory"));
    }
    Ok(out)
}
